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

import pytest

from orchestrator.deployment import Deployment
from orchestrator.engine.observer import Observer
from orchestrator.engine.watcher import WatchGroup
from orchestrator.rules.watch import READY
from orchestrator.store.state import LockHeld, StateDB, whoami
from tests.postgres import Postgres
from tests.unit.localbox import OPTIONS, Box, deploy

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
