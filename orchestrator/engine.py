"""Running plans across hosts: bounded fan-out, per-host isolation, rollout policy.

Each command here is the imperative shell around ``plan``: it sends the batches ``plan`` builds
through one ``AgentClient`` and lets ``plan`` read the answers. A failure on one host becomes
that host's failed gate and never stops the others (unless the rollout's failure budget says so).
"""

from __future__ import annotations

import getpass
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from orchestrator import dflash, plan, serving
from orchestrator.agent import AgentClient
from orchestrator.containers import spec_for
from orchestrator.errors import AgentError, AgentProtocolError, LxdError, OrchestratorError, TransportError
from orchestrator.inventory import Inventory, Target
from orchestrator.plan import Gate, HostReport
from orchestrator.playbook import Playbook, Rollout
from orchestrator.ssh import KnownHosts, RetryPolicy, SshTransport

Progress = Callable[[HostReport, str], None]


@dataclass(frozen=True)
class RunOptions:
    forks: int = 16
    skip_containers: bool = False
    accept_new_host_keys: bool = False
    lock_timeout: float = 60.0
    release_id: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)


@dataclass
class RunReport:
    kind: str
    playbook: str
    inventory: str
    release_id: str | None
    hosts: list[HostReport]
    started: float
    finished: float = 0.0
    accepted_host_keys: list[str] = field(default_factory=list)
    lint: list[dflash.Problem] | None = None

    @property
    def ok(self) -> bool:
        return bool(self.hosts) and all(h.ready for h in self.hosts)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "playbook": self.playbook,
            "release_id": self.release_id,
            "ok": self.ok,
            "duration_s": round(self.finished - self.started, 3),
            "accepted_host_keys": self.accepted_host_keys,
            **(
                {
                    "lint": {
                        "ok": not any(p.severity == "error" for p in self.lint),
                        "problems": [p.to_json() for p in self.lint],
                    }
                }
                if self.lint is not None
                else {}
            ),
            "hosts": [host_json(h, self.kind) for h in self.hosts],
        }


def host_json(h: HostReport, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": h.name,
        "ready": h.ready,
        "release_id": h.release_id,
        "previous_release_id": h.previous,
        "changed": h.changed,
        "gates": {name: g.to_json() for name, g in h.gates.items()},
        "files": [
            {
                "path": f.dest,
                "remote_path": f.remote_path,
                "sha256": f.sha256,
                "expected_sha256": f.expected,
                "changed": f.changed,
                "drift": f.drift,
            }
            for f in h.files
        ],
        "duration_s": round(h.duration_s, 3),
        "ssh": h.ssh,
    }
    if kind == "verify":
        out["in_sync"] = h.ready
    if h.container is not None:
        out["container"] = h.container
    if h.diagnosis:
        out["diagnosis"] = h.diagnosis
    if h.diffs:
        out["diffs"] = h.diffs
    return out


def _owner() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _fan_out(
    targets: list[Target],
    work: Callable[[Target, HostReport], None],
    transport: SshTransport,
    options: RunOptions,
    progress: Progress,
    rollout: Rollout | None = None,
) -> list[HostReport]:
    """Run ``work`` per target with at most ``forks`` at once, batch by batch per the rollout."""
    reports = {t.name: HostReport(t.name) for t in targets}
    by_name = {t.name: t for t in targets}
    batches = plan.rollout_batches(list(by_name), rollout.canary, rollout.batch_size) if rollout else [list(by_name)]
    budget = rollout.max_failures if rollout and (rollout.canary or rollout.batch_size) else None

    def one(name: str) -> None:
        report = reports[name]
        started = time.monotonic()
        progress(report, "start")
        guarded(report, lambda: work(by_name[name], report))
        report.duration_s = time.monotonic() - started
        count_ssh(transport, report)
        progress(report, "done")

    failures = 0
    with ThreadPoolExecutor(max_workers=max(1, options.forks)) as pool:
        for index, batch in enumerate(batches):
            if budget is not None and failures > budget:
                for name in (n for b in batches[index:] for n in b):
                    reports[name].gates[plan.GATE_ROLLOUT] = Gate(
                        False, f"not attempted: {failures} hosts failed, over the rollout's max_failures {budget}"
                    )
                break
            list(pool.map(one, batch))
            failures += sum(not reports[n].ready for n in batch)
    return [reports[t.name] for t in targets]


