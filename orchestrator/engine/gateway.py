"""A host's place in the gateway's rotation during a rollout: out before its server stops, back in
only once the gateway is seen to send it traffic.

``drain`` runs before anything stops the server: the host is taken out of rotation (never leaving
fewer than ``rollout.min_in_rotation`` serving: it waits for capacity, bounded), then the run waits
until neither the gateway nor vLLM itself (``vllm:num_requests_running`` and ``_waiting``) holds a
request of it, at most ``serving.drain_timeout``; vLLM's own ``--shutdown-timeout`` covers what is
left. ``admit`` runs after every gate passed on the host: back into rotation, then requests sent
through the gateway's own URL, from its host, until this host's vLLM counts one more finished
request. A host that fails after it was drained stays out, and its ``gateway`` gate says so.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

from orchestrator.agent import protocol
from orchestrator.engine.runner import Node, Run, Unit
from orchestrator.errors import AgentError, GatewayError, InputError, StateError
from orchestrator.gateways.base import Server
from orchestrator.gateways.client import GatewayClient
from orchestrator.results import GATE_BAKE, GATE_GATEWAY, Gate
from orchestrator.rules import probe, serving
from orchestrator.rules.gates import gateway as gateway_gate
from orchestrator.rules.probe import ProbeError

# How long a server put back may take to be sent traffic (HAProxy's health checks pass, a router
# finds it healthy): a few check intervals.
ADMIT_WAIT_S = 60.0
_IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_FINISHED = "vllm:request_success_total"


def _client(run: Run) -> GatewayClient:
    assert isinstance(run.gateway, GatewayClient)
    return run.gateway


def _host_metrics(run: Run, node: Node, prefixes: tuple[str, ...]) -> str:
    host = serving.probe_host(run.playbook, node.target.container)
    follow = serving.followed(run.playbook, node.root, serving.SERVER)
    op = protocol.metrics(run.playbook.serving.port, prefixes, host=host, server=follow)
    return run.batch(node, [op])[op]


def _vllm_in_flight(run: Run, node: Node) -> int | None:
    """Requests vLLM holds (running and waiting), or None when its /metrics cannot be read (a
    server that is down holds none)."""
    try:
        text = _host_metrics(run, node, _IN_FLIGHT)
        return int(sum(probe.total(text, name) or 0.0 for name in _IN_FLIGHT))
    except (AgentError, ProbeError):
        return None


def drain(run: Run, unit: Unit) -> bool:
    """Out of rotation before the head's server stops, and its requests finished (or the drain
    timeout ended, said). False: the gateway refused or the floor could not be kept; nothing was
    stopped, and the ``gateway`` gate says why."""
    gateway, head, playbook = _client(run), unit.head, run.playbook
    server = gateway.server(head.target.container)
    # Unset, the floor is one: a rollout with no batches drains every host at once otherwise, and
    # nothing serves. A host the gateway knows alone is taken out all the same (nothing else could
    # serve); a floor the playbook sets is held as it is.
    floor = playbook.rollout.min_in_rotation
    implied = floor is None
    floor = 1 if floor is None else floor
    started = time.monotonic()
    capacity_deadline = started + playbook.serving.startup_timeout + playbook.serving.drain_timeout
    was_in = True
    fleet = [server, *(s for s in gateway.fleet if s.key != server.key)]
    while True:
        # Other controllers behind this gateway decide under the same lock (a shared store's).
        with gateway.changing, _decided_alone(run, gateway, playbook.serving.drain_timeout + 60.0):
            rotation = gateway.rotation(fleet)
            was_in = rotation.of(server).in_rotation
            others = rotation.serving(besides=server.key)
            if not was_in:
                break  # out already (a first deploy, or drained before): nothing to take out
            # Alone: no other server the gateway lists, nor one of this run's (a gateway whose
            # listing is its rotation, an endpoints file, drops a drained host: the last host of a
            # rollout with no batches found itself alone in it, and nothing served)
            alone = implied and not any(key != server.key for key in {*rotation.members, *(s.key for s in fleet)})
            if others >= floor or alone:
                gateway.put(server, into=False)
                break
            # Every server the gateway knows, and this run's own that it does not yet: past that
            # count less one, no wait can keep the floor (it waited the whole start budget).
            possible = len(set(rotation.members) | {s.key for s in fleet}) - 1
            if floor > possible and not gateway.adapter.drops_drained:
                head.report.gates[GATE_GATEWAY] = Gate(
                    False,
                    f"not taken out of rotation: rollout.min_in_rotation {floor} can never be kept while this host is "
                    f"out: the gateway knows {possible + 1} servers (this run's included), so at most {possible} "
                    "serve; lower it, or add servers",
                    reason=gateway_gate.MIN_IN_ROTATION,
                )
                return False
        if time.monotonic() > capacity_deadline:
            head.report.gates[GATE_GATEWAY] = Gate(
                False,
                f"not taken out of rotation: {others} other hosts serve, and rollout.min_in_rotation is "
                f"{floor}{' (unset: a gateway keeps one host serving; set 0 to allow none)' if implied else ''}; "
                f"none came back within {capacity_deadline - started:.0f} s",
                reason=gateway_gate.MIN_IN_ROTATION,
            )
            return False
        run.step(head, "waiting for capacity", f"{others} other hosts serving, min_in_rotation {floor}")
        time.sleep(1.0)  # another host of the rollout is on its way back: seconds to minutes
    if not was_in:
        head.report.gates[GATE_GATEWAY] = Gate(True, f"not in the gateway's rotation before the stop ({server.key})")
        return True
    head.drained = True
    left = _wait_in_flight(run, head, server, started)
    seconds = round(time.monotonic() - started, 2)
    detail = (
        f"taken out of rotation; {'its requests finished' if not left else f'{left} still in flight'} in {seconds} s"
    )
    if left:
        detail += f" (drain_timeout {playbook.serving.drain_timeout:g} s: vLLM's --shutdown-timeout has the rest)"
    head.report.gates[GATE_GATEWAY] = Gate(True, detail, {"drain_s": seconds, "in_flight_left": left})
    return True


@contextlib.contextmanager
def _decided_alone(run: Run, gateway: GatewayClient, timeout: float) -> Iterator[None]:
    """The state store's rotation lock of this gateway (none without a store); a lock that cannot
    be had is the gateway gate's failure, before anything was taken out."""
    if run.store is None:
        yield
        return
    try:
        with run.store.gateway_lock(gateway.identity, timeout):
            yield
    except StateError as exc:
        raise GatewayError(f"not taken out of rotation: {exc}") from None


