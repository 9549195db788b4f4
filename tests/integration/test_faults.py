"""Hosts that misbehave, for real: a writer racing our rename, a full disk, a cut connection,
and two controllers at once. In every case no served file is ever partial or wrong."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fuse  # type: ignore[import-untyped]
import pytest

from orchestrator.sandbox.processes import descendants
from orchestrator.sandbox.sshhosts import SandboxHost
from tests.integration.conftest import GOOD_DRAFTER, STALE_DRAFTER, Sandbox, write_playbook

HERE = Path(__file__).resolve().parent


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def mounted(sandbox: Sandbox, host: str, path: str) -> bool:
    info = Path(f"/proc/{sandbox.host(host).pid}/mountinfo").read_text()
    return any(line.split()[4] == path for line in info.splitlines())


def assert_no_partial_files(base: Path) -> None:
    """Every file in every release matches its manifest; no temp file or staging dir remains."""
    releases = base / "releases"
    for release in releases.iterdir():
        assert not release.name.startswith("."), f"leftover staging dir {release}"
        check = subprocess.run(
            ["sha256sum", "--check", "--strict", ".manifest.sha256"], cwd=release, capture_output=True
        )
        assert check.returncode == 0, f"{release} is partial: {check.stdout.decode()}"
        leftovers = [p for p in release.rglob("*") if ".tmp-" in p.name]
        assert leftovers == []


@pytest.fixture
def lying_mount(sandbox: Sandbox, root_name: str) -> Iterator[str]:
    """The deploy root of one host on a filesystem whose config.json is rewritten after each rename."""
    host = sandbox.names[3]
    backing = sandbox.srv(host) / (Path(root_name).name + "-backing")
    backing.mkdir()
    (sandbox.srv(host) / Path(root_name).name).mkdir()
    # The host's mount namespace hides /root, where the checkout and this venv may live: the
    # system Python runs the filesystem, fusepy and the stale file carried into the host's /srv.
    lyingfs, fusepy, stale = sandbox.carry(host, HERE / "lyingfs.py", Path(fuse.__file__), STALE_DRAFTER)
    env = dict(os.environ, PYTHONPATH=str(Path(fusepy).parent))
    proc = subprocess.Popen(
        ["nsenter", "-t", str(sandbox.host(host).pid), "-m", "--", "/usr/bin/python3", lyingfs,
         f"/srv/{backing.name}", root_name, stale],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for(lambda: mounted(sandbox, host, root_name) or proc.poll() is not None, what="the FUSE mount")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        yield host
    finally:
        subprocess.run(
            ["nsenter", "-t", str(sandbox.host(host).pid), "-m", "--", "umount", "-l", root_name], check=False
        )
        proc.terminate()
        proc.wait(timeout=30)


def test_a_writer_changing_the_file_right_after_our_rename_is_caught(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,
    lying_mount: str,  # type: ignore[no-untyped-def]
) -> None:
    pb = write_playbook(tmp_path, root_name, {"serving.env": b"A=1\n"})
    run = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert run.code == 1
    bad = run.host(lying_mount)
    assert not bad["ready"] and bad["release_id"] is None
    detail = bad["gates"]["files"]["detail"]
    assert (
        "read-back of the final path" in detail
        and f"{root_name}/releases/{run.json['release_id']}/drafter/config.json" in detail
    )
    assert all(h["ready"] for h in run.json["hosts"] if h["name"] != lying_mount)
    # Nothing was made current, so nothing half-new is served.
    assert not os.path.lexists(sandbox.srv(lying_mount) / (Path(root_name).name + "-backing") / "current")


def test_a_full_disk_fails_that_host_and_keeps_the_old_release(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    host = sandbox.names[4]
    base = sandbox.srv(host) / Path(root_name).name
    base.mkdir()
    sandbox.nsenter(host, "mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", root_name)
    try:
        small = write_playbook(tmp_path / "small", root_name, {"serving.env": b"A=1\n"})
        first = cli("deploy", small, "-i", sandbox.inventory, "--json", "--limit", host)
        assert first.code == 0, first.stderr
        big = write_playbook(tmp_path / "big", root_name, {"serving.env": b"A=2\n", "blob.bin": os.urandom(1 << 20)})
        run = cli("deploy", big, "-i", sandbox.inventory, "--json", "--limit", host)
        assert run.code == 1
        detail = run.host(host)["gates"]["files"]["detail"]
        assert "ENOSPC" in detail and "No space left on device" in detail
        # The old release is still current and intact on the host, and verify says so.
        assert cli("verify", small, "-i", sandbox.inventory, "--limit", host).code == 0
        listing = sandbox.nsenter(host, "ls", "-A", f"{root_name}/releases").stdout.split()
        assert listing == [first.json["release_id"]]
    finally:
        sandbox.nsenter(host, "umount", root_name)


def test_a_connection_cut_during_the_transfer_is_retried_and_no_file_is_partial(
    sandbox: Sandbox,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    host = sandbox.host(sandbox.names[5])
    blob = os.urandom(4 << 20)
    # Throttle the link into this host so the transfer is still going when we cut it.
    subprocess.run(
        [
            "tc",
            "qdisc",
            "add",
            "dev",
            host.veth,
            "root",
            "tbf",
            "rate",
            "16mbit",
            "burst",
            "32kbit",
            "latency",
            "400ms",
        ],
        check=True,
    )
    try:
        cut_during_transfer(sandbox, host, blob, tmp_path, root_name)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", host.veth, "root"], check=True)


def cut_during_transfer(sandbox: Sandbox, host: SandboxHost, blob: bytes, tmp_path: Path, root_name: str) -> None:
    pb = write_playbook(tmp_path, root_name, {"weights/blob.bin": blob})
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "deploy", str(pb), "-i", str(sandbox.inventory), "--json", "--limit", host.name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip

    def connection_process() -> int | None:
        """The per-connection sshd whose session runs our agent (a child of the listener)."""
        for pid in descendants(host.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"dflash-agent" in cmd:
                chain = pid
                while True:
                    parent = int(Path(f"/proc/{chain}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    if parent == host.pid:
                        return chain
                    chain = parent
        return None

    victim = wait_for(connection_process, timeout=60, what="the agent's SSH session")
    assert proc.poll() is None
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    report = json.loads(out)["hosts"][0]
    assert report["ready"] and report["ssh"]["retries"] >= 1 and report["ssh"]["connects"] >= 2
    assert report["changed"]  # this run changed the host, wherever the cut fell
    base = sandbox.srv(host.name) / Path(root_name).name
    assert (base / "current" / "weights" / "blob.bin").read_bytes() == blob
    assert_no_partial_files(base)


def test_a_held_lock_stops_a_second_controller(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    host = sandbox.names[6]
    base = sandbox.srv(host) / Path(root_name).name
    base.mkdir()
    (base / ".lock").write_text('{"owner": "alice@other-controller"}')
    pb = write_playbook(tmp_path, root_name)
    with open(base / ".lock", "rb+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        run = cli("deploy", pb, "-i", sandbox.inventory, "--json", "--lock-timeout", "0.5")
    assert run.code == 1
    detail = run.host(host)["gates"]["files"]["detail"]
    assert "locked by another run" in detail and "alice@other-controller" in detail
    assert not (base / "releases").exists()
    assert all(h["ready"] for h in run.json["hosts"] if h["name"] != host)
    assert cli("deploy", pb, "-i", sandbox.inventory).code == 0  # lock released: it goes through


def test_two_deploys_at_once_do_not_interleave(sandbox: Sandbox, tmp_path: Path, root_name: str) -> None:
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    books = {
        tag: write_playbook(
            tmp_path / tag,
            root_name,
            {"serving.env": f"RUN={tag}\n".encode(), "blob": os.urandom(4 << 20)},
            drafter=drafter,
        )
        for tag, drafter in (("a", GOOD_DRAFTER), ("b", STALE_DRAFTER))
    }
    procs = [
        subprocess.Popen([sys.executable, "-m", "orchestrator", "deploy", str(pb), "-i", str(sandbox.inventory), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for pb in books.values()
    ]  # fmt: skip
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1].decode() for r in results]
    for name in sandbox.names:
        base = sandbox.srv(name) / Path(root_name).name
        assert len(list((base / "releases").iterdir())) == 2
        assert_no_partial_files(base)
        served = (base / "current" / "serving.env").read_text()
        tag = served.strip().split("=")[1]
        # The served release is whole: its drafter config comes from the same playbook.
        expected = GOOD_DRAFTER if tag == "a" else STALE_DRAFTER
        assert (base / "current" / "drafter" / "config.json").read_bytes() == expected.read_bytes()


@contextlib.contextmanager
def loopback_host(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    """A listener on loopback that hands each connection to ``handle`` on a thread of its own; its
    port. Shut down when the test is done with it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # shut down: the test is over
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept above
        listener.close()


