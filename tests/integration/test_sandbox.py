"""The ssh sandbox itself: real OpenSSH clients reach it, up is idempotent, down leaves nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.errors import SandboxError
from orchestrator.sandbox.lxdhosts import clear_dead_mount
from orchestrator.sandbox.processes import alive
from orchestrator.sandbox.sshhosts import SshSandbox
from tests.integration.conftest import Sandbox
from tests.lanes import Lane


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


def test_cli_up_status_down(tmp_path: Path, lane: Lane) -> None:
    """A second, separate sandbox through the real CLI: up twice (idempotent), status, down."""
    directory = tmp_path / "box"
    base = [sys.executable, "-m", "orchestrator", "sandbox"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args, "--dir", str(directory)], capture_output=True, text=True, timeout=120)

    try:
        exercise_sandbox_cli(cli, directory, lane)
    finally:
        if directory.exists():
            SshSandbox(directory).down()


def exercise_sandbox_cli(cli, directory: Path, lane: Lane) -> None:  # type: ignore[no-untyped-def]
    prefix, subnet = lane.prefix("c"), lane.subnet(1)
    up = cli("up", "--kind", "ssh", "--hosts", "2", "--prefix", prefix, "--subnet", subnet)
    assert up.returncode == 0, up.stderr
    status = json.loads(cli("status", "--json").stdout)
    assert status["kind"] == "ssh" and status["up"]
    assert status["inventory"] == str(directory / "inventory.yaml")
    assert [(h["name"], h["address"]) for h in status["hosts"]] == [
        ("node-01", f"{subnet}.0.2"),
        ("node-02", f"{subnet}.0.3"),
    ]
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
    assert f"{prefix}-" not in netns
    assert subprocess.run(["ip", "link", "show", f"{prefix}-br0"], capture_output=True).returncode != 0
    assert cli("status", "--json").returncode == 1


def test_down_ends_what_runs_in_a_host_even_when_it_left_sshd(tmp_path: Path, lane: Lane) -> None:
    """A process in a host's namespace that is no descendant of its sshd (a session whose parent
    exited first) is ended too, not left waiting on a connection that can no longer close."""
    box = SshSandbox(tmp_path / "box", prefix=lane.prefix("q"), subnet=lane.subnet(2))
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


@pytest.mark.usefixtures("programs")  # real lxcfs on a directory of the test's own
def test_a_dead_lxcfs_mount_left_by_a_killed_machine_is_cleared(tmp_path: Path) -> None:
    """Every process killed (a session's end) leaves lxcfs's FUSE mount with nothing serving it.

    Real lxcfs on a directory of its own, killed by its PID: the mount is then dead (ENOTCONN),
    as /var/lib/lxcfs was on a machine where the LXD tests then could not start LXD at all.
    """
    lxcfs = shutil.which("lxcfs")
    if lxcfs is None:
        pytest.fail("lxcfs is not installed (.ci/run installs it)")
    mount = tmp_path / "lxcfs"
    mount.mkdir()
    proc = subprocess.Popen(
        [lxcfs, "--foreground", "--pidfile", str(tmp_path / "lxcfs.pid"), str(mount)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mount):
            assert proc.poll() is None, "lxcfs exited before mounting"
            assert time.monotonic() < deadline, "lxcfs did not mount within 30 s"
            time.sleep(0.05)
        assert (mount / "proc" / "uptime").read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        with pytest.raises(OSError) as dead:
            (mount / "proc" / "uptime").read_text()
        assert dead.value.errno == errno.ENOTCONN

        said: list[str] = []
        clear_dead_mount(mount, said.append)
        assert mount.is_dir() and not os.path.ismount(mount)
        assert said == [f"lxd: removed the dead lxcfs mount at {mount}"]
        clear_dead_mount(mount, said.append)  # a plain directory is left alone
        assert len(said) == 1
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if os.path.ismount(mount) or not os.access(mount, os.F_OK):
            subprocess.run(["umount", "--lazy", str(mount)], check=False)


def test_a_large_sandbox_spans_bridges_and_sizes_the_arp_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane: Lane
) -> None:
    """A Linux bridge takes 1023 ports ("Exchange full" at the 1024th) and the kernel's ARP table
    1024 entries (then "neighbor table overflow"): 1024 hosts met both. Here 300 hosts, 128 to a
    bridge (the limit lowered so three bridges are made): every host answers on port 22 through
    its own bridge, a real ssh command runs on the last host of each, the ARP table is raised while
    the sandbox is up and put back by down, with the bridges."""
    from orchestrator.sandbox import sshhosts

    monkeypatch.setattr(sshhosts, "HOSTS_PER_BRIDGE", 128)
    names = ("gc_thresh1", "gc_thresh2", "gc_thresh3")
    before = [int((sshhosts.NEIGH / n).read_text()) for n in names]
    box = SshSandbox(tmp_path / "box", prefix=lane.prefix("l"), subnet=lane.subnet(3))
    said: list[str] = []
    try:
        box.up(300, said.append)
        hosts = box.hosts()
        assert len(hosts) == 300
        bridges = [f"{box.prefix}-br{k}" for k in range(3)]
        for bridge in bridges:
            assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode == 0
        if before[1] < 300 + 256:
            assert int((sshhosts.NEIGH / "gc_thresh3").read_text()) >= 4 * (300 + 256)
            assert any("ARP table raised" in line for line in said), said
        for h in hosts:
            with socket.create_connection((h.address, 22), timeout=10) as conn:
                assert conn.recv(64).startswith(b"SSH-2.0-OpenSSH")
        for h in (hosts[127], hosts[255], hosts[299]):  # the last host of each bridge
            done = subprocess.run(
                ["ssh", "-F", str(box.ssh_config), h.name, "cat /proc/sys/kernel/hostname; ip -o -4 addr show eth0"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0 and f"inet {h.address}/16" in done.stdout, done.stderr
    finally:
        box.down()
    assert [int((sshhosts.NEIGH / n).read_text()) for n in names] == before
    for bridge in (f"{box.prefix}-br{k}" for k in range(3)):
        assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
    assert f"{box.prefix}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_sandbox_larger_than_the_machine_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane: Lane
) -> None:
    """The check reads this machine's MemAvailable; a host's cost is made a third of it, so that 5
    hosts cannot fit (this machine holds 2000 real ones): refused, and nothing made."""
    from orchestrator.sandbox import sshhosts

    meminfo = Path("/proc/meminfo").read_text().splitlines()
    available = int(next(line for line in meminfo if line.startswith("MemAvailable")).split()[1]) * 1024
    monkeypatch.setattr(sshhosts, "HOST_MEMORY", available // 3)
    box = SshSandbox(tmp_path / "box", prefix=lane.prefix("k"), subnet=lane.subnet(4))
    with pytest.raises(SandboxError) as refused:
        box.up(5)
    assert "5 hosts need about" in str(refused.value) and "ask for at most 2 hosts" in str(refused.value)
    assert not (tmp_path / "box" / "hosts").exists()
    assert subprocess.run(["ip", "link", "show", f"{lane.prefix('k')}-br0"], capture_output=True).returncode != 0


def test_two_downs_of_one_sandbox_at_once_both_succeed(tmp_path: Path, lane: Lane) -> None:
    """Two processes taking the same sandbox down (a test session ending while `sandbox down` runs):
    whichever removes a file first, neither fails, and nothing of the sandbox is left."""
    prefix = lane.prefix("q")
    box = SshSandbox(tmp_path / "box", prefix=prefix, subnet=lane.subnet(2))
    try:
        box.up(2)
        junk = Path(box.hosts()[0].files) / "srv" / "junk"
        for i in range(40):  # a tree that takes both removers a while
            (junk / str(i)).mkdir(parents=True)
            for j in range(200):
                (junk / str(i) / str(j)).write_bytes(b"")
        down = (
            "import sys; from pathlib import Path; from orchestrator.sandbox.sshhosts import SshSandbox; "
            "SshSandbox(Path(sys.argv[1])).down()"  # its prefix and subnet from the sandbox's state
        )
        procs = [
            subprocess.Popen([sys.executable, "-c", down, str(box.dir)], stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errors
        assert not box.dir.exists()
        left = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
        assert prefix not in left
    finally:
        box.down()
