"""More than one controller on one PostgreSQL store (a real cluster, tests/postgres.py): real
``orchestrate`` processes against this machine's ``connection: local`` containers. Overlapping
rollouts wait and then name the holder; disjoint ones run side by side; a controller killed
mid-run leaves no lease behind; history shows every controller's runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator.deployment import Deployment
from orchestrator.engine.observer import Observer
from orchestrator.engine.runner import Stop
from orchestrator.engine.watcher import WatchGroup
from orchestrator.errors import StateError
from orchestrator.rules.watch import READY
from orchestrator.store.state import LockHeld, StateDB, whoami
from tests.postgres import Postgres
from tests.unit.localbox import OPTIONS, Box, deploy, files_only_book

REPO = Path(__file__).resolve().parents[2]


def orchestrate(box: Box, url: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(box.dir / "state"), PYTHONPATH=str(REPO))
    env["ORCHESTRATE_STATE_URL"] = url
    argv = [sys.executable, "-m", "orchestrator", *args, "-i", str(box.inventory_path)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err


def test_an_overlapping_rollout_waits_then_names_the_holder_and_touches_nothing(box: Box, postgres: Postgres) -> None:
    url = postgres.socket_url(postgres.new_database())
    playbook = box.playbook()
    held = StateDB(box.dir, url)
    try:
        with held.rollout_lock(["solo"], "deploy held-by-the-test", 30.0):
            code, _, err = finish(orchestrate(box, url, "deploy", str(playbook.file), "--lock-timeout", "1"))
    finally:
        held.close()
    user, controller, pid = whoami()
    assert code == 1, err
    assert f"waiting for solo: {user}@{controller} pid {pid}" in err
    assert f"error: solo is being rolled out by {user}@{controller} pid {pid}" in err
    assert "run deploy held-by-the-test (waited 1 s; --lock-timeout)" in err
    assert not (box.root("solo") / "current").exists()  # nothing staged, nothing started


def test_disjoint_rollouts_run_side_by_side_and_history_shows_both_controllers(box: Box, postgres: Postgres) -> None:
    url = postgres.socket_url(postgres.new_database())
    one, two = box.playbook("one", targets="[solo]"), box.playbook("two", targets="[n0]", port=box.port + 1)
    procs = [orchestrate(box, url, "deploy", str(pb.file), "--lock-timeout", "0") for pb in (one, two)]
    pids = {p.pid for p in procs}
    results = [finish(p) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    shown = subprocess.run(
        [sys.executable, "-m", "orchestrator", "history", "--state-url", url, "--json"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    runs = json.loads(shown.stdout)["runs"]
    assert {r["by"]["pid"] for r in runs} == pids and {Path(r["playbook"]).stem for r in runs} == {"one", "two"}
    page = box.dir / "fleet.html"
    reported = subprocess.run(
        [sys.executable, "-m", "orchestrator", "report", "--state-url", url, "--html", str(page)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert reported.returncode == 0, reported.stderr
    html = page.read_text()
    assert all(f"pid {pid}</td>" in html for pid in pids)  # who ran each run, on every host's table
    db = StateDB(box.dir, url)
    try:
        assert db._query("SELECT count(*) FROM leases") == [(0,)]  # each took its own rows away
    finally:
        db.close()


def test_a_store_that_cannot_take_the_run_stops_it_before_any_host(box: Box, postgres: Postgres) -> None:
    """A read-only store (exit 1) and one written by a newer orchestrate (exit 2): one line each,
    and no host touched."""
    playbook = box.playbook()
    database = postgres.new_database()
    url = postgres.socket_url(database)
    StateDB(box.dir, url).close()
    postgres.psql(f"ALTER DATABASE {database} SET default_transaction_read_only = on")
    code, out, err = finish(orchestrate(box, url, "deploy", str(playbook.file)))
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        f"error: state database {url}: cannot execute INSERT in a read-only transaction (cannot be written)"
    ]
    postgres.psql(f"ALTER DATABASE {database} SET default_transaction_read_only = off")
    postgres.psql("UPDATE schema_version SET version = 99", database)
    code, out, err = finish(orchestrate(box, url, "deploy", str(playbook.file)))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "has schema version 99, newer than" in err
    assert not (box.root("solo") / "current").exists()


def test_a_controller_killed_mid_run_leaves_no_lease(box: Box, postgres: Postgres) -> None:
    url = postgres.socket_url(postgres.new_database())
    slow = box.playbook(env={"STANDIN_GOOD_MASK": "5", "STANDIN_START_DELAY": "3"})
    first = orchestrate(box, url, "deploy", str(slow.file))
    db = StateDB(box.dir, url)
    try:
        deadline = time.monotonic() + 60
        while not db._query("SELECT pid FROM leases WHERE name = 'solo'"):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        ((pid, run),) = db._query("SELECT pid, run FROM leases WHERE name = 'solo'")
        assert pid == first.pid and re.fullmatch(r"deploy pb release \d{8}T\d{6}Z-[0-9a-f]+", run), run
        os.kill(first.pid, signal.SIGKILL)  # mid-run: its server is still loading
        first.wait(timeout=30)
        # its session ended with it, and the lease with the session (once the server has seen the
        # connection close: on a loaded machine a moment after the kill), with no one acting on it
        deadline = time.monotonic() + 30
        held = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        while db._query(held)[0][0]:
            assert time.monotonic() < deadline, "the killed controller's session kept its lease"
            time.sleep(0.05)
        # then taken at once, no waiting
        with db.rollout_lock(
            ["solo"], "deploy after the crash", 5.0, lambda n, h: (_ for _ in ()).throw(AssertionError(h))
        ):
            assert db._query("SELECT run FROM leases WHERE name = 'solo'") == [("deploy after the crash",)]
    finally:
        db.close()
    code, _, err = finish(orchestrate(box, url, "deploy", str(slow.file)))
    assert code == 0, err
    assert "waiting for solo" not in err


class Said(Observer):
    """What a run says, as it says it."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.waiting = threading.Event()

    def say(self, message: str) -> None:
        self.lines.append(message)
        if message.startswith("waiting for "):
            self.waiting.set()


