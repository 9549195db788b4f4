"""The acceptance probe's arithmetic, pure: vLLM's spec-decode counters before and after a probe
workload, their deltas summed over engines, and the statistics the acceptance gate judges.

    rate = d(accepted) / d(draft_tokens)
    mean acceptance length (tau) = 1 + d(accepted) / d(drafts)     (includes the bonus token)
    per position p = d(accepted_per_pos[p]) / d(drafts)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

PREFIX = "vllm:spec_decode_num_"
NAMES = {
    f"{PREFIX}drafts": "drafts",
    f"{PREFIX}draft_tokens": "draft_tokens",
    f"{PREFIX}accepted_tokens": "accepted",
    f"{PREFIX}accepted_tokens_per_pos": "per_pos",
}
# The three a window's verdict is computed from: a server that shows some spec-decode counters
# but not these can never be judged.
REQUIRED = ("drafts", "draft_tokens", "accepted")
# Output tokens, speculation or not: traffic that generates tokens and no drafts is traffic that
# speculation does not run for.
GENERATED = "vllm:generation_tokens_total"
FAMILIES = (PREFIX, GENERATED.removesuffix("_total"))  # what a scrape is filtered to on the host
# The requests vLLM runs now (a gauge, every engine): what watch records of the fleet's load.
RUNNING = "vllm:num_requests_running"


# Why the acceptance numbers fail, as codes (``Gate.reason``; the diagnosis reads them).
NO_SPECULATION = "no_speculation"  # no spec-decode counters, or no drafts: speculation is not running
RESTARTED = "restarted"  # a counter went down: the server restarted between the scrapes
UNREADABLE = "unreadable_metrics"  # /metrics says something that is not Prometheus' text format
UNJUDGEABLE = "unjudgeable"  # the counters miss one the verdict needs, or contradict each other
TOO_FEW_DRAFTS = "too_few_drafts"
LOW_TAU = "low_mean_acceptance_length"
LOW_RATE = "low_acceptance_rate"


class ProbeError(Exception):
    """The numbers cannot be judged (no speculation, a restart, unreadable metrics); ``reason`` says
    which."""

    def __init__(self, message: str, reason: str = UNREADABLE) -> None:
        super().__init__(message)
        self.reason = reason


class Judged(NamedTuple):
    """The acceptance gate's verdict on a probe's numbers, with its reason code when it fails."""

    ok: bool
    detail: str
    reason: str = ""  # why not ok (LOW_TAU, LOW_RATE, TOO_FEW_DRAFTS)


@dataclass
class Counters:
    """The spec-decode counters of one /metrics scrape, summed over engines."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)
    generated: float | None = None  # vllm:generation_tokens (None: the server shows none)
    shown: frozenset[str] = frozenset(NAMES.values())  # which of NAMES' counters the server shows


# One sample line of the exposition format: name, {labels} (values may hold '}' when quoted),
# value, an optional timestamp.
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_WANTED = {f"{name}_total": key for name, key in NAMES.items()}


def parse(text: str) -> Counters | None:
    """Spec-decode counters summed over every engine, and the generated tokens; None when the
    server exposes no spec-decode counter.

    Only the lines of these counters are read (a watch round parses one scrape per host, and
    prometheus_client's general parser cost ~2 ms of controller CPU a scrape); a malformed or
    non-finite one is a ``ProbeError``, never a number."""
    out = Counters()
    shown: set[str] = set()
    for line in text.split("\n"):
        if not line.startswith((PREFIX, GENERATED)):
            continue  # comments (# HELP / # TYPE), other families, blank lines
        found = _SAMPLE.fullmatch(line)
        if found is None:
            raise ProbeError(f"unreadable metrics line: {line[:120]!r}")
        name = found.group(1)
        key = _WANTED.get(name)
        if key is None and name != GENERATED:
            continue  # _created timestamps, other series of the prefix
        value = _value(found, line, "a counter")
        position = _position(found.group(2) or "", line)
        if key is None:
            out.generated = (out.generated or 0.0) + value
            continue
        shown.add(key)
        if key == "per_pos":
            position = position if position is not None else "0"
            if not position.isdigit():
                raise ProbeError(f"position is not a number: {line[:120]!r}")
            out.per_pos[int(position)] = out.per_pos.get(int(position), 0.0) + value
        else:
            setattr(out, key, getattr(out, key) + value)
    out.shown = frozenset(shown)
    return out if shown else None