def guarded(report: HostReport, work: Callable[[], None], gate: str = plan.GATE_FILES) -> None:
    """Run one host's work; what goes wrong becomes that host's failed gate, never an exception."""
    try:
        work()
    except TransportError as exc:
        report.gates[plan.GATE_CONNECT] = Gate(False, exc.message)
    except AgentError as exc:
        report.gates.setdefault(plan.GATE_CONNECT, Gate(True, "connected"))
        report.gates[gate] = Gate(False, exc.failure.describe())
    except AgentProtocolError as exc:
        report.gates.setdefault(plan.GATE_CONNECT, Gate(True, "connected"))
        report.gates[gate] = Gate(False, str(exc).split(": ", 1)[-1])
    except OrchestratorError as exc:
        report.gates[gate] = Gate(False, str(exc))


def count_ssh(transport: SshTransport, report: HostReport) -> None:
    c = transport.counters(report.name)
    report.ssh = {"connects": c.connects, "execs": c.execs, "retries": c.retries}


# The gate a failed read-only check belongs to (a stale drafter config that transformers cannot
# load is the loader's failure; the files' drift read before it must still be reported).
_CHECK_GATES = {
    "loader_view": plan.GATE_LOADER,
    "vllm_build": plan.GATE_BUILD,
    "serving_status": plan.GATE_HEALTH,
    "probe": plan.GATE_ACCEPTANCE,
}


def read_only_batch(
    client: AgentClient, target: Target, ops: list[dict[str, Any]], report: HostReport
) -> tuple[dict[str, dict[str, Any]], tuple[str, Gate] | None]:
    """Answers by op name, and the gate of the check that failed (if one did after the first op)."""
    try:
        results = client.batch(target, ops, timeout=target.container.ssh.command_timeout + 600)
        answers, failed = [r.value for r in results], None
    except AgentError as exc:
        if not exc.done or exc.failure.op not in _CHECK_GATES:
            raise
        answers, failed = exc.done, (_CHECK_GATES[exc.failure.op], Gate(False, exc.failure.describe()))
    _connected(report)
    return {op["op"]: value for op, value in zip(ops, answers, strict=False)}, failed


def read_checks(
    playbook: Playbook, values: dict[str, dict[str, Any]], failed: tuple[str, Gate] | None, report: HostReport
) -> None:
    """The loader, build, serving and probe gates from a read-only batch's answers (verify)."""
    if "vllm_build" in values:
        plan.read_serving(playbook, [values["loader_view"], values["vllm_build"]], report)
    if "serving_status" in values and report.release_id is not None:
        plan.read_serving_status(values["serving_status"], report)
    if "probe" in values:
        plan.read_probe(playbook, values["probe"], report)
    if failed is not None:
        report.gates[failed[0]] = failed[1]


def _connected(report: HostReport) -> None:
    report.gates[plan.GATE_CONNECT] = Gate(True, "connected")


def _transport(inventory: Inventory, options: RunOptions) -> SshTransport:
    return SshTransport(
        KnownHosts(inventory.known_hosts), accept_new_host_keys=options.accept_new_host_keys, retry=options.retry
    )


class _Containers:
    """The ``containers`` gate: each LXD-managed container made right (deploy) or checked (others).

    One ``LxdHost`` per GPU host, opened on first use and shared by that host's containers; a
    host whose LXD cannot be reached fails each of its containers with the same message.
    """

    def __init__(self, inventory: Inventory, playbook: Playbook, ensure: bool, skip: bool) -> None:
        self.inventory = inventory
        self.playbook = playbook
        self.ensure = ensure
        self.skip = skip
        self._hosts: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _host(self, name: str) -> Any:
        from orchestrator.lxd import LxdHost  # pylxd is imported only when a host uses LXD

        with self._lock:
            if name not in self._hosts:
                endpoint = self.inventory.hosts[name].lxd
                assert endpoint is not None
                try:
                    self._hosts[name] = LxdHost(name, endpoint)
                except LxdError as exc:
                    self._hosts[name] = exc
            found = self._hosts[name]
        if isinstance(found, LxdError):
            raise found
        return found

    def locate(self, target: Target, report: HostReport) -> Target | None:
        """The target to reach over SSH (with a discovered address), or None when it cannot be."""
        container = target.container
        if container.lxd is None:
            return target
        if self.skip:
            report.gates[plan.GATE_CONTAINERS] = Gate(True, "not checked (--skip-containers)")
            return target
        started = time.monotonic()
        try:
            host = self._host(container.host)
            spec = spec_for(container, self.playbook.disks)
            result = host.ensure(spec) if self.ensure else host.inspect(spec)
        except LxdError as exc:
            report.gates[plan.GATE_CONTAINERS] = Gate(False, exc.message)
            return None
        report.container = {
            "status": result.status.lower(),
            "address": result.address,
            "actions": result.actions,
            "drift": [{"key": d.key, "expected": d.expected, "actual": d.actual} for d in result.drift],
        }
        seconds = round(time.monotonic() - started, 2)
        report.gates[plan.GATE_CONTAINERS] = Gate(result.ok, result.detail, {"seconds": seconds})
        if result.status != "Running":
            return None
        if container.address is None:
            return target.at(result.address) if result.address else None
        return target


