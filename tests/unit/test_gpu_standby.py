"""What the standby did on a real H100, driven by ``orchestrate`` behind HAProxy, held to the
tool's own reading of it.

No GPU here: ``tests/data/gpu/standby`` is one run of ``scripts/gpu-serve --only standby --only
standby-back`` (vLLM 0.26.0's CUDA build, the tiny pair, CUDA graphs, sleep mode at level 1) and
the verify that followed: the reports that came back, the rows it printed for the rest
(``gpu-serve-standby.json``), and vLLM's own log lines of each sleep and wake-up.
``tests/data/gpu/standby-real`` holds the same with the real pair, and the founding incident
under ``watch --rollback-on degraded`` (its README says which run is which).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from orchestrator.cli.render import standby_line
from orchestrator.rules import serving
from remote_agent.checks import _our_process
from remote_agent.core import process_start_time

RUN = Path(__file__).resolve().parent.parent / "data" / "gpu" / "standby"
ROWS = json.loads((RUN / "gpu-serve-standby.json").read_text())
LOG = (RUN / "server-log-sleep.txt").read_text()


def host(name: str) -> dict[str, Any]:
    (found,) = json.loads((RUN / name).read_text())["hosts"]
    return found  # type: ignore[no-any-return]


def test_each_rollback_woke_the_standby_and_was_ready_within_the_bound() -> None:
    """Three rollbacks, each READY through the standby (the same process, woken, proven on live
    traffic at tau K + 1) in at most 10 s of the command's wall time, against 44.0-46.1 s for a
    rollback that starts vLLM (``tests/data/gpu/restarts``: the host's time, vLLM's start 42.3-44.3 s)."""
    walls = [r["wall_s"] for r in ROWS["rollbacks"]]
    assert len(walls) == 3 and max(walls) <= 10.0, walls
    started = [
        json.loads(p.read_text())["hosts"][0]["duration_s"]
        for p in sorted((RUN.parent / "restarts").glob("run*/starts-rollback-rollback.json"))
    ]
    assert len(started) == 2 and max(r["duration_s"] for r in ROWS["rollbacks"]) * 5 < min(started), started
    assert all(r["exit"] == 0 and r["health"].startswith("the standby woken in") for r in ROWS["rollbacks"])
    recorded = host("standby-0-rollback.json")
    assert recorded["gates"]["health"]["woken"] is True
    assert recorded["gates"]["acceptance"]["mean_acceptance_length"] == 8.0  # K + 1: the drafter survived
    assert standby_line(recorded["standby"]) == f"release {recorded['release_id']} woken in 0.024 s (no server started)"


def test_each_failed_release_went_back_to_the_standby_in_seconds() -> None:
    """Three releases refused by acceptance (the wrong mask token: tau 1.00), each put back on the
    release READY before, the same command, proven at tau K + 1; after the first (which compiled its
    graphs), the whole go-back fits in the run's own few seconds beside the failed start."""
    for row in ROWS["go_backs"]:
        refused, went_back = row["diagnosis"]
        assert refused.startswith("mean acceptance length 1.00 on a healthy server")
        assert "is current again with the server command it was READY with, healthy and READY (tau 8.00" in went_back
    assert [row["tool_s"] for row in ROWS["go_backs"] if not row["compiled"]] == [6.0, 5.5]


