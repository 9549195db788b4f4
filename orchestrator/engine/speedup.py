"""The speed-up gate on a host: does speculation make it faster at the fleet's load?

Two arms of the same greedy load (``gates.speedup``: its concurrency levels, prompts, output
length, pairs), sent by the agent on the host to its servers, both in this session on the
rollout's canary (``rules.gates.speedup`` has the method and the arithmetic):

- *beside*: once the release is proven, the target alone starts beside it on the baseline port
  (``BASELINE_SERVER``), the two are measured in pairs, one run at a time in an A B B A order, and
  the baseline server is stopped; the release's server is never restarted for it;
- *before* (where the GPU's memory does not hold both): the target alone is started in the
  release's place before the release starts (one extra start) and measured, then the release's
  drafter arm right after the acceptance probe; their runs are paired in order.

The baseline kept by an earlier session of the same key is never the comparator: it is the drift
check (today's baseline against it, said when they differ), and this session's is kept in its
place. Only the rollout's canary measures: the hosts after it of the same key hold its verdict
(the gpus and build gates prove "the same"), and a rollout with no canary measures nothing and
says so. The gate fails where a level does not pay (or cannot decide, unless
``on_inconclusive: pass``), and the host is not READY: it goes back to the release it had.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.playbook import SpeedupGate
from orchestrator.engine.runner import Node, Run, Unit
from orchestrator.errors import AgentError, StateError
from orchestrator.results import GATE_ACCEPTANCE, GATE_SPEEDUP, Gate
from orchestrator.rules import gates, serving
from orchestrator.rules.gates import speedup as rules

# The baseline beside the release's server: a process of its own name, so that stopping it never
# touches the server that serves.
BASELINE_SERVER = "dflash-speedup-baseline"

Runs = dict[int, list[rules.Run]]


def wanted(run: Run) -> bool:
    """The playbook asks for the gate, and its server speculates."""
    s = run.playbook.serving
    return run.playbook.gates.speedup is not None and s.target is not None and s.speculative


def _key(run: Run, unit: Unit) -> tuple[str, str] | None:
    head = unit.head
    return gates.speedup.speedup_key(run.playbook, head.target.container, head.report)


def _kept(run: Run, key: str) -> dict[int, dict[str, Any]]:
    """The baseline an earlier session kept under ``key`` (for the drift check), read once a run
    before this session's replaces it."""
    with run.once_lock:
        if ("kept", key) in run.once:
            return dict(run.once[("kept", key)])
    found: dict[int, dict[str, Any]] = {}
    if run.store is not None:
        try:
            found = run.store.baseline(key)
        except StateError as exc:
            run.say(f"error: the speed-up baselines could not be read: {exc}")
    with run.once_lock:
        run.once.setdefault(("kept", key), found)
        return dict(run.once[("kept", key)])


def _keep(run: Run, node: Node, key: str, what: str, runs: Runs) -> None:
    """This session's baseline, for the next session's drift check."""
    _kept(run, key)  # the earlier one is read before it is replaced
    if run.store is None or not runs or rules.pinned_target(node.report) is None:
        return  # a target known by its path alone: nothing to tell the next session's apart by
    try:
        run.store.keep_baseline(key, what, node.name, {c: [r.to_json() for r in rs] for c, rs in runs.items()})
    except StateError as exc:  # this run still judges; the next one has no drift check
        run.say(f"error: the speed-up baseline was not kept: {exc}")


def needs_baseline(run: Run, unit: Unit) -> tuple[str, str] | None:
    """The key (and its words) of the baseline this unit measures *before* its release starts: a
    canary, one host, a key, and arms that do not fit beside each other. None: it measures none
    before (beside, or not at all)."""
    if not wanted(run) or unit.head.name not in run.canaries or not unit.single or not _gate(run).concurrency:
        return None
    found = _key(run, unit)
    if found is None:
        return None
    arms, _ = gates.speedup.arms(run.playbook, unit.head.report)
    return found if arms == "before" else None


