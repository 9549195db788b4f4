"""What ``orchestrate watch`` decides, pure: a host's state from one round of what it read.

Each round reads, for every node, what ``verify`` reads (the files the server reads against the
release, the server we started, the READY record) and, on a head, vLLM's spec-decode counters.
No probe traffic is sent: acceptance is measured on the production traffic that flowed since the
window opened, with the probe's arithmetic and bound (``probe``), and judged by the playbook's
acceptance gate once the window holds ``min_drafts`` drafts (a quiet host's window stays open
across rounds until it does). A counter that went down, or a new server pid, is a restart: the
window starts again and the verdict of the old server is dropped.

A host's state, most urgent first:

    DOWN      the host or its server cannot be reached, is not running, or is unhealthy
    DEGRADED  live traffic is not accepting the drafter's tokens (the gate fails on a full window),
              or speculation is not running at all, or the window can never be judged (counters
              that miss one the verdict needs or contradict each other, tokens generated and none
              drafted)
    DRIFT     the files served, the model files, or the READY record no longer match the release
              we proved
    OUT_OF_ROTATION  all of the above holds, but the playbook's gateway sends the host no traffic
              (taken out and never put back: capacity lost); a host in rotation that is DOWN,
              DEGRADED or DRIFT says that users' requests reach it
    READY     none of the above; acceptance proven on live traffic, or not yet refuted

DEGRADED outranks DRIFT: the founding incident was both (a stale drafter config), and what it
costs is the acceptance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.config.playbook import AcceptanceGate
from orchestrator.results import GATE_FILES, GATE_HEALTH, GATE_MODELS, GATE_READY, HostReport
from orchestrator.rules import probe

READY, DEGRADED, DRIFT, DOWN = "READY", "DEGRADED", "DRIFT", "DOWN"
OUT_OF_ROTATION = "OUT_OF_ROTATION"
STATES = (READY, DEGRADED, DRIFT, OUT_OF_ROTATION, DOWN)


@dataclass(frozen=True)
class Seen:
    """What one round read of one node. ``error``: it could not be read at all (then nothing else
    is set). ``counters`` is None on a node that serves no HTTP, or when the server shows none."""

    at: float
    error: str | None = None
    report: HostReport | None = None  # the files, health and ready gates as verify reads them
    head: bool = True  # serves HTTP and the counters
    counters: probe.Counters | None = None
    metrics_error: str | None = None
    server_pid: int | None = None
    changed_fields: tuple[str, ...] = ()  # in drifted JSON files, named: "config.json: a.b 1 -> 2"
    notes: tuple[str, ...] = ()  # said with the round, whatever the state (a reconnect)
    # This watch rolled the host back (``--rollback-on``): said first in every later round, since
    # the host then serves another release than the playbook's (DRIFT by its files), by design.
    went_back: str | None = None
    group_down: tuple[str, ...] = ()  # the other nodes of its multi-node group that are down
    # The gateway's view of a head (with a gateway in the playbook): in rotation, in its words;
    # or why it could not be read.
    in_rotation: bool | None = None
    rotation_status: str = ""
    running: float | None = None  # the requests vLLM ran at the read (None: not shown)

    @property
    def down(self) -> bool:
        """Unreachable, or its server (rank) not running or unhealthy."""
        if self.error is not None or self.report is None:
            return True
        health = self.report.gates.get(GATE_HEALTH)
        return health is not None and not health.ok


@dataclass(frozen=True)
class Live:
    """Acceptance over one judged window of production traffic."""

    ok: bool
    detail: str
    mean_acceptance_length: float
    mean_acceptance_length_low: float
    rate: float
    drafts: int
    since: float
    until: float

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "detail": self.detail,
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
            "mean_acceptance_length_low": round(self.mean_acceptance_length_low, 3),
            "acceptance_rate": round(self.rate, 4),
            "drafts": self.drafts,
            "since": self.since,
            "until": self.until,
        }


@dataclass(frozen=True)
class HostWatch:
    """What is carried from round to round for one node."""

    name: str
    state: str | None = None
    since: float | None = None  # when it entered its state
    base: probe.Counters | None = None  # the counters when the open window began
    base_at: float | None = None
    last: probe.Counters | None = None  # the previous round's counters
    pid: int | None = None  # the server's pid in the previous round
    live: Live | None = None  # the last judged window of this server
    last_good: float | None = None  # the last round that found it READY
    release_id: str | None = None
    rounds: int = 0
    undrafted: float = 0.0  # tokens generated since drafts last moved (this server)
    state_rounds: int = 0  # rounds in its state, this one included


@dataclass(frozen=True)
class Round:
    """One node's round, as printed, exported and recorded."""

    host: str
    at: float
    state: str
    reasons: tuple[str, ...]
    release_id: str | None
    live: Live | None
    window_drafts: int | None  # drafts in the open window so far (None: no counters)
    window_needed: int  # drafts a window needs to be judged (gates.live.min_drafts)
    files_in_drift: int
    restarted: str | None
    last_good: float | None
    gates: dict[str, Any] = field(default_factory=dict)
    in_rotation: bool | None = None  # at the gateway (None: no gateway, or it could not say)
    gateway_unread: str | None = None  # why the gateway could not be read this round
    state_rounds: int = 1  # rounds in this state, this one included (alerts count rounds, not seconds)
    live_min: float | None = None  # the live gate's mean acceptance length, for alerts to compare
    running: float | None = None  # requests the server ran at the round's read (its gauge)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "at": self.at,
            "state": self.state,
            "reasons": list(self.reasons),
            "release_id": self.release_id,
            "live": self.live.to_json() if self.live else None,
            "window_drafts": self.window_drafts,
            "window_needed": self.window_needed,
            "files_in_drift": self.files_in_drift,
            "restarted": self.restarted,
            "last_good": self.last_good,
            "gates": self.gates,
            "in_rotation": self.in_rotation,
            "gateway_unread": self.gateway_unread,
            "running": self.running,
        }


