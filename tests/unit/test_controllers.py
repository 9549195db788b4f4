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
import time
from pathlib import Path

from orchestrator.store.state import StateDB, whoami
from tests.postgres import Postgres
from tests.unit.localbox import Box

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
        # its session ended with it, and the lease with the session: taken at once, no waiting
        with db.rollout_lock(
            ["solo"], "deploy after the crash", 5.0, lambda n, h: (_ for _ in ()).throw(AssertionError(h))
        ):
            assert db._query("SELECT run FROM leases WHERE name = 'solo'") == [("deploy after the crash",)]
    finally:
        db.close()
    code, _, err = finish(orchestrate(box, url, "deploy", str(slow.file)))
    assert code == 0, err
    assert "waiting for solo" not in err
