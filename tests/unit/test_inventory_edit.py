"""Inventory edits from the CLI keep every comment, the order, quoting and blank lines: only the
edited lines change; refused edits leave the file byte-identical."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("programs")

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


def test_concurrent_edits_all_land(inv: Path) -> None:
    """Eight `add-container` at once: each edit reads the file under the lock, so none is lost."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "inventory",
                "add-container",
                "gpu-a",
                f"extra-{i}",
                "--address",
                f"10.10.9.{i}",
                "-i",
                str(inv),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    text = inv.read_text()
    assert all(f"extra-{i}:" in text for i in range(8))
    assert sorted(os.listdir(inv.parent)) == ["inventory.yaml"]


def test_an_edit_goes_through_a_link_and_keeps_owner_and_mode(inv: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(inv)
    if os.geteuid() == 0:
        os.chown(inv, 65534, 65534)  # nobody: an edit as root must not make it root's
    result = cli("add-container", "gpu-a", "via-link", "--address", "10.10.9.9", "-i", link)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and "via-link:" in inv.read_text()
    st = inv.stat()
    assert oct(st.st_mode & 0o777) == "0o640"
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (65534, 65534)


TIGHT = """\
hosts:
  gpu-a:
    address: 192.0.2.10
    containers:
      serve-0:
        address: 10.10.0.2
      # serve-1 is the canary
      serve-1:
        address: 10.10.0.3
  # --- rack 4 ---
  gpu-b:
    address: 192.0.2.11
    containers:
      serve-2: {address: 10.10.1.2}
"""


@pytest.mark.parametrize(
    ("args", "kept"),
    [
        (["remove-container", "gpu-a", "serve-1"], "  # --- rack 4 ---\n  gpu-b:"),
        (["remove-container", "gpu-a", "serve-0"], "      # serve-1 is the canary\n      serve-1:"),
        (["remove-host", "gpu-a"], "  # --- rack 4 ---\n  gpu-b:"),
    ],
)
def test_removing_an_entry_keeps_the_comment_that_heads_the_next(tmp_path: Path, args: list[str], kept: str) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(TIGHT)
    result = cli(*args, "-i", inv)
    assert result.returncode == 0, result.stderr
    assert kept in inv.read_text(), inv.read_text()


@pytest.mark.parametrize("value", ['!!python/object/apply:os.system ["id"]', "!custom 1", "&a [*a]"])
def test_set_writes_plain_values_only(inv: Path, value: str) -> None:
    before = inv.read_bytes()
    result = cli("set", "defaults.vars.x", value, "-i", inv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not supported" in result.stderr and inv.read_bytes() == before


def test_a_file_that_cannot_be_replaced_is_one_clear_error(inv: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root replaces a file in a read-only directory")
    inv.parent.chmod(0o500)
    try:
        result = cli("add-container", "gpu-a", "x", "--address", "10.10.9.8", "-i", inv)
    finally:
        inv.parent.chmod(0o700)
    assert result.returncode == 2 and "cannot write" in result.stderr and "Traceback" not in result.stderr


LAID_OUT = (
    "---\n"
    "known_hosts: ~/.ssh/known_hosts\n"
    "hosts:\n"
    "    gpu-a:      # four spaces a level, sequences indented under their key\n"
    "        address: 192.0.2.10\n"
    "        containers:\n"
    "            serve-0:\n"
    "                address: 10.10.0.2\n"
    "                gpus: [0, 1]\n"
    "                groups:\n"
    "                    - serve\n"
    "...\n"
)


@pytest.mark.parametrize(
    ("bom", "newline"),
    [("", "\n"), ("", "\r\n"), ("\ufeff", "\n"), ("\ufeff", "\r\n")],
    ids=["lf", "crlf", "bom", "bom-crlf"],
)
def test_an_edit_keeps_the_files_own_layout_byte_for_byte(tmp_path: Path, bom: str, newline: str) -> None:
    """Four-space indentation, sequences indented under their key, document markers, CRLF line ends
    and a byte-order mark: each edit used to rewrite every line (two spaces, LF, the markers and the
    mark dropped). Only the edited lines change now, in the file's own layout."""
    path = tmp_path / "inventory.yaml"
    original = bom + LAID_OUT.replace("\n", newline)
    path.write_bytes(original.encode())
    run = cli("set", "hosts.gpu-a.containers.serve-0.gpus", "[2, 3]", "-i", path)
    assert run.returncode == 0, run.stderr
    after = path.read_bytes().decode()
    assert after == original.replace("gpus: [0, 1]", "gpus: [2, 3]")
    run = cli("add-container", "gpu-a", "serve-1", "--address", "10.10.0.3", "--gpus", "4", "-i", path)
    assert run.returncode == 0, run.stderr
    added = path.read_bytes().decode()
    lines = ["            serve-1:", "                address: 10.10.0.3", "                gpus: [4]"]
    assert added == after.replace(f"...{newline}", "".join(f"{line}{newline}" for line in lines) + f"...{newline}")


@pytest.mark.parametrize(
    ("text", "line", "becomes"),
    [
        ("--- # the cluster\nhosts: {}\n", 1, "'--- # the cluster' becomes '---'"),
        (
            "hosts:\n  gpu-a:\n      address: 192.0.2.10\n      containers: {}\n  gpu-b:\n    address: 192.0.2.11\n",
            3,
            "'      address: 192.0.2.10' becomes '    address: 192.0.2.10'",
        ),
        ("hosts: {}\r\nknown_hosts: ~/.ssh/known_hosts\n", 1, "'hosts: {}\\r' becomes 'hosts: {}'"),
    ],
    ids=["a comment on the document marker", "two indentations in one file", "mixed line ends"],
)
def test_an_edit_that_would_rewrite_other_lines_is_refused(tmp_path: Path, text: str, line: int, becomes: str) -> None:
    """Where the YAML writer cannot keep the file's layout, the edit is refused naming the first line
    it would rewrite; the file stays byte-identical (it used to be rewritten whole)."""
    path = tmp_path / "inventory.yaml"
    path.write_bytes(text.encode())
    run = cli("add-host", "gpu-c", "--address", "192.0.2.12", "-i", path)
    assert run.returncode == 2, run.stdout
    assert f"{path}:{line}: an edit would also rewrite line {line} (" in run.stderr, run.stderr
    assert becomes in run.stderr
    assert path.read_bytes() == text.encode()
