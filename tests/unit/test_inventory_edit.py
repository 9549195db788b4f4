"""Inventory edits from the CLI keep every comment, the order, quoting and blank lines: only the
edited lines change; refused edits leave the file byte-identical."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "inventories" / "commented.yaml"


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "inventory", *map(str, args)], capture_output=True, text=True, timeout=60
    )


def changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    import difflib

    diff = list(difflib.ndiff(before.splitlines(), after.splitlines()))
    return [d[2:] for d in diff if d.startswith("- ")], [d[2:] for d in diff if d.startswith("+ ")]


@pytest.fixture
def inv(tmp_path: Path) -> Path:
    path = tmp_path / "inventory.yaml"
    shutil.copy(GOLDEN, path)
    os.chmod(path, 0o640)
    return path


@pytest.mark.parametrize(
    ("args", "removed", "added"),
    [
        (["add-host", "gpu-c", "--address", "192.0.2.12", "--lxd-endpoint", "local"], [],
         ["  gpu-c:", "    address: 192.0.2.12", "    lxd:", "      endpoint: local", "    containers: {}"]),
        (["remove-host", "gpu-b"],
         ["  # --- rack 4 -------------------------------------------------------", "  gpu-b:                      # 4x A100",
          "    address: 192.0.2.11", "    containers:", "      serve-2:", "        address: 10.10.1.2", "        jump: true",
          "        gpus: [0, 1, 2, 3]", ""], []),
        (["add-container", "gpu-b", "serve-3", "--address", "10.10.1.3", "--gpus", "4,5", "--group", "canary"], [],
         ["      serve-3:", "        address: 10.10.1.3", "        gpus: [4, 5]", "        groups: [canary]"]),
        (["remove-container", "gpu-a", "serve-1"],
         ["      serve-1:", "        address: 10.10.0.3", "        jump: true", "        gpus: [4, 5, 6, 7]", ""], []),
        (["set", "hosts.gpu-a.containers.serve-0.gpus", "[0,1]"], ["        gpus: [0, 1, 2, 3]"], ["        gpus: [0, 1]"]),
        (["set", "defaults.port", "2222"], [], ["  port: 2222"]),
        (["set", "hosts.gpu-a.containers.serve-1.groups", "[canary]"], [], ["        groups: [canary]"]),
        (["unset", "hosts.gpu-a.containers.serve-1.jump"], ["        jump: true"], []),
    ],
)  # fmt: skip
def test_only_the_edited_lines_change(inv: Path, args: list[str], removed: list[str], added: list[str]) -> None:
    before = inv.read_text()
    run = cli(*args, "-i", inv)
    assert run.returncode == 0, run.stderr
    after = inv.read_text()
    assert changed_lines(before, after) == (removed, added)
    assert after.startswith("# Production inventory for the DFlash fleet.\n") and after.endswith("# end of inventory\n")
    assert oct(inv.stat().st_mode & 0o777) == "0o640"  # mode kept by the atomic replace
    assert cli("validate", "-i", inv).returncode == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add-container", "gpu-b", "serve-0"], "'serve-0' is already in the inventory"),
        (["add-host", "gpu-a", "--address", "192.0.2.99"], "'gpu-a' is already in the inventory"),
        (["set", "hosts.gpu-a.containers.serve-0.gpus", "[0, one]"], ":24 hosts.gpu-a.containers.serve-0.gpus: expected a list of integers"),
        (["set", "hosts.gpu-a.containers.serve-0.jmup", "true"], "unknown key (did you mean 'jump'?)"),
        (["remove-container", "gpu-a", "serve-9"], "no container 'serve-9' on GPU host 'gpu-a'"),
        (["unset", "hosts.gpu-a.address"], "jumps through GPU host 'gpu-a', which has no address"),
        (["add-host", "gpu-c", "--address", "192.0.2.12", "--lxd-endpoint", "https://192.0.2.12:8443"], "missing required key 'client_cert'"),
    ],
)  # fmt: skip
def test_refused_edits_leave_the_file_byte_identical(inv: Path, args: list[str], message: str) -> None:
    before = inv.read_bytes()
    run = cli(*args, "-i", inv)
    assert run.returncode == 2 and message in run.stderr and "is unchanged" in run.stderr, run.stderr
    assert inv.read_bytes() == before
    assert [p.name for p in inv.parent.iterdir()] == ["inventory.yaml"]  # no temp file left


def test_dry_run_prints_the_diff_and_writes_nothing(inv: Path) -> None:
    before = inv.read_bytes()
    run = cli("set", "defaults.user", "deploy", "-i", inv, "--dry-run")
    assert run.returncode == 0 and "-  user: root\n+  user: deploy\n" in run.stdout
    assert inv.read_bytes() == before


def test_list_show_and_the_default_inventory_from_the_environment(inv: Path) -> None:
    env = dict(os.environ, ORCHESTRATE_INVENTORY=str(inv))
    listing = subprocess.run(
        [sys.executable, "-m", "orchestrator", "inventory", "list"], capture_output=True, text=True, env=env
    )
    assert listing.returncode == 0 and "serve-2" in listing.stdout
    show = subprocess.run(
        [sys.executable, "-m", "orchestrator", "inventory", "show", "serve-0", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    import json

    data = json.loads(show.stdout)
    assert data["host"] == "gpu-a" and data["gpus"] == [0, 1, 2, 3] and data["vars"] == {"tier": "canary"}
    assert cli("show", "nope", "-i", inv).returncode == 2
