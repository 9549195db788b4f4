"""``orchestrate watch``: rounds over every node, each over a session kept for the watch's life.

Each node keeps one connection and one agent process (``agent.client.AgentSession``): a round is one
framed request and answer on that channel, with no SSH handshake or interpreter start. A session
that fails is closed and opened again at the next round after a backoff (1, 2, 4 ... 60 s); until
then the node is reported DOWN with why, never skipped. What the rounds mean is ``watch``'s.

Watchers of one playbook share the work as a group (``WatchGroup``): each runs its rounds, the
lead records them and tells their changes, and a follower takes the lead when the leader stops.
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient, AgentSession
from orchestrator.config.inventory import Target
from orchestrator.connectors.router import Connections
from orchestrator.engine.runner import ContainerGate, Node, Scope, Unit, finish, units_for
from orchestrator.errors import AgentError, AgentProtocolError, OrchestratorError, StateError, TransportError
from orchestrator.results import GATE_FILES, HostReport, RunReport
from orchestrator.rules import plan, probe, serving
from orchestrator.rules.watch import READY, HostWatch, Round, Seen, Transition, changed_fields, step, to_roll_back

if TYPE_CHECKING:
    from orchestrator.store.state import StateDB

BACKOFF_MAX_S = 60.0
ON_CHANGE_TIMEOUT_S = 30.0


@dataclass
class _Watched:
    node: Node
    unit: Unit
    session: AgentSession | None = None
    host: HostWatch = field(init=False)
    inventory_target: Target = field(init=False)
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    # A round's checks, kept while what they are built from stays the same (they are the same
    # every round: building them again was a tenth of a served round's CPU).
    checks: tuple[tuple[Any, ...], plan.ServedChecks, protocol.Op[str] | None, list[protocol.Op[Any]]] | None = None

    def __post_init__(self) -> None:
        self.host = HostWatch(self.node.name)
        self.inventory_target = self.node.target  # as the inventory gives it (the address found later)


class WatchGroup:
    """The watchers of one group sharing the work. Every watcher runs its rounds and serves its
    metrics; the lead (one at a time, ``WatchLead``) records each round and tells its changes; a
    watcher that takes the lead from one that stopped tells, once, each host whose recorded state
    is not what it sees now (a change the other saw and could not record, or never saw)."""

    def __init__(self, db: StateDB, name: str, say: Callable[[str], None]) -> None:
        self.db, self.name, self.say = db, name, say
        self.lead = db.watch_lead(name)
        self.rounds = 0
        self._unrecorded: list[str] = []

    @property
    def leading(self) -> bool:
        return self.lead.leading

    def after(self, rounds: list[Round], transitions: list[Transition]) -> list[Transition]:
        """After a round: lead or follow, and record the round when leading; the changes to tell
        (none for a follower: its lead tells them)."""
        self.rounds += 1
        was, blind = self.lead.leading, self.lead.unreachable
        leading = self.lead.poll()
        told = transitions
        if not leading and self.lead.unreachable is not None:
            # Nobody can say who leads while the store is down: every watcher that cannot reach it
            # tells its changes itself (twice, maybe, rather than by none: each used to say another
            # watcher did, and nothing was paged); nothing can be recorded.
            if blind is None:
                self.say(
                    f"error: watch group {self.name}: the state store cannot be reached ({self.lead.unreachable}): "
                    "running --on-change for every change this watcher sees, unrecorded, until it can"
                )
            return transitions
        if blind is not None and not leading:
            self.say(f"watch group {self.name}: the state store answers again")
        if leading and not was:
            if self.rounds > 1:
                told = transitions + self._caught_up(rounds, transitions)
                self.say(f"watch group {self.name}: taking the lead (the leader stopped); {len(told)} changes to tell")
            else:
                self.say(f"watch group {self.name}: leading")
        elif not leading and (was or self.rounds == 1):
            holder = self.lead.holder()
            who = holder.describe() if holder else "another watcher"
            self.say(f"watch group {self.name}: following {who}: it records the changes and runs --on-change")
        if not leading:
            return []
        # Watching outlives its own bookkeeping: a store that is full or locked is said (once per
        # kind of failure, and again when it recovers) while the rounds and their changes go on.
        try:
            self.db.record_watch(told, rounds)
        except StateError as exc:
            if str(exc) not in self._unrecorded:
                self.say(f"error: watch round {self.rounds} was not recorded (watching goes on): {exc}")
                self._unrecorded.append(str(exc))
        else:
            if self._unrecorded:
                self.say(f"watch round {self.rounds} recorded again")
                self._unrecorded.clear()
        return told

    def _caught_up(self, rounds: list[Round], transitions: list[Transition]) -> list[Transition]:
        try:
            recorded = self.db.last_states()
        except StateError:
            return []
        seen = {t.host for t in transitions}
        return [
            Transition(r.host, r.at, recorded.get(r.host), r.state, r)
            for r in rounds
            if r.host not in seen and recorded.get(r.host) != r.state
        ]

    def close(self) -> None:
        """Give the lead up (a follower takes it at its next round)."""
        self.lead.close()


class Watcher:
    """Every node of a playbook, watched round after round. Not thread-safe: one caller. In a
    ``group``, the lead's rounds are recorded; whoever leads (a watcher alone always does) tells
    each change to ``on_change``, except the first sight of a host that is READY."""

    def __init__(
        self,
        scope: Scope,
        group: WatchGroup | None = None,
        on_change: Callable[[Transition], None] | None = None,
    ) -> None:
        self.group, self.on_change = group, on_change
        playbook, inventory, options = scope.playbook, scope.inventory, scope.options
        self.playbook, self.options = playbook, options
        self.connections = Connections(inventory, options.accept_new_host_keys, options.retry, scope.connector)
        self.key = options.key()
        self.containers = ContainerGate(inventory, playbook, ensure=False, skip=options.skip_containers)
        self.watched = [_Watched(n, u) for u in units_for(playbook, inventory, list(scope.targets)) for n in u.nodes]
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(options.forks, len(self.watched))))
        self._gateway: Any = None  # gateway.GatewayClient, made on the first round that needs it
        self.went_back: dict[str, str] = {}  # host -> what this watch's rollback did (RollBack)

    def round(self) -> tuple[list[Round], list[Transition]]:
        """One round over every node at once: each node's round, and the transitions it showed."""
        futures = [self._pool.submit(self._observe, w) for w in self.watched]
        finish(futures)  # wakes for signals: a Ctrl-C may land on any thread
        seen = [f.result() for f in futures]
        down = {w.node.name for w, s in zip(self.watched, seen, strict=True) if s.down}
        for i, w in enumerate(self.watched):
            if not w.unit.single:
                others = tuple(n.name for n in w.unit.nodes if n.name in down and n.name != w.node.name)
                if others:
                    seen[i] = replace(seen[i], group_down=others)
        if self.playbook.gateway is not None:
            seen = self._rotation(seen)
        seen = [
            replace(s, went_back=self.went_back[w.node.name]) if w.node.name in self.went_back else s
            for w, s in zip(self.watched, seen, strict=True)
        ]
        rounds, transitions = [], []
        for w, s in zip(self.watched, seen, strict=True):
            w.host, rnd, change = step(w.host, s, self.playbook.gates.live)
            rounds.append(rnd)
            if change is not None:
                transitions.append(change)
        told = self.group.after(rounds, transitions) if self.group is not None else transitions
        failed: list[Exception] = []
        for change in told:
            # A watch that starts does not page for hosts that are fine.
            if self.on_change is not None and (change.before is not None or change.after != READY):
                try:
                    self.on_change(change)
                except Exception as exc:  # the caller's: the round's other changes are told all the same
                    failed.append(exc)
        if failed:
            if len(failed) > 1:
                failed[0].add_note(f"on_change raised for {len(failed)} of this round's changes; every one was told")
            raise failed[0]
        return rounds, transitions

    @property
    def leading(self) -> bool:
        """Whether this watcher records and tells (alone, it does)."""
        return self.group is None or self.group.leading

    def _rotation(self, seen: list[Seen]) -> list[Seen]:
        """The gateway's rotation, read once a round from its host, on every head's round."""
        from orchestrator.gateways.client import GatewayClient, gateway_target

        heads = [(i, w) for i, w in enumerate(self.watched) if w.node.rank == 0]
        try:
            if self._gateway is None:
                target = gateway_target(self.playbook, self.connections.inventory)
                self._gateway = GatewayClient(self.playbook, target, AgentClient(self.connections, self.key))
            servers = {i: self._gateway.server(w.node.target.container) for i, w in heads}
            rotation = self._gateway.rotation(list(servers.values()))
        except OrchestratorError as exc:
            return [
                replace(s, rotation_status=f"cannot be read: {exc}") if i in dict(heads) else s
                for i, s in enumerate(seen)
            ]
        out = list(seen)
        for i, server in servers.items():
            member = rotation.of(server)
            out[i] = replace(out[i], in_rotation=member.in_rotation, rotation_status=member.status)
        return out

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        for w in self.watched:
            if w.session is not None:
                w.session.close()
        self.connections.close()
        if self.group is not None:
            self.group.close()

    # --- one node ------------------------------------------------------------------------

    def _observe(self, w: _Watched) -> Seen:
        now = time.time()
        if w.session is None or not w.session.is_open:
            if time.monotonic() < w.retry_at:
                wait = w.retry_at - time.monotonic()
                return Seen(now, error=f"{w.last_error} (trying again in {wait:.0f} s)")
            try:
                self._open(w)
            except OrchestratorError as exc:
                return self._failed(w, now, _message(exc))
            fresh = True
        else:
            fresh = False
        try:
            return self._read(w, now)
        except (TransportError, AgentProtocolError) as exc:
            if fresh:
                return self._failed(w, now, _message(exc))
            lost = _message(exc)
        # A session that answered before and failed now (a dropped connection, an agent that was
        # killed): one fresh session at once, so that a blip costs no round; said either way.
        try:
            self._open(w)
            return replace(self._read(w, now), notes=(f"reconnected ({lost})",))
        except OrchestratorError as exc:
            return self._failed(w, now, f"{_message(exc)} (after: {lost})")

    def _open(self, w: _Watched) -> None:
        node = w.node
        if not node.located:
            report = HostReport(node.name)
            found = self.containers.locate(w.inventory_target, report)
            if found is None:
                failed = report.failed_gate
                raise TransportError(node.name, report.gates[failed].detail if failed else "container not running")
            node.target, node.located = found, True
        w.session = AgentSession(self.connections, node.target, self.key)
        w.session.open()
        w.failures, w.retry_at = 0, 0.0

    def _failed(self, w: _Watched, now: float, message: str) -> Seen:
        if w.session is not None:
            w.session.close()
            w.session = None
        w.failures += 1
        w.last_error = message
        # Found again through LXD next time: a container that restarted may have a new address.
        w.node.located = w.node.target.container.lxd is None
        w.retry_at = time.monotonic() + min(BACKOFF_MAX_S, 2.0 ** (w.failures - 1))
        return Seen(now, error=message)

    def _read(self, w: _Watched, now: float) -> Seen:
        playbook, node, unit = self.playbook, w.node, w.unit
        assert w.session is not None
        head = node.rank == 0
        # What verify checks too (the target's model files by the host's digest cache: a stat per
        # file), and on the head the production counters.
        host = serving.probe_host(playbook, node.target.container) if head else protocol.LOOPBACK
        built_from = (node.root, unit.process(node), head, host)
        if w.checks is None or w.checks[0] != built_from:
            served = plan.ServedChecks(playbook, node.root, unit.process(node), head, tokens=False, host=host)
            ops: list[protocol.Op[Any]] = list(served.ops)
            metrics = None
            if served.status is not None and head:
                follow = serving.followed(playbook, node.root, unit.process(node))
                families = (*probe.FAMILIES, probe.RUNNING)
                metrics = protocol.metrics(playbook.serving.port, families, host=host, server=follow).finding()
                ops.append(metrics)
            w.checks = (built_from, served, metrics, ops)
        _, served, metrics, ops = w.checks
        try:
            answers = w.session.batch(ops)
        except AgentError as exc:  # the release itself could not be read: the host says why
            return Seen(now, error=exc.failure.describe())
        report = HostReport(node.name)
        served.read(answers, report, None if head else unit.role(node))
        failed = answers.failure(metrics)
        metrics_error = failed.message if failed is not None else None
        # The metrics' failure is the round's finding (a server down), not a gate: watch judges it.
        plan.read_failures(answers, report, besides=[metrics] if metrics is not None else [])
        pid = None
        if served.status is not None and served.status in answers:
            server = answers[served.status].server
            pid = server.pid if server is not None and server.alive else None
        counters = running = None
        if metrics is not None and metrics in answers:
            try:
                counters = probe.parse(answers[metrics])
                running = probe.total(answers[metrics], probe.RUNNING)
            except probe.ProbeError as exc:
                metrics_error = str(exc)
        fields: tuple[str, ...] = ()
        files = report.gates.get(GATE_FILES)
        if files is not None and not files.ok:
            fields = tuple(self._changed_fields(w, report))
        return Seen(
            now,
            report=report,
            head=node.rank == 0 and playbook.serving.target is not None,
            counters=counters,
            metrics_error=metrics_error,
            server_pid=pid,
            changed_fields=fields,
            running=running,
        )

    def _changed_fields(self, w: _Watched, report: HostReport) -> list[str]:
        """Name what changed in drifted JSON files the host lets us read (never a private one)."""
        specs = {f.dest: f for f in self.playbook.release_files}
        drifted = [f.dest for f in report.files if f.drift and f.dest in specs and not specs[f.dest].private]
        wanted = [p for p in drifted if p.endswith(".json")]
        if not wanted or w.session is None:
            return []
        op = protocol.release_inspect(w.node.root, wanted)
        try:
            inspected = w.session.batch([op])[op]
        except AgentError:
            return []
        out: list[str] = []
        for f in inspected.files:
            if f.path in specs and not f.private:
                out += changed_fields(f.path, specs[f.path].content, f.content)
        return out