def _run(
    kind: str,
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: Progress,
    work: Callable[[AgentClient, Target, HostReport], None],
    release_id: str | None = None,
    rollout: Rollout | None = None,
) -> RunReport:
    report = RunReport(kind, str(playbook.file), str(inventory.file), release_id, [], time.time())
    containers = _Containers(inventory, playbook, ensure=kind == "deploy", skip=options.skip_containers)

    def located_work(client: AgentClient, target: Target, host_report: HostReport) -> None:
        reachable = containers.locate(target, host_report)
        if reachable is not None:
            work(client, reachable, host_report)

    with _transport(inventory, options) as transport:
        client = AgentClient(transport)
        report.hosts = _fan_out(targets, lambda t, r: located_work(client, t, r), transport, options, progress, rollout)
        report.accepted_host_keys = list(transport.known_hosts.accepted)
    report.finished = time.time()
    return report


def deploy(
    playbook: Playbook, inventory: Inventory, targets: list[Target], options: RunOptions, progress: Progress
) -> RunReport:
    release_id = options.release_id or plan.new_release_id()
    problems = plan.lint_playbook(playbook)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        return _stopped_by_lint(playbook, inventory, targets, release_id, problems)
    owner = _owner()
    ops = plan.apply_ops(playbook, release_id, owner, options.lock_timeout)
    switch = plan.switch_ops(playbook, release_id, owner, options.lock_timeout, playbook.keep_releases)

    def work(client: AgentClient, target: Target, report: HostReport) -> None:
        timeout = target.container.ssh.command_timeout + options.lock_timeout
        started = time.monotonic()
        results = client.batch(target, ops, timeout=timeout)
        _connected(report)
        staged = results[1].value
        plan.read_applied(playbook, staged, report)
        report.gates[plan.GATE_FILES].data["seconds"] = round(time.monotonic() - started, 2)
        plan.read_serving(playbook, [r.value for r in results[2:]], report)
        if not report.ready:
            return  # a failed gate leaves the previous release current
        if playbook.serving.target is not None:
            _serve(client, playbook, target, report, bool(staged.get("changed")), owner, options)
            return
        if not staged.get("changed") or staged.get("switched"):
            return  # unchanged, or already switched in the same exec (no checks ran in between)
        switched = client.batch(target, switch, timeout=timeout)
        plan.read_made_current(playbook, switched[1].value, report)

    run = _run("deploy", playbook, inventory, targets, options, progress, work, release_id, playbook.rollout)
    run.lint = problems
    if playbook.drafter is not None:
        warnings = len(problems)
        checked = (
            "target config and reference"
            if playbook.drafter.target and playbook.drafter.reference
            else (
                "target config"
                if playbook.drafter.target
                else "reference"
                if playbook.drafter.reference
                else "its own rules"
            )
        )
        lint = Gate(True, f"drafter config passes against {checked}" + (f" ({warnings} warnings)" if warnings else ""))
        for h in run.hosts:
            h.gates = {plan.GATE_LINT: lint, **h.gates}
    return run


