"""Fixtures for every suite: ``postgres``, a real PostgreSQL cluster for the session (tests/postgres.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.postgres import Postgres, running_postgres


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    # Under /tmp itself: pytest's own temporary directories are private to root, and the server
    # runs as the postgres user.
    base = Path(tempfile.mkdtemp(prefix="dflash-pg-"))
    with running_postgres(base) as pg:
        yield pg
