"""The run engine: units of one or several nodes, fanned out with isolation and a rollout policy.

Every run works on *units*. A single host is a unit of one node; a multi-node deployment (a
playbook with ``serving.multi_node``) is one unit of several nodes, rank 0 (the head) first. The
library decides which (``units_for``), so the same deploy, verify, rollback and stop (``runs``)
serve both; the steps that only a group has (one release on every node, the head's proof, ranks
alive, Ray) apply where a unit has more than one node. A failure on one node becomes that node's
failed gate, never an exception; a group's other nodes then fail its ``group`` gate, naming it.
"""

from __future__ import annotations

import contextlib
import getpass
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.config.inventory import Inventory, Target
from orchestrator.config.playbook import Playbook, Rollout
from orchestrator.connectors.base import Connector
from orchestrator.connectors.router import Connections
from orchestrator.engine.observer import Observer, Step, step_of
from orchestrator.engine.options import MAX_COUNT as MAX_COUNT
from orchestrator.engine.options import RELEASE_ID as RELEASE_ID
from orchestrator.engine.options import RELEASE_ID_RULE as RELEASE_ID_RULE
from orchestrator.engine.options import RunOptions as RunOptions
from orchestrator.engine.options import Stop as Stop
from orchestrator.engine.options import stop_reason as stop_reason
from orchestrator.errors import (
    AgentError,
    AgentProtocolError,
    GatewayError,
    InputError,
    LxdError,
    OrchestratorError,
    TransportError,
)
from orchestrator.results import (
    GATE_CONNECT,
    GATE_CONTAINERS,
    GATE_FILES,
    GATE_GATEWAY,
    GATE_GROUP,
    GATE_INTERRUPTED,
    GATE_ROLLOUT,
    Gate,
    HostReport,
    RunKind,
    RunReport,
)
from orchestrator.rules import plan, serving, startup
from orchestrator.rules.gates import gateway as gateway_gate
from orchestrator.rules.placement import Placement, place
from orchestrator.store.state import StateDB


@dataclass(frozen=True)
class Scope:
    """What one run is about and how it reaches its hosts: the playbook, the inventory, the targets
    chosen, the options, who watches, and the connector (None: SSH or local, as the inventory
    says; a test's or a library caller's own otherwise)."""

    playbook: Playbook
    inventory: Inventory
    targets: tuple[Target, ...]
    options: RunOptions = field(default_factory=RunOptions)
    observer: Observer = field(default_factory=Observer)
    connector: Connector | None = None
    store: StateDB | None = None  # where the speed-up gate's baselines are kept (None: none kept)


class Node:
    """One container of a unit: how to reach it, where its releases live, and its report."""

    def __init__(self, target: Target, rank: int, root: str) -> None:
        self.target = target  # with the address the containers gate discovered, once located
        self.rank = rank
        self.root = root
        self.report = HostReport(target.name)
        self.located = False
        self.staged: protocol.Applied | None = None  # this deploy's release_apply answer
        # The loader and engine checks running in the background since staging, collected
        # before the switch (or beside the launch, on a host where nothing serves).
        self.checks: protocol.ChecksStarted | None = None
        # The server we started runs this deploy's very command from its release: a launch keeps it
        # (None: not asked; False: the launch restarts it, and a gateway drains it first).
        self.keeps: bool | None = None
        self.pid: int | None = None  # the proven process its READY record names
        self.disturbed = False  # something of it was stopped or started: a failure must roll back
        self.drained = False  # taken out of the gateway's rotation by this run, not yet put back
        self.from_ready = False  # going back: started with the command its READY record was proven with
        self.kept = False  # the launch kept the server that ran (proven again in place, not restarted)
        # Where its server listens when not serving.port (a host with a standby alternates ports).
        self.port: int | None = None
        self.going_back = False  # a rollback: the standby of the release it goes back to is woken

    @property
    def name(self) -> str:
        """The node's container name."""
        return self.target.name


