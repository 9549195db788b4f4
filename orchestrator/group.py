"""Multi-node deployments: one vLLM deployment over several containers, gated as one group.

The imperative shell for playbooks with ``serving.multi_node``. Every node passes the
containers, files, loader and build gates on its own (the same verified release, the same vLLM);
then every node is launched (``mp``: the head and headless ranks; ``ray``: a Ray cluster, then
vLLM on the head), health and acceptance are proven through the head, and each rank must still
be alive afterwards. The group is READY only when every node is: one failing node fails them
all, and the report names it. A failed launch stops every node and checks that each is gone
(a headless rank outlives its head otherwise), then starts the group again on the previous
release and proves it, as a single host would be rolled back.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orchestrator import plan, serving
from orchestrator.agent import AgentClient
from orchestrator.engine import (
    Progress,
    RunOptions,
    RunReport,
    _connected,
    _Containers,
    _owner,
    _stopped_by_lint,
    _transport,
    count_ssh,
    guarded,
    read_checks,
    read_only_batch,
)
from orchestrator.errors import AgentError
from orchestrator.inventory import Inventory, Target
from orchestrator.placement import Placement, group_build_problems, place, ray_status
from orchestrator.plan import Gate, HostReport
from orchestrator.playbook import Playbook

GATE_GROUP = "group"
Say = Callable[[str], None]


class _Group:
    """The nodes of one run: their reports, reachable targets and one agent client."""

    def __init__(self, placement: Placement, client: AgentClient, reports: dict[str, HostReport]) -> None:
        self.placement = placement
        self.client = client
        self.reports = reports
        self.targets: dict[str, Target] = {t.name: t for t in placement.nodes}
        self.pids: dict[str, int] = {}  # each node's proven process, for its READY record
        self.located: set[str] = set()

    def each(self, work: Callable[[int, Target, HostReport], None], gate: str, names: list[str] | None = None) -> None:
        """``work(rank, target, report)`` on every (or the named) node at once, failures as gates."""
        chosen = [t for t in self.placement.nodes if names is None or t.name in names]

        def one(t: Target) -> None:
            rank = self.placement.rank_of(t.name)
            report = self.reports[t.name]
            guarded(report, lambda: work(rank, self.targets[t.name], report), gate)

        with ThreadPoolExecutor(max_workers=max(1, len(chosen))) as pool:
            list(pool.map(one, chosen))

    def locate(self, containers: _Containers, target: Target, report: HostReport) -> Target | None:
        """The containers gate, once per node per run: the target to reach, or None."""
        if target.name not in self.located:
            reachable = containers.locate(target, report)
            if reachable is None:
                return None
            self.targets[target.name] = reachable
            self.located.add(target.name)
        return self.targets[target.name]

    def failed(self) -> list[str]:
        """Nodes with a failed gate of their own (a node with no gates yet has not failed)."""
        return [t.name for t in self.placement.nodes if any(not g.ok for g in self.reports[t.name].gates.values())]

    def fail_others(self, because: list[str], what: str) -> None:
        """Every node that did not fail itself fails the group gate, naming the nodes that did."""
        named = "; ".join(f"{n} failed its {self.reports[n].failed_gate} gate" for n in because)
        for t in self.placement.nodes:
            if t.name not in because:
                self.reports[t.name].gates[GATE_GROUP] = Gate(False, f"{what}: {named}")

    def role(self, rank: int) -> str:
        if rank == 0:
            return "head"
        return "Ray worker" if self.placement.multi.executor == "ray" else "headless rank"


def _finish(
    kind: str,
    playbook: Playbook,
    inventory: Inventory,
    release_id: str | None,
    reports: dict[str, HostReport],
    started: float,
    transport: Any,
    progress: Progress,
    started_mono: float,
) -> RunReport:
    run = RunReport(kind, str(playbook.file), str(inventory.file), release_id, list(reports.values()), started)
    for report in run.hosts:
        report.duration_s = time.monotonic() - started_mono
        count_ssh(transport, report)
        progress(report, "done")
    run.accepted_host_keys = list(transport.known_hosts.accepted)
    run.finished = time.time()
    return run


def deploy(
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: Progress,
    say: Say = lambda _m: None,
) -> RunReport:
    placement = place(playbook, inventory, targets)
    release_id = options.release_id or plan.new_release_id()
    problems = plan.lint_playbook(playbook)
    if any(p.severity == "error" for p in problems):
        return _stopped_by_lint(playbook, inventory, list(placement.nodes), release_id, problems)
    lint = Gate(True, "drafter config passes lint" + (f" ({len(problems)} warnings)" if problems else ""))
    owner = _owner()
    reports = {t.name: HostReport(t.name, gates={plan.GATE_LINT: lint}) for t in placement.nodes}
    containers = _Containers(inventory, playbook, ensure=True, skip=options.skip_containers)
    started, started_mono = time.time(), time.monotonic()
    with _transport(inventory, options) as transport:
        group = _Group(placement, AgentClient(transport), reports)
        say(f"group: {placement.describe()}: staging the release on every node")
        builds: dict[str, str] = {}

        def stage_with(ops: list[dict[str, Any]]) -> Callable[[int, Target, HostReport], None]:
            def stage(rank: int, target: Target, report: HostReport) -> None:
                reachable = group.locate(containers, target, report)
                if reachable is None:
                    return
                timeout = target.container.ssh.command_timeout + options.lock_timeout
                results = group.client.batch(reachable, ops, timeout=timeout)
                _connected(report)
                plan.read_applied(playbook, results[1].value, report)
                values = [r.value for r in results[2:]]
                plan.read_serving(playbook, values, report)
                if len(values) == 2 and values[1].get("version"):
                    build = values[1]
                    builds[target.name] = f"{build['dist']} {build['version']}"
                    _group_build_gate(playbook, build, report)

            return stage

        group.each(stage_with(plan.apply_ops(playbook, release_id, owner, options.lock_timeout)), plan.GATE_FILES)
        apart = [n for n, r in reports.items() if r.release_id != release_id]
        if not group.failed() and apart and len({r.release_id for r in reports.values()}) > 1:
            # One group, one release id: the nodes that kept an older copy of these files (one was
            # repaired alone, say) stage this release too.
            say(f"group: the nodes hold different releases: staging {release_id} on {', '.join(apart)} too")
            fresh = plan.apply_ops(playbook, release_id, owner, options.lock_timeout, reuse=False)
            group.each(stage_with(fresh), plan.GATE_FILES, names=apart)
        if not _staged_alike(group, builds):
            return _finish(
                "deploy", playbook, inventory, release_id, reports, started, transport, progress, started_mono
            )
        group.placement = placement.located(group.targets)
        _launch_and_prove(playbook, group, owner, options, say)
        return _finish("deploy", playbook, inventory, release_id, reports, started, transport, progress, started_mono)


def _group_build_gate(playbook: Playbook, build: dict[str, Any], report: HostReport) -> None:
    found = group_build_problems(playbook, build.get("dist"), build.get("version"))
    if found:
        text = "; ".join(f"{p.message} ({p.fix})" for p in found)
        report.gates[plan.GATE_BUILD] = Gate(False, f"{build['dist']} {build['version']}: {text}")


def _staged_alike(group: _Group, builds: dict[str, str]) -> bool:
    """Every node passed its own gates, holds the same release and runs the same vLLM."""
    failed = group.failed()
    if failed:
        group.fail_others(failed, "not launched")
        return False
    releases = {n: r.release_id for n, r in group.reports.items()}
    if len(set(releases.values())) > 1 or len(set(builds.values())) > 1:
        head = group.placement.head.name
        for name, report in group.reports.items():
            if name == head:
                continue
            if releases[name] != releases[head]:
                report.gates[GATE_GROUP] = Gate(False, f"holds release {releases[name]}, the head {releases[head]}")
            elif builds.get(name) != builds.get(head):
                report.gates[GATE_GROUP] = Gate(False, f"runs {builds.get(name)}, the head {builds.get(head)}")
        group.fail_others(group.failed(), "not launched")
        return False
    return True


class _Launch:
    """Starting and proving one group on one release (the new one, or the previous on the way back)."""

    def __init__(self, playbook: Playbook, group: _Group, owner: str, options: RunOptions, say: Say) -> None:
        self.playbook = playbook
        self.group = group
        self.say = say
        self.lock = plan.lock_op(playbook, owner, options.lock_timeout)
        nodes = group.placement.nodes
        self.timeout = max(t.container.ssh.command_timeout for t in nodes) + options.lock_timeout + 120

    def start(self, release: str, switch: set[str]) -> bool:
        """Stop what runs, switch the named nodes to ``release``, start every rank. False: a node failed."""
        playbook, group, root = self.playbook, self.group, self.playbook.deploy_root
        placement, ray = group.placement, group.placement.multi.executor == "ray"
        # A group starts together: stop every rank first (a survivor would hold the old group's ports).
        _stop_all(playbook, group, self.lock)
        if group.failed():
            return False

        def switch_and_start(rank: int, target: Target, report: HostReport) -> None:
            ops: list[dict[str, Any]] = [self.lock]
            if target.name in switch:
                ops.append(
                    {"op": "release_switch", "root": root, "release_id": release, "keep": playbook.keep_releases}
                )
            if ray:
                ops.append(serving.ray_command(playbook, placement, rank).as_op(root, release, None, serving.RAY))
            elif (command := serving.rank_command(playbook, placement, rank, release)) is not None:
                ops.append(command.as_op(root, release, playbook.serving.port if rank == 0 else None))
            results = group.client.batch(target, ops, timeout=self.timeout)
            values = {r.op: r.value for r in results}
            if "release_switch" in values:
                switched = values["release_switch"]
                if report.files:
                    plan.read_made_current(playbook, switched, report)
                else:  # going back: the previous release's own files
                    plan.read_switched(switched, report)
            pid = values["launch"]["pid"]
            report.gates[GATE_GROUP] = Gate(True, f"rank {rank} ({group.role(rank)}) started, pid {pid}")

        self.say(f"group: launching release {release} on {len(placement.nodes)} nodes")
        group.each(switch_and_start, plan.GATE_HEALTH)
        if not group.failed() and ray:
            _ray_cluster_then_vllm(playbook, group, release, self.lock, self.timeout, self.say)
        return not group.failed()

    def prove(self) -> bool:
        """Health and acceptance through the head, then every other rank still alive."""
        playbook, group = self.playbook, self.group
        head = group.placement.head
        self.say(f"group: waiting for the head {head.name} to be healthy, then probing acceptance")
        s = playbook.serving
        budget = head.container.ssh.command_timeout + s.startup_timeout + plan.probe_timeout(playbook)
        head_report = group.reports[head.name]
        try:
            results = group.client.batch(
                group.targets[head.name], [plan.health_op(playbook), plan.probe_op(playbook)], budget
            )
        except AgentError as exc:
            gate = plan.GATE_ACCEPTANCE if exc.failure.op == "probe" else plan.GATE_HEALTH
            head_report.gates[gate] = Gate(False, exc.failure.message)
            head_report.diagnosis = plan.diagnose(playbook, head_report, failure=exc.failure)
            group.fail_others([head.name], "group not ready")
            return False
        health = results[0].value
        group.pids[head.name] = health["pid"]
        head_report.gates[plan.GATE_HEALTH] = Gate(
            True, f"healthy after {health['waited_s']} s, pid {health['pid']}", {"seconds": health["waited_s"]}
        )
        plan.read_probe(playbook, results[1].value, head_report)
        if not head_report.ready:
            head_report.diagnosis = plan.diagnose(playbook, head_report)
            group.fail_others([head.name], "group not ready")
            return False
        _check_ranks_alive(playbook, group)
        if group.failed():
            group.fail_others(group.failed(), "group not ready")
            return False
        return True


def _launch_and_prove(playbook: Playbook, group: _Group, owner: str, options: RunOptions, say: Say) -> None:
    release = group.reports[group.placement.head.name].release_id
    assert release is not None
    launch = _Launch(playbook, group, owner, options, say)
    changed = {n for n, r in group.reports.items() if r.changed}
    running = not changed and _all_running(playbook, group, release)
    if not running and not launch.start(release, changed):
        _roll_back(launch)
        return
    if not launch.prove():
        _roll_back(launch)
        return
    _write_ready_everywhere(playbook, group, release)


def _all_running(playbook: Playbook, group: _Group, release: str) -> bool:
    """Nothing changed: is the whole group still up on this release? (Then keep it and re-prove it.)"""
    alive: dict[str, bool] = {}
    ray = group.placement.multi.executor == "ray"

    def status(rank: int, target: Target, report: HostReport) -> None:
        names = ([serving.RAY] if ray else []) + ([serving.SERVER] if rank == 0 or not ray else [])
        ops = [_status_op(playbook, n) for n in names]
        results = group.client.batch(target, ops)
        servers = [r.value.get("server") or {} for r in results]
        alive[target.name] = all(x.get("alive") and x.get("release_id") in (release, None) for x in servers)

    group.each(status, plan.GATE_HEALTH)
    return all(alive.get(t.name) for t in group.placement.nodes) and not group.failed()


def _stop_all(playbook: Playbook, group: _Group, lock: dict[str, Any]) -> None:
    """Stop vLLM and Ray on every node; a node where anything is left fails its ``stopped`` gate."""
    root = playbook.deploy_root

    def stop(rank: int, target: Target, report: HostReport) -> None:
        ops = [lock] + [{"op": "stop", "root": root, "name": n} for n in (serving.SERVER, serving.RAY)]
        results = group.client.batch(target, ops, timeout=target.container.ssh.command_timeout + 120)
        left = [op["name"] for op, r in zip(ops[1:], results[1:], strict=True) if not r.value.get("gone")]
        pids = [str(r.value["stopped"]) for r in results[1:] if r.value.get("stopped")]
        if left:
            report.gates["stopped"] = Gate(False, f"still running after stop: {', '.join(left)}")
        else:
            report.gates["stopped"] = Gate(True, f"stopped pid {', '.join(pids)}" if pids else "nothing was running")

    group.each(stop, "stopped")


def _ray_cluster_then_vllm(
    playbook: Playbook, group: _Group, release: str, lock: dict[str, Any], timeout: float, say: Say
) -> None:
    """Wait until ``ray status`` on the head shows every node (and their GPUs), then start vLLM there."""
    placement = group.placement
    head = placement.head
    report = group.reports[head.name]
    want_nodes = len(placement.nodes)
    want_gpus = sum(len(t.container.gpus) for t in placement.nodes)
    say(f"group: waiting for the Ray cluster to show {want_nodes} nodes")
    nodes, gpus, text = cluster_size(playbook, group.client, group.targets[head.name], placement, want_nodes)
    if nodes < want_nodes or gpus < want_gpus:
        report.gates[GATE_GROUP] = Gate(
            False, f"ray status shows {nodes} of {want_nodes} nodes and {gpus:g} of {want_gpus} GPUs: {text[-300:]}"
        )
        return
    command = serving.rank_command(playbook, placement, 0, release)
    assert command is not None
    launch = command.as_op(playbook.deploy_root, release, playbook.serving.port)
    result = group.client.batch(group.targets[head.name], [lock, launch], timeout=timeout)
    report.gates[GATE_GROUP] = Gate(
        True, f"Ray cluster of {nodes} nodes ({gpus:g} GPUs); vLLM started on the head, pid {result[1].value['pid']}"
    )


def cluster_size(
    playbook: Playbook,
    client: AgentClient,
    head: Target,
    placement: Placement,
    want_nodes: int,
    deadline_s: float | None = None,
) -> tuple[int, float, str]:
    """Poll ``ray status`` on the head until it shows ``want_nodes`` nodes or the deadline passes."""
    argv = serving.ray_status_argv(playbook, placement)
    deadline = time.monotonic() + (deadline_s if deadline_s is not None else playbook.serving.startup_timeout)
    delay = 1.0
    while True:
        value = client.batch(head, [{"op": "command", "argv": argv, "timeout": 60}])[0].value
        nodes, gpus = ray_status(value["output"]) if value["returncode"] == 0 else (0, 0.0)
        if nodes >= want_nodes or time.monotonic() + delay > deadline:
            return nodes, gpus, value["output"]
        time.sleep(delay)  # the raylets register within seconds: poll, backing off
        delay = min(delay * 1.5, 5.0)


def _check_ranks_alive(playbook: Playbook, group: _Group) -> None:

    def check(rank: int, target: Target, report: HostReport) -> None:
        if rank > 0:
            value = group.client.batch(target, [_status_op(playbook, _main_process(group, rank))])[0].value
            _rank_alive(group, rank, value, report)

    group.each(check, plan.GATE_HEALTH)


def _rank_alive(group: _Group, rank: int, status: dict[str, Any], report: HostReport) -> None:
    """A rank other than the head serves no HTTP: its health is its process being alive."""
    server = status.get("server") or {}
    if server.get("alive"):
        group.pids[report.name] = server["pid"]
        report.gates[plan.GATE_HEALTH] = Gate(True, f"{group.role(rank)} pid {server['pid']} alive")
    else:
        report.gates[plan.GATE_HEALTH] = Gate(False, f"{group.role(rank)} is not running")


def _status_op(playbook: Playbook, name: str, head: bool = False) -> dict[str, Any]:
    """serving_status of one supervised process; /health only on the head (the others serve no HTTP)."""
    op: dict[str, Any] = {"op": "serving_status", "root": playbook.deploy_root, "name": name}
    op.update({"port": playbook.serving.port} if head else {"health": False})
    return op


def _write_ready_everywhere(playbook: Playbook, group: _Group, release: str) -> None:
    placement = group.placement
    head = group.reports[placement.head.name]
    proof = head.gates[plan.GATE_ACCEPTANCE]
    names = [t.name for t in placement.nodes]

    def write(rank: int, target: Target, report: HostReport) -> None:
        if rank > 0:
            report.gates[plan.GATE_ACCEPTANCE] = Gate(True, f"through the head {placement.head.name}: {proof.detail}")
        gates = {k: g.to_json() for k, g in report.gates.items()}
        gates["group"] = {"rank": rank, "nodes": names, "executor": placement.multi.executor}
        pid = group.pids.get(target.name)  # the head's from its health wait, the others' from their check
        files = [{"path": f.dest, "remote_path": f.remote_path, "sha256": f.sha256} for f in report.files]
        record = serving.ready_record(release, gates, files, pid)
        group.client.batch(target, [plan.put_op(playbook.deploy_root, "ready.json", record)])
        report.gates[plan.GATE_READY] = Gate(True, f"{playbook.deploy_root}/ready.json records release {release}")

    group.each(write, plan.GATE_READY)


def _main_process(group: _Group, rank: int) -> str:
    """The process a node's READY record names: vLLM on mp ranks and the Ray head, Ray elsewhere."""
    return serving.RAY if group.placement.multi.executor == "ray" and rank > 0 else serving.SERVER