@dataclass(frozen=True)
class Transition:
    """A host moving from one state to another, with the round that showed it as evidence."""

    host: str
    at: float
    before: str | None
    after: str
    round: Round

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "at": self.at,
            "from": self.before,
            "to": self.after,
            "reasons": list(self.round.reasons),
            "evidence": self.round.to_json(),
        }


def step(w: HostWatch, seen: Seen, gate: AcceptanceGate) -> tuple[HostWatch, Round, Transition | None]:
    """One round for one node: its next carried state, the round, and the transition if any."""
    reasons: list[str] = []
    down = False
    restarted: str | None = None
    base, base_at, last, live, pid, undrafted = w.base, w.base_at, w.last, w.live, w.pid, w.undrafted
    report = seen.report
    drift_count = 0
    if seen.error is not None or report is None:
        down = True
        reasons.append(seen.error or "nothing was read")
    else:
        health = report.gates.get(GATE_HEALTH)
        if health is not None and not health.ok:
            down = True
            reasons.append(health.detail)
        if seen.server_pid is not None and pid is not None and seen.server_pid != pid:
            restarted = f"the server restarted (pid {pid} -> {seen.server_pid})"
        pid = seen.server_pid if seen.server_pid is not None else pid
        drift_count = sum(1 for f in report.files if f.drift)
        if seen.group_down:
            # One group serves through its head: a rank down is the whole group down.
            down = True
            reasons.append(f"its group is down: {', '.join(seen.group_down)} not running or unreachable")
    counters = seen.counters
    window_drafts = None
    blind = False  # a serving head whose acceptance cannot be measured at all
    if seen.head and not down and report is not None and GATE_HEALTH in report.gates:
        if seen.metrics_error is not None:
            reasons.append(f"acceptance cannot be read: {seen.metrics_error}")
            live, blind = None, True
        elif counters is None:
            reasons.append("speculative decoding is not running: the server shows no vllm:spec_decode_* counters")
            live, blind = None, True
        else:
            if last is not None and probe.deltas(last, counters) is None and restarted is None:
                restarted = "the spec-decode counters went down: the server restarted"
            if restarted is not None or base is None:
                if restarted is not None:
                    live = None  # the old server's verdict says nothing of this one
                base, base_at, undrafted = counters, seen.at, 0.0
            step_d = probe.deltas(last, counters) if last is not None and restarted is None else None
            if step_d is not None:
                undrafted = 0.0 if step_d.drafts > 0 else undrafted + (step_d.generated or 0.0)
            d = probe.deltas(base, counters)
            assert d is not None  # base is at most last, which counters did not go below
            window_drafts = int(d.drafts)
            never = _never_judged(d, undrafted, gate)
            a = probe.acceptance(d) if never is None else None
            if never is not None:
                # However long it stays open, this window gives no verdict: said, never READY.
                reasons.append(never)
                live, blind = None, True
            if a is not None and a.drafts >= gate.min_drafts:
                ok, detail, _ = probe.judge(
                    a, gate.min_mean_acceptance_length, gate.min_acceptance_rate, gate.min_drafts
                )
                live = Live(
                    ok,
                    detail,
                    a.mean_acceptance_length,
                    a.mean_acceptance_length_low,
                    a.rate,
                    a.drafts,
                    base_at if base_at is not None else seen.at,
                    seen.at,
                )
                base, base_at = counters, seen.at
                window_drafts = 0  # judged: the next window opens now
            if live is not None and not live.ok:
                reasons.append(f"live traffic: {live.detail}")
        last = counters
    if restarted is not None:
        reasons.append(restarted)
    drifted = False
    if report is not None and not down:
        for name in (GATE_FILES, GATE_MODELS, GATE_READY):
            g = report.gates.get(name)
            if g is not None and not g.ok:
                drifted = True
                reasons.append(g.detail)
        reasons.extend(seen.changed_fields)
    reasons.extend(seen.notes)
    if seen.went_back is not None:
        reasons.insert(0, seen.went_back)
    if down:
        state = DOWN
    elif blind or (live is not None and not live.ok):
        state = DEGRADED
    elif drifted:
        state = DRIFT
    elif seen.in_rotation is False:
        state = OUT_OF_ROTATION
        reasons.append(f"READY but out of the gateway's rotation ({seen.rotation_status}): it serves no user")
    else:
        state = READY
    if seen.in_rotation is True and state != READY:
        reasons.append(f"in the gateway's rotation ({seen.rotation_status}): users' requests reach it")
    elif seen.in_rotation is None and seen.rotation_status:
        reasons.append(f"the gateway: {seen.rotation_status}")
    last_good = seen.at if state == READY else w.last_good
    release_id = report.release_id if report is not None and not seen.error else w.release_id
    gates = {k: g.to_json() for k, g in report.gates.items()} if report is not None else {}
    rnd = Round(
        host=w.name,
        at=seen.at,
        state=state,
        reasons=tuple(reasons),
        release_id=release_id,
        live=live,
        window_drafts=window_drafts,
        window_needed=gate.min_drafts,
        files_in_drift=drift_count,
        restarted=restarted,
        last_good=last_good,
        gates=gates,
        in_rotation=seen.in_rotation,
        gateway_unread=seen.rotation_status if seen.in_rotation is None and seen.rotation_status else None,
        state_rounds=1 if state != w.state else w.state_rounds + 1,
        live_min=gate.min_mean_acceptance_length,
        running=seen.running if not down else None,
    )
    changed = state != w.state
    nxt = replace(
        w,
        state=state,
        since=seen.at if changed else w.since,
        base=base,
        base_at=base_at,
        last=last,
        pid=pid,
        live=live,
        last_good=last_good,
        release_id=release_id,
        rounds=w.rounds + 1,
        undrafted=undrafted,
        state_rounds=rnd.state_rounds,
    )
    return nxt, rnd, Transition(w.name, seen.at, w.state, state, rnd) if changed else None


