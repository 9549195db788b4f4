"""The state store on both engines: SQLite (the default file) and a real PostgreSQL (tests/postgres.py).
The same tests run on each; what only PostgreSQL has (shared leases, credentials) is tested there."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import EXIT_BAD_INPUT, EXIT_NOT_READY, StateError
from orchestrator.results import Gate, HostReport, RunReport
from orchestrator.rules.gates import speedup as su
from orchestrator.rules.watch import Round
from orchestrator.store.state import SCHEMA_VERSION, LockHeld, StateDB, StateUrlError, whoami
from tests.postgres import PASSWORD, Postgres

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path, postgres: Postgres) -> str:
    # Asks for the session's PostgreSQL in both cases: a tier follows the fixtures a test names.
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/state.db"
    return postgres.socket_url(postgres.new_database())


def a_run(kind: str = "deploy", ready: bool = True, tau: float = 6.5, host: str = "gpu-a") -> RunReport:
    report = HostReport(host)
    report.release_id = "r1"
    report.gates["acceptance"] = Gate(
        ready, "tau", data={"mean_acceptance_length": tau, "acceptance_rate": 0.7, "drafts": 40}
    )
    started = time.time()
    return RunReport(kind, "pb.yaml", "inv.yaml", "r1", [report], started, finished=started + 1.5)


def test_a_run_is_recorded_with_who_ran_it_and_read_back(url: str, tmp_path: Path) -> None:
    db = StateDB(tmp_path / "dir", url)
    try:
        db.check_writable()
        first = db.record(a_run())
        second = db.record(a_run("verify", ready=False, tau=2.0))
        runs = db.history()
        assert [r["id"] for r in runs] == [second, first]  # newest first
        user, controller, pid = whoami()
        assert runs[0]["by"] == {"user": user, "host": controller, "pid": pid}
        assert runs[1]["hosts"][0]["gates"]["acceptance"]["ok"] is True and runs[0]["ok"] is False
        taus = [s["mean_acceptance_length"] for s in db.samples("gpu-a")]
        assert taus == [6.5, 2.0]  # oldest first, whatever the engine's own order
        assert db.history(host="nobody") == []
    finally:
        db.close()


def test_a_store_of_a_newer_schema_is_refused_and_left_as_it_is(url: str, tmp_path: Path) -> None:
    StateDB(tmp_path / "dir", url).close()
    db = StateDB(tmp_path / "dir", url)
    with db._tx() as cur:
        cur.execute(db.dialect.sql("UPDATE schema_version SET version = ?"), (SCHEMA_VERSION + 1,))
    db.close()
    with pytest.raises(StateUrlError) as refused:
        StateDB(tmp_path / "dir", url)
    assert refused.value.exit_code == EXIT_BAD_INPUT
    assert f"has schema version {SCHEMA_VERSION + 1}, newer than this orchestrate knows ({SCHEMA_VERSION})" in str(
        refused.value
    )


def test_a_state_file_from_before_schema_versions_is_upgraded_and_keeps_its_runs(tmp_path: Path) -> None:
    """The SQLite file every earlier release wrote (no schema_version, no who-ran-it columns)."""
    path = tmp_path / "state.db"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE runs (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, playbook TEXT NOT NULL, inventory TEXT NOT "
        "NULL, release_id TEXT, started REAL NOT NULL, finished REAL NOT NULL, ok INTEGER NOT NULL, hosts_total "
        "INTEGER NOT NULL, hosts_ready INTEGER NOT NULL);"
        "INSERT INTO runs VALUES (7, 'deploy', 'old.yaml', 'inv.yaml', 'r0', 1.0, 2.0, 1, 0, 0);"
    )
    old.commit()
    old.close()
    db = StateDB(tmp_path, f"sqlite://{path}")
    try:
        db.record(a_run())
        runs = db.history()
        assert [(r["id"], r["playbook"]) for r in runs] == [(8, "pb.yaml"), (7, "old.yaml")]
        assert runs[1]["by"] is None and runs[0]["by"] is not None
        assert db._query("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    finally:
        db.close()


def test_a_store_of_version_3_gains_the_watched_load_and_keeps_its_rows(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    db.record(a_run())
    db._query("DROP TABLE serving_load")
    db._query("UPDATE schema_version SET version = 3")
    db.conn.commit()
    db.close()
    db = StateDB(tmp_path)
    try:
        assert db._query("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)] and len(db.history()) == 1
        assert db.observed_load(["solo"], 0.0) == []
        rnd = Round("solo", 5.0, "READY", (), "r1", None, None, 10, 0, None, 5.0, running=3.0)
        db.record_watch([], [rnd, replace(rnd, host="other", running=1.0), replace(rnd, at=6.0, running=None)])
        assert db.observed_load(["solo"], 0.0) == [("solo", 3.0)] and db.observed_load(["solo"], 5.5) == []
    finally:
        db.close()


def test_the_watched_load_is_sampled_a_minute_a_host_and_kept_a_week(tmp_path: Path) -> None:
    """watch read every server's running requests at every round and kept a row for each: 8.8
    million rows a day at 1,024 hosts, for ever. A host's load is sampled once a minute and kept
    for the week the speed-up gate reads (``OBSERVED_DAYS``); older rows are pruned."""
    from orchestrator.store import state

    assert state.LOAD_KEEP_S == su.OBSERVED_DAYS * 86400  # the store keeps what the gate reads
    db = StateDB(tmp_path)
    try:
        now = time.time()
        with db._tx() as cur:
            cur.execute("INSERT INTO serving_load (at, host, running) VALUES (?, ?, ?)", (now - 8 * 86400, "a", 9.0))
            cur.execute("INSERT INTO serving_load (at, host, running) VALUES (?, ?, ?)", (now - 6 * 86400, "a", 4.0))
        rnd = Round("a", now, "READY", (), "r1", None, None, 10, 0, None, now, running=1.0)
        for i, at in enumerate((now, now + 10, now + 59, now + 60, now + 125)):  # rounds of 10 s and more
            db.record_watch([], [replace(rnd, at=at, running=float(i)), replace(rnd, host="b", at=at, running=2.0)])
        kept = sorted(db._query("SELECT host, at, running FROM serving_load"))
        assert [(h, round(at - now), r) for h, at, r in kept] == [
            ("a", -6 * 86400, 4.0),  # inside the week: kept
            ("a", 0, 0.0),
            ("a", 60, 3.0),
            ("a", 125, 4.0),
            ("b", 0, 2.0),
            ("b", 60, 2.0),
            ("b", 125, 2.0),
        ]
    finally:
        db.close()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://root@localhost/x", "scheme 'mysql' is neither sqlite nor postgresql"),
        ("sqlite://", "no database file"),
    ],
)
def test_a_state_url_that_is_not_one_is_bad_input(url: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(StateUrlError) as refused:
        StateDB(tmp_path, url)
    assert says in str(refused.value) and refused.value.exit_code == EXIT_BAD_INPUT


def test_postgresql_credentials_unreachable_servers_and_missing_databases(
    postgres: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = postgres.new_database()
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    StateDB(tmp_path, postgres.tcp_url(database)).close()  # the password from the environment, not the URL
    monkeypatch.setenv("PGPASSWORD", "wrong")
    with pytest.raises(StateUrlError) as wrong:
        StateDB(tmp_path, postgres.tcp_url(database))
    assert "password authentication failed" in str(wrong.value) and wrong.value.exit_code == EXIT_BAD_INPUT
    monkeypatch.delenv("PGPASSWORD")
    inline = f"postgresql://alice:{PASSWORD}x@127.0.0.1:{postgres.port}/{database}"
    with pytest.raises(StateUrlError) as shown:
        StateDB(tmp_path, inline)
    assert PASSWORD not in str(shown.value) and "alice:***@127.0.0.1" in str(shown.value)
    with pytest.raises(StateUrlError) as missing:
        StateDB(tmp_path, postgres.socket_url("no_such_db"))
    assert 'database "no_such_db" does not exist' in str(missing.value)
    with socket_closed() as port, pytest.raises(StateError) as down:
        StateDB(tmp_path, f"postgresql://alice@127.0.0.1:{port}/x")
    assert "cannot be reached" in str(down.value) and down.value.exit_code == EXIT_NOT_READY


@contextlib.contextmanager
def socket_closed() -> Iterator[int]:
    """A loopback port nothing listens on (bound, never listened, so connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def test_a_read_only_store_is_said_before_any_host_is_touched(postgres: Postgres, tmp_path: Path) -> None:
    database = postgres.new_database()
    url = postgres.socket_url(database)
    StateDB(tmp_path, url).close()
    postgres.psql(f"ALTER DATABASE {database} SET default_transaction_read_only = on")
    db = StateDB(tmp_path, url)
    try:
        with pytest.raises(StateError) as refused:
            db.check_writable()
        assert "read-only transaction" in str(refused.value) and "(cannot be written)" in str(refused.value)
    finally:
        db.close()


def test_a_rollout_lease_is_held_per_target_and_names_its_holder(postgres: Postgres, tmp_path: Path) -> None:
    url = postgres.socket_url(postgres.new_database())
    first, second = StateDB(tmp_path, url), StateDB(tmp_path, url)
    waits: list[str] = []
    try:
        with first.rollout_lock(["gpu-a", "gpu-b"], "deploy pb", 5.0):
            overlapping = second.rollout_lock(["gpu-b", "gpu-c"], "deploy other", 0.3, lambda n, h: waits.append(n))
            with pytest.raises(LockHeld) as held, overlapping:
                pytest.fail("the overlapping rollout ran")
            user, controller, pid = whoami()
            assert held.value.holder is not None and held.value.holder.pid == pid
            assert f"gpu-b is being rolled out by {user}@{controller} pid {pid}" in str(held.value)
            assert "run deploy pb (waited 0.3 s; --lock-timeout)" in str(held.value)
            assert waits == ["gpu-b"]  # told once, not every poll
            with second.rollout_lock(["gpu-c"], "deploy disjoint", 0.0):
                pass  # a disjoint rollout runs beside it
        with second.rollout_lock(["gpu-b"], "deploy after", 0.0):
            rows = second._query("SELECT name, run FROM leases ORDER BY name")
            assert rows == [("gpu-b", "deploy after")]  # the first's rows went with its lease
    finally:
        first.close()
        second.close()


def test_sqlite_has_no_shared_lease_to_take(tmp_path: Path) -> None:
    """One controller's own file: the hosts' deploy-root locks keep its runs apart."""
    db = StateDB(tmp_path)
    try:
        with db.rollout_lock(["gpu-a"], "deploy", 0.0), db.rollout_lock(["gpu-a"], "deploy", 0.0):
            pass
    finally:
        db.close()


def orchestrate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )  # fmt: skip


