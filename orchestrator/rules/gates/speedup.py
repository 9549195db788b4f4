"""The speedup gate proves speculation makes the host faster at the fleet's load (only with
`gates.speedup`).

The same greedy load (the gate's `concurrency` levels, its prompts or the probe's, `max_tokens`
each, `ignore_eos`) streamed by the agent to two servers of the same target, build, GPUs, arguments
and environment: the *drafter* arm (the release just proven) and the *baseline* arm (the same
command without `--speculative-config`). Both arms are measured **in the same session**, on the
rollout's canary, out of rotation with a gateway:

- *beside* (where the host's memory holds both): the baseline server starts beside the proven one,
  on `gates.speedup.baseline_port` (the serving port + 1 unless set; on GPUs with
  `--gpu-memory-utilization` of what the target alone needs), and the two are measured one at a
  time in an interleaved order (A B B A ...: a baseline run and the drafter run beside it make a
  *pair*, the order alternating so that a drift within the session falls on both arms alike);
- *before* (where it does not: the GPU's memory, or `gates.speedup.arms: before`): the baseline
  server starts before the release (one extra start), its runs are paired in order with the
  drafter arm's, minutes later.

Each run is measured where the time is spent: vLLM's own numbers of it (its `/metrics` read
before and after: each finished request's decode time and output tokens), the client's wall clock
kept beside them as a report (and used alone where a server shows no such numbers). Per level,
each pair gives a ratio (the drafter run's decode tokens/s a request over its baseline's); the
speed-up is their **median**, its spread their median absolute deviation over the median, and its
95% interval Student's t on the logs of the ratios. A level has **three outcomes**: it *pays* (the
interval's low end at `min` or above), it *does not pay* (its high end below `min`), or it is
*inconclusive* (neither: the gate says how many pairs would decide at today's spread). The
stopping rule is fixed before measuring: at least `repeats` pairs (3), at most `max_pairs` (6),
stopping early only once every level's interval decides. `on_inconclusive` says what READY does
with an inconclusive level: `refuse` (the default: READY means proven, and an interval holding
`min` proves neither way) or `pass` (said in the gate's words).

A kept baseline is never the comparator: a host's speed moves from one session to the next
(another tenant, clocks, a driver: 9-15% between two rollouts on one H100). The store keeps each
session's baseline (`speedup_baselines`) under its key (the target's digest, the vLLM build, the GPU
model and count, the parallel sizes, the server's own arguments, the load); the next rollout of
that key compares its own baseline with it and says the drift when they differ beyond their
spread. The hosts after the canary of the same key hold its verdict (`held_from`); a rollout with
no `rollout.canary` measures nothing and says so; a multi-node group is not measured (said).
`verify --speedup` measures both arms again, beside, where the host's memory holds both.

The diagnosis tells "accepted but does not pay at this load" (`speedup_absent`: drafter cost, K,
load) apart from low acceptance (`speedup_low_acceptance`, tau under the acceptance floor or 1.5)
and from a measurement that cannot decide (`speedup_inconclusive`).

    decode tokens/s    = (output tokens - requests) / their decode seconds   (vLLM's, over the run)
    total tokens/s     = sum(output tokens) / wall seconds of the run      (the client's, a report)
    a pair's ratio     = the drafter run's decode tokens/s / its baseline run's
    speed-up           = the median of the level's pair ratios
    expected speed-up  = tau' x the baseline's mean step / the drafter's    (vLLM's counters alone)
    tau'               = n / ceil(n / tau), n the decoded tokens a request (the last step keeps less)

The model beside the measurement: vLLM records one inter-token latency a step of a request, however
many tokens the step kept, so the two arms' mean steps and the drafter arm's tau (its drafts and
accepted tokens over the same runs) predict the speed-up without the decode times. Where that
prediction falls outside the measured interval the gate says so: the measurement, not the drafter,
is in question (other traffic on the server, a load its client could not keep up).

Published DFlash speed-ups fall with load (2.8x at 1 request to 2.4x at 8 on one model; 2.7x to
1.0x on another): acceptance says the drafter's tokens are kept, not that keeping them pays at the
fleet's load. So the verdict is per concurrency.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from orchestrator.agent import protocol
from orchestrator.agent.protocol import ServerCommand

if TYPE_CHECKING:
    from orchestrator.agent.protocol import Loaded, Sent
from orchestrator.config.inventory import Container
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    GATE_BUILD,
    HostReport,
)
from orchestrator.rules import probe, serving
from orchestrator.rules.gates.acceptance import probe_prompts
from orchestrator.rules.gates.gpus import memory_utilization
from orchestrator.rules.probe import t975

# Why the speed-up gate fails, as codes (``Gate.reason``; the diagnosis reads them).
NO_SPEEDUP = "speedup_absent"  # acceptance fine, speculation does not pay at this load
LOW_ACCEPTANCE = "speedup_low_acceptance"  # the drafter's tokens are not kept: acceptance's finding
UNMEASURED = "speedup_unmeasured"  # an arm has no runs at a level the playbook asks for
INCONCLUSIVE = "speedup_inconclusive"  # a level's interval holds min after the planned pairs
# A level's outcome: its 95% interval above min, below it, or holding it.
PAYS, DOES_NOT_PAY, UNDECIDED = "pays", "does not pay", "inconclusive"
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
class Served:
    """One run as the server counted it: the deltas of its /metrics over the run (vLLM V1).

    ``decode_s`` sums each finished request's decode time (its first token to its last) and
    ``tokens`` their output tokens; ``steps`` and ``step_s`` are the inter-token latency
    histogram's count and sum, one observation a step of a request whatever the tokens the step
    kept (vLLM 0.32 v1/metrics/stats.py ``update_from_output``), so that a step's mean time is
    the same measure with and without a drafter; ``drafts`` and ``accepted`` are the drafter's."""

    requests: float
    decode_s: float
    tokens: float
    steps: float
    step_s: float
    drafts: float = 0.0
    accepted: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """A request's decode speed, over the run's requests: tokens after the first a second."""
        return (self.tokens - self.requests) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_step_s(self) -> float | None:
        return self.step_s / self.steps if self.steps > 0 else None

    def to_json(self) -> list[float]:
        return [self.requests, self.decode_s, self.tokens, self.steps, self.step_s, self.drafts, self.accepted]