def before_launch(run: Run, unit: Unit, release: str, found: tuple[str, str]) -> bool:
    """On a canary whose arms do not fit beside each other: start the target alone in the
    release's place, measure the load, stop it, and hold its runs for the drafter arm after the
    proof. False: it could not be measured, and the speed-up gate says why (the host was
    disturbed: roll back).

    The host must serve nothing else meanwhile: with a gateway it is out of rotation (``serve``
    drains a host before this step whenever it will measure)."""
    head = unit.head
    key, _ = found
    playbook = run.playbook
    host = serving.probe_host(playbook, head.target.container)
    command = serving.command(playbook, head.target.container, release, speculative=False)
    launch = protocol.launch(head.root, serving.SERVER, command, release, playbook.serving.port, host=host)
    health = gates.health.health_op(playbook, head.root, serving.SERVER, host)
    started = time.monotonic()
    run.step(head, "measuring the speed-up's baseline", "one extra start: the target without the drafter")
    head.disturbed = True
    runs: Runs = {}
    try:
        run.batch(head, [run.lock(head), launch, health])
        failed = _warm(run, head, playbook.serving.port)
        order = gates.speedup.level_order(playbook)
        # As many as the stopping rule may pair (max_pairs): none can be added once the release runs.
        for i in range(_gate(run).max_pairs):
            for c in order:
                failed += _into(runs, *_load(run, head, playbook.serving.port, c, f"baseline, pair {i + 1}"))
    except AgentError as exc:
        failed = [exc.failure.describe()]
    finally:
        _stop(run, head, serving.SERVER)
    seconds = round(time.monotonic() - started, 1)
    if failed:
        head.report.gates[GATE_SPEEDUP] = Gate(
            False,
            f"the baseline arm (the target without the drafter) could not be measured: {'; '.join(failed[:3])}",
            {"baseline_seconds": seconds},
            reason=rules.UNMEASURED,
        )
        return False
    with run.once_lock:
        run.once[("today", key)] = (runs, seconds)
    run.say(f"{head.name}: the speed-up's baseline measured in {seconds:g} s, before the release")
    return True


def after_proof(run: Run, unit: Unit) -> bool:
    """The speed-up gate on a proven unit: measured on a canary, held from the canary on the
    hosts after it, said as not measured elsewhere. False: it failed (the host is not READY)."""
    if not wanted(run):
        return True
    head = unit.head
    found = _key(run, unit)
    if found is None:
        head.report.gates[GATE_SPEEDUP] = Gate(
            True, "not measured: the vLLM build or the target is not known (the checks did not run)"
        )
        return True
    key, what = found
    if head.name not in run.canaries:
        with run.once_lock:
            held = run.speedups.get(key)
        if held is not None:
            canary, gate = held
            head.report.gates[GATE_SPEEDUP] = Gate(
                gate.ok, f"held from the canary {canary} ({what}): {gate.detail}", {**gate.data, "held_from": canary}
            )
            return gate.ok
        why = (
            "the rollout has no canary (rollout.canary): only a canary measures it"
            if not run.canaries
            else "its GPUs, build or target differ from every canary's, whose verdict it would hold"
        )
        head.report.gates[GATE_SPEEDUP] = Gate(True, f"not measured: {why}")
        return True
    if not unit.single:
        head.report.gates[GATE_SPEEDUP] = Gate(
            True, "not measured: a multi-node group's baseline (its ranks without the drafter) is not started"
        )
        return True
    gate = measure(run, unit, key, what)
    with run.once_lock:
        run.speedups[key] = (head.name, gate)
    return gate.ok