def one_host_inventory(tmp_path: Path, sandbox: Sandbox, name: str, port: int, connect_timeout: int) -> Path:
    """An inventory of one container at 127.0.0.1:``port``, with the sandbox's client key."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        f"known_hosts: known_hosts\ndefaults:\n  key: {sandbox.box.client_key}\n"
        f"  connect_timeout: {connect_timeout}\n"
        f"hosts:\n  odd:\n    containers:\n      {name}: {{address: 127.0.0.1, port: {port}}}\n"
    )
    return inv


def test_a_host_that_hangs_up_before_its_banner_gets_one_line_not_a_traceback(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    """A listener on loopback that accepts and closes at once: not an SSH server at all."""
    with loopback_host(lambda conn: conn.close()) as port:
        (tmp_path / "known_hosts").write_text("")
        inv = one_host_inventory(tmp_path, sandbox, "mute", port, connect_timeout=5)
        run = cli("deploy", write_playbook(tmp_path, root_name), "-i", inv, "--json")
    assert run.code == 1
    detail = run.host("mute")["gates"]["connect"]["detail"]
    assert f"SSH handshake with [127.0.0.1]:{port} failed" in detail and "banner" in detail
    assert "Traceback" not in run.stderr and "Exception (client)" not in run.stderr


def test_a_banner_later_than_paramikos_15_s_waits_as_long_as_connect_timeout_says(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    """A host whose sshd answers its banner 16 s late (what a thousand connections at once do to
    sshd): with ``connect_timeout: 30`` the deploy waits for it, as OpenSSH's ConnectTimeout would.
    The late host is a relay on loopback in front of a real sandbox sshd that holds back the
    server's first line."""
    host = sandbox.hosts[7]
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def relay(client: socket.socket) -> None:
        with client, socket.create_connection((host.address, 22)) as server:
            banner = b""
            while not banner.endswith(b"\n"):
                banner += server.recv(1)
            if stop.wait(16.0):  # the server's slowness, cut short when the test ends
                return
            client.sendall(banner)
            upstream = threading.Thread(target=pump, args=(client, server), daemon=True)
            upstream.start()
            pump(server, client)
            upstream.join()

    try:
        with loopback_host(relay) as port:
            key = (Path(host.files) / "ssh_host_ed25519_key.pub").read_text().split()
            (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{port} {key[0]} {key[1]}\n")
            inv = one_host_inventory(tmp_path, sandbox, "late", port, connect_timeout=30)
            run = cli("deploy", write_playbook(tmp_path, root_name), "-i", inv, "--json")
    finally:
        stop.set()
    assert run.code == 0, run.host("late")["gates"]
    ssh = run.host("late")["ssh"]
    assert run.host("late")["gates"]["connect"]["ok"] and (ssh["connects"], ssh["retries"]) == (1, 0), ssh
    base = sandbox.srv(host.name) / Path(root_name).name
    assert (base / "current" / "drafter" / "config.json").read_bytes() == GOOD_DRAFTER.read_bytes()