def _wait_in_flight(run: Run, node: Node, server: Server, started: float) -> int:
    """Until the gateway and vLLM both hold no request of this host, or the drain timeout: what
    is left."""
    gateway = _client(run)
    deadline = started + run.playbook.serving.drain_timeout
    delay = 0.1
    while True:
        at_gateway = gateway.rotation([server]).of(server).in_flight or 0
        in_vllm = _vllm_in_flight(run, node) or 0
        left = max(at_gateway, in_vllm)
        if left == 0 or time.monotonic() + delay > deadline:
            return left
        run.step(node, "draining", f"{at_gateway} in flight at the gateway, {in_vllm} in vLLM")
        time.sleep(delay)  # requests finish in milliseconds to minutes: poll, backing off
        delay = min(delay * 2, 1.0)


def admit(run: Run, unit: Unit) -> bool:
    """Back into rotation after every gate passed, and proven there: a request sent through the
    gateway is served by this host. False: the host is out of rotation again, and the gateway
    gate says why."""
    gateway, head = _client(run), unit.head
    server = gateway.server(head.target.container, head.port)
    drained = head.report.gates.get(GATE_GATEWAY)
    before: dict[str, Any] = dict(drained.data) if drained is not None and drained.ok else {}
    started = time.monotonic()
    try:
        if run.playbook.serving.standby is not None:
            run.step(head, "moving the gateway to where it serves", server.url)
            gateway.move(server)  # the standby sleeps on the other port: the gateway follows
        run.step(head, "putting it back in rotation", server.key)
        with gateway.changing:
            gateway.put(server, into=True)
        member = gateway.wait_in_rotation(server, time.monotonic() + ADMIT_WAIT_S)
        if not member.in_rotation:
            raise GatewayError(
                f"put back, but the gateway does not send it traffic after {ADMIT_WAIT_S:.0f} s ({member.status})"
            )
        served = _served_through(run, head, gateway, server)
    except (GatewayError, AgentError, ProbeError) as exc:
        why = exc.failure.describe() if isinstance(exc, AgentError) else str(exc)
        out = _take_out(gateway, server)
        head.report.gates[GATE_GATEWAY] = Gate(False, f"{why}; {out}", before, reason=gateway_gate.NOT_SERVED)
        return False
    seconds = round(time.monotonic() - started, 2)
    detail = f"in rotation ({member.status}); a request through {gateway.spec.url} was served by this host ({served})"
    if before.get("drain_s") is not None:
        detail = f"drained in {before['drain_s']} s, then {detail}"
    head.report.gates[GATE_GATEWAY] = Gate(True, detail, {**before, "admit_s": seconds, "status": member.status})
    head.drained = False
    return True


