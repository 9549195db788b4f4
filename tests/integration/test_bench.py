"""The side-by-side benchmark keeps running: a smoke of it (N = 4, one repetition, three watch
rounds), every column it reports held to what the tools really did on the hosts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.lanes import Lane

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("orchestrate", "verify", "floor", "ansible", "ansible-pipelining", "fabric")
WATCH = ("watch (first round)", "watch round", "watch, idle second")
SERVED = ("deploy", "verify", *WATCH)


def test_bench_smoke(lane: Lane) -> None:
    sandbox = [str(lane.directory("bench-sandbox")), lane.prefix("b"), lane.subnet(5)]
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--hosts", "4", "--reps", "1", "--watch-rounds", "3", "--json",
         "--sandbox", *sandbox],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {(r["run"], r["tool"]): r for r in json.loads(run.stdout)}
    assert set(rows) == {(run_, tool) for run_ in ("change", "no change") for tool in TOOLS} | {
        ("served", step) for step in SERVED
    } | {("no change", step) for step in WATCH} | {("first deploy", "orchestrate")}
    assert all(r["hosts"] == 4 for r in rows.values())
    for run_ in ("change", "no change"):
        # one connection and one exec per host for our deploy and verify, changed or not
        for tool in ("orchestrate", "verify"):
            assert (rows[(run_, tool)]["conns"], rows[(run_, tool)]["trips"]) == (1.0, 1.0), (run_, tool)
        assert rows[(run_, "ansible")]["trips"] > 1.0 and rows[(run_, "fabric")]["trips"] == 3.0
        # the floor: one connection and one exec a host, and every tool's wall time held to it
        floor = rows[(run_, "floor")]
        assert (floor["conns"], floor["trips"], floor["x_floor"]) == (1.0, 1.0, 1.0)
        for tool in TOOLS:
            row = rows[(run_, tool)]  # (the watch rows are held below)
            assert row["x_floor"] == round(row["wall"] / floor["wall"], 3)
            # a whole process's CPU and memory: an interpreter at least
            assert row["cpu"] > 0 and 20 < row["peak_mib"] < 512, (run_, tool, row)
    # The first deploy to hosts that never ran the agent (it compiles there once): held to the
    # floor of the change run, one connection and one exec a host all the same.
    first = rows[("first deploy", "orchestrate")]
    assert (first["conns"], first["trips"]) == (1.0, 1.0)
    assert first["x_floor"] == round(first["wall"] / rows[("change", "floor")]["wall"], 3)
    # A watch, of the files or of the served fleet, holds one session a host; its later rounds open
    # none and exec none.
    for run_ in ("no change", "served"):
        first, later = rows[(run_, "watch (first round)")], rows[(run_, "watch round")]
        assert (first["conns"], first["trips"]) == (1.0, 1.0)
        assert (later["conns"], later["trips"]) == (0.0, 0.0)
        assert 0 < later["wall"] < first["wall"] and later["cpu"] > 0 and later["peak_mib"] > 20
    assert rows[("served", "deploy")]["conns"] == 1.0 and rows[("served", "verify")]["conns"] == 1.0
    # holding the sessions between rounds: a fraction of a core, and nothing to hold it to
    for run_ in ("no change", "served"):
        idle = rows[(run_, "watch, idle second")]
        assert 0 <= idle["cpu"] < 0.5 and idle["x_floor"] is None and idle["x_fabric"] is None
        assert rows[(run_, "watch round")]["x_floor"] is not None and rows[(run_, "watch round")]["x_fabric"] is None