def _never_judged(d: probe.Counters, undrafted: float, gate: AcceptanceGate) -> str | None:
    """Why the open window can never be judged (None: it can, once enough drafts flow): counters
    that miss one the verdict needs or contradict each other, or traffic that generates tokens
    and no drafts (speculation does not run for it, so drafts never come). ``undrafted``: the
    tokens generated since the drafts last moved, as many as a window's drafts at least."""
    why = probe.unjudgeable(d)
    if why is not None:
        return f"acceptance cannot be judged: {why}"
    if undrafted >= gate.min_drafts:
        return (
            f"{undrafted:.0f} tokens generated since the last draft: "
            "speculative decoding is not running for this traffic"
        )
    return None


def changed_fields(name: str, intended: bytes, found: bytes | None) -> list[str]:
    """The fields of a JSON file that differ from the release's, named by their dotted path
    ("config.json: dflash_config.mask_token_id 151669 -> 151643"); [] when either is not JSON
    (its digest already says that it changed)."""
    if found is None:
        return []
    try:
        want, got = json.loads(intended), json.loads(found)
    except (UnicodeDecodeError, ValueError):
        return []
    out: list[str] = []
    _diff(want, got, "", out)
    return [f"{name}: {line}" for line in out]


_ABSENT = object()


def _diff(want: Any, got: Any, path: str, out: list[str]) -> None:
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(want) | set(got), key=str):
            sub = f"{path}.{key}" if path else str(key)
            _diff(want.get(key, _ABSENT), got.get(key, _ABSENT), sub, out)
        return
    if want == got and type(want) is type(got):
        return
    if want is _ABSENT:
        out.append(f"{path} added ({_short(got)})")
    elif got is _ABSENT:
        out.append(f"{path} removed (was {_short(want)})")
    else:
        out.append(f"{path} {_short(want)} -> {_short(got)}")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def to_roll_back(rounds: list[Round], after: int, done: set[str]) -> list[str]:
    """The hosts a watch that rolls back takes back now (``watch --rollback-on degraded``): each
    DEGRADED for ``after`` rounds in a row, and not already taken back by this watch (a host
    DEGRADED again on the release it went back to is left to people: a rollback that did not help
    is not tried again, and two would only swap the bad release back in)."""
    return [r.host for r in rounds if r.state == DEGRADED and r.state_rounds >= after and r.host not in done]