def _finished(run: Run, node: Node) -> float:
    found = probe.total(_host_metrics(run, node, (_FINISHED.removesuffix("_total"),)), _FINISHED)
    if found is None:
        raise GatewayError(f"the server's /metrics has no {_FINISHED}: cannot tell which host served a request")
    return found


def _served_through(run: Run, node: Node, gateway: GatewayClient, server: Server) -> str:
    """Requests through the gateway until this host's vLLM counts one more finished: round robin
    reaches it within as many requests as servers serve, a cache-aware router once the prompts
    differ (each carries its own nonce)."""
    serving_now = gateway.rotation([server]).serving()
    tries = max(4, 2 * serving_now + 2)
    before = _finished(run, node)
    for attempt in range(1, tries + 1):
        run.step(node, "probing through the gateway", f"request {attempt} of at most {tries}")
        answer = gateway.send(run.playbook.serving.model_name, f"Count to ten. ({uuid.uuid4().hex[:12]})")
        if answer.status != 200:
            raise GatewayError(
                f"a request through the gateway ({gateway.spec.url}) failed: HTTP {answer.status}: {answer.text[:300]}"
            )
        if _finished(run, node) > before:
            return f"request {attempt} of {tries}"
    raise GatewayError(
        f"in rotation, but none of {tries} requests through the gateway ({gateway.spec.url}) reached this host"
    )


def _take_out(gateway: GatewayClient, server: Server) -> str:
    """After a failed admission: out of rotation again, said either way."""
    try:
        with gateway.changing:
            gateway.put(server, into=False)
        return "left out of rotation"
    except GatewayError as exc:
        return f"and could not be taken out of rotation again: {exc}"


def put_back(run: Run, unit: Unit) -> None:
    """The server was never stopped (vLLM refused the new command before anything was switched):
    the drained host goes back into rotation, serving what it served. Where the gateway will not
    take it back, the host's diagnosis says so (a healthy server out of rotation is capacity lost,
    whatever failed first)."""
    if unit.head.drained and not admit(run, unit):
        why = unit.head.report.gates[GATE_GATEWAY].detail
        unit.head.report.diagnosis.append(
            f"what served still serves, but the gateway would not take it back: out of rotation ({why})"
        )


def judge(run: Run, unit: Unit) -> None:
    """verify: the head's place in the gateway's rotation against what the other gates found. READY
    and out of rotation (drained and forgotten: capacity lost), or in rotation and not READY
    (users' requests reach a host that is not proven) is a finding."""
    gateway, head = _client(run), unit.head
    ready = head.report.ready
    try:
        server = gateway.server(head.target.container)
        member = gateway.rotation([server]).of(server)
    except (GatewayError, InputError) as exc:
        head.report.gates[GATE_GATEWAY] = gateway_gate.unreachable(str(exc))
        return
    head.report.gates[GATE_GATEWAY] = gateway_gate.read_rotation(
        member.in_rotation, member.status, member.in_flight, ready
    )


def take_out(run: Run, unit: Unit) -> None:
    """stop: out of rotation before the server ends (the stop is asked for: no floor applies)."""
    gateway, head = _client(run), unit.head
    server = gateway.server(head.target.container)
    with gateway.changing:
        member = gateway.put(server, into=False)
    head.report.gates[GATE_GATEWAY] = Gate(True, f"taken out of the gateway's rotation ({member.status})")