class Unit:
    """What one deployment runs on: one node, or a multi-node group with its head first."""

    def __init__(self, nodes: list[Node], placement: Placement | None) -> None:
        self.nodes = nodes
        self._placement = placement

    @property
    def head(self) -> Node:
        """The node that serves HTTP and is probed (the only one of a single host)."""
        return self.nodes[0]

    @property
    def single(self) -> bool:
        """Whether the unit is one host rather than a multi-node group."""
        return self._placement is None

    @property
    def ray(self) -> bool:
        """Whether the group runs vLLM over a Ray cluster."""
        return self._placement is not None and self._placement.multi.executor == "ray"

    @property
    def placement(self) -> Placement:
        """The group's placement, with the addresses the containers gate discovered."""
        assert self._placement is not None, "a single host has no placement"
        return self._placement.located({n.name: n.target for n in self.nodes})

    def role(self, node: Node) -> str:
        """What a node is in its unit, in the user's words (server, head, headless rank, Ray
        worker)."""
        if node.rank == 0:
            return "head" if not self.single else "server"
        return "Ray worker" if self.ray else "headless rank"

    def process(self, node: Node) -> str:
        """The supervised process a node's READY record names: vLLM, except on Ray workers."""
        return serving.RAY if self.ray and node.rank > 0 else serving.SERVER

    def each(self, work: Callable[[Node], object], gate: str, nodes: list[Node] | None = None) -> None:
        """``work(node)`` on every (or the given) node at once, failures as that node's gates."""
        chosen = self.nodes if nodes is None else nodes
        if len(chosen) == 1:
            guarded(chosen[0].report, lambda: work(chosen[0]), gate)
            return
        with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
            list(pool.map(lambda n: guarded(n.report, lambda: work(n), gate), chosen))

    def failed(self) -> list[str]:
        """Nodes with a failed gate of their own (a node with no gates yet has not failed)."""
        return [n.name for n in self.nodes if n.report.failed_gate is not None]

    def fail_others(self, because: list[str], what: str) -> None:
        """Every node that did not fail itself fails the group gate, naming the nodes that did."""
        if self.single or not because:
            return
        reports = {n.name: n.report for n in self.nodes}
        named = "; ".join(f"{n} failed its {reports[n].failed_gate} gate" for n in because)
        for node in self.nodes:
            if node.name not in because:
                node.report.gates[GATE_GROUP] = Gate(False, f"{what}: {named}")

    def again(self) -> Unit:
        """The same nodes, reached the same way, with fresh reports: a second start (going back)
        is judged apart, so that the first attempt's failed gates stay as they were."""
        nodes = []
        for old in self.nodes:
            node = Node(old.target, old.rank, old.root)
            node.located = old.located
            nodes.append(node)
        return Unit(nodes, self._placement)


def units_for(playbook: Playbook, inventory: Inventory, targets: list[Target], grouped: bool = True) -> list[Unit]:
    """One unit per host, or one unit for a multi-node deployment's group (placement checked).
    ``grouped=False``: every host on its own, for runs that only look (the dry run)."""
    if grouped and playbook.serving.multi_node is not None:
        group = place(playbook, inventory, targets)
        nodes = [Node(t, rank, serving.deploy_root(playbook, t.container)) for rank, t in enumerate(group.nodes)]
        return [Unit(nodes, group)]
    return [Unit([Node(t, 0, serving.deploy_root(playbook, t.container))], None) for t in targets]


