"""The suite's own rules, run as pytest runs them (pytester, in this process): a test's tier follows
the fixtures it uses; a unit test that starts a process or opens a socket fails, even where the
code under test swallows the refusal; a test that starts a vLLM server it has no row for, or more
than its row allows, fails the run.

The vLLM server here is a stand-in: a Python program under a venv-like path, run with the exact
argv the tool gives vLLM (``-c VLLM_CLI serve ...``) and a ``vllm`` package of its own that only
waits. A real server takes minutes on 2 cores; what is tested is the counting, which reads
/proc for that argv, and the budget, the same code that counts the vllm tier's real servers.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests import tiers

pytestmark = pytest.mark.usefixtures("programs")  # the inner runs start processes and open sockets

CONFTEST = """
from tests import tiers, vllm_starts
from tests.tiers import (
    agent, gateways, loopback, programs, pytest_collection_modifyitems,
    pytest_runtest_makereport, unit_guard,
)

def pytest_configure(config):
    tiers.configure(config)
    vllm_starts.register(
        config,
        {"test_budget.py::test_one_start_with_a_row_of_one": vllm_starts.Allowed(1, "the stand-in's start"),
         "test_budget.py::test_two_starts_with_a_row_of_one": vllm_starts.Allowed(1, "the stand-in's start")},
        venv_python="vllm-stand-in/bin/python",
    )
"""


def test_a_tier_is_the_costliest_of_the_fixtures_used() -> None:
    assert tiers.tier_of([]) == "unit"
    assert tiers.tier_of(["tmp_path", "monkeypatch"]) == "unit"
    assert tiers.tier_of(["tmp_path", "box"]) == "local"
    assert tiers.tier_of(["postgres", "sandbox", "box"]) == "system"
    assert tiers.tier_of(["sandbox", "vllm_cpu", "agent"]) == "vllm"
    assert set(tiers.FIXTURES.values()) <= set(tiers.TIERS)


def test_the_costliest_files_are_collected_first_and_each_file_stays_whole(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_a="def test_a1(): pass\ndef test_a2(): pass",
        test_b="def test_b1(): pass\ndef test_b2(): pass",
        test_c="def test_c1(): pass",
        test_d="def test_d1(): pass",
    )
    monkeypatch.setattr(tiers, "COSTS", {"test_c.py": 300, "test_b.py": 100})
    found = pytester.runpytest("--collect-only", "-q")
    assert [line.split("::")[1] for line in found.outlines if "::" in line] == [
        *("test_c1", "test_b1", "test_b2"),  # by cost
        *("test_a1", "test_a2", "test_d1"),  # the rest, as collected
    ]


def test_every_file_costed_is_a_test_file_of_the_suite() -> None:
    root = Path(__file__).resolve().parents[2]
    assert all((root / path).is_file() and Path(path).name.startswith("test_") for path in tiers.COSTS), tiers.COSTS


def test_the_marks_follow_the_fixtures_and_a_mark_by_hand_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_marks="""
        import pytest

        def test_nothing():
            pass

        def test_with_the_agent(agent):
            pass

        @pytest.mark.usefixtures("gateways")
        def test_behind_a_gateway():
            pass
        """
    )
    for tier, expected in (("unit", "test_nothing"), ("local", "test_with_the_agent"), ("system", "test_behind")):
        found = pytester.runpytest("-m", tier, "--collect-only", "-q")
        assert [line for line in found.outlines if "::" in line] == [
            line for line in found.outlines if expected in line
        ], found.outlines
    pytester.makepyfile(
        test_by_hand="""
        import pytest

        @pytest.mark.unit
        def test_marked():
            pass
        """
    )
    refused = pytester.runpytest("test_by_hand.py")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    assert "marked 'unit' by hand; a test's tier follows the fixtures it uses" in refused.stderr.str()


def test_a_unit_test_that_starts_a_process_or_opens_a_socket_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_guard="""
        import socket
        import subprocess

        def test_runs_a_program():
            subprocess.run(["true"], check=True)

        def test_swallows_the_refusal():
            try:
                subprocess.run(["true"])
            except Exception:
                pass  # the code under test going on as if the program had failed

        def test_swallows_even_a_base_exception():
            try:
                subprocess.run(["true"])
            except BaseException:
                pass

        def test_connects():
            socket.create_connection(("127.0.0.1", 9), timeout=1)

        def test_pure():
            assert sorted([3, 1, 2]) == [1, 2, 3]

        def test_may_run_it(programs):
            subprocess.run(["true"], check=True)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=4)
    reports = result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
    failed = {r.nodeid.split("::")[1]: str(r.longrepr) for r in reports if r.failed}
    assert set(failed) == {
        "test_runs_a_program",
        "test_swallows_the_refusal",
        "test_swallows_even_a_base_exception",
        "test_connects",
    }, failed
    assert "a unit test started a process" in failed["test_runs_a_program"]
    assert "a unit test opened a socket" in failed["test_connects"]
    # Its call returned as if nothing happened: the guard fails it all the same.
    assert "a unit test started a process" in failed["test_swallows_even_a_base_exception"]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two xdist workers"])