def measure(run: Run, unit: Unit, key: str, what: str, again: bool = False) -> Gate:
    """Both arms in this session on the running server, and the verdict: the baseline beside it,
    or the runs ``before_launch`` held. ``again`` (verify --speedup): beside only, as nothing may
    be restarted."""
    head, playbook = unit.head, run.playbook
    if not _gate(run).concurrency:  # concurrency: observed, and nothing was
        head.report.gates[GATE_SPEEDUP] = Gate(False, _gate(run).observed_from, reason=rules.UNMEASURED)
        return head.report.gates[GATE_SPEEDUP]
    with run.once_lock:
        before = run.once.pop(("today", key), None)
    if before is not None:
        return _judge_before(run, unit, key, what, before)
    arms, why = gates.speedup.arms(playbook, head.report)
    if arms == "before":
        detail = (
            f"not measured by verify: {why}, so the baseline starts in the server's place (a deploy's canary "
            "measures it)"
            if again
            else f"not measured: {why}, and no baseline ran before the release"
        )
        head.report.gates[GATE_SPEEDUP] = Gate(False, detail, reason=rules.UNMEASURED)
        return head.report.gates[GATE_SPEEDUP]
    return _beside(run, unit, key, what, why)


def _beside(run: Run, unit: Unit, key: str, what: str, why: str) -> Gate:
    """The target alone started beside the proven server, the two measured in pairs (A B B A),
    the stopping rule's early stop once every level decides; the baseline stopped whatever
    happened."""
    head, playbook = unit.head, run.playbook
    gate = _gate(run)
    release = head.report.release_id
    assert release is not None
    port = gates.speedup.baseline_port(playbook)
    host = serving.probe_host(playbook, head.target.container)
    command = gates.speedup.beside_command(playbook, head.target.container, release, head.report)
    launch = protocol.launch(head.root, BASELINE_SERVER, command, release, port, host=host)
    s = playbook.serving
    health = protocol.wait_health(head.root, BASELINE_SERVER, port, s.model_name, s.startup_timeout, host=host)
    run.step(head, "starting the speed-up's baseline beside the server", f"port {port}: {why}")
    started = time.monotonic()
    pairs: dict[int, list[tuple[rules.Run, rules.Run]]] = {c: [] for c in gate.concurrency}
    baseline: Runs = {}
    drafter: Runs = {}
    failed: list[str] = []
    start_s = measured_s = 0.0
    try:
        run.batch(head, [launch, health])
        start_s = time.monotonic() - started
        measuring = time.monotonic()
        failed = _warm(run, head, port) + _warm(run, head, s.port)
        order = gates.speedup.level_order(playbook)
        for i in range(gate.max_pairs):
            if failed:
                break
            for c in order:
                got: dict[str, rules.Run] = {}
                for arm in rules.pair_order(i):
                    one, lost = _load(run, head, port if arm == "baseline" else s.port, c, f"{arm}, pair {i + 1}")
                    failed += lost
                    if one is not None:
                        got[arm] = one
                if len(got) == 2:
                    pairs[c].append((got["baseline"], got["drafter"]))
                    baseline.setdefault(c, []).append(got["baseline"])
                    drafter.setdefault(c, []).append(got["drafter"])
            levels = [rules.paired_level(c, pairs[c]) for c in gate.concurrency]
            if i + 1 >= gate.repeats and rules.decided(levels, gate.min):
                break  # every level decides: the stopping rule's early stop
        measured_s = time.monotonic() - measuring
    except AgentError as exc:
        failed.append(exc.failure.describe())
    finally:
        stopping = time.monotonic()
        _stop(run, head, BASELINE_SERVER)
        start_s += time.monotonic() - stopping
    if failed:
        head.report.gates[GATE_SPEEDUP] = Gate(
            False,
            f"the speed-up could not be measured with the baseline beside the server: {'; '.join(failed[:3])}",
            {"baseline": {"arms": "beside", "port": port, "seconds": round(start_s, 1)}},
            reason=rules.UNMEASURED,
        )
        return head.report.gates[GATE_SPEEDUP]
    _keep(run, head, key, what, baseline)
    levels = [rules.paired_level(c, pairs[c]) for c in gate.concurrency]
    base = {"arms": "beside", "port": port, "why": why, "seconds": round(start_s, 1)}
    run.say(f"{head.name}: the speed-up's baseline beside the server, one extra start and stop: {start_s:.1f} s")
    return _verdict(run, unit, key, what, levels, (baseline, drafter), base, measured_s)