def test_history_reads_the_store_the_url_names(postgres: Postgres, tmp_path: Path) -> None:
    url = postgres.socket_url(postgres.new_database())
    db = StateDB(tmp_path, url)
    db.record(a_run())
    db.close()
    shown = orchestrate("history", "--state-url", url, "--json")
    assert shown.returncode == 0, shown.stderr
    (run,) = json.loads(shown.stdout)["runs"]
    assert run["by"]["pid"] == os.getpid()
    from_env = orchestrate("history", env={"ORCHESTRATE_STATE_URL": url})
    assert f"by {whoami()[0]}@{whoami()[1]} pid {os.getpid()}" in from_env.stdout
    bad = orchestrate("history", "--state-url", "postgresql://alice:hunter2@127.0.0.1:1/x")
    assert bad.returncode == EXIT_NOT_READY and "hunter2" not in bad.stderr and "alice:***@" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_controllers_opening_a_new_store_at_once_make_it_once(postgres: Postgres, tmp_path: Path) -> None:
    url = postgres.socket_url(postgres.new_database())
    failed: list[BaseException] = []

    def open_it() -> None:
        try:
            StateDB(tmp_path, url).close()
        except BaseException as exc:  # what each thread met is asserted below
            failed.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert failed == []
    db = StateDB(tmp_path, url)
    try:
        assert db._query("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    finally:
        db.close()


@pytest.mark.usefixtures("programs")
def test_controllers_opening_a_new_sqlite_file_at_once_all_open_it(tmp_path: Path) -> None:
    """Switching a new file to WAL takes it alone, and SQLite can answer "database is locked" there
    at once, without waiting its busy timeout: two deploys started together on a new state file,
    the second failed before any host (tests/integration/test_faults.py, one run in three). Eight
    controllers open new files at once, twelve times: every one opens and writes."""
    code = "import sys; from orchestrator.store.state import StateDB; StateDB(None, sys.argv[1]).check_writable()"
    for attempt in range(12):
        url = f"sqlite://{tmp_path}/s{attempt}/state.db"
        procs = [
            subprocess.Popen([sys.executable, "-c", code, url], env={**os.environ, "PYTHONPATH": str(REPO)},
                             stderr=subprocess.PIPE, text=True)
            for _ in range(8)
        ]  # fmt: skip
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0] * 8, errors


