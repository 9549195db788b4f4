"""Progress people can watch: each host's current step while a deploy works, on a terminal (live,
redrawn), as timestamped lines, or as JSON lines; through the CLI, the real agent's events and the
stand-in server (its start delayed, as a model loads)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from orchestrator.agent.client import Event, EventReader, read_event, without_events
from tests.unit.localbox import Box

REPO = Path(__file__).resolve().parents[2]


def orchestrate(box: Box, *args: str) -> list[str]:
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(box.dir / "state"), PYTHONPATH=str(REPO))
    return [sys.executable, "-m", "orchestrator", *args], env  # type: ignore[return-value]


def slow_playbook(box: Box) -> Path:
    playbook = box.playbook(env={"STANDIN_GOOD_MASK": "5", "STANDIN_START_DELAY": "10"})
    return playbook.file


def test_a_deploy_on_a_terminal_shows_each_hosts_live_step_before_it_finishes(box: Box) -> None:
    argv, env = orchestrate(box, "deploy", str(slow_playbook(box)), "-i", str(box.inventory_path))
    env["TERM"] = "xterm-256color"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    live_while_running = False
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed its side
                    break
                if not chunk:
                    break
                seen += chunk
                if b"waiting for health" in seen and proc.poll() is None:
                    live_while_running = True
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = seen.decode("utf-8", "replace")
    assert live_while_running, text[-2000:]
    assert "\x1b[" in text  # drawn and redrawn on the terminal, not printed line by line
    assert "solo" in text and "Loading weights" in text  # the server log's last line, while it loads
    assert proc.returncode == 0 and b"READY" in out


def test_without_a_terminal_steps_are_timestamped_lines_and_with_json_json_lines(box: Box) -> None:
    argv, env = orchestrate(box, "deploy", str(slow_playbook(box)), "-i", str(box.inventory_path))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    steps = [line.split("  ", 1)[1] for line in lines if line[:8].count(":") == 2 and " solo  " in line]
    order = [s.split(":")[0] for s in steps]
    for expected in ("staging the release", "launching the server", "waiting for health", "probing acceptance"):
        assert expected in order, lines
    assert order.index("launching the server") < order.index("waiting for health") < order.index("probing acceptance")
    waits = [s.split(": ", 2) for s in steps if s.startswith("waiting for health: ")]
    assert waits[0][1] == "at most 30 s", waits  # each step says how long it may take
    assert any(len(w) == 3 and w[2].startswith("INFO ") and "Loading weights took" in w[2] for w in waits), done.stderr
    # the loader and engine checks start with the staging and are waited for beside the launch
    # (nothing served yet): started before the launch, collected after it, before the health wait
    assert order.index("starting the loader and engine checks") < order.index("launching the server")
    checks = next(s for s in steps if s.startswith("waiting for the loader and engine checks"))
    assert checks.endswith(": at most 300 s"), checks
    collected = order.index("waiting for the loader and engine checks")
    assert order.index("launching the server") < collected < order.index("waiting for health")
    # the host's line when done says where its time went
    done_line = next(line for line in lines if "] ok   solo" in line)
    assert re.search(r"s: vLLM's start \d+\.\d s, the probe \d+\.\d s, the tool \d+\.\d s\)$", done_line), done_line

    argv, env = orchestrate(box, "verify", str(slow_playbook(box)), "-i", str(box.inventory_path), "--json")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line of stderr is JSON
    assert lines[0]["message"] == "verify pb: 1 host, 1 at once"
    events = [e for e in lines if "step" in e]
    assert {"reading the served files back", "done"} <= {e["step"] for e in events}
    assert all(e["host"] == "solo" and isinstance(e["at"], float) for e in events)
    assert events[-1]["step"] == "done" and events[-1]["ready"] is True
    assert json.loads(done.stdout)["hosts"][0]["name"] == "solo"  # stdout: the result alone


def test_event_lines_are_read_warily_and_kept_out_of_error_messages() -> None:
    got: list[Event] = []
    reader = EventReader(got.append)
    for chunk in (b'@dflash-event {"op": "wait_', b'health", "elapsed_s": 4.5, "log": "x"}\nwarn', b"ing\n"):
        reader(chunk)
    assert got == [Event("wait_health", 4.5, "x")]
    assert read_event(b'@dflash-event {"op": 3}') is None
    assert read_event(b'@dflash-event {"op": "probe", "done": true, "of": "2"}') == Event("probe")
    assert read_event(b"@dflash-event " + b"x" * 5000) is None
    assert read_event(b"Traceback (most recent call last):") is None
    assert without_events(b'@dflash-event {"op": "lock"}\nSyntaxError: bad\n') == b"SyntaxError: bad\n"


def test_nothing_a_host_says_reaches_the_terminal_as_control_codes() -> None:
    """Gate details and log lines come from hosts: a hostile one must not clear, retitle or
    rewrite the user's terminal through them."""
    import io

    from orchestrator.cli.render import ProgressPrinter, render_table
    from orchestrator.engine.observer import Step
    from orchestrator.results import Gate, HostReport, RunReport

    evil = "\x1b[2J\x1b]0;owned\x07\r\x9bplain words\ttab"
    host = HostReport("gpu-a")
    host.gates["files"] = Gate(False, evil)
    out = io.StringIO()
    render_table(RunReport("verify", "p.yaml", "i.yaml", None, [host], 0.0, 1.0), out)
    lines = io.StringIO()
    printer = ProgressPrinter("deploy", 1, lines, mode="lines")
    printer.step(Step("gpu-a", "waiting for health", evil, 3.0))
    printer.host_done(host)
    for text in (out.getvalue(), lines.getvalue()):
        assert not any(c in text for c in "\x1b\x07\r\x9b"), repr(text)
        assert "[2J]0;ownedplain words\ttab" in text