def _judge_before(run: Run, unit: Unit, key: str, what: str, before: tuple[Runs, float]) -> Gate:
    """The drafter arm right after the proof, its runs paired in order with the baseline's that
    ran before the release (``max_pairs`` of them), stopping early once every level decides."""
    head, playbook = unit.head, run.playbook
    gate = _gate(run)
    baseline, seconds = before
    run.step(head, "measuring the speed-up", f"concurrency {', '.join(map(str, gate.concurrency))}")
    started = time.monotonic()
    drafter: Runs = {}
    try:
        failed = _warm(run, head, playbook.serving.port)
        order = gates.speedup.level_order(playbook)
        for i in range(gate.max_pairs):
            for c in order:
                failed += _into(drafter, *_load(run, head, playbook.serving.port, c, f"drafter, pair {i + 1}"))
            if failed or (i + 1 >= gate.repeats and rules.decided(_paired(gate, baseline, drafter), gate.min)):
                break  # the stopping rule's early stop (or a run failed)
    except AgentError as exc:
        failed = [exc.failure.describe()]
    measured_s = time.monotonic() - started
    if failed:
        head.report.gates[GATE_SPEEDUP] = Gate(
            False, f"the drafter arm could not be measured: {'; '.join(failed[:3])}", reason=rules.UNMEASURED
        )
        return head.report.gates[GATE_SPEEDUP]
    _keep(run, head, key, what, baseline)
    levels = _paired(gate, baseline, drafter)
    base = {
        "arms": "before",
        "why": gates.speedup.arms(playbook, head.report)[1],
        "seconds": seconds,
    }
    return _verdict(run, unit, key, what, levels, (baseline, drafter), base, measured_s)


def _paired(gate: SpeedupGate, baseline: Runs, drafter: Runs) -> list[rules.Level]:
    """Each level's runs paired in order: the i-th baseline run with the i-th drafter run."""
    return [
        rules.paired_level(c, list(zip(baseline.get(c, []), drafter.get(c, []), strict=False)))
        for c in gate.concurrency
    ]


def _verdict(
    run: Run,
    unit: Unit,
    key: str,
    what: str,
    levels: list[rules.Level],
    arms: tuple[Runs, Runs],
    base: dict[str, Any],
    measured_s: float,
) -> Gate:
    """The gate from this session's pairs, with the drift against the baseline an earlier session
    kept (said, never used)."""
    head, playbook = unit.head, run.playbook
    gate = _gate(run)
    acceptance = head.report.gates.get(GATE_ACCEPTANCE)
    tau = acceptance.data.get("mean_acceptance_length") if acceptance is not None else None
    verdict = rules.judge(
        levels,
        gate.min,
        tau if isinstance(tau, (int, float)) else None,
        max(playbook.gates.acceptance.min_mean_acceptance_length, rules.LOW_TAU),
        playbook.serving.num_speculative_tokens,
        gate.on_inconclusive,
    )
    baseline, drafter = arms
    # A target known by its path alone: a baseline kept under that key may be another checkpoint
    # at the same path, so no drift is said against it, and none is kept for the next session.
    pinned = rules.pinned_target(head.report) is not None
    drifts = _drifts(run, key, baseline) if pinned else {}
    data = [
        {
            **lv.to_json(),
            "outcome": lv.outcome(gate.min),
            "baseline": _latency(baseline.get(lv.concurrency, [])),
            "drafter": _latency(drafter.get(lv.concurrency, [])),
        }
        for lv in levels
    ]
    said = f"; drift: {'; '.join(drifts.values())}" if drifts else ""
    if not pinned:
        said += (
            "; no drift check: the target is not pinned (models.target), so a baseline kept before may be "
            "another checkpoint at its path"
        )
    if gate.observed:
        said += f"; {gate.observed_from}"
    # A server in the gateway's rotation (kept in place, or verify's) shares both arms' host with
    # the users' requests: they are in its numbers, and the load is in their latency. Said.
    in_rotation = run.gateway is not None and not head.drained
    if in_rotation:
        said += "; measured with the host in the gateway's rotation: users' requests shared its server and are in its numbers"
    where = "the baseline beside the server" if base["arms"] == "beside" else "the baseline before the release"
    head.report.gates[GATE_SPEEDUP] = Gate(
        verdict.ok,
        f"{verdict.detail}; both arms in this session ({where}){said}",
        # seconds: both arms' load (measurement, not the tool's own share of the host's time)
        {
            "min": gate.min,
            "levels": data,
            "baseline": {"key": key, "what": what, "host": head.name, "at": time.time(), **base},
            "drift": drifts,
            "seconds": round(measured_s, 1),
            **({"observed": gate.observed_from} if gate.observed else {}),
            **({"in_rotation": True} if in_rotation else {}),
        },
        reason=verdict.reason,
    )
    return head.report.gates[GATE_SPEEDUP]