def _roll_back(failed: _Launch) -> None:
    """After a failed launch: stop every node (checking each is gone), then bring the previous
    release back on every node, start the group on it and prove it again; READY again if it passes.
    With no common previous release the group stays stopped."""
    playbook, group, say = failed.playbook, failed.group, failed.say
    say("group: not ready: stopping every node")
    _stop_all(playbook, group, failed.lock)
    previous = {r.previous if r.changed else r.release_id for r in group.reports.values()}
    back = previous.pop() if len(previous) == 1 else None
    changed = any(r.changed for r in group.reports.values())
    stopped = all(r.gates.get("stopped", Gate(False, "")).ok for r in group.reports.values())
    if back is None or not changed or not stopped:  # nothing else to go back to, or a node is stuck
        line = (
            "no previous release to go back to: the group was stopped on every node (no vLLM or Ray process left)"
            if stopped
            else "the group could not be stopped on every node: see each node's stopped gate"
        )
        for report in group.reports.values():
            report.diagnosis.append(line)
        return
    say(f"group: rolling back to release {back} on every node")
    # A second look at the same nodes, so that the new release's failed gates stay as they are.
    again = _Group(group.placement, group.client, {n: HostReport(n) for n in group.reports})
    again.targets = group.targets
    relaunch = copy.copy(failed)
    relaunch.group = again
    switch = {n for n, r in group.reports.items() if r.changed}
    if relaunch.start(back, switch) and relaunch.prove():
        _write_ready_everywhere(playbook, again, back)
        proof = again.reports[group.placement.head.name].gates[plan.GATE_ACCEPTANCE].detail
        line = f"rolled back: release {back} is current again on every node, healthy and READY ({proof})"
    else:
        _stop_all(playbook, again, failed.lock)
        why = "; ".join(f"{n}: {r.gates[r.failed_gate].detail}" for n, r in again.reports.items() if r.failed_gate)
        line = f"rolled back to release {back}, but the group does not pass on it either ({why}): stopped"
    for report in group.reports.values():
        report.diagnosis.append(line)


