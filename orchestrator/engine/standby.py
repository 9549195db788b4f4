"""The standby (``serving.standby``): the READY release kept asleep beside the next one, and woken
to go back to it in seconds instead of a vLLM start.

Before a new release starts on a host, the server its READY record names is put to sleep (vLLM's
sleep mode, level 1: its weights to host memory, the GPU's freed; requests in flight finish
first) and kept under another name; an older standby is stopped first (one a host). A sleeping
server keeps its port, so the new release listens on the other of ``serving.port`` and
``standby.port`` and the gateway is moved to it before it is put back in rotation. Going back (a
new release that fails a gate, or ``rollback`` to the standby's release) wakes the standby, makes
its release current again and proves it as a start is proven: health, then acceptance on live
traffic. Where a server cannot be put to sleep or woken, it is stopped and started as without a
standby, and the host's ``standby`` entry says why.

Only a single host, behind a gateway that can follow a server to another port (the playbook
refuses the rest); loaded only for a playbook with a standby.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from orchestrator.agent import protocol
from orchestrator.engine.runner import Node, Run, Unit
from orchestrator.errors import AgentError
from orchestrator.results import GATE_ACCEPTANCE, GATE_FILES, GATE_HEALTH, Gate
from orchestrator.rules import diagnosis, gates, serving

# vLLM's level 1: the weights to host memory (level 2 discards them, the drafter's included: a
# wake-up would serve no weights; vLLM 0.32 ``v1/worker/gpu_worker.py`` ``sleep``).
LEVEL = 1
# A sleep or a wake-up moves the weights between GPU and host memory: seconds for GBs (PCIe).
SLEEP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Held:
    """What the host's two names run now: the server (the one READY names?) and the standby."""

    server: protocol.Process | None
    standby: protocol.Process | None
    ready: dict[str, Any] | None
    standby_sleeping: bool


def look(run: Run, node: Node) -> Held:
    """The server and the standby as the host's records and vLLM say (one round trip)."""
    port = run.playbook.serving.port  # the records say where each listens: this is asked when they do not
    host = serving.probe_host(run.playbook, node.target.container)
    server = protocol.serving_status(node.root, serving.SERVER, port, host=host)
    standby = protocol.serving_status(node.root, serving.STANDBY, port, host=host)
    answers = run.batch(node, [server, standby])
    return Held(
        answers[server].server,
        answers[standby].server,
        answers[server].ready,
        answers[standby].sleeping,
    )


def other_port(run: Run, port: int | None) -> int:
    """Of ``serving.port`` and ``standby.port``, the one that is not ``port``."""
    s = run.playbook.serving
    assert s.standby is not None
    return s.standby.port if port == s.port else s.port


def prepare(run: Run, unit: Unit, release: str) -> tuple[int, str] | None:
    """Before ``release`` starts on a drained host: going back to the standby's release, the server
    is stopped (``start_and_prove`` then wakes the standby); else the server READY names is put to
    sleep and kept as the standby. Returns where ``release`` must listen (None: serving.port, or
    the standby is woken)."""
    node = unit.head
    host = serving.probe_host(run.playbook, node.target.container)
    held = look(run, node)
    standby, server = held.standby, held.server
    if node.going_back and standby is not None and standby.alive and standby.release_id == release:
        stop = protocol.stop(node.root, serving.SERVER, run.playbook.serving.stop_timeout)
        node.disturbed = True
        answers = run.batch(node, [run.lock(node), stop])
        if not answers[stop].gone:
            node.report.diagnosis.append("the server could not be stopped before the standby was woken")
        return None
    if server is None or not server.alive:
        # nothing serves: a new release starts where the standby (if any) does not listen
        held_port = standby.port if standby is not None and standby.alive else None
        return (other_port(run, held_port), host) if held_port == run.playbook.serving.port else None
    return keep_asleep(run, unit, held, host)


def keep_asleep(run: Run, unit: Unit, held: Held, host: str) -> tuple[int, str] | None:
    """The server READY names put to sleep and kept as the standby (an older one stopped first);
    where it cannot be, it is left for the launch to stop, and the host's ``standby`` says why.
    Returns where the next release listens."""
    node, server = unit.head, held.server
    assert server is not None
    here = server.port or run.playbook.serving.port
    same_place = (here, host)
    if held.ready is None or held.ready.get("pid") != server.pid:
        node.report.standby = {"kept": False, "why": "the server that runs is not the one its READY record names"}
        return same_place
    ops: list[protocol.Op[Any]] = [run.lock(node)]
    older = held.standby
    if older is not None and older.alive:
        ops.append(protocol.stop(node.root, serving.STANDBY, run.playbook.serving.stop_timeout))
    # what level 1 moves to host memory: the weights the models gate counted (None: no models block)
    need = sum(m.get("bytes") or 0 for m in node.report.models) or None
    sleep = protocol.sleep(
        node.root, serving.SERVER, here, LEVEL, SLEEP_TIMEOUT_S, host=host, keep_as=serving.STANDBY, need=need
    )
    ops.append(sleep)
    run.step(node, "putting the server to sleep", f"release {server.release_id} kept as the standby")
    try:
        answers = run.batch(node, ops)
    except AgentError as exc:
        node.disturbed = True  # an older standby may have been stopped
        node.report.standby = {
            "kept": False,
            "why": f"release {server.release_id} could not be put to sleep ({exc.failure.describe()}): stopped as "
            "without a standby",
        }
        return same_place
    node.disturbed = True
    slept = answers[sleep]
    node.report.standby = {
        "kept": True,
        "release_id": server.release_id,
        "pid": server.pid,
        "port": here,
        "state": slept.state,
        "sleep_s": slept.seconds,
        "host_mib": slept.host_mib,
        "gpu_mib": slept.gpu_mib,
    }
    return (other_port(run, here), host)