def _drifts(run: Run, key: str, today: Runs) -> dict[str, str]:
    """Per level, how far today's target alone is from the baseline an earlier session kept."""
    kept = _kept(run, key)
    out = {}
    for c, runs in today.items():
        earlier = kept.get(c)
        if not earlier:
            continue
        try:
            arm = rules.Arm(c, tuple(rules.Run.from_json(r) for r in earlier["runs"]))
            moved = rules.drift(rules.Arm(c, tuple(runs)), arm)
        except (KeyError, TypeError, ValueError, ArithmeticError):
            continue  # a kept row that does not read: no drift check, never a failed gate
        if moved is not None:
            when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(earlier.get("at", 0))))
            out[str(c)] = f"at {c} {moved}, kept by {earlier.get('host')} at {when} UTC"
    return out


def _gate(run: Run) -> SpeedupGate:
    gate = run.playbook.gates.speedup
    assert gate is not None
    return gate


def _warm(run: Run, node: Node, port: int) -> list[str]:
    """A warm-up run at the highest level whose numbers are not kept (the first requests after a
    start pay for allocations and compiled shapes the later ones reuse)."""
    host = serving.probe_host(run.playbook, node.target.container)
    op = gates.speedup.warm_op(run.playbook, port, host)
    loaded = run.batch(node, [op])[op]
    _, why = rules.run_of(int(op.request["concurrency"]), loaded)
    return [f"warm-up on port {port}: {w}" for w in why]


def _load(run: Run, node: Node, port: int, concurrency: int, what: str) -> tuple[rules.Run | None, list[str]]:
    """One load run, its own round trip (said as it goes): the run, or why it failed."""
    host = serving.probe_host(run.playbook, node.target.container)
    op = gates.speedup.load_op(run.playbook, concurrency, port, host)
    run.step(node, "speed-up", f"{what}, concurrency {concurrency}")
    loaded = run.batch(node, [op])[op]
    one, why = rules.run_of(concurrency, loaded)
    if why:
        return None, [f"concurrency {concurrency} on port {port}: {w}" for w in why]
    return one, []


def _into(runs: Runs, one: rules.Run | None, failed: list[str]) -> list[str]:
    if one is not None:
        runs.setdefault(one.concurrency, []).append(one)
    return failed


def _latency(runs: list[rules.Run]) -> dict[str, Any]:
    """What a user waits on, beside the total: time to first token, and each request's decode speed."""
    arm = rules.Arm(0, tuple(runs))
    return {
        "ttft_p50_s": arm.percentile(0.5),
        "ttft_p90_s": arm.percentile(0.9),
        "decode_p50_tokens_per_s": _round(arm.percentile(0.5, "decode")),
        "decode_p10_tokens_per_s": _round(arm.percentile(0.1, "decode")),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _stop(run: Run, node: Node, name: str) -> None:
    """A baseline's server, stopped whatever happened."""
    op = protocol.stop(node.root, name, run.playbook.serving.stop_timeout)
    # on failure: the release's launch stops what is left under the same name, and checks its port
    with contextlib.suppress(AgentError):
        run.batch(node, [run.lock(node), op])