def guarded(report: HostReport, work: Callable[[], object], gate: str = GATE_FILES) -> None:
    """Run one node's work; what goes wrong becomes that node's failed gate, never an exception."""
    try:
        work()
    except TransportError as exc:
        report.gates[GATE_CONNECT] = Gate(False, exc.message)
    except AgentError as exc:
        report.gates.setdefault(GATE_CONNECT, Gate(True, "connected"))
        report.gates[gate] = Gate(False, exc.failure.describe())
    except AgentProtocolError as exc:
        # An answer that cannot be read fails the gate of the op it was for, when one op's was.
        report.gates.setdefault(GATE_CONNECT, Gate(True, "connected"))
        report.gates[exc.gate or gate] = Gate(False, str(exc).split(": ", 1)[-1])
    except GatewayError as exc:
        report.gates[GATE_GATEWAY] = Gate(False, str(exc))
    except OrchestratorError as exc:
        report.gates[gate] = Gate(False, str(exc))


class ContainerGate:
    """The ``containers`` gate: each LXD-managed container made right (deploy) or checked (others).

    One ``LxdHost`` per GPU host, opened on first use and shared by that host's containers; a
    host whose LXD cannot be reached fails each of its containers with the same message.
    """

    def __init__(
        self, inventory: Inventory, playbook: Playbook, ensure: bool, skip: bool, running_only: bool = False
    ) -> None:
        self.inventory = inventory
        self.playbook = playbook
        self.ensure = ensure
        self.skip = skip
        # a stop needs only the container running: its disks and limits are what a deploy makes
        # right (a stop of another playbook's server failed on the disks it never reads)
        self.running_only = running_only
        self._hosts: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _host(self, name: str) -> Any:
        from orchestrator.lxd.host import LxdHost  # pylxd is imported only when a host uses LXD

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
        """The target to reach (with a discovered address), or None when it cannot be."""
        container = target.container
        if container.lxd is None:
            return target
        if self.skip:
            report.gates[GATE_CONTAINERS] = Gate(True, "not checked (--skip-containers)")
            return target
        started = time.monotonic()
        try:
            from orchestrator.lxd.containers import spec_for  # SSH-only runs never load the LXD layer

            host = self._host(container.host)
            spec = spec_for(container, self.playbook.disks)
            result = host.ensure(spec) if self.ensure else host.inspect(spec)
        except LxdError as exc:
            report.gates[GATE_CONTAINERS] = Gate(False, exc.message)
            return None
        report.container = {
            "status": result.status.lower(),
            "address": result.address,
            "actions": result.actions,
            "drift": [{"key": d.key, "expected": d.expected, "actual": d.actual} for d in result.drift],
        }
        seconds = round(time.monotonic() - started, 2)
        if self.running_only and not result.ok and result.status == "Running":
            detail = f"running; {result.detail} (a deploy makes it right: a stop needs only the container running)"
            report.gates[GATE_CONTAINERS] = Gate(True, detail, {"seconds": seconds})
        else:
            report.gates[GATE_CONTAINERS] = Gate(result.ok, result.detail, {"seconds": seconds})
        if result.status != "Running":
            return None
        if container.address is None:
            return target.at(result.address) if result.address else None
        return target