def test_a_vllm_start_without_its_row_or_past_it_fails_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # the inner run's `tests`
    pytester.makeconftest(CONFTEST)
    # A stand-in vLLM: the tool's exact server argv, a ``vllm`` package that only waits.
    site = pytester.path / "stand_in_site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (cli, cli.parent, cli.parent.parent):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text("import sys\n\ndef main():\n    sys.stdin.read()  # until the test closes it\n")
    (site / "vllm-0.0.0.dist-info").mkdir()
    (site / "vllm-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.0\n")
    pytester.makepyfile(
        test_budget=textwrap.dedent(
            """
            import os
            import subprocess
            import sys
            import time

            import pytest

            from orchestrator.rules.serving import VLLM_CLI
            from tests import vllm_starts

            @pytest.fixture
            def serve(tmp_path, programs):
                python = tmp_path / "vllm-stand-in" / "bin" / "python"
                python.parent.mkdir(parents=True)
                python.symlink_to(sys.executable)
                env = dict(os.environ, PYTHONPATH=os.path.abspath("stand_in_site"))
                started = []

                def start():
                    proc = subprocess.Popen(
                        [str(python), "-c", VLLM_CLI, "serve", "tiny"], stdin=subprocess.PIPE, env=env, cwd=tmp_path
                    )
                    started.append(proc)
                    deadline = time.monotonic() + 30
                    while str(proc.pid) not in {pid for pid, _ in vllm_starts.servers("vllm-stand-in/bin/python")}:
                        assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
                        time.sleep(0.02)

                yield start
                for proc in started:
                    proc.stdin.close()
                    proc.wait(timeout=30)

            def test_one_start_with_a_row_of_one(serve):
                serve()

            def test_two_starts_with_a_row_of_one(serve):
                serve()
                serve()

            def test_a_start_with_no_row(serve):
                serve()
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *workers)
    result.assert_outcomes(passed=1, failed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.outlines
    assert any(
        "test_budget.py::test_a_start_with_no_row started 1 real vLLM server(s) and has no row" in line for line in out
    ), out
    assert any(
        "test_two_starts_with_a_row_of_one started 2 real vLLM servers, past its row's 1" in line for line in out
    ), out
    assert any(line.startswith("4 vLLM server starts in 3 tests (budget 2)") for line in out), out


def test_the_vllm_start_budget_is_at_most_twenty_and_every_row_names_a_test_of_the_vllm_tier(
    pytester: pytest.Pytester,
) -> None:
    """Every row of STARTS is a test that exists, in the vllm tier, with a reason; the sum is held."""
    from tests.vllm_starts import STARTS

    assert sum(a.starts for a in STARTS.values()) <= 20
    assert all(a.starts > 0 and a.why for a in STARTS.values())
    repo = Path(__file__).resolve().parents[2]
    found = pytester.runpytest(str(repo / "tests"), "-m", "vllm", "--collect-only", "-q", "-p", "no:cacheprovider")
    collected = {line.split("[", 1)[0] for line in found.outlines if "::" in line}
    rows = {f"tests/{row.split('tests/', 1)[1]}" for row in STARTS}
    assert rows <= {f"tests/{c.split('tests/', 1)[1]}" for c in collected}, rows - collected
