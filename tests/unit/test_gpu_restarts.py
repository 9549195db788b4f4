"""Restarts on a real GPU, as the tool saw them: the compile cache, the engine check kept, the tool's
own share, and the way back when a start fails.

``tests/data/gpu/restarts`` holds two runs of ``scripts/gpu-serve`` on the device (one H100 80GB,
vLLM 0.26.0's CUDA build, the tiny pair in bf16, this tree), each on a fresh work directory:
``run1`` is ``--only graphs verify starts`` then ``--only force-aot stop`` on the same machine,
``run2`` is ``--only graphs starts stop``. ``starts`` is three restarts of the same server command:
a files-only release, the drafter's weights from another directory, a rollback. ``force-aot`` adds
``VLLM_FORCE_AOT_LOAD=1`` (a new command: the same compile key, loaded), then a command with
another key under the guard, which vLLM refuses. These tests hold the figures the docs give to
that record (n = 2 cold starts, 6 warm restarts of one command, 1 of a new command).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

RECORD = Path(__file__).resolve().parent.parent / "data" / "gpu" / "restarts"
RUNS = ("run1", "run2")
STARTS = ("files-only", "new-weights", "rollback")


def host(run: str, name: str) -> dict[str, Any]:
    (h,) = json.loads((RECORD / run / f"{name}.json").read_text())["hosts"]
    return h  # type: ignore[no-any-return]


def starts(run: str) -> dict[str, dict[str, Any]]:
    """Each restart's report, by the step's name."""
    names = {"files-only": "starts-files-only-deploy", "new-weights": "starts-new-weights-deploy"}
    names["rollback"] = "starts-rollback-rollback"
    return {step: host(run, name) for step, name in names.items()}


@pytest.mark.parametrize("run", RUNS)
def test_every_restart_of_the_command_loads_the_cold_start_s_compiled_graphs(run: str) -> None:
    cold = host(run, "graphs-deploy")["gates"]["health"]["startup"]
    assert (cold["compile"], cold["artifacts_saved"], cold["artifacts_loaded"]) == ("miss", 2, 0)
    for step, report in starts(run).items():
        ledger = report["gates"]["health"]["startup"]
        assert (ledger["compile"], ledger["artifacts_saved"], ledger["artifacts_loaded"]) == ("hit", 0, 2), step
        assert ledger["cache_dirs"] == cold["cache_dirs"], step  # the same key's directories
        assert ledger["compile_s"] < cold["compile_s"] / 10, step  # 1.8-1.9 s against 23-30 s
        assert abs(sum(ledger["phases"].values()) - ledger["total_s"]) <= 0.05 * ledger["total_s"], step
        assert ledger["kv_tokens"] >= cold["kv_tokens"], step  # no smaller KV cache warm


def test_a_warm_restart_takes_at_most_half_the_cold_start_but_the_first_after_it() -> None:
    """The goal (a warm restart <= 50% of the cold start) holds from the second restart on: 33-38%
    of cold, n = 4. The first restart after a cold start pays vLLM's silent warm-up after graph
    capture again (24-25 s; 1-2 s later): 53-58% of cold, n = 2."""
    later, first = [], []
    for run in RUNS:
        cold = host(run, "graphs-deploy")["gates"]["health"]["startup"]["total_s"]
        reports = starts(run)
        first.append(reports["files-only"]["gates"]["health"]["startup"]["total_s"] / cold)
        assert reports["files-only"]["gates"]["health"]["startup"]["phases"]["warm-up"] >= 20
        for step in ("new-weights", "rollback"):
            ledger = reports[step]["gates"]["health"]["startup"]
            later.append(ledger["total_s"] / cold)
            assert ledger["phases"]["warm-up"] <= 3, (run, step)
    assert max(later) <= 0.5 and 0.33 <= statistics.mean(later) <= 0.37, later
    assert all(0.5 < r < 0.6 for r in first), first


@pytest.mark.parametrize("run", RUNS)
def test_a_restart_of_a_command_vllm_passed_costs_the_tool_about_two_seconds(run: str) -> None:
    """The engine check of the very command vLLM passed is read from the host (a few ms); the
    tool's share of a cold first deploy is 1.6 s (1.2-1.3%) and of a warm restart 1.4-2.2 s."""
    cold = host(run, "graphs-deploy")
    assert cold["gates"]["engine"]["cached"] is False and cold["gates"]["engine"]["seconds"] > 30
    assert cold["time"]["tool_s"] <= 2.0 and cold["time"]["tool_share"] <= 0.05
    for step, report in starts(run).items():
        engine, time = report["gates"]["engine"], report["time"]
        assert engine["cached"] is True and engine["seconds"] < 0.1, step
        assert "kept on the host" in engine["detail"], step
        assert time["tool_s"] == round(time["seconds"] - time["vllm_start_s"] - time["probe_s"], 1), step
        assert time["tool_s"] <= 2.2 and time["tool_share"] <= 0.05, (step, time)


def test_verify_of_a_serving_host_takes_under_three_seconds() -> None:
    timings = json.loads((RECORD / "run1" / "timings-graphs.json").read_text())
    assert timings["verify-verify"]["exit"] == 0 and timings["verify-verify"]["seconds"] <= 3.0
    assert timings["verify-verify-probe"]["exit"] == 0 and timings["verify-verify-probe"]["seconds"] <= 3.0


def test_a_new_command_is_checked_and_its_failed_start_goes_back_to_the_command_that_was_ready() -> None:
    """The guard's command is new: the loader and engine checks run (the loader's key holds the
    environment), 16.7 s of the tool's. Another key under the guard: vLLM refuses to compile, and
    the host goes back to the release *and* the command it was READY with (the playbook's is the
    one that failed), READY again: before, it was left with nothing serving."""
    hit = host("run1", "force-hit-deploy")
    assert hit["gates"]["engine"]["cached"] is False and hit["gates"]["health"]["startup"]["compile"] == "hit"
    assert hit["time"]["tool_s"] > 10  # the checks of a command seen for the first time
    miss = host("run1", "force-miss-deploy")
    assert miss["gates"]["health"]["ok"] is False and "FileNotFoundError" in miss["gates"]["health"]["detail"]
    assert any("VLLM_FORCE_AOT_LOAD=1 (serving.env)" in d for d in miss["diagnosis"])
    back = miss["diagnosis"][-1]
    assert back.startswith("rolled back: release ") and "with the server command it was READY with, healthy" in back
    log = (RECORD / "run1" / "dflash-serve.log").read_text()
    last = log.split("\n=== ")[-1]
    assert "launch " + back.split()[3] in last.splitlines()[0]  # the last start: that release again
    assert "Directly load AOT compilation" in last  # with the command whose key the cache holds
