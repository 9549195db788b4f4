"""How many real vLLM servers the suite starts, and which tests start them.

Most of the integration suite's time is real vLLM starting (20-60 s each on 2 cores), so the
count is what keeps the suite's time in check: the terminal summary says it, by test. A thread
reads /proc once a second (no vLLM starts in under one) for processes running the tool's `vllm
serve` program from the sandbox's vLLM venv; a process forked by one (vLLM's own workers) is not
another start. /proc is the machine's: servers in LXD containers and in the ssh sandbox's
network namespaces are seen alike, and so is a server that another run on this machine starts
meanwhile (a side run's count is the two runs' together).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.rules.serving import VLLM_CLI
from orchestrator.sandbox.processes import proc_start

VENV_PYTHON = "vllm-venv/bin/python"


def _cmdline(pid: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _server(argv: list[str]) -> bool:
    return len(argv) > 3 and argv[0].endswith(VENV_PYTHON) and argv[1:4] == ["-c", VLLM_CLI, "serve"]


def _parent(pid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "0"
    return stat.rsplit(")", 1)[1].split()[1]


def servers() -> Iterator[tuple[str, str]]:
    """(pid, start time) of every vLLM server process on this machine, its forks left out."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and _server(_cmdline(pid)) and not _server(_cmdline(_parent(pid))):
            yield pid, proc_start(int(pid))


class StartCounter:
    """Counts distinct vLLM servers seen, each under the test that was running when it appeared."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set(servers())  # already running: not this suite's
        self.by_test: Counter[str] = Counter()
        self.test = "(between tests)"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vllm-start-counter", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        for server in servers():
            if server not in self.seen:
                self.seen.add(server)
                self.by_test[self.test] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()


_counter: StartCounter | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    # Called for this directory's tests only (a conftest's hook): started at the first of them.
    global _counter
    if _counter is None:
        _counter = StartCounter()
    _counter.test = item.nodeid
    yield
    _counter.poll()  # a server that appeared in the last second is still this test's
    _counter.test = "(between tests)"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _counter is None:
        return
    _counter.stop()
    total = sum(_counter.by_test.values())
    terminalreporter.section("real vLLM server starts")
    terminalreporter.write_line(f"{total} vLLM server starts in {len(_counter.by_test)} tests")
    for test, count in _counter.by_test.most_common():
        terminalreporter.write_line(f"{count:4d}  {test}")
