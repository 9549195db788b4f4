"""The speed-up gate on a host: does speculation make it faster at the fleet's load?

Two arms of the same greedy load (``gates.speedup``: its concurrency levels, prompts, output
length, repeats), sent by the agent on the host to its server:

- the *baseline*: the same target, build, GPUs and arguments without the drafter. It costs one
  extra server start, so it is measured once per key (``gates.speedup.speedup_key``: the target's weights,
  the vLLM build, the GPU model and count, the parallel sizes, the server's own arguments, the
  load) by a canary, before the drafter's release starts, with the host out of rotation, and kept
  in the state store; a later rollout of another drafter over the same target reuses it;
- the *drafter arm*: right after the acceptance probe passed, on the server just proven.

Only the rollout's canary measures: the hosts after it of the same key hold its verdict (the gpus
and build gates prove "the same"), and a rollout with no canary measures nothing and says so. The
gate fails with both numbers per concurrency where the speed-up is below ``min``
(``rules.speedup.judge``), and the host is not READY: it goes back to the release it had.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from orchestrator.agent import protocol
from orchestrator.engine.runner import Node, Run, Unit
from orchestrator.errors import AgentError, StateError
from orchestrator.results import GATE_ACCEPTANCE, GATE_SPEEDUP, Gate
from orchestrator.rules import gates, serving
from orchestrator.rules.gates import speedup as rules


def wanted(run: Run) -> bool:
    """The playbook asks for the gate, and its server speculates."""
    s = run.playbook.serving
    return run.playbook.gates.speedup is not None and s.target is not None and s.speculative


def _key(run: Run, unit: Unit) -> tuple[str, str] | None:
    head = unit.head
    return gates.speedup.speedup_key(run.playbook, head.target.container, head.report)


def _kept(run: Run, key: str) -> dict[int, dict[str, Any]]:
    """The baseline kept under ``key`` (this run's, or the store's), every level the gate asks for."""
    gate = run.playbook.gates.speedup
    assert gate is not None
    with run.once_lock:
        found = run.once.get(("baseline", key))
    if found is None and run.store is not None:
        try:
            found = run.store.baseline(key)
        except StateError as exc:
            run.say(f"error: the speed-up baselines could not be read: {exc}")
            found = None
    if not found or any(c not in found for c in gate.concurrency):
        return {}
    return dict(found)


def before_launch(run: Run, unit: Unit, release: str, found: tuple[str, str]) -> bool:
    """On a canary with no baseline kept for its key: start the target alone, measure the load,
    stop it, keep what it measured (a store's, and this run's for the hosts after it). False: it
    could not be measured, and the speed-up gate says why (the host was disturbed: roll back).

    The host must serve nothing else meanwhile: with a gateway it is out of rotation (``serve``
    drains a host before this step whenever it will measure). ``found``: its key, in words too
    (``needs_baseline``'s)."""
    head = unit.head
    key, what = found
    playbook = run.playbook
    host = serving.probe_host(playbook, head.target.container)
    command = serving.command(playbook, head.target.container, release, speculative=False)
    launch = protocol.launch(head.root, serving.SERVER, command, release, playbook.serving.port, host=host)
    health = gates.health.health_op(playbook, head.root, serving.SERVER, host)
    started = time.monotonic()
    run.step(head, "measuring the speed-up's baseline", "one extra start: the target without the drafter")
    head.disturbed = True
    try:
        run.batch(head, [run.lock(head), launch, health])
        runs, failed = _arm(run, head, "baseline")
    except AgentError as exc:
        runs, failed = {}, [exc.failure.describe()]
    finally:
        _stop(run, head)
    seconds = round(time.monotonic() - started, 1)
    if failed:
        head.report.gates[GATE_SPEEDUP] = Gate(
            False,
            f"the baseline arm (the target without the drafter) could not be measured: {'; '.join(failed[:3])}",
            {"baseline_seconds": seconds},
            reason=rules.UNMEASURED,
        )
        return False
    stored = {c: [r.to_json() for r in rs] for c, rs in runs.items()}
    kept = {c: {"at": time.time(), "host": head.name, "what": what, "runs": r} for c, r in stored.items()}
    with run.once_lock:
        run.once[("baseline", key)] = kept
        run.once[("baseline_seconds", key)] = seconds
    if run.store is not None:
        try:
            run.store.keep_baseline(key, what, head.name, stored)
        except StateError as exc:  # this run still judges with it; a later one measures again
            run.say(f"error: the speed-up baseline was not kept: {exc}")
    run.say(f"{head.name}: the speed-up's baseline measured in {seconds:g} s ({what})")
    return True


def needs_baseline(run: Run, unit: Unit) -> tuple[str, str] | None:
    """The key (and its words) of the baseline this unit measures before its release starts: a
    canary, one host, a key, and none kept under it. None: it measures none."""
    if not wanted(run) or unit.head.name not in run.canaries or not unit.single:
        return None
    found = _key(run, unit)
    return found if found is not None and not _kept(run, found[0]) else None


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


def measure(run: Run, unit: Unit, key: str, what: str) -> Gate:
    """The drafter arm on the running server, judged against the baseline kept under ``key``."""
    head, playbook = unit.head, run.playbook
    gate = playbook.gates.speedup
    assert gate is not None
    kept = _kept(run, key)
    if not kept:
        head.report.gates[GATE_SPEEDUP] = Gate(
            False,
            f"no baseline kept for {what} at concurrency {list(gate.concurrency)}: a deploy's canary measures one",
            reason=rules.UNMEASURED,
        )
        return head.report.gates[GATE_SPEEDUP]
    run.step(head, "measuring the speed-up", f"concurrency {', '.join(map(str, gate.concurrency))}")
    started = time.monotonic()
    try:
        runs, failed = _arm(run, head, "drafter")
    except AgentError as exc:
        runs, failed = {}, [exc.failure.describe()]
    if failed:
        head.report.gates[GATE_SPEEDUP] = Gate(
            False, f"the drafter arm could not be measured: {'; '.join(failed[:3])}", reason=rules.UNMEASURED
        )
        return head.report.gates[GATE_SPEEDUP]
    levels, data = [], []
    for c in gate.concurrency:
        base = rules.Arm(c, tuple(rules.Run.from_json(r) for r in kept[c]["runs"]))
        arm = rules.Arm(c, tuple(runs[c]))
        lv = rules.level(base, arm)
        levels.append(lv)
        data.append({**lv.to_json(), "baseline": _latency(base), "drafter": _latency(arm)})
    acceptance = head.report.gates.get(GATE_ACCEPTANCE)
    tau = acceptance.data.get("mean_acceptance_length") if acceptance is not None else None
    verdict = rules.judge(
        levels,
        gate.min,
        tau if isinstance(tau, (int, float)) else None,
        max(playbook.gates.acceptance.min_mean_acceptance_length, rules.LOW_TAU),
        playbook.serving.num_speculative_tokens,
    )
    first = min(kept[c]["at"] for c in gate.concurrency)
    with run.once_lock:
        seconds = run.once.get(("baseline_seconds", key))
    baseline = {
        "key": key,
        "what": what,
        "host": kept[gate.concurrency[0]]["host"],
        "at": first,
        "measured": seconds is not None,  # by this run (one extra start), else kept from an earlier one
        **({"seconds": seconds} if seconds is not None else {}),
    }
    source = (
        f"baseline measured now ({seconds:g} s, one extra start)"
        if seconds is not None
        else f"baseline kept from {baseline['host']} at {time.strftime('%Y-%m-%d %H:%M', time.gmtime(first))} UTC"
    )
    head.report.gates[GATE_SPEEDUP] = Gate(
        verdict.ok,
        f"{verdict.detail}; {source}",
        # seconds: the drafter arm's load (measurement, not the tool's own share of the host's time)
        {"min": gate.min, "levels": data, "baseline": baseline, "seconds": round(time.monotonic() - started, 1)},
        reason=verdict.reason,
    )
    return head.report.gates[GATE_SPEEDUP]


def _arm(run: Run, node: Node, arm: str) -> tuple[dict[int, list[rules.Run]], list[str]]:
    """One arm's load runs, each its own round trip (said as it goes), the warm-up's dropped."""
    host = serving.probe_host(run.playbook, node.target.container)
    ops = gates.speedup.load_ops(run.playbook, host)
    runs: dict[int, list[rules.Run]] = {}
    failed: list[str] = []
    for i, op in enumerate(ops):
        concurrency = int(op.request["concurrency"])
        if i:
            run.step(node, f"speed-up: the {arm} arm", f"run {i} of {len(ops) - 1}, concurrency {concurrency}")
        loaded = run.batch(node, [op])[op]
        one, why = rules.run_of(concurrency, loaded)
        if why:
            failed += [f"concurrency {concurrency}: {w}" for w in why]
        elif i:
            runs.setdefault(concurrency, []).append(one)
    return runs, failed


def _latency(arm: rules.Arm) -> dict[str, Any]:
    """What a user waits on, beside the total: time to first token, and each request's decode speed."""
    return {
        "ttft_p50_s": arm.percentile(0.5),
        "ttft_p90_s": arm.percentile(0.9),
        "decode_p50_tokens_per_s": _round(arm.percentile(0.5, "decode")),
        "decode_p10_tokens_per_s": _round(arm.percentile(0.1, "decode")),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _stop(run: Run, node: Node) -> None:
    """The baseline's server, stopped whatever happened (the drafter's release starts next)."""
    op = protocol.stop(node.root, serving.SERVER, run.playbook.serving.stop_timeout)
    # on failure: the release's launch stops what is left under the same name, and checks its port
    with contextlib.suppress(AgentError):
        run.batch(node, [run.lock(node), op])