def wake(run: Run, unit: Unit, release: str, switch: bool) -> tuple[bool | None, tuple[int, str] | None]:
    """Going back to ``release``: the standby that holds it woken as the server (current switched
    back to it), and proven (health, acceptance). Returns (proven, where a start must listen):
    proven None when no standby holds ``release`` or it could not be woken (then stopped): start it
    as usual, where the standby does not listen."""
    node, playbook = unit.head, run.playbook
    host = serving.probe_host(playbook, node.target.container)
    held = look(run, node)
    standby = held.standby
    if standby is None or not standby.alive:
        return None, None
    port = standby.port or playbook.serving.port
    if standby.release_id != release:
        return None, (other_port(run, port), host) if port == playbook.serving.port else None
    if not held.standby_sleeping:
        # Woken outside the tool (its dev routes answer whoever reaches them): it may have been
        # given other weights since (/collective_rpc), so it is not what its READY record proved.
        why = "was awake (woken outside the tool: it may serve other weights than its READY record proved)"
        return _not_used(run, node, release, why, host, port)
    run.note(unit, f"waking the standby of release {release}")
    run.step(node, "waking the standby", f"release {release}, port {port}")
    at_port = replace(playbook, serving=replace(playbook.serving, port=port))
    wake_op = protocol.wake_up(node.root, serving.STANDBY, port, SLEEP_TIMEOUT_S, host=host, serve_as=serving.SERVER)
    record = protocol.serving_status(node.root, serving.SERVER, None)
    health = gates.health.health_op(at_port, node.root, serving.SERVER, host)
    probe = gates.acceptance.probe_op(at_port, host)
    switch_op = protocol.release_switch(node.root, release, playbook.keep_releases) if switch else None
    ops: list[protocol.Op[Any]] = [run.lock(node), *([switch_op] if switch_op else []), wake_op, record, health, probe]
    node.disturbed = True
    try:
        answers = run.batch(node, ops)
    except AgentError as exc:
        if exc.failure.gate == GATE_FILES:
            raise  # the lock or the switch: its own gate says why
        if exc.failure.op == "wake_up":
            return _not_used(run, node, release, f"could not be woken ({exc.failure.describe()})", host, port)
        node.report.gates[exc.failure.gate] = Gate(False, exc.failure.message, reason=exc.failure.code)
        node.report.diagnosis = diagnosis.diagnose(playbook, node.report, failure=exc.failure)
        node.port = port
        return False, None
    woke = answers[wake_op]
    if switch_op is not None:
        gates.files.read_started(playbook, answers[switch_op], node.report)
    node.pid, node.port, node.from_ready = answers[health].pid, port, True
    gates.health.read_health(answers[health], True, node.report, answers[record].ready)
    gates.acceptance.read_probe(playbook, answers[probe], node.report, answers[record].ready)
    health_gate = node.report.gates[GATE_HEALTH]
    node.report.gates[GATE_HEALTH] = Gate(
        health_gate.ok,
        f"the standby woken in {woke.seconds:g} s; {health_gate.detail}",
        {**health_gate.data, "woken_s": woke.seconds, "woken": True},
        reason=health_gate.reason,
    )
    node.report.standby = {"kept": False, "woken": True, "release_id": release, "wake_s": woke.seconds}
    ok = node.report.gates[GATE_ACCEPTANCE].ok
    if not ok:
        node.report.diagnosis = diagnosis.diagnose(playbook, node.report)
    return ok, None


def _not_used(
    run: Run, node: Node, release: str, why: str, host: str, port: int
) -> tuple[bool | None, tuple[int, str] | None]:
    """A standby that cannot be used (awake, or it could not be woken) is stopped (it holds its
    port and host memory), and the release is started as without one, where it listened."""
    stop = protocol.stop(node.root, serving.STANDBY, run.playbook.serving.stop_timeout)
    gone = run.batch(node, [run.lock(node), stop])[stop].gone
    node.report.standby = {
        "kept": False,
        "woken": False,
        "why": f"the standby of release {release} {why}: "
        + ("stopped, and the release started instead" if gone else "and could not be stopped"),
    }
    return None, (port, host)