# The server's families a load run's numbers are read from (their _sum and _count samples).
DECODE, OUTPUT, STEP = (
    "vllm:request_decode_time_seconds",
    "vllm:request_generation_tokens",
    "vllm:inter_token_latency_seconds",
)


def served(before: str | None, after: str | None) -> Served | None:
    """A run's server-side numbers from the two reads around it. None where the server shows no
    such families, a value does not read, a counter went back (a restart between the reads), or
    no request finished within the run."""
    if before is None or after is None:
        return None
    names = (f"{DECODE}_count", f"{DECODE}_sum", f"{OUTPUT}_sum", f"{STEP}_count", f"{STEP}_sum")
    try:
        deltas: list[float] = []
        for name in names:
            a, b = probe.total(before, name), probe.total(after, name)
            if a is None or b is None or b < a:
                return None
            deltas.append(b - a)
        drafted = probe.parse(before), probe.parse(after)
    except probe.ProbeError:
        return None
    drafts = accepted = 0.0
    if drafted[0] is not None and drafted[1] is not None:
        drafts = drafted[1].drafts - drafted[0].drafts
        accepted = drafted[1].accepted - drafted[0].accepted
        if drafts < 0 or accepted < 0:
            return None
    requests, decode_s, tokens, steps, step_s = deltas
    if requests < 1 or decode_s <= 0:
        return None
    return Served(requests, decode_s, tokens, steps, step_s, drafts, accepted)


