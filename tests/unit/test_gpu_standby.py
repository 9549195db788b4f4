"""What the standby did on a real H100, driven by ``orchestrate`` behind HAProxy, held to the
tool's own reading of it.

No GPU here: ``tests/data/gpu/standby`` is one run of ``scripts/gpu-serve --only standby --only
standby-back`` (vLLM 0.26.0's CUDA build, the tiny pair, CUDA graphs, sleep mode at level 1) and
the verify that followed: the reports that came back, the rows it printed for the rest
(``gpu-serve-standby.json``), and vLLM's own log lines of each sleep and wake-up.
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
