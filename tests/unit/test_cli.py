"""The command line's own answers, before any playbook is read."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import orchestrator
from orchestrator.cli.main import main


def test_version_is_answered_as_ansible_pyinfra_and_vllm_answer_it(capsys: pytest.CaptureFixture[str]) -> None:
    """``--version`` prints the installed version and exits 0 (``-v`` stays ``--verbose``)."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert capsys.readouterr().out == f"orchestrate {pyproject['project']['version']}\n"
    assert orchestrator.__version__ == pyproject["project"]["version"]
