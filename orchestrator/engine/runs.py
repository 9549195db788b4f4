"""The runs a user asks for: deploy, verify, rollback, stop and the dry run, each written once.

Each is a few steps over the units of ``runner`` (a single host, or a multi-node group): the
steps decide through ``plan`` and talk to hosts only through the run's agent client. What only a
group has (every node on one release, the proof through its head, its ranks, Ray) is in the steps
themselves, where a unit has more than one node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from orchestrator.agent import protocol
from orchestrator.engine import launch, push
from orchestrator.engine.runner import Node, Run, Scope, Unit, execute, units_for
from orchestrator.errors import AgentError, ArtifactError
from orchestrator.results import (
    GATE_BAKE,
    GATE_CONNECT,
    GATE_FILES,
    GATE_GPUS,
    GATE_GROUP,
    GATE_LINT,
    GATE_MODELS,
    GATE_RAY,
    GATE_SPEEDUP,
    Gate,
    RunKind,
    RunReport,
)
from orchestrator.rules import gates, plan, serving
from orchestrator.rules.gates import models


def deploy(scope: Scope) -> RunReport:
    """Lint; then on every node stage the release and check it (files, loader, build); then,
    with a server, start it and prove it (else switch ``current``). READY only if all pass."""
    playbook, inventory = scope.playbook, scope.inventory
    release_id = scope.options.release_id or plan.new_release_id()
    problems = gates.lint.lint_playbook(playbook, scope.targets)
    lint = gates.lint.lint_gate(playbook, problems)
    units = units_for(playbook, inventory, list(scope.targets))
    if lint is not None and not lint.ok:
        # Nothing is touched: every host says why, and no connection is opened.
        now = time.time()
        hosts = [n.report for u in units for n in u.nodes]
        for host in hosts:
            host.gates[GATE_LINT] = lint
        return RunReport(
            RunKind.DEPLOY, str(playbook.file), str(inventory.file), release_id, hosts, now, now, lint=problems
        )

    def work(run: Run, unit: Unit) -> None:
        if lint is not None:
            for node in unit.nodes:
                node.report.gates[GATE_LINT] = lint
        try:
            if not _stage(run, unit, release_id):
                return
            if playbook.serving.target is not None:
                launch.serve(run, unit)
            else:
                unit.each(lambda node: _switch_staged(run, node), GATE_FILES)
        finally:
            for node in unit.nodes:
                launch.cancel_checks(run, node)  # started, and not collected: the host failed first

    report = execute(
        RunKind.DEPLOY, scope, units, work, release_id, playbook.rollout, _bake if playbook.rollout.bake_s else None
    )
    report.lint = problems
    return report


def _bake(run: Run, canaries: list[Unit]) -> str | None:
    """The canary batch on live traffic for ``rollout.bake_s``: a canary that degrades is taken out
    of rotation and rolled back, and the rollout stops there."""
    from orchestrator.engine import gateway

    ready = [u for u in canaries if u.head.report.ready]
    if not ready:
        return None  # the failure budget decides
    run.say(f"baking the canary ({', '.join(u.head.name for u in ready)}) for {run.playbook.rollout.bake_s:g} s")
    degraded = gateway.bake(run, ready)
    for unit in (u for u in ready if u.head.name in degraded):
        if run.gateway is not None:
            gateway.take_out(run, unit)
            unit.head.drained = True
        launch.roll_back(run, unit)
    if degraded:
        return f"the canary {', '.join(degraded)} degraded while it baked, and was rolled back"
    unjudged = [u.head.name for u in ready if not u.head.report.gates[GATE_BAKE].ok]
    if unjudged:
        return f"the canary {', '.join(unjudged)} could not be judged while it baked (too little live traffic)"
    return None


def _stage(run: Run, unit: Unit, release_id: str) -> bool:
    """Stage the release on every node with its checks; a group must end on one release and one
    vLLM. False: a node failed (a group's other nodes then fail their group gate: not launched)."""
    playbook = run.playbook
    builds: dict[str, str] = {}
    # One host that will launch: its checks run on in the background (launch.start_and_prove
    # collects them); a group's nodes, or a playbook with nothing to launch, wait for them here.
    launches = unit.single and playbook.serving.target is not None

    def stage(reuse: bool) -> Callable[[Node], None]:
        def on(node: Node) -> None:
            if not run.locate(node) or not _gpus(run, unit, node):
                return
            pushed = _push_models(run, node)
            if pushed is None:
                return
            pins = gates.models.pins(playbook, {role: done.digests for role, done in pushed.items()})
            command = expect = None
            if launches:
                # vLLM's verdict on the command the launch will run, in the checks' process
                command = serving.command(playbook, node.target.container, release_id)
                expect = serving.resolved(playbook, node.target.container, release_id)
            batch = plan.Stage(
                playbook,
                node.root,
                release_id,
                run.owner,
                run.options.lock_timeout,
                reuse,
                pins=pins,
                command=command,
                expect=expect,
                env=serving.environment(playbook, node.target.container),
            )
            started = time.monotonic()
            try:
                answers = run.batch(node, batch.ops)
            except AgentError as exc:
                # Under the gate of the op that failed (a model directory: models; the loader's
                # transformers: loader): nothing was switched, what ran, runs.
                node.report.gates.setdefault(GATE_CONNECT, Gate(True, "connected"))
                node.report.gates[exc.failure.gate or GATE_FILES] = Gate(False, exc.failure.describe())
                return
            node.staged = answers[batch.apply]
            node.keeps = answers[batch.runs] if batch.runs is not None else None
            gates.files.read_applied(playbook, node.staged, node.report)
            node.report.gates[GATE_FILES].data["seconds"] = round(time.monotonic() - started, 2)
            target, drafter = answers.get(batch.models.target), answers.get(batch.models.drafter)
            config = models.read_models(playbook, target, drafter, node.report, pins=pins)
            push.note(pushed, node.report)
            models.read_weights(playbook, drafter, config, node.report)
            if batch.checks is not None:
                background = batch.checks.read(playbook, answers, node.report)
                build = answers[batch.checks.build]
                if build.version:
                    builds[node.name] = build.describe()
                if background is not None and launches:
                    node.checks = background  # collected before the switch, or beside the launch
                elif background is not None:
                    launch.collect_checks(run, node, background)

        return on

    if not unit.single:
        run.note(unit, f"{unit.placement.describe()}: staging the release on every node")
    unit.each(stage(reuse=True), GATE_FILES)
    releases = {n.report.release_id for n in unit.nodes}
    apart = [n for n in unit.nodes if n.report.release_id != release_id]
    if not unit.failed() and len(releases) > 1:
        # One group, one release id: the nodes that kept an older copy of these files (one was
        # repaired alone, say) stage this release too.
        run.note(unit, f"the nodes hold different releases: staging {release_id} on {', '.join(n.name for n in apart)}")
        unit.each(stage(reuse=False), GATE_FILES, apart)
    return _alike(unit, builds)


def _gpus(run: Run, unit: Unit, node: Node) -> bool:
    """The gpus gate, once a node, before anything is pushed or staged: the GPUs the server
    will get are there, free, driven recent enough, and (more than one) can all-reduce."""
    if GATE_GPUS in node.report.gates:
        return node.report.gates[GATE_GPUS].ok
    checks = gates.gpus.GpuChecks(run.playbook, node.root, node.target.container, len(unit.nodes))
    if not checks.ops:
        return True
    started = time.monotonic()
    answers = run.batch(node, checks.ops[:1])
    checks.read(answers, node.report)
    if checks.nccl is not None and node.report.gates[GATE_GPUS].ok:
        # Only on GPUs that passed: an all-reduce over the wrong ones would only add noise.
        checks.read(answers | run.batch(node, [checks.nccl]), node.report)
    node.report.gates[GATE_GPUS].data["seconds"] = round(time.monotonic() - started, 2)
    return node.report.gates[GATE_GPUS].ok


def _push_models(run: Run, node: Node) -> dict[str, push.Pushed] | None:
    """Every model with ``push:`` where this node's server reads it (None: a push failed, and the
    models gate says why)."""
    pushed = {}
    for model in run.playbook.models.all:
        if model.push is None:
            continue
        try:
            pushed[model.role] = push.push(run, node, model)
        except AgentError as exc:
            node.report.gates.setdefault(GATE_CONNECT, Gate(True, "connected"))
            node.report.gates[GATE_MODELS] = Gate(False, f"pushing the {model.role}: {exc.failure.describe()}")
            return None
        except ArtifactError as exc:
            node.report.gates[GATE_MODELS] = Gate(False, f"pushing the {model.role}: {exc}")
            return None
    return pushed


def _alike(unit: Unit, builds: dict[str, str]) -> bool:
    """Every node passed its own gates, holds the same release and runs the same vLLM."""
    if not unit.failed():
        head = unit.head
        for node in unit.nodes[1:]:
            if node.report.release_id != head.report.release_id:
                detail = f"holds release {node.report.release_id}, the head {head.report.release_id}"
                node.report.gates[GATE_GROUP] = Gate(False, detail)
            elif builds.get(node.name) != builds.get(head.name):
                detail = f"runs {builds.get(node.name)}, the head {builds.get(head.name)}"
                node.report.gates[GATE_GROUP] = Gate(False, detail)
    unit.fail_others(unit.failed(), "not launched")
    return not unit.failed()


def _switch_staged(run: Run, node: Node) -> None:
    """Files only: make the staged release current (once the checks on it passed)."""
    staged = node.staged
    if staged is None or not staged.changed or staged.switched:
        return  # unchanged, or already switched in the same exec (no checks ran in between)
    switch = protocol.release_switch(node.root, staged.release_id, run.playbook.keep_releases)
    answers = run.batch(node, [run.lock(node), switch])
    gates.files.read_made_current(run.playbook, answers[switch], node.report)


def verify(
    scope: Scope, *, probe_acceptance: bool = False, rehash: bool = False, engine: bool = False, speedup: bool = False
) -> RunReport:
    """Read only, one exec per node (two with ``engine``): the files the server reads against the
    playbook's digests, the model files (their digests from the host's cache, or hashed again with
    ``rehash``) and the overlay's links against their pins, the loader and build checks, the server
    (or rank) alive and healthy, the READY record; with ``probe_acceptance`` the acceptance probe
    through the head, held to the READY record's; with ``engine`` the installed vLLM's verdict on
    the served command. A group also needs every node on one release (and, with Ray, every node
    in the cluster). ``speedup``: the speed-up gate's two arms again, the target alone beside the
    server (``engine.speedup``; a host that fails a gate before it is not loaded)."""
    playbook, inventory = scope.playbook, scope.inventory

    def check(run: Run, unit: Unit, node: Node) -> None:
        if not run.locate(node):
            return
        head = node.rank == 0
        host = (
            serving.probe_host(playbook, unit.head.target.container) if playbook.serving.target else protocol.LOOPBACK
        )
        served = plan.ServedChecks(playbook, node.root, unit.process(node), head, rehash, host=host)
        env = serving.environment(playbook, node.target.container)  # the server's: the deploy's key too
        checks = (
            plan.Checks(playbook, node.root, None, findings=True, env=env) if plan.Checks.wanted(playbook) else None
        )
        gpu = gates.gpus.GpuChecks(playbook, node.root, node.target.container, len(unit.nodes))
        ops: list[protocol.Op[Any]] = [*served.ops, *(checks.ops if checks else []), *gpu.ops]
        probe = None
        if probe_acceptance and served.status is not None and head:
            follow = serving.followed(playbook, node.root, unit.process(node))
            probe = gates.acceptance.probe_op(playbook, host, server=follow).finding()
            ops.append(probe)
        answers = run.batch(node, ops)
        report = node.report
        served.read(answers, report, None if head else unit.role(node))
        if checks is not None:
            checks.read(playbook, answers, report)
        gpu.read(answers, report)
        if probe is not None and probe in answers:
            # held to the READY record's own probe: a fall since READY is found here too
            record = answers.get(served.status) if served.status is not None else None
            gates.acceptance.read_probe(playbook, answers[probe], report, record.ready if record is not None else None)
        plan.read_failures(answers, report)
        if engine and unit.single and playbook.serving.target is not None and report.release_id is not None:
            # vLLM as installed now, on the command the current release is served with: an
            # upgrade under a running server shows here, not at its next restart.
            command = serving.command(playbook, node.target.container, report.release_id)
            want = serving.resolved(playbook, node.target.container, report.release_id)
            op = protocol.engine_check(node.root, serving.SERVER, command, want, kept=False).finding()
            found = run.batch(node, [op])
            if op in found:
                gates.engine.read_engine(found[op], report)
            plan.read_failures(found, report)

    def work(run: Run, unit: Unit) -> None:
        unit.each(lambda node: check(run, unit, node), GATE_FILES)
        if speedup and unit.single and not unit.failed():
            _speedup_again(run, unit)
        if run.gateway is not None:
            from orchestrator.engine import gateway

            gateway.judge(run, unit)
        if unit.single:
            return
        head = unit.head
        if unit.ray and not unit.failed():
            want = len(unit.nodes)
            nodes, gpus, _ = launch.cluster_size(playbook, run.client, head.target, unit.placement, want, deadline_s=0)
            head.report.gates[GATE_RAY] = Gate(
                nodes == want, f"ray status shows {nodes} of {want} nodes, {gpus:g} GPUs"
            )
        for node in unit.nodes:
            if node.report.release_id != head.report.release_id:
                detail = f"current is release {node.report.release_id}, the head's {head.report.release_id}"
                node.report.gates[GATE_GROUP] = Gate(False, detail)
        unit.fail_others(unit.failed(), "group not ready")

    return execute(RunKind.VERIFY, scope, units_for(playbook, inventory, list(scope.targets)), work)


def _speedup_again(run: Run, unit: Unit) -> None:
    """verify --speedup: both arms again, the target alone beside the server as it runs (where the
    memory holds both: nothing is restarted)."""
    from orchestrator.engine import speedup

    head = unit.head
    if run.playbook.gates.speedup is None:
        head.report.gates[GATE_SPEEDUP] = Gate(False, "the playbook has no gates.speedup to measure against")
        return
    found = gates.speedup.speedup_key(run.playbook, head.target.container, head.report)
    if found is None:
        head.report.gates[GATE_SPEEDUP] = Gate(
            False, "the vLLM build or the target is not known here (the build check did not run)"
        )
        return
    speedup.measure(run, unit, *found, again=True)


def dry_run(scope: Scope) -> RunReport:
    """What a deploy would change on every node, with diffs of text files; nothing is written."""
    playbook = scope.playbook

    def inspect(run: Run, node: Node) -> None:
        if run.locate(node):
            op = protocol.release_inspect(node.root, gates.files.paths(playbook))
            # The model directories too: a deploy that pushes weights or pins changed ones makes a
            # new release even when no file of the release's own changed.
            checks = gates.models.ModelChecks(playbook, node.root, record=False, tokens=False, findings=True)
            answers = run.batch(node, [op, *checks.ops])
            gates.files.read_inspected(playbook, answers[op], node.report)
            target = answers.get(checks.target) if checks.target is not None else None
            drafter = answers.get(checks.drafter) if checks.drafter is not None else None
            failed = {
                role: f.describe()
                for role, op in (("target", checks.target), ("drafter", checks.drafter))
                if (f := answers.failure(op)) is not None
            }
            models.read_model_changes(playbook, target, drafter, node.report, failed)

    def work(run: Run, unit: Unit) -> None:
        unit.each(lambda node: inspect(run, node), GATE_FILES)

    units = units_for(playbook, scope.inventory, list(scope.targets), grouped=False)
    return execute(RunKind.DRY_RUN, scope, units, work)


def stop(scope: Scope) -> RunReport:
    """Stop what the agent started for this playbook (vLLM, and Ray) and check that none of it is left."""

    def work(run: Run, unit: Unit) -> None:
        unit.each(run.locate, GATE_CONNECT)
        if not unit.failed() and run.gateway is not None:
            from orchestrator.engine import gateway

            gateway.take_out(run, unit)
        if not unit.failed():
            # the standby too, whether or not the playbook still keeps one: asleep, it holds host memory
            launch.stop_all(run, unit, standby=True)
        unit.fail_others(unit.failed(), "group stop incomplete")

    units = units_for(scope.playbook, scope.inventory, list(scope.targets))
    return execute(RunKind.STOP, scope, units, work)


def rollback(scope: Scope, *, to_release: str | None = None) -> RunReport:
    """Make an earlier release current again (the previous one, or ``to_release``).

    With a server in the playbook, that release is started and proven as a deploy proves a new
    one: health, then acceptance on live traffic, then its READY record (on a group, every node
    must have the same release to go back to). If it fails, the release that was current comes
    back, started and proven again, and the hosts are reported not ready.
    """
    playbook = scope.playbook

    def switch_only(run: Run, node: Node, back: str) -> None:
        switch = protocol.release_switch(node.root, back)
        gates.files.read_switched(run.batch(node, [run.lock(node), switch])[switch], node.report)

    def work(run: Run, unit: Unit) -> None:
        # A first look that writes nothing: with nothing to go back to, nothing is touched.
        listings: dict[str, protocol.Releases] = {}

        def look(node: Node) -> None:
            if run.locate(node):
                op = protocol.release_list(node.root)
                listings[node.name] = run.batch(node, [op])[op]

        unit.each(look, GATE_CONNECT)
        back = None
        if not unit.failed():
            back, problems = plan.common_release(listings, to_release, alone=unit.single)
            for node in unit.nodes:
                if node.name in problems:
                    node.report.gates[GATE_FILES] = Gate(False, problems[node.name])
        if back is not None and playbook.serving.target is None:
            unit.each(lambda node: switch_only(run, node, back), GATE_FILES)
        elif back is not None:
            for node in unit.nodes:
                current = listings[node.name].current
                node.report.release_id, node.report.previous = back, current
                node.report.changed = back != current
            # A node already on that release is not switched by the start: its files are read
            # back here as a switch reads them (no link changes), so that the READY record the
            # proof writes names the files served (else verify finds their digests differ).
            unit.each(lambda node: None if node.report.changed else switch_only(run, node, back), GATE_FILES)
            if not unit.failed():
                run.note(unit, f"rolling back to release {back} on {', '.join(n.name for n in unit.nodes)}")
                for node in unit.nodes:
                    node.going_back = True  # a standby of that release is woken, not started again
                launch.serve(run, unit)
        unit.fail_others(unit.failed(), "group not rolled back")

    units = units_for(playbook, scope.inventory, list(scope.targets))
    return execute(RunKind.ROLLBACK, scope, units, work, to_release)