@pytest.mark.parametrize("query", ["password=hunter2", "sslmode=disable&password=hunter2", "sslpassword=hunter2"])
@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.usefixtures("programs")
def test_a_password_in_the_state_urls_query_string_is_never_shown(query: str, as_json: bool) -> None:
    """libpq takes ``?password=`` as readily as ``user:password@``: either is a secret in every
    message, plain or ``--json``."""
    with socket_closed() as port:
        url = f"postgresql://alice@127.0.0.1:{port}/x?{query}"
        bad = orchestrate("history", "--state-url", url, *(["--json"] if as_json else []))
    assert bad.returncode == EXIT_NOT_READY and "hunter2" not in bad.stderr + bad.stdout
    (line,) = bad.stderr.strip().splitlines()
    said = json.loads(line)["message"] if as_json else line
    assert f"state database postgresql://alice@127.0.0.1:{port}/x?{query.replace('hunter2', '***')}" in said


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://alice@127.0.0.1:{port}/x?pass%77ord=hunter2",  # libpq decodes the key
        "postgresql://alice@127.0.0.1:{port}/x?sslmode=disable&%73slpassword=hunter2",
        "postgresql://alice@127.0.0.1:{port}/x?password=hun%74er2",  # and the value
        "postgresql://alice:hunter2@127.0.0.1:{port}/x",
        "host=127.0.0.1 port={port} dbname=x password=hunter2",  # libpq's key=value form
        "host=127.0.0.1 port={port} password = 'hunter2 and more' dbname=x",
        "host=127.0.0.1 port={port} sslpassword=hunter2",
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.usefixtures("programs")
def test_a_password_under_any_spelling_libpq_reads_is_never_shown(url: str, as_json: bool) -> None:
    """Whatever libpq would take as a password (a percent-encoded key or value, the ``key=value``
    form, a quoted value with spaces) is a secret in every message, plain or ``--json``: the
    query's exact ``password=`` alone was redacted, and the others were printed."""
    with socket_closed() as port:
        bad = orchestrate("history", "--state-url", url.format(port=port), *(["--json"] if as_json else []))
    shown = bad.stderr + bad.stdout
    assert bad.returncode in (EXIT_NOT_READY, EXIT_BAD_INPUT), shown
    assert "hunter2" not in shown and "hun%74er2" not in shown and "and more" not in shown, shown
    (line,) = bad.stderr.strip().splitlines()
    said = json.loads(line)["message"] if as_json else line
    assert "***" in said and f"{port}" in said, said
    if "://" not in url:  # refused as input, in words that show the form it takes
        assert bad.returncode == EXIT_BAD_INPUT and "not a URL (postgresql://" in said, said


