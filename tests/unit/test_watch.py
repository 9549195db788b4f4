"""``orchestrate watch``: what a round decides (pure), and whole watches through the real agent.

The whole watches run the real agent in a kept session over the ``local`` connector, against the
stand-in server (``standin_vllm.py``: its acceptance follows the drafter config it loaded, and
SIGHUP stands in for a restart behind our back). tests/integration/test_watch.py does it again
over SSH against real vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.cli import main as cli
from orchestrator.config.playbook import AcceptanceGate, Playbook, load_playbook
from orchestrator.deployment import Deployment
from orchestrator.engine.observer import Observer
from orchestrator.engine.watcher import Watcher
from orchestrator.errors import InputError
from orchestrator.results import GATE_FILES, GATE_HEALTH, GATE_READY, FileState, Gate, HostReport
from orchestrator.rules import probe
from orchestrator.rules.watch import DEGRADED, DOWN, DRIFT, READY, HostWatch, Seen, changed_fields, step
from orchestrator.store import metrics
from orchestrator.store.state import StateDB
from tests.unit import localbox
from tests.unit.localbox import GOOD_MASK, OPTIONS, Box, K, alive, deploy, ended, free_port, immutable, stop

GATE = AcceptanceGate(min_mean_acceptance_length=3.0, min_drafts=50)

# --- one round, pure ------------------------------------------------------------------------


def report(files_ok: bool = True, healthy: bool = True, ready_ok: bool = True) -> HostReport:
    r = HostReport("gpu-a")
    r.release_id = "R1"
    digest = "a" * 64
    r.files = [
        FileState("drafter/config.json", "/srv/current/drafter/config.json", digest if files_ok else "b" * 64, digest)
    ]
    r.gates[GATE_FILES] = Gate(files_ok, "in sync" if files_ok else "drift: drafter/config.json")
    r.gates[GATE_HEALTH] = Gate(healthy, "pid 7 alive, /health 200" if healthy else "the server is not running")
    r.gates[GATE_READY] = Gate(ready_ok, "READY record matches" if ready_ok else "restarted since READY")
    return r


def counters(drafts: float, accepted_per_draft: float, k: int = 7) -> probe.Counters:
    return probe.Counters(drafts, drafts * k, drafts * accepted_per_draft)


def seen(at: float, c: probe.Counters | None, pid: int = 7, **kw: Any) -> Seen:
    return Seen(at, report=kw.pop("report", None) or report(), counters=c, server_pid=pid, **kw)


def test_a_quiet_window_stays_open_across_rounds_until_it_holds_enough_drafts() -> None:
    w = HostWatch("gpu-a")
    w, r, t = step(w, seen(0, counters(100, 6)), GATE)
    assert r.state == READY and r.live is None and r.window_drafts == 0
    assert t is not None and t.before is None and t.after == READY
    w, r, t = step(w, seen(30, counters(130, 6)), GATE)  # 30 drafts: not enough to judge
    assert r.state == READY and r.live is None and r.window_drafts == 30 and t is None
    w, r, _ = step(w, seen(60, counters(160, 6)), GATE)  # 60 drafts since the window opened
    assert r.live is not None and r.live.ok and r.live.drafts == 60 and r.live.since == 0
    assert r.live.mean_acceptance_length == pytest.approx(7.0)
    w, r, _ = step(w, seen(90, counters(170, 6)), GATE)  # a new window: 10 drafts so far
    assert r.window_drafts == 10 and r.live is not None and r.live.until == 60  # the last verdict stays


def test_a_full_window_of_rejected_drafts_is_degraded_even_while_the_files_drift() -> None:
    w, _, _ = step(HostWatch("gpu-a"), seen(0, counters(0, 0)), GATE)
    drifting = report(files_ok=False)
    w, r, t = step(w, seen(30, counters(40, 0.05), report=drifting), GATE)
    assert r.state == DRIFT and t is not None and (t.before, t.after) == (READY, DRIFT)
    w, r, t = step(w, seen(60, counters(200, 0.05), report=drifting), GATE)
    assert r.state == DEGRADED and t is not None and (t.before, t.after) == (DRIFT, DEGRADED)
    assert r.live is not None and r.live.mean_acceptance_length == pytest.approx(1.05)
    assert any(reason.startswith("live traffic: mean acceptance length 1.05 < 3.0") for reason in r.reasons)
    assert "drift: drafter/config.json" in r.reasons  # both said


def test_a_counter_reset_is_a_restart_never_negative_acceptance() -> None:
    w, _, _ = step(HostWatch("gpu-a"), seen(0, counters(1000, 6)), GATE)
    w, r, _ = step(w, seen(30, counters(1100, 6)), GATE)
    assert r.live is not None and r.live.ok
    w, r, _ = step(w, seen(60, counters(20, 0.1)), GATE)  # went down: restarted, same pid
    assert r.restarted == "the spec-decode counters went down: the server restarted"
    assert r.live is None and r.window_drafts == 0 and r.state == READY  # the old verdict is dropped
    w, r, _ = step(w, seen(90, counters(120, 0.1)), GATE)
    assert r.state == DEGRADED and r.live is not None and r.live.drafts == 100 and r.restarted is None


def test_a_new_server_pid_is_a_restart_even_when_the_counters_only_grew() -> None:
    w, _, _ = step(HostWatch("gpu-a"), seen(0, counters(10, 6), pid=7), GATE)
    w, r, _ = step(w, seen(30, counters(500, 6), pid=8), GATE)
    assert r.restarted == "the server restarted (pid 7 -> 8)"
    assert r.live is None and r.window_drafts == 0  # the window starts at the new server's counters


def test_a_window_that_can_never_be_judged_is_said_and_never_ready() -> None:
    """Each of these left the window open and the host READY for ever: traffic that generates
    tokens and no drafts (speculation does not run for it), a server that shows some spec-decode
    counters but not one the verdict needs, counters that contradict each other."""
    w, r, _ = step(HostWatch("gpu-a"), seen(0, probe.Counters(100, 700, 600, generated=1000)), GATE)
    w, r, _ = step(w, seen(30, probe.Counters(100, 700, 600, generated=1049)), GATE)
    assert r.state == READY  # 49 tokens: fewer than a window's drafts, so not yet said
    w, r, t = step(w, seen(60, probe.Counters(100, 700, 600, generated=1050)), GATE)
    assert r.state == DEGRADED and t is not None and (t.before, t.after) == (READY, DEGRADED)
    assert r.reasons[0] == (
        "50 tokens generated since the last draft: speculative decoding is not running for this traffic"
    )
    w, r, t = step(w, seen(90, probe.Counters(160, 1120, 960, generated=1500)), GATE)  # drafts flow again
    assert r.state == READY and r.live is not None and r.live.ok and r.live.drafts == 60
    # A window judged mid-traffic leaves the last few drafts in the next one (seen on real vLLM:
    # 42 judged, 6 left): tokens without drafts after them are said all the same.
    w, r, _ = step(w, seen(120, probe.Counters(166, 1162, 1002, generated=1548)), GATE)
    assert r.state == READY and r.window_drafts == 6
    w, r, t = step(w, seen(150, probe.Counters(166, 1162, 1002, generated=1598)), GATE)
    assert r.state == DEGRADED and r.reasons[0].startswith("50 tokens generated since the last draft")

    for counters, why in (
        (probe.Counters(60, 420, 360, shown=frozenset({"drafts", "accepted"})), "but not vllm:spec_decode_num_draft"),
        (probe.Counters(60, 0, 0), "60 drafts but 0 draft tokens"),
        (probe.Counters(0, 420, 0), "420 draft tokens in no draft"),
        (probe.Counters(60, 420, 900), "900 tokens accepted of 420 drafted"),
    ):
        w, r, _ = step(HostWatch("gpu-a"), seen(0, probe.Counters(0, 0, 0)), GATE)
        w, r, _ = step(w, seen(30, counters), GATE)
        assert r.state == DEGRADED and r.live is None, (counters, r)
        assert r.reasons[0].startswith("acceptance cannot be judged: ") and why in r.reasons[0], r.reasons


def test_down_when_unreachable_or_unhealthy_and_no_counters_is_degraded() -> None:
    w, r, t = step(HostWatch("gpu-a"), Seen(0, error="connect to 10.0.0.9:22 timed out"), GATE)
    assert r.state == DOWN and r.reasons == ("connect to 10.0.0.9:22 timed out",) and t is not None
    w, r, _ = step(w, seen(30, None, report=report(healthy=False)), GATE)
    assert r.state == DOWN and r.reasons[0] == "the server is not running"
    w, r, _ = step(w, seen(60, None), GATE)
    assert r.state == DEGRADED and "no vllm:spec_decode_* counters" in r.reasons[0]
    w, r, _ = step(w, seen(90, None, metrics_error="GET /metrics failed: 500"), GATE)
    assert r.state == DEGRADED and r.reasons[0] == "acceptance cannot be read: GET /metrics failed: 500"


def test_a_stale_ready_record_is_drift_and_a_rank_without_http_needs_no_counters() -> None:
    _w, r, _ = step(HostWatch("gpu-a"), seen(0, counters(0, 0), report=report(ready_ok=False)), GATE)
    assert r.state == DRIFT and r.reasons == ("restarted since READY",)
    rank = Seen(0, report=report(), head=False, server_pid=9)
    assert step(HostWatch("gpu-b"), rank, GATE)[1].state == READY


def test_changed_fields_are_named_by_their_path() -> None:
    want = {"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17]}, "use_swa": True}
    got = {"dflash_config": {"mask_token_id": 151643, "target_layer_ids": [1, 2]}, "extra": 1}
    assert changed_fields("drafter/config.json", json.dumps(want).encode(), json.dumps(got).encode()) == [
        "drafter/config.json: dflash_config.mask_token_id 151669 -> 151643",
        "drafter/config.json: dflash_config.target_layer_ids [1, 9, 17] -> [1, 2]",
        "drafter/config.json: extra added (1)",
        "drafter/config.json: use_swa removed (was true)",
    ]
    assert changed_fields("a.json", b"{}", b"not json") == []
    assert changed_fields("a.json", b'{"x": 1}', b'{"x": 1.0}') == ["a.json: x 1 -> 1.0"]


@pytest.mark.usefixtures("loopback")
def test_metrics_are_served_with_prometheus_names_and_values() -> None:
    w, good, _ = step(HostWatch("gpu-a"), seen(0, counters(0, 0)), GATE)
    w, good, _ = step(w, seen(30, counters(100, 6)), GATE)
    v, bad, _ = step(HostWatch("gpu-b"), seen(0, counters(0, 0), report=report(files_ok=False)), GATE)
    v, bad, _ = step(v, seen(30, counters(100, 0.5), report=report(files_ok=False)), GATE)
    # the READY record's speed-up per concurrency, as verify's ready gate reads it from the record
    recorded = [{"concurrency": 1, "speedup": 2.25}, {"concurrency": 64, "speedup": 0.91}]
    good = dataclasses.replace(good, gates={**good.gates, "ready": {"ok": True, "detail": "", "speedup": recorded}})
    collector = metrics.WatchCollector("pb")
    collector.update([good, bad], leader=True)
    port = free_port()
    server = metrics.serve(collector, port, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    p = "dflash_orchestrator_"

    def value(name: str, host: str, **labels: str) -> float:
        return samples[(p + name, tuple(sorted({"host": host, **labels}.items())))]

    assert value("host_state", "gpu-a", dflash_orchestrator_host_state="READY") == 1
    assert value("host_state", "gpu-a", dflash_orchestrator_host_state="DEGRADED") == 0
    assert value("host_state", "gpu-b", dflash_orchestrator_host_state="DEGRADED") == 1
    assert value("mean_acceptance_length_tokens", "gpu-a") == pytest.approx(7.0)
    assert value("mean_acceptance_length_tokens", "gpu-b") == pytest.approx(1.5)
    assert value("acceptance_rate_ratio", "gpu-a") == pytest.approx(6 / 7)
    assert value("window_drafts", "gpu-b") == 100
    assert value("files_in_drift", "gpu-a") == 0 and value("files_in_drift", "gpu-b") == 1
    assert (
        value("last_good_round_age_seconds", "gpu-a") >= 0
        and (p + "last_good_round_age_seconds", (("host", "gpu-b"),)) not in samples
    )
    assert value("release_info", "gpu-a", release_id="R1") == 1
    assert value("state_rounds", "gpu-a") == 2 and value("state_rounds", "gpu-b") == 1  # what alerts count
    assert value("live_min_mean_acceptance_length_tokens", "gpu-b") == GATE.min_mean_acceptance_length
    assert samples[(p + "watch_leader", (("group", "pb"),))] == 1
    assert value("speedup_ratio", "gpu-a", concurrency="1") == 2.25
    assert value("speedup_ratio", "gpu-a", concurrency="64") == 0.91
    assert not any(name == p + "speedup_ratio" and ("host", "gpu-b") in labels for name, labels in samples)
    # Prometheus' own linter finds nothing to say of the names, types and help
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, ""), lint


# --- whole watches through the real agent ------------------------------------------------------


def complete(box: Box, requests: int = 4, tokens: int = 64) -> None:
    """Production traffic, as a client sends it (not the probe's)."""
    for _ in range(requests):
        body = json.dumps({"model": "tiny", "prompt": "def f():", "max_tokens": tokens}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{box.port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


def restart_by_hand(box: Box) -> None:
    """SIGHUP the stand-in (a restart behind our back: the drafter config read again, counters at
    zero), and wait until its counters show it."""
    os.kill(box.pid("solo"), signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{box.port}/metrics", timeout=10) as response:
            counters = probe.parse(response.read().decode())
        if counters is not None and counters.drafts == 0:
            return
        assert time.monotonic() < deadline, "the stand-in did not restart its counters"
        time.sleep(0.02)


def watcher(box: Box, playbook: Playbook) -> Watcher:
    inv = box.inventory
    return Deployment(playbook, inv, OPTIONS).watcher()


def test_the_founding_incident_replayed_under_watch(box: Box) -> None:
    playbook = box.playbook()
    first = deploy(box, playbook)
    assert first.ok
    w = watcher(box, playbook)
    try:
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (None, READY) and r.window_drafts == 0
        session_pid = w.watched[0].session.pid if w.watched[0].session else None
        complete(box)
        (r,), changes = w.round()
        assert r.state == READY and not changes
        assert r.live is not None and r.live.mean_acceptance_length == pytest.approx(K + 1)
        # Out of band: a stale drafter config lands where the server reads it, and the server is
        # restarted by hand (SIGHUP: it reads the file again, its counters start at zero).
        served = box.root("solo") / "current" / "drafter" / "config.json"
        served.write_text(served.read_text().replace(f'"mask_token_id": {GOOD_MASK}', '"mask_token_id": 9'))
        restart_by_hand(box)
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (READY, DRIFT)
        assert "drafter/config.json: dflash_config.mask_token_id 5 -> 9" in r.reasons
        assert r.restarted == "the spec-decode counters went down: the server restarted"
        complete(box)
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (DRIFT, DEGRADED)
        assert r.live is not None and r.live.mean_acceptance_length == pytest.approx(1.0)
        assert r.reasons[0].startswith("live traffic: mean acceptance length 1.00 < 4.0")
        # Every round went over one session: one agent process, one exec.
        assert w.watched[0].session is not None and w.watched[0].session.pid == session_pid
        assert w.connections.counters(w.watched[0].node.name).execs == 1
        server = box.pid("solo")
        os.killpg(server, signal.SIGKILL)
        assert ended(server)
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (DEGRADED, DOWN) and r.reasons[0] == "the server is not running"
    finally:
        w.close()
    assert session_pid is not None and not alive(session_pid)  # the agent ends with the watch


def test_a_server_put_to_sleep_is_down_under_watch_and_ready_again_once_woken(box: Box) -> None:
    """vLLM asleep (its sleep routes opened in the container's own environment, outside the
    playbook) answers /health 200 and serves nothing: watch says DOWN with vLLM's words, and READY
    once it is woken."""
    python = box.dir / "bin" / "python"
    python.write_text(f"#!/bin/sh\nVLLM_SERVER_DEV_MODE=1 exec {python.read_text().split('exec ', 1)[1]}")
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    w = watcher(box, playbook)

    def post(path: str) -> None:
        asked = urllib.request.Request(f"http://127.0.0.1:{box.port}{path}", data=b"", method="POST")
        with urllib.request.urlopen(asked, timeout=10) as answer:
            assert answer.status == 200

    try:
        (r,), _ = w.round()
        assert r.state == READY
        post("/sleep?level=1")
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (READY, DOWN)
        assert r.reasons[0].endswith(
            "but vLLM is asleep (POST /sleep): every request waits in its queue until POST /wake_up"
        )
        post("/wake_up")
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (DOWN, READY)
    finally:
        w.close()


def test_a_watch_that_rolls_back_takes_a_degraded_host_back_once_and_it_is_ready_again(box: Box) -> None:
    """The founding incident under ``watch --rollback-on degraded``: a stale drafter config lands
    behind the tool's back and the server reads it; once the host has been DEGRADED for the rounds
    asked, it is rolled back on its own (the previous release started and proven, READY), and live
    traffic is accepted again; the host is then said to serve another release than the playbook's
    (DRIFT) until people deploy again. A host DEGRADED again is not rolled back a second time."""
    first = deploy(box, box.playbook())
    (box.dir / "notes.txt").write_text("the second release\n")
    playbook = box.playbook()
    second = deploy(box, playbook)
    assert first.ok and second.ok and first.release_id != second.release_id
    said: list[str] = []

    class Said(Observer):
        def say(self, message: str) -> None:
            said.append(message)

    w = watcher(box, playbook)
    rollbacks = Deployment(playbook, box.inventory, OPTIONS, observer=Said()).rollbacks(after=2, watcher=w)
    try:
        served = box.root("solo") / "current" / "drafter" / "config.json"
        served.write_text(served.read_text().replace(f'"mask_token_id": {GOOD_MASK}', '"mask_token_id": 9'))
        restart_by_hand(box)
        (r,), _ = w.round()  # the window opens: drift seen, acceptance not yet judged
        assert r.state == DRIFT and rollbacks([r]) == []
        complete(box)
        (r,), _ = w.round()
        assert r.state == DEGRADED and r.state_rounds == 1
        assert rollbacks([r]) == []  # one round: not yet
        complete(box)
        (r,), _ = w.round()
        assert r.state == DEGRADED and r.state_rounds == 2
        (report,) = rollbacks([r])
        assert report.kind == "rollback" and report.ok, report.hosts[0].gates
        assert box.current("solo").endswith(str(first.release_id))
        assert "solo: DEGRADED for 2 rounds: rolling it back" in said
        assert any(line.startswith("solo: rollback READY") for line in said), said
        (r,), _ = w.round()  # the new server seen: its window opens
        assert r.restarted is not None and r.state != DEGRADED
        complete(box)
        (r,), _ = w.round()
        # Back on the previous release: its drafter's tokens accepted again, and the host said to
        # serve another release than the playbook's (its notes.txt is the first release's) until
        # people deploy again.
        assert r.state == DRIFT and r.release_id == first.release_id, r.reasons
        assert r.live is not None and r.live.mean_acceptance_length == pytest.approx(K + 1)
        # Said first, in every later round: why the host is not on the playbook's release.
        assert r.reasons[0].startswith("rolled back by this watch at "), r.reasons
        assert (
            f"from release {second.release_id} (DEGRADED for 2 rounds) to release {first.release_id}: it serves "
            "that release, not the playbook's; deploy again to go forward"
        ) in r.reasons[0]
        assert any("notes.txt has sha256" in reason for reason in r.reasons), r.reasons
        again = replace(r, state=DEGRADED, state_rounds=5)
        assert rollbacks([again]) == []  # once a watch: a rollback that did not help is left to people
    finally:
        w.close()


def test_a_rollback_that_cannot_start_is_said_and_the_watch_goes_on() -> None:
    from orchestrator.engine.watcher import RollBack
    from orchestrator.rules.watch import Round

    said: list[str] = []
    asked: list[str] = []

    def refuse(host: str) -> Any:
        asked.append(host)
        raise InputError("no release before 20261207T000000Z-000000 to go back to")

    rollbacks = RollBack(refuse, 2, said.append)
    degraded = [Round(h, 0.0, DEGRADED, ("live traffic",), "r2", None, 0, 50, 0, None, None) for h in ("a", "b")]
    assert rollbacks([replace(degraded[0], state_rounds=2), degraded[1]]) == []
    assert asked == ["a"]  # b: one round only
    assert said[-1] == "a: rollback not run: no release before 20261207T000000Z-000000 to go back to"
    assert rollbacks([replace(degraded[0], state_rounds=3)]) == [] and asked == ["a"]  # once a watch


def test_a_rollback_by_the_watch_that_fails_is_said_first_in_the_hosts_later_rounds() -> None:
    """A watch's rollback that ran and failed (the release before does not pass either): the host's
    later rounds say so first, with the run's last word, so nobody takes its state for the
    playbook's release failing. The rollback's report and the watcher stand in (a failed rollback
    of a real host is a test of its own in test_runs.py): what is held is the sentence the watch
    hands its watcher; a real watcher says it in test_a_watch_that_rolls_back_takes_a_degraded_host_back."""
    from types import SimpleNamespace

    from orchestrator.engine.watcher import RollBack
    from orchestrator.results import RunReport
    from orchestrator.rules.watch import Round

    host = HostReport("a", release_id="r1", previous="r2", changed=True)
    host.gates["health"] = Gate(False, "pid 7 alive, but /health does not answer")
    host.diagnosis.append("rolled back to release r1, but it does not pass either (a: ...): stopped")
    failed = RunReport("rollback", "p.yaml", "i.yaml", "r1", [host], started=1796601600.0)
    told = SimpleNamespace(went_back={})
    rollbacks = RollBack(lambda name: failed, 2, lambda line: None, told)  # type: ignore[arg-type]
    degraded = Round("a", 0.0, DEGRADED, ("live traffic",), "r2", None, 0, 50, 0, None, None, state_rounds=2)
    assert rollbacks([degraded]) == [failed]
    assert told.went_back == {
        "a": "this watch's rollback at 00:00:00Z from release r2 failed: "
        "rolled back to release r1, but it does not pass either (a: ...): stopped"
    }


def test_a_watch_that_rolls_back_is_refused_where_it_cannot_through_the_cli(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    files = localbox.files_only_book(box, "files", ["solo"])
    argv = ["watch", str(files), "-i", str(box.inventory_path), "--once", "--rollback-on", "degraded"]
    assert cli.main(argv) == 2
    assert "--rollback-on rolls back a server: the playbook serves none" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        cli.main([*argv, "--rollback-after", "0"])
    assert refused.value.code == 2
    assert "--rollback-after: must be at least 1" in capsys.readouterr().err


def test_a_watch_that_rolls_back_needs_a_single_host_server(box: Box) -> None:
    with pytest.raises(InputError, match="a multi_node group is rolled back whole"):
        Deployment(box.group(), box.inventory, OPTIONS).rollbacks(after=2)
    files = load_playbook(localbox.files_only_book(box, "files", ["solo"]))
    with pytest.raises(InputError, match="the playbook serves none"):
        Deployment(files, box.inventory, OPTIONS).rollbacks(after=2)


def test_traffic_that_speculation_does_not_run_for_is_said_through_the_real_agent(box: Box) -> None:
    """One-token completions (the prefill makes the token, no draft follows): the window never fills,
    and the host left READY was watched blind. Said once the tokens pass a window's drafts, then READY
    on a judged window once drafts flow."""
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    w = watcher(box, playbook)
    try:
        assert w.round()[0][0].state == READY
        complete(box, requests=playbook.gates.live.min_drafts, tokens=1)
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (READY, DEGRADED) and r.live is None
        assert f"{playbook.gates.live.min_drafts} tokens generated since the last draft" in r.reasons[0]
        complete(box)
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (DEGRADED, READY) and r.live is not None and r.live.ok
    finally:
        w.close()


def test_a_killed_agent_is_replaced_in_the_same_round_and_said(box: Box) -> None:
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    w = watcher(box, playbook)
    try:
        assert w.round()[0][0].state == READY
        session = w.watched[0].session
        assert session is not None and session.pid is not None
        old = session.pid
        os.kill(old, signal.SIGKILL)
        (r,), changes = w.round()
        assert r.state == READY and not changes
        # Found as it is sent or as it is read, whichever comes first: both say what ended.
        said = ("reconnected (the agent ended its session", "reconnected (the command ended while we were sending")
        assert r.reasons[-1].startswith(said), r.reasons
        fresh = w.watched[0].session
        assert fresh is not None and fresh.pid not in (None, old)
        assert w.connections.counters(w.watched[0].node.name).execs == 2
    finally:
        w.close()


def test_an_unreachable_host_is_down_every_round_with_its_backoff_said(box: Box) -> None:
    playbook = box.playbook()
    inventory = yaml.safe_load(box.inventory_path.read_text())
    inventory["hosts"]["this-box"]["containers"]["solo"]["python"] = "/nonexistent/python3"
    box.inventory_path.write_text(yaml.safe_dump(inventory))
    w = watcher(box, playbook)
    try:
        (r,), (_t,) = w.round()
        assert r.state == DOWN and "/nonexistent/python3" in r.reasons[0]
        (r,), changes = w.round()  # within the backoff: said, not tried again
        assert r.state == DOWN and r.reasons[0].endswith("(trying again in 1 s)") and not changes
    finally:
        w.close()


def test_watch_once_through_the_cli_runs_on_change_and_records(
    box: Box, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    served = box.root("solo") / "current" / "notes.txt"
    served.write_text("edited by hand\n")
    changes = tmp_path / "changes.jsonl"
    state = tmp_path / "state"
    argv = ["watch", str(playbook.file), "-i", str(box.inventory_path), "--once", "--json", "--state-dir", str(state)]
    argv += ["--on-change", f"cat >> {changes}"]
    code = cli.main(argv)
    assert code == 1
    out = json.loads(capsys.readouterr().out)
    (host,) = out["hosts"]
    assert host["state"] == DRIFT and host["gates"]["files"]["ok"] is False
    (change,) = [json.loads(line) for line in changes.read_text().splitlines()]
    assert (change["host"], change["from"], change["to"]) == ("solo", None, DRIFT)
    assert any("notes.txt" in reason for reason in change["reasons"])
    from orchestrator.store.state import StateDB

    db = StateDB(state)
    try:
        (recorded,) = db.transitions("solo")
    finally:
        db.close()
    assert recorded == change
    served.write_text("release notes\n")
    assert cli.main(argv) == 0  # READY again: no change command for a host that starts fine
    assert json.loads(capsys.readouterr().out)["hosts"][0]["state"] == READY
    assert changes.read_text().count("\n") == 1
    assert cli.main([a for a in argv if a != "--json"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["HOST", "STATE", "RELEASE", "DETAIL"] and table[1].split()[:2] == ["solo", READY]
    assert table[1].endswith("no window judged yet: 0 of the 10 drafts needed")  # a window says what it lacks
    assert table[-1] == "watch: 1/1 hosts READY"


def test_the_target_model_files_are_watched_and_a_missing_one_is_drift_not_down(box: Box) -> None:
    from tests.unit.test_models import model_dirs, with_models

    target, _ = model_dirs(box)
    playbook = with_models(box)
    assert deploy(box, playbook).ok
    w = watcher(box, playbook)
    try:
        (r,), _ = w.round()
        assert r.state == READY and r.gates["models"]["ok"], r.gates
        weights = target / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
        (r,), (t,) = w.round()
        assert (t.before, t.after) == (READY, DRIFT) and "model.safetensors has sha256" in r.gates["models"]["detail"]
        target.rename(target.with_name("target.moved"))  # the directory gone: its op fails on the host
        (r,), _ = w.round()
        assert r.state == DRIFT and not r.gates["models"]["ok"] and r.gates["health"]["ok"], r.gates
        assert r.gates["models"]["detail"].startswith("model_files"), r.gates["models"]
        assert r.live is not None or r.window_drafts is not None  # the ops after it were still read
    finally:
        w.close()


def test_a_group_is_watched_node_by_node_and_a_dead_rank_takes_the_group_down(box: Box) -> None:
    playbook = box.group()
    assert deploy(box, playbook).ok
    w = watcher(box, playbook)
    try:
        rounds, _ = w.round()
        assert [(r.host, r.state) for r in rounds] == [("n0", READY), ("n1", READY)]
        assert rounds[0].window_drafts == 0 and rounds[1].window_drafts is None  # counters: the head's
        os.kill(box.pid("n1"), signal.SIGKILL)
        assert ended(box.pid("n1"))
        rounds, changes = w.round()
        assert [(r.host, r.state) for r in rounds] == [("n0", DOWN), ("n1", DOWN)]
        assert rounds[1].reasons[0] == "headless rank is not running"
        assert rounds[0].reasons == ("its group is down: n1 not running or unreachable",)
        assert [(t.host, t.before, t.after) for t in changes] == [("n0", READY, DOWN), ("n1", READY, DOWN)]
    finally:
        w.close()


def test_a_running_watch_prints_rounds_ends_on_sigterm_and_leaves_no_agent(box: Box, tmp_path: Path) -> None:
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    argv = [sys.executable, "-m", "orchestrator", "watch", str(playbook.file), "-i", str(box.inventory_path)]
    proc = subprocess.Popen(
        [*argv, "--interval", "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    try:
        rounds = [json.loads(proc.stdout.readline()) for _ in range(2)]  # one JSON line a round
        assert [r["round"] for r in rounds] == [1, 2]
        assert rounds[0]["transitions"][0]["to"] == READY and rounds[1]["transitions"] == []
        agents = [p for p in children(proc.pid) if "dflash-agent" in cmdline(p)]
        assert len(agents) == 1  # one agent for the whole watch, not one a round
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert ended(agents[0])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert b"Traceback" not in proc.stderr.read() if proc.stderr else True


def test_a_running_watch_rolls_a_degraded_host_back_between_its_rounds(box: Box, tmp_path: Path) -> None:
    """``orchestrate watch --rollback-on degraded`` as a process: the founding incident on its
    host, and the watch itself takes it back to the previous release between two rounds."""
    first = deploy(box, box.playbook())
    (box.dir / "notes.txt").write_text("the second release\n")
    playbook = box.playbook()
    assert first.ok and deploy(box, playbook).ok
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    argv = [sys.executable, "-m", "orchestrator", "watch", str(playbook.file), "-i", str(box.inventory_path)]
    argv += ["--interval", "1", "--json", "--rollback-on", "degraded", "--rollback-after", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        assert json.loads(proc.stdout.readline())["hosts"][0]["state"] == READY
        served = box.root("solo") / "current" / "drafter" / "config.json"
        served.write_text(served.read_text().replace(f'"mask_token_id": {GOOD_MASK}', '"mask_token_id": 9'))
        restart_by_hand(box)
        deadline = time.monotonic() + 90
        seen = []
        while True:
            with contextlib.suppress(OSError):  # the server restarts under the rollback
                complete(box)
            (host,) = json.loads(proc.stdout.readline())["hosts"]
            seen.append(host["state"])
            if host["release_id"] == first.release_id:
                break
            assert time.monotonic() < deadline, f"not rolled back within 90 s: {seen}"
        assert DEGRADED in seen and box.current("solo").endswith(str(first.release_id))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 1  # ended on SIGTERM, its host DRIFT (another release than the playbook's)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = proc.stderr.read().decode()
    assert "solo: DEGRADED for 1 round: rolling it back" in said and "solo: rollback READY" in said, said[-2000:]
    assert "Traceback" not in said


def test_a_metrics_port_in_use_is_bad_input_before_any_round(box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    playbook = box.playbook()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(
            ["watch", str(playbook.file), "-i", str(box.inventory_path), "--once", "--metrics-port", str(port)]
        )
    assert code == 2
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1: Address already in use" in capsys.readouterr().err


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_watch_outlives_its_own_bookkeeping(box: Box, tmp_path: Path) -> None:
    """A state database that stops taking writes while watch runs, and a host that goes down then:
    the transition is printed and judged, said not to be recorded (once), and the rounds go on;
    when the database takes writes again, the next transition is recorded and so it says. It used
    to end the watch at the first transition it could not record."""
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    state = tmp_path / "state"
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(state))
    argv = [sys.executable, "-m", "orchestrator", "watch", str(playbook.file), "-i", str(box.inventory_path)]
    proc = subprocess.Popen(
        [*argv, "--interval", "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None and proc.stderr is not None
    said = b""

    def until(words: bytes) -> None:
        nonlocal said
        deadline = time.monotonic() + 60
        while words not in said:
            assert time.monotonic() < deadline, said
            if select.select([proc.stderr], [], [], 0.5)[0]:
                said += os.read(proc.stderr.fileno(), 1 << 16)

    def state_now() -> str:
        return str(json.loads(proc.stdout.readline())["hosts"][0]["state"])  # type: ignore[union-attr]

    try:
        assert state_now() == READY
        immutable(state, True)
        try:
            assert stop(box, playbook).ok
            while state_now() == READY:
                pass  # rounds go on until the one that sees the server gone
            until(b"was not recorded (watching goes on)")
            assert state_now() == DOWN  # and go on after it
        finally:
            immutable(state, False)
        assert deploy(box, playbook).ok
        while state_now() != READY:
            pass  # the round that sees it back
        until(b"recorded again")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) >= 0  # it ends on SIGTERM after its round (its code: the last round's states)
    finally:
        immutable(state, False)
        if proc.poll() is None:
            proc.kill()
    said += proc.stderr.read()
    assert said.count(b"was not recorded (watching goes on)") == 1 and b"Traceback" not in said
    db = StateDB(state)
    try:
        moves = [(t["from"], t["to"]) for t in db.transitions()]
    finally:
        db.close()
    # The one it could not record is not there; what came after it (DOWN, through any DRIFT the
    # redeploy showed, to READY) is.
    assert moves[0] == (None, READY) and (READY, DOWN) not in moves
    assert moves[1][0] == DOWN and moves[-1][1] == READY


def test_on_change_runs_beside_the_rounds_never_inside_them(box: Box, tmp_path: Path) -> None:
    """An --on-change command that does not return (a pager that hangs) while the rounds go on:
    they used to wait for it, transition by transition. The command here waits on a pipe that
    the test opens only once two more rounds came out after the transition it was given."""
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    gate, told = tmp_path / "gate", tmp_path / "told"
    os.mkfifo(gate)
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    argv = [sys.executable, "-m", "orchestrator", "watch", str(playbook.file), "-i", str(box.inventory_path)]
    argv += ["--interval", "1", "--json", "--on-change", f"cat >> {told}; read go < {gate}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    buffered = b""

    def next_round(within: float = 30) -> dict[str, Any]:
        nonlocal buffered
        deadline = time.monotonic() + within
        while b"\n" not in buffered:
            assert time.monotonic() < deadline, "no round came out"
            if select.select([proc.stdout], [], [], 0.5)[0]:
                buffered += os.read(proc.stdout.fileno(), 1 << 16)  # type: ignore[union-attr]
        line, buffered = buffered.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    try:
        assert next_round()["hosts"][0]["state"] == READY
        assert stop(box, playbook).ok
        while next_round()["hosts"][0]["state"] != DOWN:
            pass
        # While the command still waits: rounds are a second apart; inside the round, they would
        # wait out the command's own 30 s limit.
        after = [next_round(within=15)["round"] for _ in range(2)]
        assert told.exists() and json.loads(told.read_text())["to"] == DOWN
    finally:
        try:  # let the command end, whatever the test found (no reader: nothing waits on it)
            go = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            pass
        else:
            os.write(go, b"go\n")
            os.close(go)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) >= 0 and len(after) == 2


def test_ready_out_of_the_gateways_rotation_is_its_own_state_and_in_rotation_is_said_when_not_ready() -> None:
    w, r, t = step(HostWatch("gpu-a"), seen(0, counters(0, 0), in_rotation=False, rotation_status="DRAIN"), GATE)
    assert r.state == "OUT_OF_ROTATION" and r.in_rotation is False and t is not None
    assert "READY but out of the gateway's rotation (DRAIN): it serves no user" in r.reasons
    assert r.to_json()["in_rotation"] is False
    w, r, t = step(w, seen(1, counters(0, 0), in_rotation=True, rotation_status="UP"), GATE)
    assert r.state == "READY" and t is not None and t.after == "READY"
    w, r, _ = step(
        w, seen(2, counters(0, 0), in_rotation=True, rotation_status="UP", report=report(healthy=False)), GATE
    )
    assert r.state == "DOWN" and "in the gateway's rotation (UP): users' requests reach it" in r.reasons
    _, r, _ = step(w, seen(3, counters(0, 0), rotation_status="cannot be read: refused"), GATE)
    assert "the gateway: cannot be read: refused" in r.reasons and r.in_rotation is None


def test_watch_once_fails_while_the_gateway_cannot_be_read(
    box: Box, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every host READY, but the gateway's rotation unread (its endpoints file replaced by a
    directory here): whether users reach them is unknown, and `watch --once` passed with exit 0."""
    playbook = box.playbook(targets="[n0]")
    assert deploy(box, playbook).ok
    endpoints = tmp_path / "endpoints.json"
    url = f"http://127.0.0.1:{box.port}"
    endpoints.write_text(json.dumps({"endpoints": [{"name": "n0", "url": url}]}))
    gateway = {"kind": "endpoints-file", "runs_on": "n0", "url": url, "path": str(endpoints)}
    watched = box.playbook(targets="[n0]", top={"gateway": gateway})
    argv = ["watch", str(watched.file), "-i", str(box.inventory_path), "--once", "--json"]
    argv += ["--state-dir", str(tmp_path / "state")]
    assert cli.main(argv) == 0, capsys.readouterr()
    (host,) = json.loads(capsys.readouterr().out)["hosts"]
    assert host["state"] == READY and host["in_rotation"] is True and host["gateway_unread"] is None
    endpoints.unlink()
    endpoints.mkdir()
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    (host,) = json.loads(captured.out)["hosts"]
    assert host["in_rotation"] is None and "not a regular file" in host["gateway_unread"]
    said = [json.loads(line)["message"] for line in captured.err.splitlines()]
    assert any(m.startswith("error: the gateway cannot be read:") and "rotation is not known" in m for m in said), said


def test_a_host_stopped_after_its_last_watch_is_stopped_in_the_report(
    box: Box, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report took a host's state from its last watch transition: a host stopped since (its
    watch stopped with it) stayed READY, serving nothing."""
    playbook = box.playbook()
    state = ["--state-dir", str(tmp_path / "state")]
    assert cli.main(["deploy", str(playbook.file), "-i", str(box.inventory_path), *state]) == 0
    assert cli.main(["watch", str(playbook.file), "-i", str(box.inventory_path), "--once", *state]) == 0
    capsys.readouterr()

    def shown() -> str:
        assert cli.main(["report", "--json", *state]) == 0
        (host,) = json.loads(capsys.readouterr().out)["hosts"]
        return str(host["state"])

    assert shown() == READY
    assert cli.main(["stop", str(playbook.file), "-i", str(box.inventory_path), *state]) == 0
    capsys.readouterr()
    assert shown() == "STOPPED"
    page = tmp_path / "fleet.html"
    assert cli.main(["report", "--html", str(page), *state]) == 0
    assert '<span class="state state-STOPPED">STOPPED</span> 1' in page.read_text()
    assert cli.main(["deploy", str(playbook.file), "-i", str(box.inventory_path), *state]) == 0
    assert cli.main(["watch", str(playbook.file), "-i", str(box.inventory_path), "--once", *state]) == 0
    capsys.readouterr()
    assert shown() == READY


def test_an_on_change_that_raises_loses_none_of_the_rounds_other_changes(box: Box) -> None:
    """Two hosts that nothing serves: their first round shows both (neither READY). A caller's
    ``on_change`` that raises on the first was the end of the round's telling (the second host's
    change never reached it); every change is told, then the first error is raised."""
    told: list[str] = []

    def on_change(change: Any) -> None:
        told.append(change.host)
        if len(told) == 1:
            raise RuntimeError("the pager is down")

    book = box.playbook(targets="[solo, n0]")
    watcher = Deployment(book, box.inventory, OPTIONS).watcher(on_change=on_change)
    try:
        with pytest.raises(RuntimeError, match="the pager is down"):
            watcher.round()
    finally:
        watcher.close()
    assert sorted(told) == ["n0", "solo"]


@pytest.mark.usefixtures("programs")
def test_an_on_change_command_that_leaves_a_child_behind_ends_with_its_own_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--on-change`` ends when its command exits, not when its output closes: a command that
    sends a notifier off with ``&`` left it holding the pipes, and every page was "did not finish
    within 30 s" (its worker held as long). A command that fails is still said, with its last
    line of stderr."""
    from orchestrator.engine import watcher as watching
    from orchestrator.rules.watch import Round, Transition

    monkeypatch.setattr(watching, "ON_CHANGE_TIMEOUT_S", 2.0)
    said: list[str] = []
    seen = Round("solo", 1.0, DOWN, ("the server is gone",), "r1", None, None, 10, 0, None, None)
    change = Transition("solo", 1.0, READY, DOWN, seen)
    # the child outlives the command by a second, then ends by itself
    left_behind = watching.OnChange("sleep 3 & exit 0", said.append)
    left_behind(change)
    left_behind.close(wait=True)
    assert said == []
    failing = watching.OnChange("cat >/dev/null; echo 'the pager said no' >&2; exit 3", said.append)
    failing(change)
    failing.close(wait=True)
    assert said == ["--on-change for solo: exit status 3 the pager said no"]
    hanging = watching.OnChange("exec sleep 5", said.append)  # its own process, killed at the bound
    hanging(change)
    hanging.close(wait=True)
    assert said[-1] == "--on-change for solo: did not finish within 2 s"