# How often a bake reads the canary's counters.
BAKE_POLL_S = 1.0


def bake(run: Run, units: list[Unit]) -> list[str]:
    """After the canary batch: watch each READY canary for ``rollout.bake_s`` with the traffic it
    gets (its live acceptance since the bake began, or since it restarted, against the live gate;
    its failed answers at the gateway). Each canary's ``bake`` gate says what was seen; a canary
    that degrades is taken out, rolled back, and the names of those are returned."""
    playbook = run.playbook
    live = playbook.gates.live
    canaries = [u for u in units if u.head.report.ready]
    watched: dict[str, dict[str, Any]] = {}
    for unit in canaries:
        head = unit.head
        server = run.gateway.server(head.target.container) if run.gateway is not None else None
        errors = run.gateway.rotation([server]).of(server).errors if server is not None else None
        watched[head.name] = {"base": _host_metrics(run, head, probe.FAMILIES), "errors": errors, "restarts": 0}
    deadline = time.monotonic() + playbook.rollout.bake_s
    degraded: dict[str, str] = {}
    while True:
        for unit in canaries:
            head = unit.head
            if head.name in degraded:
                continue
            seen = watched[head.name]
            run.step(head, "baking", f"{max(0.0, deadline - time.monotonic()):.0f} s left")
            try:
                now = _host_metrics(run, head, probe.FAMILIES)
            except AgentError as exc:
                degraded[head.name] = f"its server stopped answering: {exc.failure.describe()}"
                continue
            try:
                seen["acceptance"] = probe.measure(seen["base"], now)
            except ProbeError as exc:
                if exc.reason == probe.RESTARTED:
                    seen["base"], seen["restarts"] = now, seen["restarts"] + 1  # judge what follows
                seen.pop("acceptance", None)
            a = seen.get("acceptance")
            if a is not None and a.drafts >= live.min_drafts:
                verdict = probe.judge(a, live.min_mean_acceptance_length, live.min_acceptance_rate, live.min_drafts)
                if not verdict.ok:
                    degraded[head.name] = f"live acceptance fell: {verdict.detail}"
            if run.gateway is not None and seen["errors"] is not None:
                server = run.gateway.server(head.target.container)
                errors = run.gateway.rotation([server]).of(server).errors or 0
                if errors > seen["errors"]:
                    degraded[head.name] = f"the gateway counted {errors - seen['errors']} failed answers from it"
        if time.monotonic() + BAKE_POLL_S > deadline or len(degraded) == len(canaries):
            break
        time.sleep(BAKE_POLL_S)  # the canary's traffic accrues: read it again
    for unit in canaries:
        head, seen = unit.head, watched[unit.head.name]
        if seen["restarts"] and head.name not in degraded:
            # Its counters started again: the server restarted under it (a crash, a supervisor).
            times = "once" if seen["restarts"] == 1 else f"{seen['restarts']} times"
            degraded[head.name] = f"its server restarted {times} while it baked (its counters started again)"
        a = seen.get("acceptance")
        said = (
            f"tau {a.mean_acceptance_length:.2f} over {a.drafts} drafts" if a is not None else "no drafts to judge"
        ) + (f", {seen['restarts']} restarts" if seen["restarts"] else "")
        if head.name in degraded:
            head.report.gates[GATE_BAKE] = Gate(
                False, f"degraded within {playbook.rollout.bake_s:g} s: {degraded[head.name]}", reason="degraded"
            )
        elif a is None or a.drafts < live.min_drafts:
            # A bake that saw too little traffic proved nothing: it passed, and the rollout went on
            # on the strength of a canary nobody judged. The canary stays (nothing was seen wrong).
            head.report.gates[GATE_BAKE] = Gate(
                False,
                f"baked {playbook.rollout.bake_s:g} s and judged nothing: {a.drafts if a else 0} drafts on live "
                f"traffic, gates.live.min_drafts {live.min_drafts} needed (did traffic reach it? a longer "
                "rollout.bake_s, or more traffic)",
                reason="unjudged",
            )
        else:
            head.report.gates[GATE_BAKE] = Gate(True, f"baked {playbook.rollout.bake_s:g} s on live traffic: {said}")
    return sorted(degraded)