@pytest.mark.parametrize("stored", ["'three'", "3.5", "-1", "99999999999", "x'00'", None])
@pytest.mark.usefixtures("programs")
def test_a_schema_version_this_tool_never_writes_is_one_line_and_nothing_written(
    tmp_path: Path, stored: str | None
) -> None:
    """A store whose version is no small integer was not made by this tool, or was damaged: said
    in one line, exit 2, and not written to (it was a traceback)."""
    path = tmp_path / "state.db"
    StateDB(tmp_path).close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        if stored is None:  # emptied: it was taken for a store from before versions ("duplicate column name")
            conn.execute("DELETE FROM schema_version")
        else:
            conn.execute(f"UPDATE schema_version SET version = {stored}")
        conn.commit()
    before = path.read_bytes()
    with pytest.raises(StateUrlError) as refused:
        StateDB(tmp_path)
    if stored is None:
        assert "has an empty schema_version table: its version cannot be known" in str(refused.value)
    else:
        assert "has schema version" in str(refused.value) and "not a version this tool writes" in str(refused.value)
    assert refused.value.exit_code == EXIT_BAD_INPUT
    shown = orchestrate("history", "--state-dir", str(tmp_path))
    assert shown.returncode == EXIT_BAD_INPUT and "Traceback" not in shown.stderr
    assert len(shown.stderr.strip().splitlines()) == 1
    assert path.read_bytes() == before