def test_a_fleet_that_does_not_fit_the_terminal_is_summarised_live() -> None:
    """1024 hosts on a 40-line terminal: the live view counts the hosts at each step and names the
    slowest and the failed ones, instead of a row per host; the finished lines above it are the
    failed hosts only (the result table still has every host)."""
    import io

    from rich.console import Console

    from orchestrator.cli.render import ProgressPrinter
    from orchestrator.engine.observer import Step
    from orchestrator.results import Gate, HostReport

    out = io.StringIO()
    printer = ProgressPrinter("deploy", 1024, out, mode="live")
    printer.height = 40
    names = [f"gpu-{i:04d}/serve-0" for i in range(1024)]
    for i, name in enumerate(names):
        printer.step(Step(name, ("staging", "waiting for health", "acceptance probe")[i % 3]))
    printer._steps[names[20]] = (printer._steps[names[20]][0], time.monotonic() - 100)  # at it for long
    for name in names[:10]:
        report = HostReport(name)
        report.gates["acceptance"] = Gate(name != names[3], "tau 6.50" if name != names[3] else "tau 1.02 < 3.0")
        printer.host_done(report)
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(printer._render())
    shown = console.export_text().splitlines()
    assert len(shown) <= 5, shown
    assert shown[0].startswith("deploy: 10/1024 done (9 ready, 1 failed), 1014 in flight")
    assert shown[1] == "  at: acceptance probe 338, staging 338, waiting for health 338"
    assert shown[2].startswith(f"  slowest: {names[20]} acceptance probe 100 s; ")  # 20 % 3 == 2
    assert shown[3] == f"  failed: {names[3]} (acceptance)"
    # a terminal that holds them all gets a row a host, as before
    few = ProgressPrinter("deploy", 3, io.StringIO(), mode="live")
    few.height = 40
    for name in names[:3]:
        few.step(Step(name, "staging"))
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(few._render())
    assert [line.split()[0] for line in console.export_text().splitlines()[:3]] == names[:3]


def test_a_host_s_done_line_puts_the_speed_up_s_load_apart_from_the_tool_s_share() -> None:
    import io

    from orchestrator.cli.render import ProgressPrinter
    from orchestrator.results import Gate, HostReport

    host = HostReport("gpu-a", duration_s=360.0)
    host.gates["acceptance"] = Gate(True, "tau 8.00")
    host.time = {"seconds": 360.0, "vllm_start_s": 109.4, "probe_s": 0.3, "tool_s": 70.0, "tool_share": 0.194}
    host.time |= {"speedup_baseline_s": 164.8, "speedup_drafter_s": 15.5}
    out = io.StringIO()
    ProgressPrinter("deploy", 1, out, mode="lines").host_done(host)
    said = out.getvalue().strip()
    assert said.endswith(
        "(360.00 s: vLLM's start 109.4 s, the probe 0.3 s, the speed-up's load 180.3 s, the tool 70.0 s)"
    ), said