def _message(exc: OrchestratorError) -> str:
    if isinstance(exc, AgentProtocolError):
        return str(exc).split(": ", 1)[-1]
    return getattr(exc, "message", None) or str(exc)


class RollBack:
    """``watch --rollback-on degraded``: a host DEGRADED for ``after`` rounds in a row is rolled
    back by ``roll_back`` (the library's rollback limited to that host: the fleet's rollout lease,
    the gateway's drain and capacity floor, the previous release started and proven, the run
    recorded as any rollback), once a watch. Between rounds, by the group's lead only: one
    watcher of a group acts, as one pages."""

    def __init__(
        self,
        roll_back: Callable[[str], RunReport],
        after: int,
        say: Callable[[str], None],
        watcher: Watcher | None = None,
    ) -> None:
        self.roll_back, self.after, self.say, self.watcher = roll_back, after, say, watcher
        self.done: set[str] = set()

    def __call__(self, rounds: list[Round]) -> list[RunReport]:
        reports = []
        for host in to_roll_back(rounds, self.after, self.done):
            self.done.add(host)
            self.say(f"{host}: DEGRADED for {self.after} round{'s' * (self.after != 1)}: rolling it back")
            try:
                report = self.roll_back(host)
            except OrchestratorError as exc:  # bad input found at the run's start: said, and the watch goes on
                self.say(f"{host}: rollback not run: {_message(exc)}")
                continue
            ok = report.ok
            said = "; ".join(h.diagnosis[-1] for h in report.hosts if h.diagnosis) or ("READY" if ok else "failed")
            self.say(f"{host}: rollback {'READY' if ok else 'failed'}: {said}")
            if self.watcher is not None:
                self.watcher.went_back[host] = went_back(report, self.after)
            reports.append(report)
        return reports


