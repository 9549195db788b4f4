"""The ssh sandbox itself: real OpenSSH clients reach it, up is idempotent, down leaves nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestrator.sandbox.processes import alive
from orchestrator.sandbox.sshhosts import SshSandbox
from tests.integration.conftest import Sandbox


def test_openssh_client_reaches_each_host_with_strict_host_keys(sandbox: Sandbox) -> None:
    for name in sandbox.names[:3]:
        out = subprocess.run(
            ["ssh", "-F", str(sandbox.box.ssh_config), "-o", "BatchMode=yes", name, "cat /srv/whoami 2>/dev/null; hostname"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        assert out.stdout.strip()
    # each host has its own /srv: a file in one is not in another
    (sandbox.srv(sandbox.names[0]) / "only-here").write_text("x")
    probe = [
        "ssh",
        "-F",
        str(sandbox.box.ssh_config),
        sandbox.names[1],
        "test -e /srv/only-here && echo yes || echo no",
    ]
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == "no"


def test_cli_up_status_down(tmp_path: Path) -> None:
    """A second, separate sandbox through the real CLI: up twice (idempotent), status, down."""
    directory = tmp_path / "box"
    base = [sys.executable, "-m", "orchestrator", "sandbox"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args, "--dir", str(directory)], capture_output=True, text=True, timeout=120)

    try:
        exercise_sandbox_cli(cli, directory)
    finally:
        if directory.exists():
            SshSandbox(directory).down()


def exercise_sandbox_cli(cli, directory: Path) -> None:  # type: ignore[no-untyped-def]
    up = cli("up", "--kind", "ssh", "--hosts", "2", "--prefix", "dfs", "--subnet", "10.79")
    assert up.returncode == 0, up.stderr
    status = json.loads(cli("status", "--json").stdout)
    assert status["kind"] == "ssh" and status["up"]
    assert status["inventory"] == str(directory / "inventory.yaml")
    assert [(h["name"], h["address"]) for h in status["hosts"]] == [("node-01", "10.79.0.2"), ("node-02", "10.79.0.3")]
    pids = [h.pid for h in SshSandbox(directory).hosts()]

    again = cli("up", "--hosts", "2")
    assert again.returncode == 0, again.stderr
    assert [h.pid for h in SshSandbox(directory).hosts()] == pids  # nothing restarted

    hosts = SshSandbox(directory).hosts()
    down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not directory.exists()
    assert not any(alive(h.pid, h.pid_start) for h in hosts)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "dfs-" not in netns
    assert subprocess.run(["ip", "link", "show", "dfs-br0"], capture_output=True).returncode != 0
    assert cli("status", "--json").returncode == 1


def test_down_ends_what_runs_in_a_host_even_when_it_left_sshd(tmp_path: Path) -> None:
    """A process in a host's namespace that is no descendant of its sshd (a session whose parent
    exited first) is ended too, not left waiting on a connection that can no longer close."""
    box = SshSandbox(tmp_path / "box", prefix="dfq", subnet="10.84")
    try:
        box.up(1)
        stray = subprocess.Popen(["ip", "netns", "exec", box.hosts()[0].netns, "sleep", "600"], start_new_session=True)
        try:
            box.down()
            stray.wait(timeout=30)  # raises while it still runs (down may have reaped it already)
        finally:
            if stray.poll() is None:
                stray.kill()
                stray.wait()
    finally:
        box.down()