def test_a_deploy_from_python_waits_for_the_held_lease_names_the_holder_then_runs_and_records(
    box: Box, postgres: Postgres
) -> None:
    """The library does what ``orchestrate deploy`` does with a store: no second rollout beside a
    held lease, whoever calls it."""
    url = postgres.socket_url(postgres.new_database())
    playbook = box.playbook()
    held, store = StateDB(box.dir, url), StateDB(box.dir, url)
    said = Said()
    deployment = Deployment(playbook, box.inventory, replace(OPTIONS, lock_timeout=60.0), said, store=store)
    released = threading.Event()

    def hold() -> None:
        with held.rollout_lock(["solo"], "deploy held-by-the-test", 30.0):
            assert said.waiting.wait(60)  # the deploy is seen waiting before the lease is let go
            assert not (box.root("solo") / "current").exists()  # and has touched nothing
        released.set()

    holder = threading.Thread(target=hold)
    try:
        holder.start()
        deadline = time.monotonic() + 30
        while not held._query("SELECT run FROM leases WHERE name = 'solo'"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        report = deployment.deploy()
        holder.join(60)
        runs = store.history()
    finally:
        held.close()
        store.close()
    user, controller, pid = whoami()
    assert released.is_set() and report.ok, [h.failed_gate for h in report.hosts]
    assert f"waiting for solo: {user}@{controller} pid {pid}" in said.lines[0]
    assert said.lines[1].startswith("deploy pb: 1 host")
    assert [(r["kind"], r["release_id"]) for r in runs] == [("deploy", report.release_id)]


def test_an_interrupt_while_the_lease_is_waited_for_ends_the_run_as_interrupted_and_records_it(
    box: Box, postgres: Postgres
) -> None:
    """A first Ctrl-C (``options.interrupt``) while another controller holds the lease: the run
    ends as an interrupted run does, each host named as interrupted (none touched), recorded. The
    library raised ``KeyboardInterrupt`` from ``deploy()`` (the CLI said "aborted", unrecorded)."""
    url = postgres.socket_url(postgres.new_database())
    held, store = StateDB(box.dir, url), StateDB(box.dir, url)
    said = Said()
    options = replace(OPTIONS, lock_timeout=60.0, interrupt=Stop())
    deployment = Deployment(box.playbook(), box.inventory, options, said, store=store)

    def interrupt() -> None:
        assert said.waiting.wait(60)
        options.interrupt.set()

    helper = threading.Thread(target=interrupt)
    try:
        with held.rollout_lock(["solo"], "deploy held-by-the-test", 30.0):
            helper.start()
            report = deployment.deploy()
        helper.join(60)
        runs = store.history()
    finally:
        held.close()
        store.close()
    assert report.interrupted and not report.ok
    (solo,) = report.hosts
    assert solo.failed_gate == "interrupted", solo.gates
    assert solo.gates["interrupted"].detail.startswith("not started: interrupted while waiting for solo, which ")
    assert "run deploy held-by-the-test" in solo.gates["interrupted"].detail
    assert not (box.root("solo") / "current").exists()
    assert [(r["kind"], r["ok"], r["hosts_total"]) for r in runs] == [("deploy", False, 1)]


def test_a_deploy_from_python_past_its_lock_timeout_raises_naming_the_holder(box: Box, postgres: Postgres) -> None:
    url = postgres.socket_url(postgres.new_database())
    held, store = StateDB(box.dir, url), StateDB(box.dir, url)
    deployment = Deployment(box.playbook(), box.inventory, replace(OPTIONS, lock_timeout=0.5), store=store)
    try:
        with held.rollout_lock(["solo"], "deploy held-by-the-test", 30.0), pytest.raises(LockHeld) as refused:
            deployment.deploy()
        runs = store.history()
    finally:
        held.close()
        store.close()
    assert "run deploy held-by-the-test" in str(refused.value) and runs == []
    assert not (box.root("solo") / "current").exists()


def test_python_watchers_of_one_group_lead_follow_record_and_take_over(box: Box, tmp_path: Path) -> None:
    """``Deployment.watcher()`` with a store joins the watch group as ``orchestrate watch`` does."""
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    one, two = StateDB(tmp_path / "state"), StateDB(tmp_path / "state")
    told: list[str] = []
    first = Deployment(playbook, box.inventory, OPTIONS, store=one).watcher(on_change=lambda t: told.append(t.host))
    second = Deployment(playbook, box.inventory, OPTIONS, Said(), store=two).watcher()
    try:
        first.round()
        second.round()
        assert (first.leading, second.leading) == (True, False)
        assert one.last_states() == {"solo": READY}
        assert told == []  # a host first seen READY pages nobody
        first.close()
        second.round()
        assert second.leading
        assert isinstance(second.group, WatchGroup)
    finally:
        first.close()
        second.close()
        one.close()
        two.close()
    assert [(t["from"], t["to"]) for t in StateDB(tmp_path / "state").transitions("solo")] == [(None, READY)]


class HeldLease:
    """A files-only deploy of n0, n1 and solo from Python, one host at a time, holding its rollout
    lease, whose first host (n0) waits on its deploy root's lock, which the test holds."""

    def __init__(self, box: Box, url: str) -> None:
        import fcntl

        from orchestrator.config.playbook import load_playbook
        from orchestrator.engine.runner import RunOptions, Stop

        box.root("n0").mkdir(parents=True)
        self.held = open(box.root("n0") / ".lock", "w")  # noqa: SIM115 (held across the test)
        fcntl.flock(self.held, fcntl.LOCK_EX)
        self.store = StateDB(box.dir, url)
        self.said = Said()
        options = RunOptions(forks=1, lock_timeout=300.0, interrupt=Stop(), state_dir=box.dir / "state")
        book = load_playbook(files_only_book(box, "lease", ["n0", "n1", "solo"]))
        deployment = Deployment(book, box.inventory, options, self.said, store=self.store)
        self.report: Any = None
        self.thread = threading.Thread(target=lambda: setattr(self, "report", deployment.deploy()))
        self.thread.start()
        self.admin = psycopg.connect(url, autocommit=True)
        deadline = time.monotonic() + 60
        # Taken and named before any host starts (n0 then waits on the test): a session ended
        # between the two fails the run at its start, before any host, which is not these tests'
        # case.
        while len(self.holders()) != 1 or self.named() != {"n0", "n1", "solo"}:
            assert time.monotonic() < deadline, self.said.lines
            time.sleep(0.05)

    def named(self) -> set[str]:
        """The hosts whose lease row names a holder (the store's schema exists: it made it)."""
        return {n for (n,) in self.admin.execute("SELECT name FROM leases").fetchall()}

    def holders(self) -> set[int]:
        """The backends that hold the run's three advisory locks."""
        rows = self.admin.execute(
            "SELECT pid, count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted GROUP BY pid"
        ).fetchall()
        return {pid for pid, n in rows if n == 3}

    def finish(self) -> Any:
        self.held.close()  # n0 goes on
        self.thread.join(120)
        assert not self.thread.is_alive()
        self.admin.close()
        self.store.close()
        return self.report


def test_a_lease_whose_session_the_database_ended_is_taken_again_when_no_one_took_it(
    box: Box, postgres: Postgres
) -> None:
    """A PostgreSQL restart ends every session, and a session's advisory locks go with it: the
    lease was gone while the run went on, silently. Taken again on a new session, the run goes on."""
    run = HeldLease(box, postgres.socket_url(postgres.new_database()))
    (first,) = run.holders()
    run.admin.execute("SELECT pg_terminate_backend(%s)", (first,))
    deadline = time.monotonic() + 30
    while not run.holders() or run.holders() == {first}:  # held again, by a new session
        assert time.monotonic() < deadline, "the lease was not taken again"
        time.sleep(0.05)
    names = run.named()
    report = run.finish()
    assert names == {"n0", "n1", "solo"}  # the holder is still named
    assert report.ok and not report.interrupted, [h.failed_gate for h in report.hosts]
    assert not any(line.startswith("error:") for line in run.said.lines), run.said.lines


def test_a_lease_another_controller_took_while_the_session_was_gone_stops_the_rollout(
    box: Box, postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session ended, and another controller took one of the hosts' lease before this one
    noticed: it starts no new host (it used to roll on, and the other controller stopped a host
    under it), the host in flight finishes, and the run says who holds the lease now."""
    from orchestrator.store import state

    monkeypatch.setattr(state, "LEASE_CHECK_S", 2.0)  # the test takes the lease well within it
    run = HeldLease(box, postgres.socket_url(postgres.new_database()))
    (first,) = run.holders()
    other = psycopg.connect(run.store.url or "", autocommit=True)
    try:
        key = state._lock_key("n1")
        run.admin.execute("SELECT pg_terminate_backend(%s)", (first,))
        deadline = time.monotonic() + 10
        while not other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:
            assert time.monotonic() < deadline, "the terminated session's lock never went"
        other.execute("UPDATE leases SET controller = 'ctl-b', pid = 4242, run = 'deploy by b' WHERE name = 'n1'")
        deadline = time.monotonic() + 30
        while not any(line.startswith("error: the rollout lease") for line in run.said.lines):
            assert time.monotonic() < deadline, run.said.lines
            time.sleep(0.05)
        report = run.finish()
    finally:
        other.close()
    by_name = {h.name: h for h in report.hosts}
    assert by_name["n0"].ready  # in flight: its steps are atomic and it finishes
    for name in ("n1", "solo"):
        gate = by_name[name].gates["interrupted"]
        assert not gate.ok and gate.detail.startswith("not started: the rollout lease of n1 was lost"), gate
        assert "pid 4242" in gate.detail and "run deploy by b" in gate.detail
        assert not (box.root(name) / "current").exists()
    assert not report.ok and not report.interrupted  # exit 1, not 130: nobody interrupted it


def test_a_store_whose_server_stops_answering_costs_the_lease_let_go_and_the_record_never_the_run(
    box: Box, postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backend of the run's database stops (SIGSTOP: no reset, no answer), the lease's
    included, while the first host waits: the controller waited in the lease's keeper before its
    table for as long as the server was stopped (5 minutes in the recorded case). It lets the lease
    go within its bound, says so, says the record was not taken, and returns what the hosts did."""
    from orchestrator import deployment
    from orchestrator.store import state

    monkeypatch.setattr(deployment, "STORE_ANSWER_S", 2.0)
    monkeypatch.setattr(state, "LET_GO_S", 2.0)
    run = HeldLease(box, postgres.socket_url(postgres.new_database()))
    backends = [
        pid
        for (pid,) in run.admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    ]
    assert len(backends) >= 2  # the store's, and the lease's session
    for pid in backends:
        os.kill(pid, signal.SIGSTOP)  # children of the cluster this test suite started
    try:
        run.held.close()
        run.thread.join(60)
        assert not run.thread.is_alive(), ("the run waited on the store", run.said.lines)
        report = run.report
    finally:
        for pid in backends:
            os.kill(pid, signal.SIGCONT)
    run.finish()
    assert report.ok, [h.failed_gate for h in report.hosts]
    assert any(
        line.startswith("error: the rollout lease was not let go: state database") and "within 2 s" in line
        for line in run.said.lines
    ), run.said.lines
    assert any(line.startswith("error: the run was not recorded") for line in run.said.lines), run.said.lines


def test_a_store_that_stops_answering_after_the_hosts_changed_costs_the_record_not_the_run(
    box: Box, postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's server process stops (SIGSTOP: no reset, no answer) while the hosts change: the
    controller waited for ever to record the run. It says the record was not taken and returns
    what the hosts did."""
    from orchestrator import deployment

    monkeypatch.setattr(deployment, "STORE_ANSWER_S", 2.0)
    run = HeldLease(box, postgres.socket_url(postgres.new_database()))
    ((backend,),) = run.store._query("SELECT pg_backend_pid()")
    os.kill(backend, signal.SIGSTOP)  # a child of the cluster this test suite started
    try:
        run.held.close()
        run.thread.join(60)
        assert not run.thread.is_alive(), "the run waited on the store"
        report = run.report
    finally:
        os.kill(backend, signal.SIGCONT)
    run.finish()
    # The write left blocked holds the connection: closing the store left it to the process (it
    # was closed under that thread, and when the server answered the process aborted).
    assert not run.store.conn.closed
    assert report.ok, [h.failed_gate for h in report.hosts]
    assert any(
        line.startswith("error: the run was not recorded: state database")
        and "did not take the run's record in 2 s" in line
        for line in run.said.lines
    ), run.said.lines


def test_watchers_that_cannot_reach_the_store_tell_their_changes_themselves(postgres: Postgres) -> None:
    """PostgreSQL down: no watcher could take the lead, so each said another one did, and none
    ran --on-change: monitoring went quiet exactly when it was needed. Each watcher that cannot
    reach the store tells what it sees itself (twice rather than never), says so once, and
    follows the lead again when the store answers."""
    from orchestrator.rules.watch import HostWatch, step
    from tests.unit.test_watch import GATE, counters, seen

    database = postgres.new_database()
    url = postgres.socket_url(database)
    lines: list[str] = []
    leader, other = StateDB(Path("/nonexistent"), url), StateDB(Path("/nonexistent"), url)
    first, second = WatchGroup(leader, "g", lines.append), WatchGroup(other, "g", lines.append)
    _, rnd, change = step(HostWatch("gpu-a"), seen(0, counters(0, 0), error="refused"), GATE)
    assert change is not None
    try:
        assert first.after([rnd], [change]) == [change] and second.after([rnd], [change]) == []
        postgres.psql(f"ALTER DATABASE {database} ALLOW_CONNECTIONS false")
        postgres.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'")
        lines.clear()
        assert first.after([rnd], [change]) == [change] and second.after([rnd], [change]) == [change]
        down = [line for line in lines if "the state store cannot be reached" in line]
        assert len(down) == 2 and all(line.startswith("error: watch group g:") for line in down), lines
        assert not any("following" in line for line in lines), lines
        assert first.after([rnd], [change]) == [change]  # said once, told every round
        assert len([line for line in lines if "cannot be reached" in line]) == 2
        postgres.psql(f"ALTER DATABASE {database} ALLOW_CONNECTIONS true")
        told = [first.after([rnd], [change]), second.after([rnd], [change])]
        assert sorted(map(len, told)) == [0, 1]  # one leads again, and only it tells
    finally:
        postgres.psql(f"ALTER DATABASE {database} ALLOW_CONNECTIONS true")
        first.close()
        second.close()
        leader.close()
        other.close()


def _backends(store: StateDB, admin: StateDB) -> list[int]:
    """The server processes of every session on the store's database but the admin's own."""
    rows = admin._query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return [pid for (pid,) in rows]


def test_a_store_that_stops_answering_fails_each_call_in_bounded_time_and_the_next_session_answers(
    postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every session of the store's database stopped (SIGSTOP: the kernel still acknowledges,
    nothing answers): a read, a transaction and a watcher's poll for its group's lead each waited
    for as long as the server was stopped (watch ran no round; its metrics kept a dead host
    READY). Each now fails after STORE_CALL_S naming the wait, the round ends and says so, and the
    store's next call is served on a fresh session."""
    from orchestrator.rules.watch import HostWatch, step
    from orchestrator.store import state
    from tests.unit.test_watch import GATE, counters, seen

    monkeypatch.setattr(state, "STORE_CALL_S", 1.5)
    url = postgres.socket_url(postgres.new_database())
    store, admin = StateDB(Path("/nonexistent"), url), StateDB(Path("/nonexistent"), url)
    lines: list[str] = []
    group = WatchGroup(store, "g", lines.append)
    _, rnd, change = step(HostWatch("gpu-a"), seen(0, counters(0, 0), error="refused"), GATE)
    assert change is not None
    try:
        assert group.after([rnd], [change]) == [change]  # it leads: its own session holds the lock
        ((first,),) = store._query("SELECT pg_backend_pid()")
        stopped = _backends(store, admin)
        assert first in stopped and len(stopped) == 2  # the store's and the lead's
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)  # children of the cluster this test suite started
        try:
            started = time.monotonic()
            with pytest.raises(StateError, match=r"did not answer within 1.5 s"):
                store.last_states()
            assert time.monotonic() - started < 10
            # the session given up is not used again: the next call is served on a new one (the
            # server's other processes answer)
            ((again,),) = store._query("SELECT pg_backend_pid()")
            assert again not in stopped
            started = time.monotonic()
            group.after([rnd], [change])  # the round ends; its lead's session was the stopped one
            assert time.monotonic() - started < 15
            assert any("did not answer within 1.5 s" in line for line in lines), lines
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
    finally:
        group.close()
        store.close()
        admin.close()


def test_a_session_the_server_ended_is_replaced_and_the_runs_record_is_kept(postgres: Postgres) -> None:
    """A PostgreSQL restart (or a failover, an administrator) ends the store's session during a
    run: the run's record, written at its end on the old session, was lost ("terminating connection
    due to administrator command"). A write is sent on a live session (one round trip first), a
    read is asked again on a new one; each is recorded and read back once."""
    from tests.unit.test_state import a_run

    url = postgres.socket_url(postgres.new_database())
    store, admin = StateDB(Path("/nonexistent"), url), StateDB(Path("/nonexistent"), url)
    try:
        for step in ("write", "read"):
            ((backend,),) = store._query("SELECT pg_backend_pid()")
            admin._query("SELECT pg_terminate_backend(?)", (backend,))
            if step == "write":
                store.record(a_run(tau=5.5))
            else:
                (run,) = store.history()
                assert run["hosts_ready"] == 1
            ((again,),) = store._query("SELECT pg_backend_pid()")
            assert again != backend
        assert len(admin.history()) == 1  # recorded once
    finally:
        store.close()
        admin.close()