def _serve(
    client: AgentClient,
    playbook: Playbook,
    target: Target,
    report: HostReport,
    changed: bool,
    owner: str,
    options: RunOptions,
) -> None:
    """Switch, launch, wait for health, probe acceptance; READY only if all pass, else roll back.

    One exec does the switch, the launch, the health wait and the probe (the agent stops at the
    first failure, so a dead server is never probed), holding the deploy-root lock throughout.
    """
    assert report.release_id is not None
    root, s = playbook.deploy_root, playbook.serving
    release = report.release_id
    launch = serving.command(playbook, target.container, release).as_op(root, release, s.port)
    launch["keep_if_running"] = not changed
    lock = plan.lock_op(playbook, owner, options.lock_timeout)
    ops: list[dict[str, Any]] = [lock]
    if changed:
        ops.append({"op": "release_switch", "root": root, "release_id": release, "keep": playbook.keep_releases})
    probe_timeout = plan.probe_timeout(playbook)
    ops += [
        launch,
        plan.health_op(playbook),
        plan.probe_op(playbook),
    ]
    budget = target.container.ssh.command_timeout + options.lock_timeout + s.startup_timeout + probe_timeout
    try:
        results = client.batch(target, ops, timeout=budget)
    except AgentError as exc:
        failure = exc.failure
        if failure.op == "release_switch":
            raise
        name = plan.GATE_ACCEPTANCE if failure.op == "probe" else plan.GATE_HEALTH
        report.gates[name] = Gate(False, failure.message)
        report.diagnosis = plan.diagnose(playbook, report, failure=failure)
        _roll_back(client, playbook, target, report, changed, owner, options)
        return
    values = {r.op: r.value for r in results}
    if changed:
        report.previous = values["release_switch"].get("previous")
        if report.files:
            plan.read_made_current(playbook, values["release_switch"], report)
        else:  # a rollback: the earlier release's own files, as its manifest holds them
            plan.read_switched(values["release_switch"], report)
    health = values["wait_health"]
    kept = " (already running)" if values["launch"].get("kept") else ""
    report.gates[plan.GATE_HEALTH] = Gate(
        True, f"healthy after {health['waited_s']} s, pid {health['pid']}{kept}", {"seconds": health["waited_s"]}
    )
    plan.read_probe(playbook, values["probe"], report)
    if not report.ready:
        report.diagnosis = plan.diagnose(playbook, report)
        _roll_back(client, playbook, target, report, changed, owner, options)
        return
    files = [{"path": f.dest, "remote_path": f.remote_path, "sha256": f.sha256} for f in report.files]
    _write_ready(client, target, root, release, {k: g.to_json() for k, g in report.gates.items()}, files, health["pid"])
    report.gates[plan.GATE_READY] = Gate(True, f"{root}/ready.json records release {release}")


def _roll_back(
    client: AgentClient,
    playbook: Playbook,
    target: Target,
    report: HostReport,
    changed: bool,
    owner: str,
    options: RunOptions,
) -> None:
    """After a failure past launch: the previous release and its server come back; the host stays not ready."""
    root, s = playbook.deploy_root, playbook.serving
    previous = report.previous
    lock = plan.lock_op(playbook, owner, options.lock_timeout)
    if not changed or previous is None:
        # Nothing to go back to: stop the failed server rather than leave it looking healthy.
        client.batch(target, [lock, {"op": "stop", "root": root}])
        report.diagnosis.append("no previous release to roll back to: the server was stopped")
        return
    relaunch = serving.command(playbook, target.container, previous).as_op(root, previous, s.port)
    ops: list[dict[str, Any]] = [
        lock,
        {"op": "release_switch", "root": root, "release_id": previous},
        relaunch,
        plan.health_op(playbook),
        plan.probe_op(playbook),
    ]
    budget = (
        target.container.ssh.command_timeout + s.startup_timeout + options.lock_timeout + plan.probe_timeout(playbook)
    )
    try:
        results = client.batch(target, ops, timeout=budget)
    except AgentError as exc:
        report.diagnosis.append(f"rollback to {previous} failed: {exc.failure.describe()}")
        return
    values = {r.op: r.value for r in results}
    check = HostReport(target.name)
    plan.read_probe(playbook, values["probe"], check)
    proof = check.gates[plan.GATE_ACCEPTANCE]
    if not proof.ok:
        report.diagnosis.append(
            f"rolled back to release {previous}, but it does not pass the probe either: {proof.detail}"
        )
        return
    # The previous release earned READY again on live traffic: record it, with the new server's pid.
    files = [
        {"path": f["path"], "remote_path": f["remote_path"], "sha256": f["sha256"]}
        for f in values["release_switch"]["files"]
    ]
    _write_ready(
        client, target, root, previous, {plan.GATE_ACCEPTANCE: proof.to_json()}, files, values["wait_health"]["pid"]
    )
    report.diagnosis.append(f"rolled back: release {previous} is current again, healthy and READY ({proof.detail})")


