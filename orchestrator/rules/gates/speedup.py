"""The speedup gate proves speculation makes the host faster at the fleet's load (only with
`gates.speedup`).

The same greedy load (the gate's `concurrency` levels, its prompts or the probe's, `max_tokens`
each, `ignore_eos`) streamed by the agent to the server, `repeats` runs an arm at each level after
one warm-up run, interleaved across levels: output tokens/s per run (and each request's time to
first token and decode tokens/s, p50/p90 in the gate's data). The *baseline* arm (the same target,
build, GPUs, arguments and environment without `--speculative-config`) costs one extra server start:
the rollout's canary measures it before the release starts (out of rotation with a gateway), once
per key (the target's digest, the vLLM build, the GPU model and count, the parallel sizes, the
server's own arguments, the load), and the state store keeps it (`speedup_baselines`), so a later
rollout of another drafter over the same target reuses it. The *drafter* arm runs right after the
acceptance probe, on the server just proven. Per level: the ratio of mean tokens/s with a 95% lower
bound from the repeats (the delta method, Student's t; a spread over 5% is said, and widens it); a
level below `min` fails with both numbers, and the diagnosis tells "accepted but does not pay at
this load" (`speedup_absent`: drafter cost, K, load) apart from low acceptance
(`speedup_low_acceptance`, tau under the acceptance floor or 1.5). The hosts after the canary of the
same key hold its verdict (`held_from`); a rollout with no `rollout.canary` measures nothing and
says so; a multi-node group is not measured (said). `verify --speedup` sends the drafter arm again
against the kept baseline.

The speed-up gate's arithmetic, pure: the same load (concurrency, prompts, greedy, a fixed
output length) run against the target alone (the baseline arm) and with the drafter (the drafter
arm), repeated; per concurrency the output tokens per second of each arm, their spread, the
speed-up with its 95% lower bound, and the verdict against ``gates.speedup.min``.

    total tokens/s     = sum(output tokens) / wall seconds of the run      (what the host serves)
    per request        = (tokens - 1) / (seconds - time to first token)    (what a user waits on)
    speed-up           = drafter arm's mean total tokens/s / the baseline's, per concurrency

Published DFlash speed-ups fall with load (2.8x at 1 request to 2.4x at 8 on one model; 2.7x to
1.0x on another): acceptance says the drafter's tokens are kept, not that keeping them pays at the
fleet's load. So the verdict is per concurrency, and a level where acceptance is fine but the
speed-up is absent is told apart from a level where acceptance itself is low.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.protocol import Loaded, Sent
from orchestrator.config.inventory import Container
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    GATE_BUILD,
    HostReport,
)
from orchestrator.rules import serving
from orchestrator.rules.gates.acceptance import probe_prompts
from orchestrator.rules.probe import t975

# Why the speed-up gate fails, as codes (``Gate.reason``; the diagnosis reads them).
NO_SPEEDUP = "speedup_absent"  # acceptance fine, speculation does not pay at this load
LOW_ACCEPTANCE = "speedup_low_acceptance"  # the drafter's tokens are not kept: acceptance's finding
UNMEASURED = "speedup_unmeasured"  # an arm has no runs at a level the playbook asks for
# Below this many tokens a step (tau), a drafter is low in acceptance whatever the acceptance gate's
# own threshold: fewer than one draft in two gets a token kept (a lost drafter gives ~1.03, the real
# pair 2.25; the diagnosis's "does not match the target" line starts here too).
LOW_TAU = 1.5
# A spread above this (relative standard deviation of one arm's repeats) widens the bound, said.
STEADY = 0.05


@dataclass(frozen=True)
class Request:
    """One request of a load run: output tokens, seconds from send to last token, and to the first."""

    tokens: int
    seconds: float
    first_token_s: float | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The request's own decode speed, after its first token (None: too short to say)."""
        if self.first_token_s is None or self.tokens < 2 or self.seconds <= self.first_token_s:
            return None
        return (self.tokens - 1) / (self.seconds - self.first_token_s)