def verify(
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: Progress,
    probe_acceptance: bool = False,
) -> RunReport:
    """Per node: same release, same digests, loader and build, its process alive, READY record; the
    head's health (and acceptance with --probe); with Ray, the cluster's node count."""
    placement = place(playbook, inventory, targets)
    reports = {t.name: HostReport(t.name) for t in placement.nodes}
    containers = _Containers(inventory, playbook, ensure=False, skip=options.skip_containers)
    ray = placement.multi.executor == "ray"
    base_ops = [op for op in plan.verify_ops(playbook) if op["op"] != "serving_status"]  # per rank below
    started, started_mono = time.time(), time.monotonic()
    with _transport(inventory, options) as transport:
        group = _Group(placement, AgentClient(transport), reports)

        def check(rank: int, target: Target, report: HostReport) -> None:
            reachable = group.locate(containers, target, report)
            if reachable is None:
                return
            status = _status_op(playbook, _main_process(group, rank), head=rank == 0)
            ops = [*base_ops, status]
            if rank == 0 and probe_acceptance:
                ops.append(plan.probe_op(playbook))
            values, failed = read_only_batch(group.client, reachable, ops, report)
            plan.read_verified(playbook, values["release_verify"], report)
            read_checks(playbook, values, failed, report)
            # What only a group checks: its build's multi-node limits; a rank's process, not /health.
            if "vllm_build" in values:
                _group_build_gate(playbook, values["vllm_build"], report)
            if rank > 0 and "serving_status" in values and report.release_id is not None:
                _rank_alive(group, rank, values["serving_status"], report)

        group.each(check, plan.GATE_FILES)
        head = placement.head.name
        if ray and not group.failed():
            placement = placement.located(group.targets)
            nodes, gpus, _ = cluster_size(
                playbook, group.client, group.targets[head], placement, len(placement.nodes), deadline_s=0
            )
            ok = nodes == len(placement.nodes)
            reports[head].gates["ray"] = Gate(
                ok, f"ray status shows {nodes} of {len(placement.nodes)} nodes, {gpus:g} GPUs"
            )
        releases = {r.release_id for r in reports.values()}
        if len(releases) > 1:
            for report in reports.values():
                if report.release_id != reports[head].release_id:
                    report.gates[GATE_GROUP] = Gate(
                        False, f"current is release {report.release_id}, the head's {reports[head].release_id}"
                    )
        if group.failed():
            group.fail_others(group.failed(), "group not ready")
        return _finish("verify", playbook, inventory, None, reports, started, transport, progress, started_mono)


