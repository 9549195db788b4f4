"""How many real vLLM servers the suite starts, which tests may start them, and how many each.

Most of the suite's time is real vLLM starting (20-60 s a server on 2 cores), so the starts are
budgeted like the agent's ops: ``STARTS`` has one row for every test allowed to start a server,
with its count and why. A server started by a test with no row, or past its row's count, fails
that test and so the run; the terminal summary lists the starts by test.

A thread reads /proc once a second (no vLLM starts in under one) for processes running the
tool's `vllm serve` program from the sandbox's vLLM venv; a process forked by one (vLLM's own
workers) is not another start. /proc is the machine's: a server counts for this process only where
it runs in this worker's lane (tests/lanes.py: its ssh hosts' network namespaces, its LXD
containers) or from its base temp (a ``connection: local`` deploy root), so two workers, or a
second run in other lanes, never count each other's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orchestrator.rules.serving import VLLM_CLI
from orchestrator.sandbox.processes import proc_start
from tests import lanes

VENV_PYTHON = "vllm-venv/bin/python"


@dataclass(frozen=True)
class Allowed:
    starts: int
    why: str


# One row per test allowed to start real vLLM servers (its node id, parameters left out). A
# multi-node group's start is a server per node. Keep the sum at most 20: a test whose subject is
# not the start shares a server, and one about the controller's reading of an answer replays a
# recording in a faster tier (tests/data/vllm-cpu, tests/data/gpu).
STARTS: dict[str, Allowed] = {
    "tests/integration/test_serving.py::test_good_drafter_is_ready_then_a_narrower_window_is_refused_by_its_history_and_rolled_back": Allowed(
        3, "the tiny pair READY; a narrower window started and refused by its history; the READY one started again"
    ),
    "tests/integration/test_serving.py::test_speculative_decoding_switched_off_fails_the_gate": Allowed(
        1, "real vLLM without a drafter exposes no spec_decode counters: the gate must say speculation is off"
    ),
    "tests/integration/test_real_pair.py::test_the_real_pair_is_ready_with_the_reference_tau_and_a_stale_mask_is_refused": Allowed(
        3, "the stale mask refused, the real pair READY, the speed-up gate's baseline beside it (the target alone)"
    ),
    "tests/integration/test_multinode.py::TestTwoContainerGroup::test_a_two_container_group_is_ready_through_its_head": Allowed(
        2, "the TP=2 group over two containers: a server per node"
    ),
    "tests/integration/test_multinode.py::TestTwoContainerGroup::test_a_dead_rank_and_a_stale_drafter_config_fail_the_group_and_deploy_repairs_both": Allowed(
        2, "the repaired group started again on both nodes"
    ),
    "tests/integration/test_gateway_vllm.py::test_a_restart_behind_haproxy_loses_no_request": Allowed(
        4, "two servers behind HAProxy, then each restarted under load for a new release"
    ),
    "tests/integration/test_gateway_vllm.py::test_a_restart_behind_vllm_router_loses_no_request": Allowed(
        2, "each server restarted under load behind vllm-router for a new command"
    ),
    "tests/integration/test_lxd.py::test_real_vllm_in_a_container_is_ready_and_watch_sees_the_founding_incident": Allowed(
        2, "the demo READY in a container; restarted by hand with the stale drafter config (the founding incident)"
    ),
}


def _cmdline(pid: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _server(argv: list[str], venv_python: str) -> bool:
    return len(argv) > 3 and argv[0].endswith(venv_python) and argv[1:4] == ["-c", VLLM_CLI, "serve"]


def _parent(pid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "0"
    return stat.rsplit(")", 1)[1].split()[1]


def servers(venv_python: str = VENV_PYTHON) -> Iterator[tuple[str, str]]:
    """(pid, start time) of every vLLM server process on this machine run by a Python whose path
    ends with ``venv_python``, its forks left out."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and _server(_cmdline(pid), venv_python) and not _server(_cmdline(_parent(pid)), venv_python):
            yield pid, proc_start(int(pid))


