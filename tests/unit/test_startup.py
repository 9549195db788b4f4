"""What the ``orchestrate`` process loads at start: it runs before every command, on every host count."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator

ORCHESTRATE = Path(sys.executable).parent / "orchestrate"


def imported_modules(*argv: str) -> set[str]:
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    proc = subprocess.run([str(ORCHESTRATE), *argv], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.skipif(importlib.util.find_spec("invoke") is None, reason="invoke is not installed beside paramiko")
def test_orchestrate_does_not_load_invoke_that_paramiko_would_pull_in() -> None:
    modules = imported_modules("--help")
    assert "paramiko" in modules  # the check below would be empty otherwise
    assert not {m for m in modules if m.startswith(("invoke.", "unittest", "asyncio"))}


def test_the_public_api_loads_on_first_use() -> None:
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        orchestrator.nope  # noqa: B018