@pytest.mark.parametrize("pair", [("team/a", "team_a"), ("a b", "a_b"), ("ü", "_"), ("x" * 300, "x" * 301)])
def test_watch_groups_whose_names_differ_lead_apart(tmp_path: Path, pair: tuple[str, str]) -> None:
    """Each watch group has a lead of its own: on SQLite the lead is a file named after the group,
    and names that differ only where a file name cannot hold them (``team/a`` and ``team_a``)
    shared one file, so one of the two groups never led (never recorded, never paged); a name too
    long for a file name could not be led at all."""
    db = StateDB(tmp_path)
    try:
        one, two = db.watch_lead(pair[0]), db.watch_lead(pair[1])
        assert one.poll() and two.poll(), (one.unreachable, two.unreachable)
        assert one._path() != two._path()
        one.close()
        two.close()
        assert db.watch_lead("plain-name_1.0")._path().name.endswith(".watch-plain-name_1.0.lead")  # as before
    finally:
        db.close()


def test_watchers_sharing_one_sqlite_store_from_two_state_directories_have_one_leader(tmp_path: Path) -> None:
    """The lead of a watch group on SQLite is an flock beside the database file, not in each
    watcher's state directory: two watchers with one ``sqlite:///`` URL and state directories of
    their own both led, and every change was paged twice."""
    url = f"sqlite:///{tmp_path / 'shared' / 'state.db'}"
    (tmp_path / "shared").mkdir()
    one, two = StateDB(tmp_path / "one", url), StateDB(tmp_path / "two", url)
    try:
        first, second = one.watch_lead("pb"), two.watch_lead("pb")
        assert first.poll() and not second.poll()
        assert (tmp_path / "shared" / "state.db.watch-pb.lead").is_file()
        holder = second.holder()
        assert holder is not None and holder.pid == os.getpid()
        first.close()
        assert second.poll()  # the lead passes on when its holder lets go
        second.close()
    finally:
        one.close()
        two.close()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_transitions_are_in_the_order_recorded_whatever_each_watchers_clock_said(
    tmp_path: Path, postgres: Postgres, store: str
) -> None:
    """Each transition's time is the clock of the watcher that saw it: a watcher that took the
    lead with its clock an hour behind the one before it had its later changes sorted first, and
    the host's last state read back as an older one (the report, and what a new leader tells)."""
    from orchestrator.rules.watch import HostWatch, step
    from tests.unit.test_watch import GATE, counters, seen

    db = StateDB(tmp_path, None if store == "sqlite" else postgres.socket_url(postgres.new_database()))
    try:
        w, r1, down = step(HostWatch("gpu-a"), seen(7200.0, counters(0, 0), error="refused"), GATE)
        _, r2, up = step(w, seen(3600.0, counters(0, 0)), GATE)  # the next leader, an hour behind
        assert down is not None and up is not None
        db.record_watch([down], [r1])
        db.record_watch([up], [r2])
        assert [t["to"] for t in db.transitions("gpu-a")] == ["DOWN", "READY"]
        assert db.last_states() == {"gpu-a": "READY"}
    finally:
        db.close()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_gateways_rotation_lock_is_one_controllers_at_a_time(tmp_path: Path, postgres: Postgres, store: str) -> None:
    """Two controllers behind one gateway read its rotation and take a server out one at a time:
    the second waits, and past its timeout is told who it waited for, in one line."""
    url = f"sqlite:///{tmp_path / 'state.db'}" if store == "sqlite" else postgres.socket_url(postgres.new_database())
    one, two = StateDB(tmp_path / "a", url), StateDB(tmp_path / "b", url)
    try:
        with one.gateway_lock("haproxy gw http://lb:80", 1.0):
            with (
                pytest.raises(
                    StateError, match=r"the rotation lock of gateway haproxy gw http://lb:80 was held past 0.2 s"
                ),
                two.gateway_lock("haproxy gw http://lb:80", 0.2),
            ):
                pass
            with two.gateway_lock("haproxy other http://lb2:80", 0.2):
                pass  # another gateway's lock is another lock
        with two.gateway_lock("haproxy gw http://lb:80", 0.2):
            pass  # free again once the first let go
    finally:
        one.close()
        two.close()