@dataclass(frozen=True)
class Run:
    """One load run at one concurrency: every request, the run's wall time, and the server's own
    numbers of it where it shows them."""

    concurrency: int
    wall_s: float
    requests: tuple[Request, ...]
    served: Served | None = None

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.requests) / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """As the state store keeps a baseline's runs (and the READY record the drafter arm's)."""
        return {
            "concurrency": self.concurrency,
            "wall_s": self.wall_s,
            "requests": [[r.tokens, r.seconds, r.first_token_s] for r in self.requests],
            **({"served": self.served.to_json()} if self.served is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Run:
        """A run the store kept (``to_json``'s; a run kept before the server's numbers has none)."""
        kept = data.get("served")
        return cls(
            int(_stored(data["concurrency"])),
            _stored(data["wall_s"]),
            tuple(
                Request(int(_stored(t)), _stored(s), None if f is None else _stored(f)) for t, s, f in data["requests"]
            ),
            Served(*(_stored(x) for x in kept)) if kept is not None else None,
        )


def _stored(value: Any) -> float:
    """A kept figure: a finite number, never below 0 (ValueError: the kept run does not read)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a count or a time: {value!r}")
    return float(value)


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
    requests = tuple(Request(r.tokens, r.seconds, r.first_token_s) for r in kept)
    return Run(concurrency, loaded.wall_s, requests, served(loaded.metrics_before, loaded.metrics_after)), failed


@dataclass(frozen=True)
class Arm:
    """One arm's repeats at one concurrency: the mean speed and its spread (vLLM's decode
    tokens/s a request where every run has the server's numbers, else the total tokens/s)."""

    concurrency: int
    runs: tuple[Run, ...]

    @property
    def by_server(self) -> bool:
        return bool(self.runs) and all(_decoded(r) for r in self.runs)

    def _speeds(self) -> list[float]:
        by_server = self.by_server  # one measure for every run, decided once
        return [_server_speed(r) if by_server else r.tokens_per_s for r in self.runs]

    @property
    def mean(self) -> float:
        return sum(self._speeds()) / len(self.runs)

    @property
    def spread(self) -> float:
        """The repeats' relative standard deviation (0 with one run: unknown, said by ``n``)."""
        n = len(self.runs)
        if n < 2 or self.mean <= 0:
            return 0.0
        sd = math.sqrt(sum((v - self.mean) ** 2 for v in self._speeds()) / (n - 1))
        return sd / self.mean

    def by_client(self) -> Arm:
        """The same runs measured by the client's clock alone (to compare with an arm that has no
        server numbers)."""
        return Arm(self.concurrency, tuple(replace(r, served=None) for r in self.runs))

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
    spread: float  # paired: the ratios' MAD over their median; else the larger arm's relative SD
    repeats: tuple[int, int]  # (baseline runs, drafter runs): equal when paired
    high: float = math.inf  # 95% upper bound of the speed-up (inf: no bound)
    paired: bool = False  # runs paired in one session (the median of ratios), not two arms' means
    log_mean: float | None = None  # paired: the mean and SD of the logs of the ratios
    log_sd: float | None = None
    # what the ratios are of: "server" (vLLM's decode time of each request: where the time is
    # spent) or "client" (the agent's wall clock: a server that shows no such numbers)
    measured: str = "client"
    client_speedup: float | None = None  # measured by the server: the wall clock's median beside it
    # The model beside the measurement, from vLLM's counters alone: tau (the drafter arm's tokens a
    # step) times the baseline's mean step over the drafter's.
    expected: float | None = None
    tau: float | None = None
    steps_s: tuple[float, float] | None = None  # (baseline, drafter) mean step seconds

    @property
    def model_disagrees(self) -> bool:
        """The expected speed-up falls outside the measured 95% interval."""
        if self.expected is None or not math.isfinite(self.high) or self.repeats[1] < 2:
            return False
        return not self.low <= self.expected <= self.high

    @property
    def steady(self) -> bool:
        return self.spread <= STEADY

    def outcome(self, minimum: float) -> str:
        """Pays, does not pay, or inconclusive: where ``minimum`` falls against the interval."""
        if self.low >= minimum:
            return PAYS
        if self.high < minimum:
            return DOES_NOT_PAY
        return UNDECIDED

    def pairs_to_decide(self, minimum: float) -> int | None:
        """Pairs in all that would make the interval decide at today's spread of the ratios (None:
        not paired, fewer than 2 pairs, or the ratios centre on ``minimum`` itself)."""
        if self.log_mean is None or not self.log_sd or minimum <= 0:
            return None
        gap = abs(self.log_mean - math.log(minimum))
        for n in range(2, 1001):
            if t975(n - 1) * self.log_sd / math.sqrt(n) < gap:
                return n
        return None

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
            **({"speedup_high": round(self.high, 4)} if math.isfinite(self.high) else {}),
            **({"pairs": self.repeats[1]} if self.paired else {}),
            **({"measured": self.measured} if self.paired else {}),
            **({"client_speedup": round(self.client_speedup, 4)} if self.client_speedup is not None else {}),
            **self._model_json(),
        }

    def _model_json(self) -> dict[str, Any]:
        if self.expected is None or self.tau is None or self.steps_s is None:
            return {}
        return {
            "expected_speedup": round(self.expected, 4),
            "tau": round(self.tau, 3),
            "step_ms": [round(self.steps_s[0] * 1000, 3), round(self.steps_s[1] * 1000, 3)],
            "model_disagrees": self.model_disagrees,
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
        high = ratio * (1 + t975(n - 1) * rel_se)
    else:
        low, high = 0.0, math.inf  # one run an arm: no bound, so no verdict either way
    return Level(
        concurrency=drafter.concurrency,
        baseline=baseline.mean,
        drafter=drafter.mean,
        speedup=ratio,
        low=low,
        spread=max(baseline.spread, drafter.spread),
        repeats=(len(baseline.runs), len(drafter.runs)),
        high=high,
    )


def paired_level(concurrency: int, pairs: Sequence[tuple[Run, Run]]) -> Level:
    """Runs paired in one session (a baseline run and the drafter run beside it): the median of
    the pairs' ratios, its spread (median absolute deviation over the median: one disturbed pair
    moves neither), and its 95% interval from the logs of the ratios (Student's t on n - 1: the
    ratio of two speeds is log-symmetric). Pairs whose either run served nothing are left out."""
    import statistics  # here: it brings fractions and decimal, ~5 ms of every controller start

    kept = [(b, d) for b, d in pairs if b.tokens_per_s > 0 and d.tokens_per_s > 0]
    n = len(kept)
    if not n:
        return Level(concurrency, 0.0, 0.0, 0.0, 0.0, 0.0, (0, 0), paired=True)
    client = [d.tokens_per_s / b.tokens_per_s for b, d in kept]
    by_server = all(_decoded(b) and _decoded(d) for b, d in kept)
    if by_server:  # vLLM's decode time: what the client's Python and the queue do not move
        speeds = [(_server_speed(b), _server_speed(d)) for b, d in kept]
        ratios = [d / b for b, d in speeds]
    else:
        speeds = [(b.tokens_per_s, d.tokens_per_s) for b, d in kept]
        ratios = client
    median = statistics.median(ratios)
    spread = statistics.median(abs(r - median) for r in ratios) / median
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if n >= 2:
        sd = statistics.stdev(logs)
        half = t975(n - 1) * sd / math.sqrt(n)
        low, high, log_sd = math.exp(mean - half), math.exp(mean + half), sd
    else:
        low, high, log_sd = 0.0, math.inf, None
    tau, steps = _model([b for b, _ in kept], [d for _, d in kept])
    return Level(
        concurrency=concurrency,
        baseline=statistics.fmean(b for b, _ in speeds),
        drafter=statistics.fmean(d for _, d in speeds),
        speedup=median,
        low=low,
        spread=spread,
        repeats=(n, n),
        high=high,
        paired=True,
        log_mean=mean,
        log_sd=log_sd,
        measured="server" if by_server else "client",
        client_speedup=statistics.median(client) if by_server else None,
        expected=_expected(tau, steps, [d for _, d in kept]),
        tau=tau,
        steps_s=steps,
    )


def _expected(tau: float | None, steps: tuple[float, float] | None, drafter: Sequence[Run]) -> float | None:
    """tau, cut to the requests' length (``kept_a_step``), times the baseline's step over the
    drafter's."""
    if tau is None or steps is None:
        return None
    served = [r.served for r in drafter if r.served is not None]
    requests = sum(s.requests for s in served)
    decoded = (sum(s.tokens for s in served) - requests) / requests if requests else 0.0
    return kept_a_step(tau, decoded) * steps[0] / steps[1]


def _decoded(run: Run) -> bool:
    return run.served is not None and run.served.decode_tokens_per_s > 0


def _server_speed(run: Run) -> float:
    assert run.served is not None
    return run.served.decode_tokens_per_s


def kept_a_step(tau: float, decoded: float) -> float:
    """The tokens a step keeps, on average, for requests of ``decoded`` tokens after the first at
    ``tau`` a step: their last step keeps only what is left (31 tokens at 8 a step take 4 steps,
    7.75 a step), while the drafter's counters count every accepted token."""
    if decoded <= 0 or tau <= 0:
        return tau
    return decoded / math.ceil(decoded / tau - 1e-9)


def _model(baseline: Sequence[Run], drafter: Sequence[Run]) -> tuple[float | None, tuple[float, float] | None]:
    """tau (the drafter arm's drafts and accepted tokens: 1 + accepted a draft) and both arms'
    mean step (their steps' time over their number), pooled over the level's runs; None where a
    run lacks the server's numbers or the drafter arm drafted nothing."""
    b = [r.served for r in baseline]
    d = [r.served for r in drafter]
    if not b or not d or any(x is None for x in (*b, *d)):
        return None, None
    bs = [x for x in b if x is not None]
    ds = [x for x in d if x is not None]
    drafts = sum(x.drafts for x in ds)
    b_steps, d_steps = sum(x.steps for x in bs), sum(x.steps for x in ds)
    if drafts <= 0 or b_steps <= 0 or d_steps <= 0:
        return None, None
    b_step, d_step = sum(x.step_s for x in bs) / b_steps, sum(x.step_s for x in ds) / d_steps
    if b_step <= 0 or d_step <= 0:
        return None, None
    return 1 + sum(x.accepted for x in ds) / drafts, (b_step, d_step)


# How far back ``concurrency: observed`` looks at the load watch recorded.
OBSERVED_DAYS = 7


def observed_levels(samples: Sequence[tuple[str, float]], most: int | None) -> tuple[tuple[int, ...], str]:
    """``concurrency: observed``: the levels from the requests the servers ran at each watch round
    (``samples``: host and running requests): their median and 90th percentile (nearest rank),
    each rounded up to a whole request and at least 1, at most ``most`` (``--max-num-seqs``: a
    level above it would queue). Empty, and why, where watch recorded none."""
    if not samples:
        return (), (
            f"no load was observed: watch recorded no round of these hosts' servers in the last {OBSERVED_DAYS} days "
            "(run `orchestrate watch` with the state store, or list the levels in gates.speedup.concurrency)"
        )
    values = sorted(v for _, v in samples)

    def rank(q: float) -> float:
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

    median, p90 = rank(0.5), rank(0.9)
    levels = sorted({min(max(1, math.ceil(v)), most or 1 << 30) for v in (median, p90)})
    hosts = len({h for h, _ in samples})
    capped = f", at most --max-num-seqs {most}" if most is not None and math.ceil(p90) > most else ""
    return tuple(levels), (
        f"levels from the fleet's load as watch recorded it: median {median:g}, 90th percentile {p90:g} requests "
        f"running, {len(values)} rounds on {hosts} host{'s' * (hosts != 1)} over {OBSERVED_DAYS} days{capped}"
    )


def decided(levels: Sequence[Level], minimum: float) -> bool:
    """Whether every level's interval already decides (the stopping rule's early stop)."""
    return bool(levels) and all(lv.outcome(minimum) != UNDECIDED for lv in levels)


def pair_order(index: int) -> tuple[str, str]:
    """The arms' order in pair ``index``: A B, then B A, ... (a drift within the session, a host
    warming or cooling, falls on both arms alike instead of on the one measured second)."""
    return ("baseline", "drafter") if index % 2 == 0 else ("drafter", "baseline")


def drift(today: Arm, kept: Arm) -> str | None:
    """The host's target-alone speed today against the baseline a session before kept, in words
    when they differ beyond both spreads (the interval of their ratio excludes 1, by over 5%): what
    a kept baseline would have put into a ratio taken across sessions. None: no drift to say."""
    if not today.runs or not kept.runs:
        return None
    if not (today.by_server and kept.by_server):  # one measure for both: the client's, if not vLLM's
        today, kept = today.by_client(), kept.by_client()
    if kept.mean <= 0:
        return None
    moved = level(kept, today)
    unit = "decode tokens/s a request, vLLM's" if today.by_server else "tokens/s"
    if (moved.low > 1 or moved.high < 1) and abs(moved.speedup - 1) > STEADY:
        return (
            f"the target alone ran {moved.speedup - 1:+.0%} against the baseline kept before "
            f"({today.mean:.0f} against {kept.mean:.0f} {unit})"
        )
    return None


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
    levels: Sequence[Level],
    minimum: float,
    tau: float | None = None,
    min_tau: float | None = None,
    k: int = 0,
    on_inconclusive: str = "refuse",
) -> Verdict:
    """The gate, per level: pays, does not pay, or inconclusive (``Level.outcome``). Any level that
    does not pay fails it, told apart by acceptance (``tau`` against ``min_tau``): low acceptance is
    acceptance's finding; acceptance fine with no speed-up is the drafter's cost at that load (K
    drafted a step, tau kept). A level that is inconclusive fails it too unless ``on_inconclusive``
    is ``pass``, and says how many pairs would decide."""
    said = "; ".join(_numbers(lv, minimum) for lv in levels)
    if not levels:
        return Verdict(False, "no load was measured", UNMEASURED)
    unsteady = [lv for lv in levels if not lv.steady]
    if unsteady:
        said += "; " + ", ".join(
            f"at {lv.concurrency} the {'pairs' if lv.paired else 'repeats'} spread {lv.spread:.0%} "
            f"(over {STEADY:.0%}): the bound is widened by it"
            for lv in unsteady
        )
    odd = [lv for lv in levels if lv.model_disagrees]
    if odd:
        said += "; " + "; ".join(_disagreement(lv) for lv in odd)
    slow = [lv for lv in levels if lv.outcome(minimum) == DOES_NOT_PAY]
    open_ = [lv for lv in levels if lv.outcome(minimum) == UNDECIDED]
    undecided = ""
    if open_:
        undecided = f"inconclusive at concurrency {', '.join(str(lv.concurrency) for lv in open_)} " + "; ".join(
            _to_decide(lv, minimum) for lv in open_
        )
    if slow:
        at = ", ".join(str(lv.concurrency) for lv in slow)
        also = f" ({undecided})" if undecided else ""
        if tau is not None and min_tau is not None and tau < min_tau:
            return Verdict(
                False,
                f"speed-up below {minimum:g} at concurrency {at}{also}, and acceptance is low (tau {tau:.2f} < "
                f"{min_tau:g}): the drafter's tokens are not kept. {said}",
                LOW_ACCEPTANCE,
                tuple(levels),
            )
        if tau is None:
            kept = "with acceptance not probed in this run"
        else:
            kept = f"with acceptance fine (tau {tau:.2f}" + (f" of K = {k} drafted)" if k else ")")
        return Verdict(
            False,
            f"speed-up below {minimum:g} at concurrency {at} {kept}{also}: speculation does not pay "
            f"at this load (the drafter's cost per step outweighs what it keeps: a lower K, less load per host, or no "
            f"speculation here). {said}",
            NO_SPEEDUP,
            tuple(levels),
        )
    if open_ and on_inconclusive != "pass":
        return Verdict(
            False,
            f"{undecided}: the measurement neither shows that speculation pays {minimum:g}x nor that it does not, "
            f"so the host is not READY on it (gates.speedup.on_inconclusive: refuse). {said}",
            INCONCLUSIVE,
            tuple(levels),
        )
    if open_:
        said = f"{undecided}, READY as gates.speedup.on_inconclusive: pass says. {said}"
    return Verdict(True, said, levels=tuple(levels))


def _to_decide(lv: Level, minimum: float) -> str:
    """How many pairs would decide an inconclusive level, at today's spread."""
    need = lv.pairs_to_decide(minimum)
    if lv.repeats[1] < 2:
        return f"(at {lv.concurrency}: one run an arm, no interval)"
    if not lv.paired:
        return f"(at {lv.concurrency}: arms measured apart, {lv.repeats[0]}+{lv.repeats[1]} runs)"
    if need is None:
        return f"(at {lv.concurrency}: the speed-up sits at {minimum:g}, no number of pairs would decide)"
    return f"(at {lv.concurrency}: about {need} pairs would decide, {lv.repeats[1]} measured)"


def _disagreement(lv: Level) -> str:
    assert lv.expected is not None and lv.tau is not None and lv.steps_s is not None
    return (
        f"at {lv.concurrency} vLLM's counters expect {lv.expected:.2f}x (tau {lv.tau:.2f}, a step "
        f"{lv.steps_s[1] * 1000:.1f} ms against {lv.steps_s[0] * 1000:.1f} ms alone), outside the measured "
        f"{lv.low:.2f}-{lv.high:.2f}: the measurement, not the drafter, is in question (other traffic on the "
        "server, or a load its client could not keep up)"
    )


def _numbers(lv: Level, minimum: float) -> str:
    if lv.repeats[0] > 1 and lv.repeats[1] > 1:
        bound = f", 95% {lv.low:.2f}-{lv.high:.2f}" if math.isfinite(lv.high) else f", 95% >= {lv.low:.2f}"
    else:
        bound = ", one run an arm: no bound"
    n = f"{lv.repeats[1]} pairs" if lv.paired else f"n = {lv.repeats[0]}+{lv.repeats[1]}"
    unit = "decode tokens/s a request, vLLM's" if lv.measured == "server" else "tokens/s"
    beside = ""
    if lv.client_speedup is not None:
        beside += f"; the client's clock {lv.client_speedup:.2f}x"
    if lv.expected is not None:
        beside += f"; expected {lv.expected:.2f}x from vLLM's counters"
    return (
        f"at {lv.concurrency}: {lv.speedup:.2f}x ({lv.drafter:.0f} against {lv.baseline:.0f} {unit}{bound}, "
        f"{n}{beside}): {lv.outcome(minimum)}"
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


def load_op(
    playbook: Playbook, concurrency: int, port: int, host: str = protocol.LOOPBACK, max_tokens: int | None = None
) -> protocol.Op[protocol.Loaded]:
    """One load run at ``concurrency`` against the server on ``port``."""
    gate = playbook.gates.speedup
    assert gate is not None
    s, prompts = playbook.serving, speedup_prompts(playbook)
    tokens = gate.max_tokens if max_tokens is None else max_tokens
    requests = load_requests(playbook, concurrency)
    # a token a second for each request in a wave, at the least: a CPU server is that slow
    timeout = 60.0 + tokens * requests / concurrency
    return protocol.load(port, s.model_name, prompts, tokens, concurrency, requests, timeout, host=host)


def warm_op(playbook: Playbook, port: int, host: str = protocol.LOOPBACK) -> protocol.Op[protocol.Loaded]:
    """A warm-up run at the highest level, short, whose numbers are not kept (the first requests
    after a start pay for allocations and compiled shapes the later ones reuse)."""
    gate = playbook.gates.speedup
    assert gate is not None
    return load_op(playbook, max(gate.concurrency), port, host, min(gate.max_tokens, 16))


def level_order(playbook: Playbook) -> tuple[int, ...]:
    """The levels in the order a pair round measures them: every level once a round, so that a
    slow minute of the host spreads over every level, not one."""
    gate = playbook.gates.speedup
    assert gate is not None
    return gate.concurrency


def baseline_port(playbook: Playbook) -> int:
    """Where the baseline beside the server listens: ``gates.speedup.baseline_port``, else the
    serving port + 1 (- 1 at the top of the range)."""
    gate, port = playbook.gates.speedup, playbook.serving.port
    if gate is not None and gate.baseline_port is not None:
        return gate.baseline_port
    return port + 1 if port < 65535 else port - 1


# What the target alone needs of a GPU beyond its weights: activations, CUDA graphs and a KV cache
# for the gate's levels (a few GiB whatever the model), and a margin over the weights' bytes.
_BESIDE_FIXED_MIB = 3 * 1024
_BESIDE_WEIGHTS = 1.25
# What two servers may ask of one GPU together (vLLM refuses a start whose share is not free).
_BESIDE_CEILING = 0.95


def baseline_memory(playbook: Playbook, report: HostReport) -> float | None:
    """The ``--gpu-memory-utilization`` of the baseline beside the server: the gate's, else the
    target's weights per GPU (its bytes over the tensor parallel size) with a margin, over the
    GPU's memory. None: no GPU (a CPU build: the host's memory) or nothing known to size it by."""
    gate = playbook.gates.speedup
    assert gate is not None
    if not report.gpus:
        return None
    if gate.baseline_memory is not None:
        return gate.baseline_memory
    sizes: list[int] = [g["memory_total_mib"] for g in report.gpus if isinstance(g.get("memory_total_mib"), int)]
    total = min(sizes, default=0)
    weights = next((m.get("bytes") for m in report.models if m.get("name") == "target"), None)
    if not total or not isinstance(weights, int):
        return None
    per_gpu_mib = weights / max(1, len(report.gpus)) / 2**20
    return math.ceil((per_gpu_mib * _BESIDE_WEIGHTS + _BESIDE_FIXED_MIB) / total * 100) / 100


def arms(playbook: Playbook, report: HostReport) -> tuple[str, str]:
    """Beside (both servers at once, measured in turn) or before (the baseline in the release's
    place first), and why: ``gates.speedup.arms``, else beside where the memory holds both."""
    gate = playbook.gates.speedup
    assert gate is not None
    if gate.arms != "auto":
        return gate.arms, f"gates.speedup.arms: {gate.arms}"
    if not report.gpus:
        return "beside", "no GPU: both servers in the host's memory"
    need = baseline_memory(playbook, report)
    share = memory_utilization(playbook)
    if need is None:
        return "before", "the target's size or the GPU's memory is not known, so both may not fit"
    if round(share + need, 4) <= _BESIDE_CEILING:
        return "beside", f"the server asks {share:g} of the GPU's memory, the target alone {need:g}"
    return "before", (
        f"the GPU's memory does not hold both (the server asks {share:g} of it, the target alone about {need:g}; "
        "a lower --gpu-memory-utilization or gates.speedup.baseline_memory would)"
    )


def beside_command(playbook: Playbook, container: Container, release: str, report: HostReport) -> ServerCommand:
    """The baseline beside the server: the release's command without the drafter, on the baseline
    port, with its own share of the GPU's memory."""
    command = serving.command(playbook, container, release, speculative=False)
    argv = list(command.argv)
    argv[argv.index("--port") + 1] = str(baseline_port(playbook))
    share = baseline_memory(playbook, report)
    if share is not None:
        # In place of the server's own (vLLM 0.26 keeps the last of two, warning "Found duplicate
        # keys --gpu-memory-utilization": recorded on an H100, tests/data/gpu/speedup-beside).
        flag = "--gpu-memory-utilization"
        kept = [a for i, a in enumerate(argv) if not (a.startswith(flag + "=") or a == flag or argv[i - 1] == flag)]
        argv = [*kept, flag, f"{share:g}"]
    return replace(command, argv=tuple(argv))


def pinned_target(report: HostReport) -> str | None:
    """The target's weights as one digest, where the models gate found them (None: the playbook
    names no ``models.target``, so the target is known by its path alone)."""
    return next((m.get("sha256") for m in report.models if m.get("name") == "target" and m.get("sha256")), None)


def speedup_key(playbook: Playbook, container: Container, report: HostReport) -> tuple[str, str] | None:
    """The baseline arm's key for a host, from what its gates found (``baseline_key``):
    None while the build or the target is not known (the checks did not run)."""
    gate, s = playbook.gates.speedup, playbook.serving
    build = report.gates.get(GATE_BUILD)
    vllm = build.data.get("vllm") if build is not None else None
    if gate is None or s.target is None or not isinstance(vllm, str):
        return None
    target = pinned_target(report)
    prompts = hashlib.sha256(json.dumps(list(speedup_prompts(playbook))).encode()).hexdigest()
    return baseline_key(
        target or s.target,
        vllm,
        [str(g.get("name")) for g in report.gpus],
        (serving.tensor_parallel_size(playbook, container), s.pipeline_parallel_size),
        {"python": s.python, "env": dict(s.env), "extra_args": list(s.extra_args), "model_name": s.model_name},
        {"max_tokens": gate.max_tokens, "prompts_sha256": prompts, "requests": f"whole waves, {LOAD_WAVES} at least"},
    )
