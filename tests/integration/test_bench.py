"""The side-by-side benchmark keeps running: a smoke of it (N = 4, one repetition)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_smoke() -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--hosts", "4", "--reps", "1"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()[1:]]
    table = {(r[1], r[2]): r for r in rows}
    assert set(table) == {
        (run_, tool)
        for run_ in ("first", "second")
        for tool in ("orchestrate", "floor", "ansible", "ansible-pipelining", "fabric")
    }
    # one exec per host for our deploy, changed or not
    assert float(table[("first", "orchestrate")][5]) == 1.0 and float(table[("second", "orchestrate")][5]) == 1.0
    assert float(table[("first", "ansible")][5]) > 1.0
    # the floor: one exec a host, and every tool's wall time held to it
    assert float(table[("first", "floor")][5]) == 1.0 and table[("first", "floor")][6] == "1.00"
    assert float(table[("first", "orchestrate")][6]) > 0