@dataclass
class Run:
    """What every step of one run shares: the playbook, options, one agent client, the containers gate."""

    playbook: Playbook
    inventory: Inventory
    options: RunOptions
    client: AgentClient
    containers: ContainerGate
    observer: Observer = field(default_factory=Observer)
    owner: str = field(default_factory=lambda: f"{getpass.getuser()}@{socket.gethostname()}")
    # What several nodes share and is done once for all of them (a model pushed to a GPU host
    # whose containers mount it): key -> the outcome, under its own lock.
    once: dict[Any, Any] = field(default_factory=dict)
    once_lock: threading.Lock = field(default_factory=threading.Lock)
    gateway: Any = None  # gateway.GatewayClient: the router or load balancer in front, when the playbook has one
    store: StateDB | None = None  # the speed-up gate's baselines
    # The canary batch's hosts, once the rollout has one (only a canary measures speed-up), and
    # what each canary's speed-up gate found, by baseline key: the later hosts of one key hold it.
    canaries: frozenset[str] = frozenset()
    speedups: dict[str, tuple[str, Gate]] = field(default_factory=dict)

    def locate(self, node: Node) -> bool:
        """The containers gate, once per node per run; False when the node cannot be reached."""
        if not node.located:
            if node.target.container.lxd is not None and not self.containers.skip:
                self.step(node, "checking its container")
            reachable = self.containers.locate(node.target, node.report)
            if reachable is None:
                return False
            node.target, node.located = reachable, True
        return True

    def batch(self, node: Node, ops: list[protocol.Op[Any]]) -> protocol.Answers:
        """One round trip to a node; it answered, so it is connected."""
        bounds = {op.name: op.budget_s for op in ops}
        events = (
            (lambda e: self.observer.step(step_of(node.name, e, bounds.get(e.op)))) if self.observer.watching else None
        )
        answers = self.client.batch(node.target, ops, events=events)
        node.report.gates.setdefault(GATE_CONNECT, Gate(True, "connected"))
        return answers

    def step(self, node: Node | str, what: str, detail: str = "") -> None:
        """Say what a node is doing now (the controller's own steps: the agent's come as events)."""
        self.observer.step(Step(node if isinstance(node, str) else node.name, what, detail))

    def note(self, unit: Unit, message: str) -> None:
        """Progress of a group's steps (a single host's one line per host says enough)."""
        if not unit.single:
            self.observer.say(f"group: {message}")

    def say(self, message: str) -> None:
        """A line about the run as a whole (a push's progress)."""
        self.observer.say(message)

    def lock(self, node: Node) -> protocol.Op[protocol.Locked]:
        """The deploy-root lock op for a node, owned by this run and waiting at most --lock-timeout."""
        return protocol.lock(node.root, self.owner, self.options.lock_timeout)


Work = Callable[[Run, Unit], None]


# How often the main thread wakes while hosts are in flight. A Ctrl-C may be delivered to any
# thread of the process; Python runs its handler only in the main thread, and only once that
# thread executes again: blocked in a plain wait for a host, it would take the interrupt when the
# host finished (minutes, on a lock or a model load).
_WAKE_S = 0.2


