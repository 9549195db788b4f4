"""What the ``orchestrate`` process loads at start: it runs before every command, on every host count."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator

ORCHESTRATE = Path(sys.executable).parent / "orchestrate"


def imported_modules(*argv: str, code: int = 0) -> set[str]:
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    proc = subprocess.run([str(ORCHESTRATE), *argv], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == code, proc.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.usefixtures("programs")
def test_help_loads_no_ssh_library() -> None:
    """SSH is opened only for a run that has an SSH target: paramiko is not imported before."""
    modules = imported_modules("--help")
    assert "orchestrator.cli.main" in modules and "paramiko" not in modules


@pytest.mark.skipif(importlib.util.find_spec("invoke") is None, reason="invoke is not installed beside paramiko")
@pytest.mark.usefixtures("programs")
def test_orchestrate_does_not_load_invoke_that_paramiko_would_pull_in(tmp_path: Path) -> None:
    """A run over SSH (to a loopback port that refuses, so it fails fast) loads paramiko, not invoke."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "inv.yaml").write_text(
        f"hosts:\n  h:\n    containers:\n      c: {{address: 127.0.0.1, port: {port}, connect_timeout: 1}}\n"
    )
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "pb.yaml").write_text(
        f"name: t\ntargets: [all]\ndeploy_root: {tmp_path}/root\nfiles: [{{src: a.txt, dest: a.txt}}]\n"
    )
    state = str(tmp_path / "state")
    modules = imported_modules(
        "verify", str(tmp_path / "pb.yaml"), "-i", str(tmp_path / "inv.yaml"), "--state-dir", state, code=1
    )
    assert "paramiko" in modules  # the check below would be empty otherwise
    assert not {m for m in modules if m.startswith(("invoke.", "unittest", "asyncio"))}


def test_the_public_api_loads_on_first_use() -> None:
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        orchestrator.nope  # noqa: B018
