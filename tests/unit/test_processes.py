"""The sandbox's measuring of a command's own peak memory (``run_measured``, used by the push test
and the models bench): the command's, never the caller's."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from orchestrator.sandbox.processes import run_measured

pytestmark = pytest.mark.usefixtures("programs")

GROW = "x = bytearray({mib} << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nprint('done')\nraise SystemExit({code})"


def test_the_peak_is_the_command_s_own_whatever_the_caller_holds() -> None:
    alone, small = run_measured([sys.executable, "-c", GROW.format(mib=1, code=0)])
    assert alone.returncode == 0 and alone.stdout == b"done\n"
    held = bytearray(400 << 20)  # the caller grows past anything the command uses
    held[:: 1 << 12] = b"\1" * len(held[:: 1 << 12])
    again, after = run_measured([sys.executable, "-c", GROW.format(mib=1, code=0)])
    assert again.returncode == 0
    # A child has its parent's address space until it execs, and the kernel counts that into its
    # peak: measured that way, the caller's 400 MiB was the command's.
    assert after < 100 << 10, after
    assert abs(after - small) < 20 << 10, (small, after)
    del held


def test_a_command_s_own_growth_and_exit_status_are_its() -> None:
    proc, peak = run_measured([sys.executable, "-c", GROW.format(mib=200, code=3)])
    assert proc.returncode == 3 and proc.stdout == b"done\n"
    assert 200 << 10 < peak < 300 << 10, peak


def test_a_command_past_its_time_is_ended_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    hang = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    proc, peak = run_measured([sys.executable, "-c", hang], timeout=3)
    assert proc.returncode == -9 and peak == 0
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # SIGKILL is sent; the process takes a moment to be gone
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_missing_program_fails_as_the_command() -> None:
    proc, _ = run_measured(["/nonexistent/program"])
    assert proc.returncode != 0 and b"No such file or directory" in proc.stderr