def finish(submitted: Iterable[Future[Any]]) -> None:
    """Wait for every future, waking every ``_WAKE_S`` so that a signal handler can run."""
    pending = set(submitted)
    while pending:
        done, pending = wait(pending, timeout=_WAKE_S, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()


def _gateway_answers(run: Run, units: list[Unit], reports: list[HostReport]) -> bool:
    """The gateway is asked first, before any host is touched: one that cannot be reached or
    refuses stops the run with its words, and nothing is left drained."""
    from orchestrator.gateways.client import GatewayClient, gateway_target  # only runs with a gateway need it

    try:
        run.gateway = GatewayClient(run.playbook, gateway_target(run.playbook, run.inventory), run.client)
        run.observer.say(f"asking the {run.playbook.gateway.kind} gateway on {run.gateway.target.name}")  # type: ignore[union-attr]
        servers = []
        for unit in units:  # the command hook is asked of each server it will be told about
            with contextlib.suppress(InputError):  # an address LXD gives only once it is located
                servers.append(run.gateway.server(unit.head.target.container))
        run.gateway.rotation(servers)
        run.gateway.fleet = servers
    except (GatewayError, InputError, TransportError, AgentProtocolError) as exc:
        for report in reports:
            report.gates[GATE_GATEWAY] = Gate(
                False, f"the gateway: {exc}: no host was touched", reason=gateway_gate.UNREACHABLE
            )
            run.observer.host_done(report)
        return False
    return True


def execute(
    kind: RunKind,
    scope: Scope,
    units: list[Unit],
    work: Work,
    release_id: str | None = None,
    rollout: Rollout | None = None,
    after_canary: Callable[[Run, list[Unit]], str | None] | None = None,
) -> RunReport:
    """Run ``work`` on every unit, at most ``forks`` at once, batch by batch per the rollout;
    ``after_canary``: run on the canary batch once it is done, saying why the rollout stops (or None)."""
    playbook, inventory, options, observer = scope.playbook, scope.inventory, scope.options, scope.observer
    reports = [n.report for u in units for n in u.nodes]
    run_report = RunReport(kind, str(playbook.file), str(inventory.file), release_id, reports, time.time())
    with Connections(inventory, options.accept_new_host_keys, options.retry, scope.connector) as connections:
        run = Run(
            playbook,
            inventory,
            options,
            AgentClient(connections, options.key()),
            ContainerGate(
                inventory,
                playbook,
                ensure=kind is RunKind.DEPLOY,
                skip=options.skip_containers,
                running_only=kind is RunKind.STOP,
            ),
            observer,
            store=scope.store,
        )
        asks_gateway = playbook.gateway is not None and playbook.serving.target is not None and kind != "dry-run"
        if asks_gateway and not _gateway_answers(run, units, reports):
            run_report.finished = time.time()
            return run_report

        def one(unit: Unit) -> None:
            if options.interrupt.is_set():
                why = stop_reason(options.interrupt) or "the run was interrupted"
                for node in unit.nodes:
                    node.report.gates[GATE_INTERRUPTED] = Gate(False, f"not started: {why}")
                    observer.host_done(node.report)
                return
            started = time.monotonic()
            for node in unit.nodes:
                observer.host_started(node.report)
            guarded(unit.head.report, lambda: work(run, unit))
            for node in unit.nodes:
                node.report.duration_s = time.monotonic() - started
                gates = {name: g.to_json() for name, g in node.report.gates.items()}
                node.report.time = startup.time_split(node.report.duration_s, gates, node.report.rollback_gates)
                node.report.ssh = connections.counters(node.name).to_json()
                observer.host_done(node.report)

        by_name = {u.head.name: u for u in units}
        budget = rollout.max_failures if rollout and (rollout.canary or rollout.batch_size) else None
        batches = (
            plan.rollout_batches(list(by_name), rollout.canary, rollout.batch_size) if rollout else [list(by_name)]
        )
        if rollout and rollout.canary:
            run.canaries = frozenset(batches[0])
            if after_canary is not None and len(batches) == 1:
                # the bake guards the hosts after the canary: none in this run (a --limit, or as
                # many hosts as the canary), so none runs, and the run says so
                run.say(
                    f"no bake: every host of this run ({len(batches[0])}) is in the canary batch "
                    f"(rollout.canary {rollout.canary}), so none comes after it to guard"
                )
        failures = 0
        pool = ThreadPoolExecutor(max_workers=max(1, options.forks))
        try:
            for index, batch in enumerate(batches):
                # an interrupted run names its hosts not started as interrupted (the budget did not stop them)
                if budget is not None and failures > budget and not options.interrupt.is_set():
                    for unit in (by_name[n] for b in batches[index:] for n in b):
                        for node in unit.nodes:
                            node.report.gates[GATE_ROLLOUT] = Gate(
                                False,
                                f"not attempted: {failures} hosts failed, over the rollout's max_failures {budget}",
                            )
                    break
                finish(pool.submit(one, by_name[n]) for n in batch)
                stopped = None
                if index == 0 and rollout and rollout.canary and after_canary is not None and len(batches) > 1:
                    stopped = after_canary(run, [by_name[n] for n in batch])
                failures += sum(
                    not n.report.ready and n.report.failed_gate != GATE_INTERRUPTED
                    for name in batch
                    for n in by_name[name].nodes
                )
                if stopped is not None:
                    for unit in (by_name[n] for b in batches[index + 1 :] for n in b):
                        for node in unit.nodes:
                            node.report.gates[GATE_ROLLOUT] = Gate(False, f"not attempted: {stopped}")
                    break
        except BaseException:
            # A second Ctrl-C: stop waiting. Hosts in flight end at their own deadlines, and each
            # step on a host is atomic, so the next run finds every host consistent.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        run_report.accepted_host_keys = connections.accepted_host_keys
    run_report.finished = time.time()
    return run_report
