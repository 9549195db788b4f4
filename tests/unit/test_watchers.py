"""Two watchers of one group on one store (a real PostgreSQL, and the SQLite default): both run
rounds and serve metrics, one leads (records, runs --on-change). The leader is killed by PID, a
host is then made DEGRADED (a stale drafter config and a restart behind our back, then live
traffic), and the follower takes the lead, reports it, and --on-change runs once for it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.rules.watch import DEGRADED, READY
from orchestrator.store.state import StateDB
from tests.postgres import Postgres
from tests.unit.localbox import GOOD_MASK, Box, deploy, ended, free_port
from tests.unit.test_watch import complete, restart_by_hand

REPO = Path(__file__).resolve().parents[2]


class Watch:
    """``orchestrate watch`` as a process, its stderr lines read as they come."""

    def __init__(self, box: Box, playbook: Path, env: dict[str, str], port: int, changes: Path) -> None:
        argv = [sys.executable, "-m", "orchestrator", "watch", str(playbook), "-i", str(box.inventory_path)]
        argv += [
            "--interval",
            "1",
            "--metrics-port",
            str(port),
            "--on-change",
            f"cat >> {changes}; echo >> {changes}",
        ]
        self.port = port
        self.proc = subprocess.Popen(
            argv, env={**os.environ, "PYTHONPATH": str(REPO), **env}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, pattern: str, within: float = 60.0) -> str:
        deadline = time.monotonic() + within
        while True:
            for line in self.seen:
                if re.search(pattern, line):
                    return line
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.proc.poll() is None, (pattern, "\n".join(self.seen[-20:]))
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=min(remaining, 0.2)))

    def leader_metric(self) -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        found = re.search(r"^dflash_orchestrator_watch_leader\{[^}]*\} (\S+)$", text, re.M)
        return float(found.group(1)) if found else None

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.mark.parametrize("store", ["postgresql", "sqlite"])
def test_the_follower_takes_the_lead_when_the_leader_is_killed_and_reports_once(
    box: Box, tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    if store == "postgresql":
        pg: Postgres = request.getfixturevalue("postgres")
        env = {"ORCHESTRATE_STATE_URL": pg.socket_url(pg.new_database())}
    else:
        env = {"ORCHESTRATE_STATE_DIR": str(tmp_path / "state")}
    env["ORCHESTRATE_STATE_DIR"] = env.get("ORCHESTRATE_STATE_DIR", str(tmp_path / "state"))
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    changes = tmp_path / "changes.jsonl"
    first = Watch(box, playbook.file, env, free_port(), changes)
    second: Watch | None = None
    try:
        first.wait_for(r"watch group pb@[0-9a-f]{8}: leading")
        first.wait_for(r"round \d+: 1 READY")
        second = Watch(box, playbook.file, env, free_port(), changes)
        following = second.wait_for(r"watch group pb@[0-9a-f]{8}: following ")
        assert f"pid {first.proc.pid}" in following
        second.wait_for(r"round \d+: 1 READY")
        assert (first.leader_metric(), second.leader_metric()) == (1.0, 0.0)  # both serve metrics
        os.kill(first.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        first.proc.wait(30)
        took = second.wait_for(r"watch group pb@[0-9a-f]{8}: taking the lead")
        takeover_s = time.monotonic() - killed
        # DEGRADED now: the founding incident's stale config, a restart behind our back, traffic
        served = box.root("solo") / "current" / "drafter" / "config.json"
        served.write_text(served.read_text().replace(f'"mask_token_id": {GOOD_MASK}', '"mask_token_id": 9'))
        restart_by_hand(box)
        deadline = time.monotonic() + 60
        while not any(json.loads(line)["to"] == DEGRADED for line in _lines(changes)):
            assert time.monotonic() < deadline, second.seen[-20:]
            complete(box)
        assert second.leader_metric() == 1.0
    finally:
        first.end()
        if second is not None:
            second.end()
    told = [(c["from"], c["to"]) for c in map(json.loads, _lines(changes))]
    assert told.count(("DRIFT", DEGRADED)) + told.count((READY, DEGRADED)) == 1, told  # once, by the new lead
    assert "0 changes to tell" in took  # nothing happened between the kill and the takeover
    db = StateDB(tmp_path / "state", env.get("ORCHESTRATE_STATE_URL"))
    try:
        recorded = [(t["from"], t["to"]) for t in db.transitions("solo")]
    finally:
        db.close()
    assert recorded[0] == (None, READY) and recorded[-1][1] == DEGRADED
    assert len(recorded) == len(set(recorded))  # each change recorded once, by one watcher
    print(f"takeover after the kill: {takeover_s:.2f} s at --interval 1")
    assert ended(first.proc.pid)


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
