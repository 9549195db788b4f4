"""The library's entry point: a playbook over an inventory, and the runs a user asks of it.

    from orchestrator import Deployment, load_inventory, load_playbook

    deployment = Deployment(load_playbook("playbooks/sandbox.yaml"), load_inventory("inventory/x.yaml"))
    report = deployment.deploy()          # a RunReport: every host's gates, READY or why not
    assert report.ok, [h.failed_gate for h in report.hosts]
    deployment.verify(probe=True)

The CLI is a thin shell over this class; anything it does, a program can do the same way. Progress
goes to an ``Observer`` (none by default: a library run is quiet), and the hosts are reached
through the inventory's connections (SSH, or ``connection: local``) unless a ``connector`` is
given: a test's ``connectors.fake.FakeConnector``, say, which answers the agent's ops in memory.

Given a ``store`` (``StateDB``), a run does what ``orchestrate`` does with it: the store must
take a record before any host is touched, a run that changes what hosts serve holds its targets'
rollout lease (waiting up to ``options.lock_timeout`` for another controller, naming it), and
the run is recorded. A watcher of such a deployment leads its watch group or follows it.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from orchestrator.config.inventory import Inventory, Target
from orchestrator.config.playbook import Playbook, max_num_seqs
from orchestrator.connectors.base import Connector
from orchestrator.engine import runs
from orchestrator.engine.observer import Observer
from orchestrator.engine.runner import RELEASE_ID, RELEASE_ID_RULE, RunOptions, Scope, Stop, stop_reason
from orchestrator.errors import InputError, LeaseWaitStopped, StateError
from orchestrator.results import GATE_INTERRUPTED, Gate, HostReport, RunKind, RunReport
from orchestrator.rules.plan import new_release_id

if TYPE_CHECKING:
    from orchestrator.engine.watcher import RollBack, Watcher
    from orchestrator.rules.watch import Transition
    from orchestrator.store.state import Holder, StateDB


def select_targets(playbook: Playbook, inventory: Inventory, limit: Sequence[str] = ()) -> list[Target]:
    """The containers a run works on: the playbook's targets, within ``limit`` (container, group or
    GPU host names, or ``all``) when given. None selected is bad input, never a run of nothing."""
    multi = playbook.serving.multi_node
    try:
        chosen = inventory.resolve(playbook.targets)
    except InputError as exc:
        if multi is None or playbook.targets != multi.nodes:
            raise
        raise multi.error(f"{exc.message} (nodes and targets name containers or groups of the inventory)") from None
    if limit:
        limited = {t.name for t in inventory.resolve(list(limit))}
        chosen = [t for t in chosen if t.name in limited]
    if not chosen:
        raise InputError("no targets: the playbook's targets and --limit select no container")
    local: dict[str, str] = {}
    for target in chosen:
        _check_root(playbook, inventory, target)
        if target.container.on_this_machine:
            # Two local containers on one deploy root would be one server, READY twice.
            root = target.container.deploy_root or playbook.deploy_root
            other = local.setdefault(root, target.name)
            if other != target.name:
                raise InputError(
                    f"containers {other} and {target.name} are both this machine with deploy root {root}: "
                    "one place cannot be two containers",
                    file=str(inventory.file),
                    key=f"hosts.{target.container.host}.containers.{target.name}.deploy_root",
                )
    return chosen


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _check_root(playbook: Playbook, inventory: Inventory, target: Target) -> None:
    """A deploy root apart from the model directories: inside one, each release would be a file of
    the model (hashed, and nested in the next release's overlay); around one, pruning releases
    would walk the weights."""
    container = target.container
    root = container.deploy_root or playbook.deploy_root
    for model in playbook.models.all:
        if _within(root, model.path) or _within(model.path, root):
            message = f"{root} overlaps models.{model.role}.path {model.path} (a deploy root is a directory of its own)"
            if container.deploy_root:
                key = f"hosts.{container.host}.containers.{container.name}.deploy_root"
                raise InputError(message, file=str(inventory.file), key=key)
            raise InputError(message, file=str(playbook.file), key="deploy_root")


# How long the state database has to answer a run's write: a store that stops answering (a
# server stopped, a network cut without a reset) held the controller for ever, after the hosts
# had changed, with nothing said.
STORE_ANSWER_S = 120.0


def _answered(write: Callable[[], object], store: StateDB, what: str) -> None:
    """``write`` to the store, or StateError once it has not answered in ``STORE_ANSWER_S`` (its
    thread is left to end with the process: a blocked read cannot be interrupted)."""
    failed: list[BaseException] = []

    def call() -> None:
        try:
            write()
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    worker = threading.Thread(target=call, name="state-write", daemon=True)
    worker.start()
    worker.join(STORE_ANSWER_S)
    if worker.is_alive():
        store.abandon()  # the thread still uses the connection: never closed under it
        raise StateError(f"state database {store.where} did not {what} in {STORE_ANSWER_S:g} s")
    if failed:
        raise failed[0]


@dataclass
class Deployment:
    """A playbook deployed to its targets in an inventory: ``deploy``, ``verify``, ``rollback``,
    ``stop`` and ``dry_run``, each returning the run's report (they raise only for bad input: a
    host that fails is a failed gate in the report, never an exception)."""

    playbook: Playbook
    inventory: Inventory
    options: RunOptions = field(default_factory=RunOptions)
    observer: Observer = field(default_factory=Observer)
    connector: Connector | None = None
    limit: Sequence[str] = ()
    store: StateDB | None = None
    targets: tuple[Target, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.targets = tuple(select_targets(self.playbook, self.inventory, self.limit))
        if self.playbook.gateway is not None:
            from orchestrator.gateways.client import check_servers, gateway_target

            gateway_target(self.playbook, self.inventory)  # a gateway the inventory cannot reach is bad input
            check_servers(self.playbook, select_targets(self.playbook, self.inventory, ()))

    @property
    def scope(self) -> Scope:
        """What every run of this deployment works with."""
        return self._scope(self.options)

    def _scope(self, options: RunOptions) -> Scope:
        playbook = self._observed_levels(self.playbook)
        return Scope(playbook, self.inventory, self.targets, options, self.observer, self.connector, self.store)

    def _observed_levels(self, playbook: Playbook) -> Playbook:
        """``gates.speedup.concurrency: observed``: the levels taken now from the load watch
        recorded of every target's server (not only those this run limits itself to)."""
        gate = playbook.gates.speedup
        if gate is None or not gate.observed:
            return playbook
        from orchestrator.rules.gates import speedup

        levels: tuple[int, ...] = ()
        if self.store is None:
            why = (
                "no load was observed: concurrency: observed reads the load watch recorded in the state store, "
                "and this run has none (--state)"
            )
        else:
            hosts = [t.name for t in select_targets(playbook, self.inventory, ())]
            try:
                samples = self.store.observed_load(hosts, time.time() - speedup.OBSERVED_DAYS * 86400)
            except StateError as exc:
                samples, why = [], f"no load was observed: the state store could not be read ({exc})"
            else:
                levels, why = speedup.observed_levels(samples, max_num_seqs(playbook.serving))
        observed = replace(gate, concurrency=levels, observed_from=why)
        return replace(playbook, gates=replace(playbook.gates, speedup=observed))

    def deploy(self) -> RunReport:
        """Lint, push and check the release on every target, start the server and prove it (health,
        acceptance on live traffic): READY, or the previous release back where it was."""
        # Named before the lease is asked for, so that a controller kept waiting names it too.
        options = replace(self.options, release_id=self.options.release_id or new_release_id())
        return self._run(RunKind.DEPLOY, lambda: runs.deploy(self._scope(options)), f"release {options.release_id}")

    def verify(
        self, *, probe: bool = False, rehash: bool = False, engine: bool = False, speedup: bool = False
    ) -> RunReport:
        """Read what every target serves and check it (never writes). ``probe``: prove acceptance
        again on live traffic; ``rehash``: hash every model file instead of trusting the cache;
        ``engine``: the installed vLLM's verdict on the served command (the engine gate);
        ``speedup``: the speed-up gate's drafter arm again, against the baseline in ``store``."""
        return self._run(
            RunKind.VERIFY,
            lambda: runs.verify(self.scope, probe_acceptance=probe, rehash=rehash, engine=engine, speedup=speedup),
        )

    def rollback(self, *, to: str | None = None) -> RunReport:
        """Make the previous release (or ``to``) current again, started and proven like a deploy."""
        if to is not None and not (isinstance(to, str) and RELEASE_ID.fullmatch(to)):
            raise InputError(f"{to!r}: {RELEASE_ID_RULE}", key="rollback to")
        return self._run(RunKind.ROLLBACK, lambda: runs.rollback(self.scope, to_release=to), f"to {to}" if to else "")

    def stop(self) -> RunReport:
        """End the servers (vLLM, and Ray) this playbook runs, checking nothing of them is left."""
        return self._run(RunKind.STOP, lambda: runs.stop(self.scope))

    def dry_run(self) -> RunReport:
        """What a deploy would change on every target, with diffs of text files; writes nothing."""
        return self._run(RunKind.DRY_RUN, lambda: runs.dry_run(self.scope))

    @property
    def watch_group(self) -> str:
        """The watch group these targets' watchers join by default: the playbook's name and a
        digest of the hosts it watches. By name alone, a second playbook of that name (another
        team's, other hosts) joined the first one's group, and as its follower never recorded or
        paged anything."""
        hosts = "\n".join(sorted(t.name for t in self.targets))
        return f"{self.playbook.name}@{hashlib.sha256(hosts.encode()).hexdigest()[:8]}"

    def watcher(self, group: str | None = None, on_change: Callable[[Transition], None] | None = None) -> Watcher:
        """Rounds that keep proving every target (``Watcher.round``); close it when done. With a
        store, the watcher joins the watch ``group`` (default: ``watch_group``): the one that
        leads records each round and tells its changes (``on_change``), a follower takes the lead
        when the leader stops and tells what it finds unrecorded."""
        from orchestrator.engine.watcher import Watcher, WatchGroup

        joined = None
        if self.store is not None:
            joined = WatchGroup(self.store, group or self.watch_group, self.observer.say)
        return Watcher(self.scope, joined, on_change)

    def rollbacks(self, after: int, watcher: Watcher | None = None) -> RollBack:
        """For a watch that rolls back (``RollBack``): each host DEGRADED for ``after`` rounds in
        a row rolled back on its own, as ``rollback`` with ``limit`` that host would. Given the
        ``watcher``, its later rounds of a host rolled back say so first."""
        from orchestrator.engine.watcher import RollBack

        if self.playbook.serving.multi_node is not None:
            raise InputError("--rollback-on rolls back one host at a time: a multi_node group is rolled back whole")
        if self.playbook.serving.target is None:
            raise InputError("--rollback-on rolls back a server: the playbook serves none (serving.target)")

        def roll_back(host: str) -> RunReport:
            return replace(self, limit=(host,)).rollback()

        return RollBack(roll_back, after, self.observer.say, watcher)

    def _run(self, kind: RunKind, work: Callable[[], RunReport], detail: str = "") -> RunReport:
        store = self.store
        if store is not None:
            # the record must be possible before any host changes
            _answered(store.check_writable, store, "take the run's first write")
        try:
            with self._lease(kind, detail):
                hosts = len(self.targets)
                forks = min(self.options.forks, hosts)
                self.observer.say(f"{kind} {self.playbook.name}: {hosts} host{'s' * (hosts != 1)}, {forks} at once")
                report = work()
        except LeaseWaitStopped as stopped:
            # A Ctrl-C while another controller held the lease: no host was touched. The run ends
            # as any interrupted run does, each host named, recorded (it said "aborted", unrecorded).
            report = RunReport(kind, str(self.playbook.file), str(self.inventory.file), None, [], time.time())
            for target in self.targets:
                host = HostReport(target.name)
                host.gates[GATE_INTERRUPTED] = Gate(False, f"not started: {stopped}")
                report.hosts.append(host)
                self.observer.host_done(host)
            report.finished = time.time()
        report.interrupted = self.options.interrupt.is_set() and stop_reason(self.options.interrupt) is None
        if store is not None:
            try:
                _answered(lambda: store.record(report), store, "take the run's record")
            except StateError as exc:
                # What the hosts did stands: the report is returned, and the loss of its record said.
                self.observer.say(f"error: the run was not recorded: {exc}")
        return report

    def _lease(self, kind: RunKind, detail: str) -> contextlib.AbstractContextManager[None]:
        """The fleet-wide rollout lease of the targets, for the runs that change what hosts serve
        (on a shared PostgreSQL store; verify and dry-run only read, and go on beside them)."""
        if self.store is None or not kind.rolls_out:
            return contextlib.nullcontext()
        timeout = self.options.lock_timeout

        def waiting(name: str, holder: Holder | None) -> None:
            who = holder.describe() if holder else "a controller that left no record"
            self.observer.say(f"waiting for {name}: {who} is rolling it out (up to {timeout:g} s)")

        def lost(why: str) -> None:
            # The hosts in flight finish their steps (each atomic); none starts after them.
            self.observer.say(f"error: {why}: starting no new host")
            stop = self.options.interrupt
            stop.halt(why) if isinstance(stop, Stop) else stop.set()

        run = " ".join(filter(None, (str(kind), self.playbook.name, detail)))
        names = [t.name for t in self.targets]
        return self.store.rollout_lock(
            names, run, timeout, waiting, self.options.interrupt, lost, lambda why: self.observer.say(f"error: {why}")
        )