GOOD_RUN = {"concurrency": 1, "wall_s": 2.0, "requests": [[32, 1.0, 0.1]], "served": [1, 0.9, 32, 31, 0.9, 0, 0]}


@pytest.mark.parametrize(
    ("concurrency", "at", "runs"),
    [
        (1, 100.0, "{not json"),
        (1, 100.0, '"a string"'),
        (1, 100.0, "[1, 2]"),
        (1, 100.0, "[" * 100_000),  # nested past the parser: RecursionError
        ("one", 100.0, json.dumps([GOOD_RUN])),
        (0, 100.0, json.dumps([GOOD_RUN])),
        (1, "yesterday", json.dumps([GOOD_RUN])),
        (1, float("inf"), json.dumps([GOOD_RUN])),  # (SQLite keeps no NaN: it is NULL)
    ],
)
def test_a_kept_baseline_row_that_does_not_read_is_no_baseline_never_an_error(
    tmp_path: Path, concurrency: Any, at: Any, runs: str
) -> None:
    """The speed-up gate reads the kept baseline after the canary has switched: a row another
    writer or a damaged store left there was a traceback at that point (``current`` new, the
    READY record old, the run in no history). It is skipped; the last row that reads is the
    baseline."""
    db = StateDB(tmp_path)
    try:
        db.keep_baseline("k", "target", "n0", {1: [GOOD_RUN], 2: [GOOD_RUN]})
        with db._tx() as cur:
            cur.execute(
                "INSERT INTO speedup_baselines (at, key, concurrency, host, what, runs) VALUES (?, ?, ?, ?, ?, ?)",
                (at, "k", concurrency, "evil", "x", runs),
            )
        kept = db.baseline("k")
        assert sorted(kept) == [1, 2] and {v["host"] for v in kept.values()} == {"n0"}
    finally:
        db.close()


@pytest.mark.parametrize(
    "run",
    [
        {**GOOD_RUN, "wall_s": "2"},
        {**GOOD_RUN, "wall_s": float("nan")},
        {**GOOD_RUN, "requests": [[32, -1.0, 0.1]]},
        {**GOOD_RUN, "requests": [[32, 1.0]]},
        {**GOOD_RUN, "requests": {"a": 1}},
        {**GOOD_RUN, "served": [1, 2]},
        {**GOOD_RUN, "served": [1, float("inf"), 32, 31, 0.9, 0, 0]},
        {**GOOD_RUN, "concurrency": True},
    ],
)
def test_a_kept_run_whose_figures_are_not_counts_or_times_does_not_read(run: dict[str, Any]) -> None:
    """Each figure of a kept run is a finite number, never below 0: anything else is a run that
    does not read (ValueError or TypeError, which the drift check takes as no baseline)."""
    assert su.Run.from_json(GOOD_RUN).wall_s == 2.0
    with pytest.raises((ValueError, TypeError)):
        su.Run.from_json(run)


def test_observed_load_another_writer_damaged_is_no_observation(tmp_path: Path) -> None:
    """``concurrency: observed`` takes its levels from the stored rounds: text, a blob, infinity
    or a negative count there was a traceback; they are not observations."""
    db = StateDB(tmp_path)
    try:
        with db._tx() as cur:
            for running in (3, 5.0, "three", float("inf"), -2, 1e30, b"\x00"):
                cur.execute(
                    "INSERT INTO serving_load (at, host, running) VALUES (?, ?, ?)", (time.time(), "a", running)
                )
        assert db.observed_load(["a"], 0) == [("a", 3.0), ("a", 5.0)]
        assert su.observed_levels(db.observed_load(["a"], 0), None)[0] == (3, 5)
    finally:
        db.close()