def went_back(report: RunReport, after: int) -> str:
    """What a watch's rollback of one host did, as its later rounds say it first: the host serves
    the release it went back to, not the playbook's (its files are then DRIFT by design)."""
    when = time.strftime("%H:%M:%SZ", time.gmtime(report.started))
    host = report.hosts[0] if report.hosts else None
    left = f" from release {host.previous}" if host is not None and host.previous else ""
    if report.ok and host is not None:
        return (
            f"rolled back by this watch at {when}{left} (DEGRADED for {after} round{'s' * (after != 1)}) "
            f"to release {host.release_id}: it serves that release, not the playbook's; deploy again to go forward"
        )
    why = host.diagnosis[-1] if host is not None and host.diagnosis else "see its run record"
    return f"this watch's rollback at {when}{left} failed: {why}"


class OnChange:
    """``--on-change CMD``: run by ``/bin/sh -c`` (the operator's own command line) for each
    transition, the transition as JSON on its stdin; never with anything of the hosts in argv.

    Off the round: a call queues the transition and returns, and ``workers`` threads run the
    commands (a slow pager used to hold the watch for every transition of a round). One host's
    transitions always go to the same worker, so each host's commands run in the order its
    transitions happened; hosts run side by side. ``close`` lets the queued ones finish."""

    def __init__(self, command: str, say: Callable[[str], None], workers: int = 8) -> None:
        self.command, self.say = command, say
        self._queues: list[queue.Queue[Transition | None]] = [queue.Queue() for _ in range(workers)]
        self._threads = [threading.Thread(target=self._work, args=(q,), daemon=True) for q in self._queues]
        for thread in self._threads:
            thread.start()

    def __call__(self, transition: Transition) -> None:
        self._queues[zlib.crc32(transition.host.encode()) % len(self._queues)].put(transition)

    def close(self, wait: bool = True) -> None:
        """No more transitions; with ``wait``, return once every queued command has run (each is
        bounded by ON_CHANGE_TIMEOUT_S)."""
        for q in self._queues:
            q.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self, transitions: queue.Queue[Transition | None]) -> None:
        while (transition := transitions.get()) is not None:
            self._run(transition)

    def _run(self, transition: Transition) -> None:
        import json
        import tempfile

        data = (json.dumps(transition.to_json()) + "\n").encode()  # one JSON line: appends make JSON Lines
        # The command's end is its exit, not the end of its output: its stderr goes to a file, its
        # stdout nowhere. With pipes, a helper that left a child behind (a notifier sent off with
        # `&`) held them open, and every page was "did not finish within 30 s", its worker held.
        with tempfile.TemporaryFile() as errors:
            try:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", self.command], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors
                )
            except OSError as exc:
                self.say(f"--on-change for {transition.host}: {exc.strerror or exc}")
                return
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # a command that does not read its line
                proc.stdin.write(data)
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            try:
                code = proc.wait(timeout=ON_CHANGE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                self.say(f"--on-change for {transition.host}: did not finish within {ON_CHANGE_TIMEOUT_S:.0f} s")
                return
            if code != 0:
                errors.seek(max(0, errors.seek(0, 2) - 16384))  # its last 16 KB: the tail is what is said
                tail = errors.read().decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
                self.say(f"--on-change for {transition.host}: exit status {code} {tail[0]}".rstrip())


def run_rounds(
    watcher: Watcher,
    interval: float,
    once: bool,
    on_round: Callable[[int, list[Round], list[Transition]], None],
    stop: threading.Event,
) -> list[Round]:
    """Rounds every ``interval`` seconds (from the start of one to the start of the next) until
    ``stop`` is set, or one with ``once``; the last round's results."""
    number = 0
    while True:
        started = time.monotonic()
        number += 1
        rounds, transitions = watcher.round()
        on_round(number, rounds, transitions)
        if once or stop.wait(max(0.0, interval - (time.monotonic() - started))):
            return rounds