def test_the_memory_the_tool_counts_for_the_standby_is_what_vllm_says_it_kept() -> None:
    """The agent counts the sleeping server's GPU memory from nvidia-smi (910 MiB); vLLM says of
    each sleep that 0.9 GiB is still in use. On the tiny pair nothing is copied to host memory
    (0.00 GiB backed up: its weights are 0.4 MB), so the wake-up is milliseconds; a real target's
    weights are copied back over PCIe and are not measured here."""
    sleeps = re.findall(r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still in use", LOG)
    wakes = re.findall(r"It took ([\d.]+) seconds to wake up", LOG)
    assert len(sleeps) == 6 and len(wakes) == 6  # 3 rollbacks and 3 go-backs, each a sleep then a wake
    assert all(float(kept) == 0.9 for _, kept in sleeps)
    assert all(float(s) < 0.1 for s in wakes)
    assert "0.00 GiB is backed up in CPU" in LOG
    for row in ROWS["deploys"]:
        kept = row["standby"]
        assert kept["state"] == "weights_offloaded" and kept["kept"]
        assert abs(kept["gpu_mib"] / 1024 - 0.9) < 0.05, kept
    line = standby_line(ROWS["deploys"][0]["standby"])
    assert line.endswith("asleep on port 8040, pid 751 (host memory 2959 MiB, GPU memory 910 MiB)"), line


def test_a_sleeping_standby_is_the_tools_own_process_on_the_gpu(tmp_path: Path) -> None:
    """The verify after a deploy with a standby failed its gpus gate on the H100: the sleeping
    server's worker (pid 4756) holds 890 MiB, and the gate took it for another process's. A process
    of the standby's record is ours, as the server's and Ray's are."""
    recorded = host("verify-standby-asleep.json")
    assert recorded["gates"]["gpus"]["detail"] == (
        "GPU 0 is used by another process: pid 4756 (/opt/torch/.venv/bin/python3) holds 890 MiB"
    )
    assert recorded["standby"]["asleep"] is True and recorded["standby"]["gpu_mib"] == 890
    (tmp_path / "run").mkdir()
    me = {"pid": os.getpid(), "start": process_start_time(os.getpid()), "unit": None, "port": 8040}
    assert not _our_process(str(tmp_path), os.getpid())
    (tmp_path / "run" / f"{serving.STANDBY}.json").write_text(json.dumps(me))
    assert _our_process(str(tmp_path), os.getpid())


# --- the real pair (SmolLM2-135M-Instruct and its trained drafter), the founding incident --------

REAL = RUN.parent / "standby-real"


def progress(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (REAL / name).read_text().splitlines()]


def steps(lines: list[dict[str, Any]], step: str) -> list[float]:
    return [line["at"] for line in lines if line.get("step") == step]


def test_each_rollback_of_the_real_pair_was_ready_within_ten_seconds_of_the_decision() -> None:
    """Six rollbacks of the real pair through the standby (two runs of three, ``standby-run*.json``),
    each READY (the host's ``done``) at most 10 s after the command's first line: the same process
    woken (0.27 GiB of weights copied back in 17-27 ms), proven at the tau its READY record holds,
    HAProxy moved back. Most of the rest is the failed server's stop (vLLM's own teardown, 3.5-4.6
    s) and the acceptance probe (2.9-4.3 s)."""
    rows = [
        row
        for run in ("standby-run1.json", "standby-run2.json")
        for row in json.loads((REAL / run).read_text())["rollbacks"]
    ]
    assert len(rows) == 6
    for row in rows:
        assert row["ready"] and row["health"].startswith("the standby woken in"), row
        assert row["standby"]["woken"] and row["standby"]["wake_s"] < 0.05
    decisions = []
    for name in sorted(p.name for p in REAL.glob("run*-rollback-*.stderr")):
        lines = progress(name)
        (done,) = steps(lines, "done")
        (stop,) = steps(lines, "stopping the server")
        assert steps(lines, "waking the standby"), name  # woken, never started
        assert not steps(lines, "launching the server"), name
        decisions.append(done - lines[0]["at"])
        assert 3.0 < min(t for t in (line["at"] for line in lines) if t > stop) - stop < 5.0  # vLLM's teardown
    assert len(decisions) == 6 and max(decisions) <= 10.0, decisions
    recorded = json.loads((REAL / "run1-rollback-0.json").read_text())["hosts"][0]
    assert recorded["gates"]["acceptance"]["mean_acceptance_length"] == 2.252  # the trained drafter's tau
    assert recorded["gates"]["health"]["woken"] is True


def test_each_failed_real_release_went_back_to_the_standby_within_ten_seconds_of_its_verdict() -> None:
    """Three releases of the real pair with the stale mask token (tau 1.03, refused by acceptance),
    each put back on the release READY before by waking its standby, the same process (pid 1029)
    all three times: from the failed verdict to READY 7.4-7.6 s."""
    rows = json.loads((REAL / "standby-back.json").read_text())["go_backs"]
    assert len(rows) == 3
    assert {row["standby"]["pid"] for row in rows} == {1029}  # one standby, woken and put to sleep again
    for row in rows:
        refused, went_back = row["diagnosis"]
        assert refused.startswith("mean acceptance length 1.03 on a healthy server")
        assert "rolled back: release" in went_back and "healthy and READY (tau 2.25" in went_back
    for n in range(3):
        lines = progress(f"go-back-{n}.stderr")
        (verdict,) = steps(lines, "stopping the server")  # the probe failed: the new server stopped
        (done,) = steps(lines, "done")
        assert steps(lines, "waking the standby") and done - verdict <= 10.0, (n, done - verdict)
    wakes = re.findall(r"It took ([\d.]+) seconds to wake up", (REAL / "server-log-sleep.txt").read_text())
    assert len(wakes) == 9 and max(float(s) for s in wakes) < 0.03  # 6 rollbacks and 3 go-backs


def test_the_real_pairs_standby_keeps_its_weights_in_host_memory_and_little_of_the_gpu() -> None:
    """Asleep, the real pair's server copies its 0.27 GiB of weights to host memory and keeps
    0.96-0.98 GiB of the GPU (CUDA context and pools); the tool counts 974-992 MiB of GPU memory
    and 3.3-3.4 GiB resident on the host, in the READY record and the report."""
    log = (REAL / "server-log-sleep.txt").read_text()
    backed = re.findall(r"of which ([\d.]+) GiB is backed up in CPU", log)
    kept = re.findall(r"([\d.]+) GiB memory is still in use", log)
    assert backed and set(backed) == {"0.27"} and all(0.9 < float(k) < 1.0 for k in kept)
    for run in ("standby-run1.json", "standby-run2.json"):
        for row in json.loads((REAL / run).read_text())["deploys"]:
            standby = row["standby"]
            assert standby["kept"] and standby["state"] == "weights_offloaded"
            assert 950 <= standby["gpu_mib"] <= 1000 and 3300 <= standby["host_mib"] <= 3500, standby


def test_the_founding_incident_on_the_gpu_was_undone_by_waking_the_standby_within_a_minute() -> None:
    """The founding incident on the H100 (``scripts/gpu-serve --only standby-watch``), three times
    with the real pair and once with the tiny one: the drafter config the server reads made stale
    behind the tool's back and the server restarted by its host; ``watch --rollback-on degraded``
    (rounds of 2 s, two DEGRADED rounds) saw it DEGRADED and rolled the host back by waking its
    standby (the same process), and live acceptance on the standby's release passed again 13.4-16.8 s
    after the stale server first answered /health."""
    restored = []
    for name in ("watch-real-1.json", "watch-real-2.json", "watch-real-3.json", "watch-tiny.json"):
        found = json.loads((REAL / name).read_text())
        assert found["serving_pid"] == found["standby_pid"] is not None, name  # woken, not started
        restored.append(found["collapse_to"]["restored_s"])
        assert found["collapse_to"]["degraded_s"] < found["collapse_to"]["rolling_back_s"] < restored[-1]
        hosts = [r["hosts"][0] for r in found["rounds"]]
        stale = found["second"]["release_id"]
        degraded = [h for h in hosts if h["state"] == "DEGRADED"]
        assert len(degraded) >= 2 and all(h["release_id"] == stale and not h["live"]["ok"] for h in degraded)
        back = [h for h in hosts if h["release_id"] == found["first"]["release_id"] and (h["live"] or {}).get("ok")]
        assert back, name  # live traffic accepted again on the release the standby held
        assert any("rolling it back" in line for line in found["said"])
        assert any("rollback READY" in line for line in found["said"])
    assert len(restored) == 4 and max(restored) <= 60.0, restored
    real = json.loads((REAL / "watch-real-1.json").read_text())
    taus = [h["live"]["mean_acceptance_length"] for r in real["rounds"] for h in r["hosts"] if h["live"]]
    assert min(taus) < 1.05 and max(taus) > 1.8  # the stale config's 1.03; the standby's 1.94 on the load
