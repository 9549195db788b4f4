"""Starting a unit's servers and proving them: READY on every node, or back to what was current.

A unit starts on one release (the new one, or an earlier one on the way back): every node is
switched to it where it changed, and its process launched (vLLM; on a group, every rank, or a Ray
cluster and then vLLM on the head). The proof goes through the head: ``/health``, then acceptance
on live traffic; on a group every other rank must still be alive after it. A single node needs
to wait for no other, so its switch, launch, health wait and probe are one exec, holding the
deploy-root lock throughout. A group starts together: everything of it is stopped first (a
surviving rank would hold the old group's ports), and stopping checks that nothing is left (a
headless rank outlives its head otherwise).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any, Literal

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.config.inventory import Target
from orchestrator.config.playbook import Playbook
from orchestrator.engine.runner import Node, Run, Unit
from orchestrator.errors import AgentError, AgentFailure, AgentProtocolError, OrchestratorError
from orchestrator.results import (
    GATE_ACCEPTANCE,
    GATE_ENGINE,
    GATE_FILES,
    GATE_GATEWAY,
    GATE_GROUP,
    GATE_HEALTH,
    GATE_READY,
    GATE_STOPPED,
    Gate,
)
from orchestrator.rules import diagnosis, gates, plan, serving
from orchestrator.rules.placement import Placement, ray_status


def serve(run: Run, unit: Unit) -> None:
    """Start the release the head's report names (unless the unit already runs it), prove it, and
    record READY on every node; when that fails, go back to the release that was current.

    With a gateway, a server that will be restarted leaves its rotation first (drained), and READY
    needs the gateway to send the host traffic again (``rotation``)."""
    from orchestrator.engine import (
        compile_cache,  # a served host's cache, taken or given: loaded where a unit serves
        gateway,  # the gateway's steps, only for a playbook with one
        speedup,  # the speed-up gate's arms, only for a playbook with one
    )

    release = unit.head.report.release_id
    assert release is not None
    changed = {n.name for n in unit.nodes if n.report.changed}
    baseline = speedup.needs_baseline(run, unit)  # one extra start: out of rotation for it too
    # Every restart is drained first, whatever caused it: changed files, a changed command (a flag,
    # a variable of serving.env: the launch restarts a server whose command differs), no server.
    restarts = bool(changed) or baseline is not None or unit.head.keeps is False
    if run.gateway is not None and restarts and not gateway.drain(run, unit):
        unit.fail_others([unit.head.name], "not launched")
        return  # the gateway refused, or capacity would fall below its floor: nothing was stopped
    head = unit.head
    if baseline is not None and head.checks is not None and not collect_checks(run, head, head.checks):
        # The baseline arm stops what serves: the loader and engine checks are heard first, so a
        # refusal still leaves the serving release serving.
        if run.gateway is not None:
            gateway.put_back(run, unit)
        return
    if baseline is not None and not speedup.before_launch(run, unit, release, baseline):
        unit.head.report.diagnosis = diagnosis.diagnose(run.playbook, unit.head.report)
        roll_back(run, unit)
        return
    at = None
    if run.playbook.serving.standby is not None and unit.single and restarts and baseline is None:
        from orchestrator.engine import standby  # a playbook with a standby only

        if head.checks is not None and head.checks.serving and not collect_checks(run, head, head.checks):
            # heard before the server is put to sleep: a refusal leaves what serves serving
            if run.gateway is not None:
                gateway.put_back(run, unit)
            return
        at = standby.prepare(run, unit, release)
    proven = start_and_prove(run, unit, release, switch=changed, keep=not changed and baseline is None, at=at)
    if proven and not speedup.after_proof(run, unit):
        unit.head.report.diagnosis = diagnosis.diagnose(run.playbook, unit.head.report)
        unit.fail_others([unit.head.name], "group not ready")
        roll_back(run, unit)
    elif proven:
        if run.gateway is None or gateway.admit(run, unit):
            write_ready(run, unit, release)
            if unit.single and unit.head.report.ready:
                compile_cache.take(run, unit.head)  # for the hosts of its key after it
        else:
            unit.fail_others([unit.head.name], "not served through the gateway")
            unit.head.report.diagnosis.append(
                "every gate passed on the host, but the gateway did not serve it: left out of rotation (see the gateway gate)"
            )
    elif any(n.disturbed for n in unit.nodes):
        roll_back(run, unit)
    elif run.gateway is not None:
        # the lock, the switch or vLLM's verdict failed before anything was stopped or started:
        # what ran, runs, and goes back into rotation
        gateway.put_back(run, unit)


def start_and_prove(
    run: Run,
    unit: Unit,
    release: str,
    switch: set[str],
    keep: bool,
    ready_command: Literal["prefer", "only"] | None = None,
    at: tuple[int, str] | None = None,
) -> bool:
    """Switch the ``switch`` nodes to ``release``, start the unit on it, prove it through the head.

    ``keep``: nothing changed, so a unit already running this release is kept and proven again.
    ``ready_command`` (going back, one host): start the command the release was READY with, as the
    host recorded it (see ``protocol.launch``), not the playbook's. ``at``: the port and address
    that command listened on, where the host recorded another than the playbook's (the playbook
    changed them, and its start failed): it is started and proven there.
    """
    from orchestrator.engine import compile_cache  # loaded where a unit serves (a files-only run never does)

    playbook, head = run.playbook, unit.head
    if unit.single and playbook.serving.standby is not None and (ready_command is not None or head.going_back):
        from orchestrator.engine import standby  # a playbook with a standby only

        # Going back: the standby that holds the release is woken rather than a server started.
        woken, elsewhere = standby.wake(run, unit, release, switch=head.name in switch)
        if woken is not None:
            return woken
        at = at or elsewhere
    if at is not None:
        head.port = at[0]
    host = serving.probe_host(playbook, head.target.container)
    if at is not None:
        playbook = replace(playbook, serving=replace(playbook.serving, port=at[0]))
        host = at[1]
    health, probe = (
        gates.health.health_op(playbook, head.root, serving.SERVER, host),
        gates.acceptance.probe_op(playbook, host),
    )
    # The READY record the head held before this run: the probe is held to its tau. Read with
    # the proof, before this run writes its own.
    record = protocol.serving_status(head.root, serving.SERVER, None)
    proof: list[protocol.Op[Any]] = [record, health, probe]
    together = unit.single  # no other node to wait for: start and proof in one exec
    kept = keep and not together and _all_running(run, unit, release)
    if not together and not kept:
        stop_all(run, unit)
        if unit.failed():
            return False

    def start(node: Node) -> None:
        switch_op = protocol.release_switch(node.root, release, playbook.keep_releases) if node.name in switch else None
        # A host of a key whose cache the controller keeps gets it before vLLM starts (not going
        # back, and not a server that runs this command already and is kept).
        start_env = {}
        if together and ready_command is None and not (keep and node.keeps):
            start_env = compile_cache.give(run, node)
        launch = _launch_op(
            run, unit, node, release, keep=keep and together, ready_command=ready_command, start_env=start_env, at=at
        )
        # The loader and engine checks started at staging: collected before anything is switched
        # or stopped for the release (a refusal leaves what serves serving); on a host where
        # nothing serves, the server starts beside them and is stopped if they refuse.
        pending = node.checks if together and launch is not None else None
        beside = pending is not None and not pending.serving
        if pending is not None and not beside and not collect_checks(run, node, pending):
            return
        # Else vLLM's own verdict on the command before anything is switched or stopped for it
        # (going back, or a group: stopped before its ranks start, see stop_all).
        engine = None
        # Not going back to a command that served READY: it is what starts, not the playbook's.
        asks = ready_command is None or not unit.single
        if together and launch is not None and pending is None and asks and GATE_ENGINE not in node.report.gates:
            command = serving.command(playbook, node.target.container, release)
            want = serving.resolved(playbook, node.target.container, release)
            engine = protocol.engine_check(
                node.root, serving.SERVER, command, want, keep_if_running=keep, release_id=release
            )
        if beside:
            assert pending is not None and launch is not None
            if not _launch_beside_checks(run, unit, node, launch, pending):
                return
            steps: tuple[protocol.Op[Any] | None, ...] = (switch_op,)
        else:
            steps = (engine, switch_op, launch)
        ops: list[protocol.Op[Any]] = [run.lock(node), *(op for op in steps if op is not None)]
        if together:
            ops += proof
        try:
            answers = run.batch(node, ops)
        except AgentProtocolError:
            # The host's answer cannot be read: whatever of the batch ran may have stopped or
            # started the server, so a failure from here rolls back.
            node.disturbed = True
            raise
        except AgentError as exc:
            if exc.failure.gate == GATE_ENGINE:
                # vLLM refused the command (or could not be asked): nothing was switched or
                # stopped for it, and its own words are the gate.
                node.report.gates[GATE_ENGINE] = Gate(False, exc.failure.message, reason=exc.failure.code)
                return
            # The lock or the switch (the files gate's ops) stopped or started nothing, unless the
            # server was started beside the checks: then a failure from here rolls back.
            node.disturbed = node.disturbed or beside or exc.failure.gate != GATE_FILES
            if not together or exc.failure.gate == GATE_FILES:
                raise  # the node's own gate says why (on one node alone: its files gate)
            _proof_failed(run, unit, exc.failure)
            compile_cache.judge(node)
            return
        node.disturbed = True
        if engine is not None:
            gates.engine.read_engine(answers[engine], node.report)
        gates.files.read_started(playbook, answers.get(switch_op) if switch_op else None, node.report)
        if together:
            assert launch is not None
            kept_now = False if beside else answers[launch].kept  # beside: nothing was running to keep
            node.kept = kept_now
            node.from_ready = not beside and answers[launch].from_ready
            _read_proof(run, unit, answers[health], answers[probe], kept_now, answers[record].ready)
            compile_cache.judge(node)
        elif launch is not None:
            node.report.gates[GATE_GROUP] = Gate(
                True, f"rank {node.rank} ({unit.role(node)}) started, pid {answers[launch].pid}"
            )

    if kept:
        run.note(unit, f"release {release} already runs on every node: proving it again")
    else:
        run.note(unit, f"launching release {release} on {', '.join(n.name for n in unit.nodes)}")
        unit.each(start, GATE_FILES if together else GATE_HEALTH)
    if together or unit.failed():
        unit.fail_others(unit.failed(), "not launched")
        return not unit.failed()
    if unit.ray and not kept and not _ray_cluster_then_vllm(run, unit, release):
        return False
    run.note(unit, f"waiting for the head {head.name} to be healthy, then probing acceptance")
    try:
        answers = run.batch(head, proof)
    except AgentError as exc:
        _proof_failed(run, unit, exc.failure)
        return False
    if not _read_proof(run, unit, answers[health], answers[probe], kept, answers[record].ready):
        return False
    return _ranks_alive(run, unit)


def collect_checks(run: Run, node: Node, started: protocol.ChecksStarted) -> bool:
    """Wait for a node's background loader and engine checks and read their gates: False when
    one failed."""
    assert started.token is not None
    node.checks = None
    op = protocol.checks_wait(node.root, started.token)
    plan.read_checks_done(run.playbook, run.batch(node, [op])[op], node.report)
    return node.report.failed_gate is None


def cancel_checks(run: Run, node: Node) -> None:
    """A node's background checks the run will not collect (it failed another gate first): stopped,
    ``launched`` put back. A host that cannot be reached now keeps them until their deadline."""
    pending, node.checks = node.checks, None
    if pending is None or pending.token is None:
        return
    with contextlib.suppress(OrchestratorError):
        run.batch(node, [protocol.checks_wait(node.root, pending.token, cancel=True)])


def _launch_beside_checks(
    run: Run, unit: Unit, node: Node, launch: protocol.Op[protocol.Launched], pending: protocol.ChecksStarted
) -> bool:
    """Nothing serves on the host: start the server while the checks finish (one exec), switch
    ``current`` only once they pass, and stop it if they do not (nothing was serving; nothing
    serves)."""
    assert pending.token is not None
    node.checks = None
    wait = protocol.checks_wait(node.root, pending.token)
    try:
        answers = run.batch(node, [run.lock(node), launch, wait])
    except AgentProtocolError:
        node.disturbed = True  # the answer cannot be read: the server may have started
        raise
    except AgentError as exc:
        if exc.failure.gate == GATE_FILES:
            raise  # the lock: nothing was started
        node.disturbed = True
        if exc.failure.gate != GATE_ENGINE:
            _proof_failed(run, unit, exc.failure)  # the launch's own gate says why (a port taken...)
            return False
        node.report.gates[GATE_ENGINE] = Gate(False, exc.failure.message, reason=exc.failure.code)
    else:
        node.disturbed = True
        plan.read_checks_done(run.playbook, answers[wait], node.report)
        if node.report.failed_gate is None:
            return True
    stop = protocol.stop(node.root, serving.SERVER, run.playbook.serving.stop_timeout)
    answers = run.batch(node, [run.lock(node), stop])
    node.disturbed = not answers[stop].gone
    if answers[stop].gone:
        node.report.diagnosis.append(
            "nothing was serving: the server started beside the checks was stopped, and current was not switched"
        )
    return False


def _launch_op(
    run: Run,
    unit: Unit,
    node: Node,
    release: str,
    keep: bool,
    ready_command: Literal["prefer", "only"] | None = None,
    start_env: dict[str, str] | None = None,
    at: tuple[int, str] | None = None,
) -> protocol.Op[protocol.Launched] | None:
    """What a node starts: vLLM (a single host, or an ``mp`` rank), or Ray (None: a Ray head
    starts vLLM only once the cluster is up). ``at``: see ``start_and_prove``."""
    playbook, port = run.playbook, run.playbook.serving.port
    host = serving.probe_host(playbook, unit.head.target.container)
    if at is not None:
        port, host = at
        playbook = replace(playbook, serving=replace(playbook.serving, port=port))  # its command's --port
    if unit.single:
        command = serving.command(playbook, node.target.container, release)
        return protocol.launch(
            node.root,
            serving.SERVER,
            command,
            release,
            port,
            keep_if_running=keep,
            host=host,
            ready_command=ready_command,
            start_env=start_env,
        )
    placement = unit.placement
    if unit.ray:
        command = serving.ray_command(playbook, placement, node.rank)
        return protocol.launch(node.root, serving.RAY, command, release, None)
    rank_command = serving.rank_command(playbook, placement, node.rank, release)
    assert rank_command is not None
    return protocol.launch(
        node.root, serving.SERVER, rank_command, release, port if node.rank == 0 else None, host=host
    )


def _read_proof(
    run: Run,
    unit: Unit,
    healthy: protocol.Healthy,
    scrapes: protocol.Scrapes,
    kept: bool,
    last_ready: dict[str, Any] | None,
) -> bool:
    head = unit.head
    head.pid = healthy.pid
    gates.health.read_health(healthy, kept, head.report, last_ready)
    gates.acceptance.read_probe(run.playbook, scrapes, head.report, last_ready)
    if head.report.gates[GATE_ACCEPTANCE].ok:
        return True
    head.report.diagnosis = diagnosis.diagnose(run.playbook, head.report)
    unit.fail_others([head.name], "group not ready")
    return False


def _proof_failed(run: Run, unit: Unit, failure: AgentFailure) -> None:
    """The server did not start, did not become healthy, or the probe could not talk to it."""
    head = unit.head
    head.report.gates[failure.gate] = Gate(False, failure.message, reason=failure.code)
    head.report.diagnosis = diagnosis.diagnose(run.playbook, head.report, failure=failure)
    unit.fail_others([head.name], "group not ready")


def _all_running(run: Run, unit: Unit, release: str) -> bool:
    """A group where nothing changed: is every rank still up on this release? Then it is kept."""
    alive: dict[str, bool] = {}

    def status(node: Node) -> None:
        names = ([serving.RAY] if unit.ray else []) + ([serving.SERVER] if node.rank == 0 or not unit.ray else [])
        ops = [protocol.serving_status(node.root, name, None) for name in names]
        answers = run.batch(node, list(ops))
        servers = [answers[op].server for op in ops]
        alive[node.name] = all(s is not None and s.alive and s.release_id in (release, None) for s in servers)

    unit.each(status, GATE_HEALTH)
    return all(alive.get(n.name) for n in unit.nodes) and not unit.failed()


def _ranks_alive(run: Run, unit: Unit) -> bool:
    """After the proof: every rank but the head still alive (its health is its process)."""

    def check(node: Node) -> None:
        if node.rank == 0:
            return
        op = protocol.serving_status(node.root, unit.process(node), None)
        server = run.batch(node, [op])[op].server
        gate = gates.health.rank_alive(server, unit.role(node))
        node.report.gates[GATE_HEALTH] = gate
        if gate.ok and server is not None:
            node.pid = server.pid

    unit.each(check, GATE_HEALTH)
    unit.fail_others(unit.failed(), "group not ready")
    return not unit.failed()


def stop_all(run: Run, unit: Unit, standby: bool = False) -> None:
    """Stop vLLM and Ray on every node; a node where anything is left fails its ``stopped`` gate.
    ``standby``: the sleeping standby too (``stop``; a rollback wakes it instead)."""

    def stop(node: Node) -> None:
        wait = run.playbook.serving.stop_timeout
        names = (serving.SERVER, serving.RAY, *((serving.STANDBY,) if standby and node.rank == 0 else ()))
        ops = [protocol.stop(node.root, name, 30.0 if name == serving.RAY else wait) for name in names]
        node.disturbed = True
        answers = run.batch(node, [run.lock(node), *ops])
        left = [op.request["name"] for op in ops if not answers[op].gone]
        pids = [str(answers[op].pid) for op in ops if answers[op].pid]
        if left:
            node.report.gates[GATE_STOPPED] = Gate(False, f"still running after stop: {', '.join(left)}")
        else:
            node.report.gates[GATE_STOPPED] = Gate(
                True, f"stopped pid {', '.join(pids)}" if pids else "nothing was running"
            )

    unit.each(stop, GATE_STOPPED)


def _ready_listened(run: Run, unit: Unit) -> tuple[int, str] | None:
    """Where the command the head's READY record names listened, when the host recorded another
    port or address than the playbook's (None: the playbook's, or not known)."""
    head = unit.head
    status = protocol.serving_status(head.root, serving.SERVER, None)
    try:
        listened = run.batch(head, [status])[status].ready_listened
    except AgentError:
        return None
    playbook = run.playbook
    here = (playbook.serving.port, serving.probe_host(playbook, head.target.container))
    return listened if listened is not None and listened != here else None


def write_ready(run: Run, unit: Unit, release: str) -> None:
    """The READY record on every node: which release, on what evidence, served by which process."""
    head = unit.head
    proof = head.report.gates[GATE_ACCEPTANCE]

    def write(node: Node) -> None:
        report = node.report
        if node is not head:
            report.gates[GATE_ACCEPTANCE] = Gate(True, f"through the head {head.name}: {proof.detail}")
        gates: dict[str, Any] = {k: g.to_json() for k, g in report.gates.items()}
        if not unit.single:
            placement = unit.placement
            gates[GATE_GROUP] = {
                "rank": node.rank,
                "nodes": [n.name for n in unit.nodes],
                "executor": placement.multi.executor,
            }
        kept = report.standby if report.standby and report.standby.get("kept") else None
        standby = {k: v for k, v in kept.items() if k != "kept"} if kept else None
        record = serving.ready_record(release, gates, [f.record() for f in report.files], node.pid, standby)
        # Under the deploy-root lock, as every write: another run cannot switch or restart
        # between this run's proof and its record of it without holding the lock itself.
        run.batch(node, [run.lock(node), protocol.put(node.root, "ready.json", record)])
        report.gates[GATE_READY] = Gate(True, f"{node.root}/ready.json records release {release}")

    unit.each(write, GATE_READY)


def roll_back(run: Run, unit: Unit) -> None:
    """After a failure past launch: stop every node (checking each is gone), then start the release
    that was current on every node again, with the command its READY record was proven with where
    the host recorded it (one host), and prove it; READY again if it passes. A release that was
    already current is started again only with that other command (the playbook's is the one that
    failed). With nothing to go back to, the unit stays stopped."""
    run.note(unit, f"not ready: stopping {', '.join(n.name for n in unit.nodes)}")
    if run.gateway is not None and not unit.head.drained:
        _out_before_the_stop(run, unit)
    stop_all(run, unit)
    reports = [n.report for n in unit.nodes]
    previous = {r.previous if r.changed else r.release_id for r in reports}
    back = previous.pop() if len(previous) == 1 else None
    changed = any(r.changed for r in reports)
    stopped = all(r.gates.get(GATE_STOPPED, Gate(False, "")).ok for r in reports)
    everywhere = "" if unit.single else " on every node"
    # The release that was current, but the server's command changed (a flag, a variable) and the
    # new one failed: only the command READY was proven with can bring back what served.
    command_only = back is not None and not changed and stopped and unit.single
    again: Unit | None = None
    if command_only:
        assert back is not None
        run.note(unit, f"starting release {back} again with the server command it was READY with")
        again = unit.again()
        for node, old in zip(again.nodes, unit.nodes, strict=True):
            node.report.files = old.report.files  # the same release, read back by this run: no switch
        at = _ready_listened(run, unit)
        proven = start_and_prove(run, again, back, set(), keep=False, ready_command="only", at=at)
        if not proven and any(g.reason == "no_ready_command" for g in again.head.report.gates.values()):
            again = None  # no other command recorded: nothing was started
            if unit.head.kept:
                # The server that failed its proof was the one READY named, kept in place: its own
                # command from its own release is started afresh (it was stopped, leaving less
                # serving than before), and proven.
                run.note(unit, f"starting release {back} again: the server kept in place failed its proof")
                again = unit.again()
                for node, old in zip(again.nodes, unit.nodes, strict=True):
                    node.report.files = old.report.files
                proven = start_and_prove(run, again, back, set(), keep=False)
    if again is None and (back is None or not changed or not stopped):  # nothing to go back to, or stuck
        if not stopped:
            line = "the deployment could not be stopped: see the stopped gate"
        elif not changed:
            # One host: the command its READY record was proven with was looked for (a group's
            # ranks are started from the playbook alone).
            none_other = ", and no other server command is recorded as READY with it" if unit.single else ""
            line = (
                f"release {back} was already current and does not pass with this playbook's serving settings"
                f"{none_other}: stopped{everywhere} (no vLLM or Ray process left)"
            )
        else:
            line = f"no previous release to go back to: stopped{everywhere} (no vLLM or Ray process left)"
        if unit.head.drained:
            line += "; left out of the gateway's rotation (taken out before the stop)"
        for report in reports:
            report.diagnosis.append(line)
        return
    assert back is not None
    if again is None:
        run.note(unit, f"rolling back to release {back}")
        again = unit.again()
        switch = {n.name for n in unit.nodes if n.report.changed}
        proven = start_and_prove(run, again, back, switch, keep=False, ready_command="prefer")
    went_back = {name: g.to_json() for name, g in again.head.report.gates.items()}
    woken = again.head.report.standby if (again.head.report.standby or {}).get("woken") else None
    for report in reports:
        report.rollback_gates = went_back  # its start and probe: vLLM's time in the split, not the tool's
        if woken is not None:  # the standby this run put to sleep is the server again: said so, not "kept"
            report.standby = {**(report.standby or {}), **woken}
    with_command = " with the server command it was READY with" if again.head.from_ready else ""
    if woken is not None:
        with_command = f" by waking its standby in {woken.get('wake_s')} s (no server started)"
    if unit.head.kept and not changed and not again.head.from_ready:
        with_command = ", its server (kept in place, failed its proof) started afresh from it"
    if proven and _admitted(run, again, unit):
        write_ready(run, again, back)
        proof = again.head.report.gates[GATE_ACCEPTANCE].detail
        line = f"rolled back: release {back} is current again{everywhere}{with_command}, healthy and READY ({proof})"
    elif again.head.report.gates.get(GATE_ACCEPTANCE, Gate(False, "")).ok:
        refused = again.head.report.gates[GATE_GATEWAY].detail
        line = f"rolled back to release {back}{with_command}, healthy, but not served through the gateway ({refused})"
    else:
        stop_all(run, again)
        why = "; ".join(
            f"{n.name}: {n.report.gates[gate].detail}" for n in again.nodes if (gate := n.report.failed_gate)
        )
        line = f"rolled back to release {back}{with_command}, but it does not pass either ({why}): stopped"
    if unit.head.drained and not again.head.report.gates.get(GATE_READY, Gate(False, "")).ok:
        line += "; left out of the gateway's rotation (taken out before the stop)"
    for report in reports:
        report.diagnosis.append(line)


def _out_before_the_stop(run: Run, unit: Unit) -> None:
    """A server kept in rotation (nothing to restart: it was proven again in place) that failed
    its proof leaves the gateway's rotation before it stops, as a restart's drain does: stopped in
    rotation, the users' requests sent to it were lost. No floor holds here (the host failed); a
    gateway that cannot be told is said, and the stop goes on."""
    from orchestrator.engine import gateway

    try:
        gateway.take_out(run, unit)
    except OrchestratorError as exc:
        unit.head.report.gates[GATE_GATEWAY] = Gate(False, f"not taken out of rotation before the stop: {exc}")
        return
    unit.head.drained = True


def _admitted(run: Run, again: Unit, unit: Unit) -> bool:
    """After a rollback proved the previous release: back into the gateway's rotation (the failed
    attempt's drain is in ``unit``'s report)."""
    if run.gateway is None:
        return True
    from orchestrator.engine import gateway

    drained = unit.head.report.gates.get(GATE_GATEWAY)
    if drained is not None:
        again.head.report.gates[GATE_GATEWAY] = drained
    again.head.drained = unit.head.drained
    return gateway.admit(run, again)


def _ray_cluster_then_vllm(run: Run, unit: Unit, release: str) -> bool:
    """Wait until ``ray status`` on the head shows every node (and their GPUs), then start vLLM there."""
    playbook, head, placement = run.playbook, unit.head, unit.placement
    want_nodes = len(unit.nodes)
    want_gpus = sum(len(n.target.container.gpus) for n in unit.nodes)
    run.note(unit, f"waiting for the Ray cluster to show {want_nodes} nodes")
    nodes, gpus, text = cluster_size(playbook, run.client, head.target, placement, want_nodes)
    if nodes < want_nodes or gpus < want_gpus:
        head.report.gates[GATE_GROUP] = Gate(
            False, f"ray status shows {nodes} of {want_nodes} nodes and {gpus:g} of {want_gpus} GPUs: {text[-300:]}"
        )
        unit.fail_others([head.name], "not launched")
        return False
    command = serving.rank_command(playbook, placement, 0, release)
    assert command is not None
    host = serving.probe_host(playbook, head.target.container)
    launch = protocol.launch(head.root, serving.SERVER, command, release, playbook.serving.port, host=host)
    try:
        answers = run.batch(head, [run.lock(head), launch])
    except AgentError as exc:
        _proof_failed(run, unit, exc.failure)
        return False
    head.report.gates[GATE_GROUP] = Gate(
        True, f"Ray cluster of {nodes} nodes ({gpus:g} GPUs); vLLM started on the head, pid {answers[launch].pid}"
    )
    return True


def cluster_size(
    playbook: Playbook,
    client: AgentClient,
    head: Target,
    placement: Placement,
    want_nodes: int,
    deadline_s: float | None = None,
) -> tuple[int, float, str]:
    """Poll ``ray status`` on the head until it shows ``want_nodes`` nodes or the deadline passes."""
    op = protocol.command(serving.ray_status_argv(playbook, placement))
    deadline = time.monotonic() + (deadline_s if deadline_s is not None else playbook.serving.startup_timeout)
    delay = 1.0
    while True:
        output = client.batch(head, [op])[op]
        nodes, gpus = ray_status(output.output) if output.returncode == 0 else (0, 0.0)
        if nodes >= want_nodes or time.monotonic() + delay > deadline:
            return nodes, gpus, output.output
        time.sleep(delay)  # the raylets register within seconds: poll, backing off
        delay = min(delay * 1.5, 5.0)