def belongs(pid: str, prefix: str, basetemp: str) -> bool:
    """Whether a server is this worker's: in the network namespace of one of its lane's ssh hosts,
    in one of its lane's LXD containers, or run from a directory under its base temp (a
    ``connection: local`` host's deploy root is a test's temporary directory)."""
    try:
        net = os.stat(f"/proc/{pid}/ns/net").st_ino
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    if f"lxc.payload.{prefix}" in cgroup or cwd == basetemp or cwd.startswith(basetemp + os.sep):
        return True
    try:
        names = [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
    except OSError:
        return False
    for name in names:
        with contextlib.suppress(OSError):
            if os.stat(f"/run/netns/{name}").st_ino == net:
                return True
    return False


def row(item: pytest.Item) -> str:
    """The budget row a test's starts count against: its node id without its parameters (nor a
    pytest-xdist group's suffix)."""
    return item.nodeid.split("@", 1)[0].split("[", 1)[0]


@dataclass(eq=False)  # a plugin is hashed by pytest's plugin manager
class StartBudget:
    """A pytest plugin: counts distinct vLLM servers, each under the test that was running when it
    appeared, and fails a test whose starts go past its row of ``table``."""

    table: Mapping[str, Allowed]
    venv_python: str = VENV_PYTHON
    prefix: str = "d"  # the lane's names (tests/lanes.py): servers under others' are not counted
    basetemp: str | None = None  # this process's base temp, learnt at the first test
    seen: set[tuple[str, str]] = field(default_factory=set)
    by_test: Counter[str] = field(default_factory=Counter)
    over: dict[str, str] = field(default_factory=dict)
    test: str = "(between tests)"

    def __post_init__(self) -> None:
        self.seen = set(servers(self.venv_python))  # already running: not this run's
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="vllm-start-counter", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        with self._lock:
            for server in servers(self.venv_python):
                if server in self.seen:
                    continue
                if self.basetemp is None or not belongs(server[0], self.prefix, self.basetemp):
                    continue  # another worker's or another run's (or not yet known: seen again)
                self.seen.add(server)
                self.by_test[self.test] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()

    def verdict(self, test: str) -> str | None:
        """Why ``test`` has started more servers than it may, or None."""
        started = self.by_test[test]
        allowed = self.table.get(test)
        if started == 0 or (allowed is not None and started <= allowed.starts):
            return None
        if allowed is None:
            return f"{test} started {started} real vLLM server(s) and has no row in tests/vllm_starts.py STARTS"
        return f"{test} started {started} real vLLM servers, past its row's {allowed.starts} ({allowed.why})"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        if self.basetemp is None:
            self.basetemp = str(item.config._tmp_path_factory.getbasetemp().resolve())  # type: ignore[attr-defined]
        self.test = row(item)
        yield
        self.test = "(between tests)"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        self.poll()  # a server that appeared in the last second is still this test's
        why = self.verdict(row(item))
        if why is not None and row(item) not in self.over:
            self.over[row(item)] = why
            if report.passed:
                report.outcome = "failed"
                report.longrepr = why

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop()
        if self.over and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        output = getattr(session.config, "workeroutput", None)
        if output is not None:  # a pytest-xdist worker: the controller prints the summary
            output["vllm_starts"] = dict(self.by_test)
            output["vllm_over"] = list(self.over.values())

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        summarize(terminalreporter, self.table, self.by_test, list(self.over.values()))


def summarize(
    terminalreporter: pytest.TerminalReporter, table: Mapping[str, Allowed], by_test: Counter[str], over: list[str]
) -> None:
    total = sum(by_test.values())
    if total == 0 and not over:
        return
    terminalreporter.section("real vLLM server starts")
    budget = sum(a.starts for a in table.values())
    terminalreporter.write_line(f"{total} vLLM server starts in {len(by_test)} tests (budget {budget})")
    for test, count in by_test.most_common():
        allowed = table.get(test)
        terminalreporter.write_line(f"{count:4d}  of {allowed.starts if allowed else 0:2d}  {test}")
    for why in over:
        terminalreporter.write_line(f"OVER BUDGET: {why}")


@dataclass(eq=False)
class WorkersStarts:
    """Under pytest-xdist: the workers' counts, gathered as each ends, in one summary."""

    table: Mapping[str, Allowed]
    by_test: Counter[str] = field(default_factory=Counter)
    over: list[str] = field(default_factory=list)

    def pytest_testnodedown(self, node: object, error: object) -> None:
        output = getattr(node, "workeroutput", {})
        self.by_test.update(output.get("vllm_starts", {}))
        self.over += output.get("vllm_over", [])

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        summarize(terminalreporter, self.table, self.by_test, self.over)


def register(config: pytest.Config, table: Mapping[str, Allowed] = STARTS, venv_python: str = VENV_PYTHON) -> None:
    """Counts and budgets this process's tests' starts (under pytest-xdist, each worker its own, in
    its lane: the controller process runs no test)."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        config.pluginmanager.register(WorkersStarts(table), "vllm-start-summary")
        return
    prefix = lanes.current().prefix("")
    config.pluginmanager.register(StartBudget(table, venv_python, prefix), "vllm-start-budget")