@dataclass(frozen=True)
class Run:
    """One load run at one concurrency: every request, and the run's wall time."""

    concurrency: int
    wall_s: float
    requests: tuple[Request, ...]

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.requests) / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """As the state store keeps a baseline's runs (and the READY record the drafter arm's)."""
        return {
            "concurrency": self.concurrency,
            "wall_s": self.wall_s,
            "requests": [[r.tokens, r.seconds, r.first_token_s] for r in self.requests],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Run:
        """A run the store kept (``to_json``'s)."""
        return cls(
            int(data["concurrency"]),
            float(data["wall_s"]),
            tuple(Request(int(t), float(s), None if f is None else float(f)) for t, s, f in data["requests"]),
        )


def run_of(concurrency: int, loaded: Loaded) -> tuple[Run, list[str]]:
    """The agent's load run as the gate reads it, and why any request failed (a failed request's
    tokens do not count: a run with failures is said, never silently faster or slower)."""

    def why(sent: Sent) -> str | None:
        if sent.error is not None:
            return sent.error
        # a whole answer with no token streamed: not a measurement (a server or a proxy that
        # does not stream, or one that stops at once), never a run that looks infinitely slow
        return None if sent.tokens > 0 else "no output token came back (the completion was not streamed)"

    kept = tuple(su for su in loaded.requests if why(su) is None)
    failed = [f"request {i + 1}: {w}" for i, su in enumerate(loaded.requests) if (w := why(su)) is not None]
    return Run(concurrency, loaded.wall_s, tuple(Request(r.tokens, r.seconds, r.first_token_s) for r in kept)), failed


@dataclass(frozen=True)
class Arm:
    """One arm's repeats at one concurrency: the mean total tokens/s and its spread."""

    concurrency: int
    runs: tuple[Run, ...]

    @property
    def mean(self) -> float:
        return sum(r.tokens_per_s for r in self.runs) / len(self.runs)

    @property
    def spread(self) -> float:
        """The repeats' relative standard deviation (0 with one run: unknown, said by ``n``)."""
        n = len(self.runs)
        if n < 2 or self.mean <= 0:
            return 0.0
        sd = math.sqrt(sum((r.tokens_per_s - self.mean) ** 2 for r in self.runs) / (n - 1))
        return sd / self.mean

    def percentile(self, q: float, what: str = "first_token_s") -> float | None:
        """A percentile (nearest rank) of the requests' time to first token, or their decode speed."""
        if what == "first_token_s":
            values = sorted(r.first_token_s for run in self.runs for r in run.requests if r.first_token_s is not None)
        else:
            values = sorted(v for run in self.runs for r in run.requests if (v := r.decode_tokens_per_s) is not None)
        if not values:
            return None
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


@dataclass(frozen=True)
class Level:
    """The speed-up at one concurrency: both arms' numbers and the ratio with its 95% lower bound."""

    concurrency: int
    baseline: float  # total tokens/s
    drafter: float
    speedup: float
    low: float  # 95% lower bound of the speed-up
    spread: float  # the larger of the two arms' relative spreads
    repeats: tuple[int, int]  # (baseline runs, drafter runs)

    @property
    def steady(self) -> bool:
        return self.spread <= STEADY

    def to_json(self) -> dict[str, Any]:
        """The level as the gate's data carries it (the READY record, history, the report)."""
        return {
            "concurrency": self.concurrency,
            "speedup": round(self.speedup, 4),
            "speedup_low": round(self.low, 4),
            "baseline_tokens_per_s": round(self.baseline, 2),
            "drafter_tokens_per_s": round(self.drafter, 2),
            "spread": round(self.spread, 4),
            "repeats": list(self.repeats),
        }


def level(baseline: Arm, drafter: Arm) -> Level:
    """Both arms at one concurrency: the ratio of means, and its lower bound from each arm's
    repeats (the delta method: the ratio's relative variance is the sum of the arms' relative
    variances of their means), Student's t on the fewer repeats. One run an arm: no bound."""
    ratio = drafter.mean / baseline.mean if baseline.mean > 0 else 0.0
    n = min(len(baseline.runs), len(drafter.runs))
    if n >= 2:
        rel_se = math.sqrt(baseline.spread**2 / len(baseline.runs) + drafter.spread**2 / len(drafter.runs))
        low = ratio * max(0.0, 1 - t975(n - 1) * rel_se)
    else:
        low = ratio
    return Level(
        concurrency=drafter.concurrency,
        baseline=baseline.mean,
        drafter=drafter.mean,
        speedup=ratio,
        low=low,
        spread=max(baseline.spread, drafter.spread),
        repeats=(len(baseline.runs), len(drafter.runs)),
    )


def baseline_key(
    target: str,
    build: str,
    gpus: Sequence[str],
    parallel: tuple[int, int],
    serving: Mapping[str, Any],
    load: Mapping[str, Any],
) -> tuple[str, str]:
    """What a baseline arm depends on, as the key the state store keeps it under, and in words:
    the target's weights (their digest), the vLLM build, the GPU model and count, the parallel
    sizes, the server's own arguments and environment (not its GPUs' indices or its release), and
    the load but its concurrency (each level is kept apart, so that another list reuses the
    levels it shares). Another drafter over the same target reuses it."""
    body = {
        "target": target,
        "build": build,
        "gpus": sorted(gpus),
        "parallel": list(parallel),
        "serving": dict(serving),
        "load": dict(load),
    }
    key = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    chips = (
        f"{len(gpus)} x {sorted(gpus)[0]}" if gpus and len(set(gpus)) == 1 else (", ".join(sorted(gpus)) or "no GPU")
    )
    what = f"target {target[:12]}, {build}, {chips}, tp {parallel[0]} pp {parallel[1]}"
    return key, what


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str
    reason: str = ""
    levels: tuple[Level, ...] = ()


def judge(
    levels: Sequence[Level], minimum: float, tau: float | None = None, min_tau: float | None = None, k: int = 0
) -> Verdict:
    """The gate: every concurrency at ``minimum`` or above. A level below it is told apart by
    acceptance (``tau`` against ``min_tau``): low acceptance is acceptance's finding; acceptance
    fine with no speed-up is the drafter's cost at that load (K drafted a step, tau kept)."""
    said = "; ".join(_numbers(lv) for lv in levels)
    if not levels:
        return Verdict(False, "no load was measured", UNMEASURED)
    unsteady = [lv for lv in levels if not lv.steady]
    if unsteady:
        said += "; " + ", ".join(
            f"at {lv.concurrency} the repeats spread {lv.spread:.0%} (over {STEADY:.0%}): the bound is widened by it"
            for lv in unsteady
        )
    slow = [lv for lv in levels if lv.speedup < minimum]
    if not slow:
        return Verdict(True, said, levels=tuple(levels))
    at = ", ".join(str(lv.concurrency) for lv in slow)
    if tau is not None and min_tau is not None and tau < min_tau:
        return Verdict(
            False,
            f"speed-up below {minimum:g} at concurrency {at}, and acceptance is low (tau {tau:.2f} < {min_tau:g}): "
            f"the drafter's tokens are not kept. {said}",
            LOW_ACCEPTANCE,
            tuple(levels),
        )
    if tau is None:
        kept = "with acceptance not probed in this run"
    else:
        kept = f"with acceptance fine (tau {tau:.2f}" + (f" of K = {k} drafted)" if k else ")")
    return Verdict(
        False,
        f"speed-up below {minimum:g} at concurrency {at} {kept}: speculation does not pay "
        f"at this load (the drafter's cost per step outweighs what it keeps: a lower K, less load per host, or no "
        f"speculation here). {said}",
        NO_SPEEDUP,
        tuple(levels),
    )


def _numbers(lv: Level) -> str:
    bound = f", 95% >= {lv.low:.2f}" if lv.repeats[0] > 1 and lv.repeats[1] > 1 else ", one run an arm: no bound"
    return (
        f"at {lv.concurrency}: {lv.speedup:.2f}x ({lv.drafter:.0f} against {lv.baseline:.0f} tokens/s{bound}, "
        f"n = {lv.repeats[0]}+{lv.repeats[1]})"
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
    """The baseline arm's key for a host, from what its gates found (``baseline_key``):
    None while the build or the target is not known (the checks did not run)."""
    gate, s = playbook.gates.speedup, playbook.serving
    build = report.gates.get(GATE_BUILD)
    vllm = build.data.get("vllm") if build is not None else None
    if gate is None or s.target is None or not isinstance(vllm, str):
        return None
    target = next((m.get("sha256") for m in report.models if m.get("name") == "target" and m.get("sha256")), None)
    prompts = hashlib.sha256(json.dumps(list(speedup_prompts(playbook))).encode()).hexdigest()
    return baseline_key(
        target or s.target,
        vllm,
        [str(g.get("name")) for g in report.gpus],
        (serving.tensor_parallel_size(playbook, container), s.pipeline_parallel_size),
        {"python": s.python, "env": dict(s.env), "extra_args": list(s.extra_args), "model_name": s.model_name},
        {"max_tokens": gate.max_tokens, "prompts_sha256": prompts, "requests": f"whole waves, {LOAD_WAVES} at least"},
    )