def _write_ready(
    client: AgentClient,
    target: Target,
    root: str,
    release: str,
    gates: dict[str, Any],
    files: list[dict[str, Any]],
    pid: int | None,
) -> None:
    client.batch(target, [plan.put_op(root, "ready.json", serving.ready_record(release, gates, files, pid))])


def _stopped_by_lint(
    playbook: Playbook, inventory: Inventory, targets: list[Target], release_id: str, problems: list[dflash.Problem]
) -> RunReport:
    now = time.time()
    errors = sum(p.severity == "error" for p in problems)
    detail = f"not attempted: the drafter config has {errors} lint errors (deploy stopped before touching any host)"
    hosts = [HostReport(t.name, gates={plan.GATE_LINT: Gate(False, detail)}) for t in targets]
    return RunReport("deploy", str(playbook.file), str(inventory.file), release_id, hosts, now, now, lint=problems)


Reader = Callable[[Playbook, dict[str, Any], HostReport], None]


def _read_only(
    kind: str,
    ops: list[dict[str, Any]],
    reader: Reader,
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: Progress,
) -> RunReport:
    """One batch per host that writes nothing; ``reader`` turns its answer into gates."""

    def work(client: AgentClient, target: Target, report: HostReport) -> None:
        values, failed = read_only_batch(client, target, ops, report)
        reader(playbook, values[ops[0]["op"]], report)
        read_checks(playbook, values, failed, report)

    return _run(kind, playbook, inventory, targets, options, progress, work)


def dry_run(
    playbook: Playbook, inventory: Inventory, targets: list[Target], options: RunOptions, progress: Progress
) -> RunReport:
    ops = plan.inspect_ops(playbook)
    return _read_only("dry-run", ops, plan.read_inspected, playbook, inventory, targets, options, progress)


def verify(
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: Progress,
    probe_acceptance: bool = False,
) -> RunReport:
    ops = plan.verify_ops(playbook, probe_acceptance)
    return _read_only("verify", ops, plan.read_verified, playbook, inventory, targets, options, progress)


def stop(
    playbook: Playbook, inventory: Inventory, targets: list[Target], options: RunOptions, progress: Progress
) -> RunReport:
    """End the server each target runs for this playbook (the one the agent started, by pid)."""
    root = playbook.deploy_root

    def work(client: AgentClient, target: Target, report: HostReport) -> None:
        lock = plan.lock_op(playbook, _owner(), options.lock_timeout)
        results = client.batch(target, [lock, {"op": "stop", "root": root}])
        _connected(report)
        pid = results[1].value.get("stopped")
        report.gates["stopped"] = Gate(True, f"server pid {pid} stopped" if pid else "no server was running")

    return _run("stop", playbook, inventory, targets, options, progress, work)


def rollback(
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: Progress,
    to_release: str | None = None,
) -> RunReport:
    """Make an earlier release current again (the previous one, or ``to_release``).

    With a server in the playbook, that release is started and proven as a deploy proves a new
    one: health, then acceptance on live traffic, then its READY record. If it fails, the release
    that was current comes back, started and proven again, and the host is reported not ready.
    """
    owner = _owner()
    root = playbook.deploy_root

    def switch_only(client: AgentClient, target: Target, report: HostReport) -> None:
        ops = plan.switch_ops(playbook, to_release, owner, options.lock_timeout)
        results = client.batch(target, ops, timeout=target.container.ssh.command_timeout + options.lock_timeout)
        _connected(report)
        plan.read_switched(results[1].value, report)

    def switch_and_serve(client: AgentClient, target: Target, report: HostReport) -> None:
        listing = client.batch(target, [{"op": "release_list", "root": root}])[0].value
        _connected(report)
        back = to_release or listing["previous"]
        if back is None:
            report.gates[plan.GATE_FILES] = Gate(False, "there is no previous release to go back to")
            return
        report.release_id, report.previous = back, listing["current"]
        _serve(client, playbook, target, report, back != listing["current"], owner, options)

    work = switch_and_serve if playbook.serving.target is not None else switch_only
    return _run("rollback", playbook, inventory, targets, options, progress, work, to_release)