def stop(
    playbook: Playbook, inventory: Inventory, targets: list[Target], options: RunOptions, progress: Progress
) -> RunReport:
    """Stop vLLM (and Ray) on every node of the group and check that nothing of it is left."""
    placement = place(playbook, inventory, targets)
    reports = {t.name: HostReport(t.name) for t in placement.nodes}
    containers = _Containers(inventory, playbook, ensure=False, skip=options.skip_containers)
    lock = plan.lock_op(playbook, _owner(), options.lock_timeout)
    started, started_mono = time.time(), time.monotonic()
    with _transport(inventory, options) as transport:
        group = _Group(placement, AgentClient(transport), reports)

        def locate(rank: int, target: Target, report: HostReport) -> None:
            group.locate(containers, target, report)

        group.each(locate, plan.GATE_CONNECT)
        if not group.failed():
            _stop_all(playbook, group, lock)
        if group.failed():
            group.fail_others(group.failed(), "group stop incomplete")
        return _finish("stop", playbook, inventory, None, reports, started, transport, progress, started_mono)


def rollback(
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: Progress,
    to_release: str | None = None,
    say: Say = lambda _m: None,
) -> RunReport:
    """Go back to an earlier release on every node, and prove it as a deploy proves a new one.

    The group is stopped, every node switched to the release (the previous one, which must be the
    same on every node, or ``to_release``), the group started on it and proven through the head,
    then READY recorded on every node. If that fails, the release that was current comes back the
    same way; with nothing to go back to, the group stays stopped.
    """
    placement = place(playbook, inventory, targets)
    reports = {t.name: HostReport(t.name) for t in placement.nodes}
    containers = _Containers(inventory, playbook, ensure=False, skip=options.skip_containers)
    started, started_mono = time.time(), time.monotonic()
    with _transport(inventory, options) as transport:
        group = _Group(placement, AgentClient(transport), reports)
        listings: dict[str, dict[str, Any]] = {}

        def look(rank: int, target: Target, report: HostReport) -> None:
            reachable = group.locate(containers, target, report)
            if reachable is not None:
                ops = [{"op": "release_list", "root": playbook.deploy_root}]
                listings[target.name] = group.client.batch(reachable, ops)[0].value
                _connected(report)

        group.each(look, plan.GATE_CONNECT)
        if not group.failed():
            back = _common_release(listings, to_release, reports)
            if back is not None:
                for name, report in reports.items():
                    report.release_id, report.previous = back, listings[name]["current"]
                    report.changed = back != listings[name]["current"]
                group.placement = placement.located(group.targets)
                say(f"group: rolling back to release {back} on {len(placement.nodes)} nodes")
                _launch_and_prove(playbook, group, _owner(), options, say)
        if group.failed():
            group.fail_others(group.failed(), "group not rolled back")
        return _finish("rollback", playbook, inventory, to_release, reports, started, transport, progress, started_mono)


def _common_release(
    listings: dict[str, dict[str, Any]], to_release: str | None, reports: dict[str, HostReport]
) -> str | None:
    """The release every node goes back to, or None with each node's files gate saying why not."""
    wanted = {name: to_release or listing["previous"] for name, listing in listings.items()}
    problems = {
        name: f"release {release} does not exist here"
        for name, release in wanted.items()
        if release is not None and release not in {r["release_id"] for r in listings[name]["releases"]}
    }
    if None in wanted.values() or len(set(wanted.values())) > 1:
        held = ", ".join(f"{name}: {release or 'none'}" for name, release in wanted.items())
        problems = {name: f"the nodes have no common previous release ({held}): name one with --to" for name in wanted}
    for name, detail in problems.items():
        reports[name].gates[plan.GATE_FILES] = Gate(False, detail)
    return None if problems else next(iter(wanted.values()))