def _value(found: re.Match[str], line: str, what: str) -> float:
    """A sample's value: a finite number, never below 0 (counters and these gauges)."""
    try:
        value = float(found.group(3))
    except ValueError:
        raise ProbeError(f"unreadable metrics value: {line[:120]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ProbeError(f"{what} is {found.group(3)}: {line[:120]!r}")
    return value


def total(text: str, name: str) -> float | None:
    """The sum of one family's samples over every label set (every engine, every finish reason);
    None when /metrics has none of it. A malformed or non-finite sample is a ``ProbeError``."""
    found_any, sum_ = False, 0.0
    for line in text.split("\n"):
        if not line.startswith(name):
            continue
        found = _SAMPLE.fullmatch(line)
        if found is None or found.group(1) != name:
            continue  # another family with this prefix, or a line that is not a sample of it
        found_any, sum_ = True, sum_ + _value(found, line, name)
    return sum_ if found_any else None


# A server's label sets are the same every scrape (engine, model, position): a watch round reads
# one scrape a host, and parsing their labels again was half of what parsing cost. Read-only once
# stored; bounded, for a server whose labels keep changing.
_POSITIONS: dict[str, str | None] = {}
_POSITIONS_KEPT = 1 << 14


def _position(text: str, line: str) -> str | None:
    """The ``position`` label of a sample's label set (None: it has none); a malformed label set is
    a ``ProbeError``."""
    try:
        return _POSITIONS[text]
    except KeyError:
        pass
    position = _labels(text, line).get("position")
    if len(_POSITIONS) < _POSITIONS_KEPT:
        _POSITIONS[text] = position
    return position


def _labels(text: str, line: str) -> dict[str, str]:
    labels, at = {}, 0
    while at < len(text):
        found = _LABEL.match(text, at)
        if found is None or found.end() == at:
            raise ProbeError(f"unreadable labels: {line[:120]!r}")
        labels[found.group(1)] = found.group(2)
        at = found.end()
    return labels


@dataclass(frozen=True)
class Acceptance:
    """What a probe's counter deltas mean: tau (mean acceptance length) with its 95% lower bound,
    the rate and per-position rates."""

    drafts: int
    draft_tokens: int
    accepted: int
    rate: float
    mean_acceptance_length: float
    mean_acceptance_length_low: float  # 95% lower bound
    per_position: list[float]
    # Each prompt's tau, where the probe read the counters after each prompt. Then the bound is
    # over prompts (each prompt's drafts one sample): acceptance within a request is not
    # independent token by token, and a per-token bound is several times too narrow for it.
    per_prompt: tuple[float, ...] = ()

    @property
    def bound_over(self) -> str:
        """What the 95% bound counts as independent samples, in the user's words."""
        return f"over {len(self.per_prompt)} prompts" if self.per_prompt else "per token"


def deltas(before: Counters, after: Counters) -> Counters | None:
    """What the counters gained from ``before`` to ``after``; None when one went down (the
    server restarted in between: its counters began again at zero)."""
    d = Counters(
        drafts=after.drafts - before.drafts,
        draft_tokens=after.draft_tokens - before.draft_tokens,
        accepted=after.accepted - before.accepted,
        per_pos={p: after.per_pos.get(p, 0.0) - before.per_pos.get(p, 0.0) for p in after.per_pos},
        generated=after.generated - before.generated
        if after.generated is not None and before.generated is not None
        else None,
        shown=after.shown,
    )
    if any(v < 0 for v in (d.drafts, d.draft_tokens, d.accepted, *d.per_pos.values(), d.generated or 0.0)):
        return None
    if any(p not in after.per_pos for p in before.per_pos):
        return None
    return d


def unjudgeable(d: Counters) -> str | None:
    """Why counter deltas can never give a verdict, however much traffic flows (None: they can).
    A draft holds at least one token and accepts at most as many as it holds; a server that shows
    some spec-decode counters must show the three the verdict is computed from."""
    missing = [name for name, key in NAMES.items() if key in REQUIRED and key not in d.shown]
    if missing:
        return f"the server shows spec-decode counters but not {', '.join(missing)}"
    if d.drafts > 0 and d.draft_tokens < d.drafts:
        return f"{d.drafts:.0f} drafts but {d.draft_tokens:.0f} draft tokens: the spec-decode counters disagree"
    if d.draft_tokens > 0 and d.drafts == 0:
        return f"{d.draft_tokens:.0f} draft tokens in no draft: the spec-decode counters disagree"
    if d.accepted > d.draft_tokens:
        return f"{d.accepted:.0f} tokens accepted of {d.draft_tokens:.0f} drafted: the spec-decode counters disagree"
    return None


def acceptance(d: Counters, prompts: Sequence[Counters] = ()) -> Acceptance | None:
    """The statistics of counter deltas; None when they hold no drafts. ``prompts``: the deltas
    of each prompt alone, where they were read: the bound is then over prompts."""
    drafts, tokens, accepted = int(d.drafts), int(d.draft_tokens), int(d.accepted)
    if drafts == 0 or tokens == 0:
        return None
    k = tokens / drafts
    clusters = [(int(p.drafts), int(p.accepted)) for p in prompts]
    low = prompts_low(clusters)
    return Acceptance(
        drafts=drafts,
        draft_tokens=tokens,
        accepted=accepted,
        rate=accepted / tokens,
        mean_acceptance_length=1 + accepted / drafts,
        mean_acceptance_length_low=low if low is not None else 1 + k * wilson_low(accepted, tokens),
        per_position=[d.per_pos[p] / drafts for p in sorted(d.per_pos)],
        per_prompt=tuple(1 + a / n if n else 1.0 for n, a in clusters) if low is not None else (),
    )


def other_traffic(before_text: str, after_text: str, own_tokens: int | None) -> int | None:
    """The tokens the server generated between two scrapes beyond the probe's own: other clients'
    requests, whose drafts the counters hold too (a server kept in rotation). None where it cannot
    be told (the server shows no vllm:generation_tokens, or the probe's usage is unknown)."""
    before, after = parse(before_text), parse(after_text)
    if own_tokens is None or before is None or after is None or before.generated is None or after.generated is None:
        return None
    return max(0, round(after.generated - before.generated) - own_tokens)


def measure(before_text: str, after_text: str, each: Sequence[str] = ()) -> Acceptance:
    """The acceptance of the traffic between two scrapes; a ProbeError when there is no speculation,
    a restart or nothing drafted. ``each``: the scrapes after each prompt, in order (the last
    prompt's may be ``after`` itself), for the bound over prompts."""
    before, after = parse(before_text), parse(after_text)
    if before is None or after is None:
        raise ProbeError(
            "speculative decoding is not running: the server exposes no vllm:spec_decode_* counters", NO_SPECULATION
        )
    d = deltas(before, after)
    if d is None:
        raise ProbeError("a spec-decode counter went down during the probe: the server restarted", RESTARTED)
    why = unjudgeable(d)
    if why is not None:
        raise ProbeError(f"acceptance cannot be judged: {why}", UNJUDGEABLE)
    prompts, last = [], before
    for i, text in enumerate(each, 1):
        now = parse(text)
        if now is None:
            raise ProbeError(f"the counters read after prompt {i} show no vllm:spec_decode_* series", UNJUDGEABLE)
        step = deltas(last, now)
        if step is None:
            raise ProbeError("a spec-decode counter went down during the probe: the server restarted", RESTARTED)
        prompts.append(step)
        last = now
    a = acceptance(d, prompts)
    if a is None:
        raise ProbeError("the probe produced no drafts: speculative decoding is not running", NO_SPECULATION)
    return a


# Student's t, two-sided 95%, for a few degrees of freedom; beyond, its Cornish-Fisher expansion
# (within 0.003 of the exact value from 11 on).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    """Student's t quantile at 0.975 with ``df`` degrees of freedom (df >= 1)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df * df)


def prompts_low(clusters: Sequence[tuple[int, int]]) -> float | None:
    """tau's 95% lower bound with each prompt's (drafts, accepted) one sample: the ratio
    estimator's variance over clusters (a prompt that drafts well drafts well all along), with
    Student's t for the few prompts a probe sends. None with fewer than 2 prompts or no drafts."""
    n, drafts, accepted = len(clusters), sum(c[0] for c in clusters), sum(c[1] for c in clusters)
    if n < 2 or drafts == 0:
        return None
    r = accepted / drafts
    spread = sum((a - r * d) ** 2 for d, a in clusters) / (n - 1)
    return max(1.0, 1 + r - t975(n - 1) * math.sqrt(n * spread) / drafts)


def wilson_low(successes: int, trials: int, z: float = 1.96) -> float:
    """The Wilson score interval's lower bound of a success rate: the gate's 95% confidence bound."""
    if trials == 0:
        return 0.0
    p = successes / trials
    denom = 1 + z * z / trials
    centre = p + z * z / (2 * trials)
    margin = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, (centre - margin) / denom)


def judge(a: Acceptance, min_tau: float, min_rate: float | None, min_drafts: int) -> Judged:
    """The acceptance gate's verdict on these numbers: enough drafts to decide, then tau, then the rate."""
    numbers = (
        f"tau {a.mean_acceptance_length:.2f} (95% >= {a.mean_acceptance_length_low:.2f} {a.bound_over}), "
        f"rate {a.rate:.1%}, {a.drafts} drafts"
    )
    if a.drafts < min_drafts:
        return Judged(False, f"too few drafts to decide ({a.drafts} < {min_drafts}): {numbers}", TOO_FEW_DRAFTS)
    if a.mean_acceptance_length < min_tau:
        return Judged(False, f"mean acceptance length {a.mean_acceptance_length:.2f} < {min_tau}: {numbers}", LOW_TAU)
    if min_rate is not None and a.rate < min_rate:
        return Judged(False, f"acceptance rate {a.rate:.1%} < {min_rate:.1%}: {numbers}", LOW_RATE)
    return Judged(True, numbers)
