"""Unit-test fixtures: ``box``, this machine as ``connection: local`` containers (localbox.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.localbox import Box, make_box


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    yield from make_box(tmp_path, monkeypatch)
