"""Host-key policy on real OpenSSH keys: unknown refused, changed always refused, accept-new recorded."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import paramiko
import pytest

from orchestrator.connectors.ssh import KnownHosts
from orchestrator.errors import HostKeyChanged, InputError, UnknownHostKey

pytestmark = pytest.mark.usefixtures("programs")


def keypair(tmp_path: Path, name: str) -> tuple[paramiko.PKey, str]:
    path = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return paramiko.PKey.from_path(path), (tmp_path / f"{name}.pub").read_text().split()[1]


def test_known_key_passes_and_changed_key_is_refused(tmp_path: Path) -> None:
    key, blob = keypair(tmp_path, "a")
    other, _ = keypair(tmp_path, "b")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"# comment\n10.0.0.1 ssh-ed25519 {blob}\n")
    table = KnownHosts(kh)
    table.check("h", "10.0.0.1", key, accept_new=False)
    with pytest.raises(HostKeyChanged) as info:
        table.check("h", "10.0.0.1", other, accept_new=True)
    assert "HOST KEY CHANGED" in str(info.value) and "line 2" in str(info.value) and "ssh-keygen -R" in str(info.value)
    assert not info.value.transient


def test_unknown_key_refused_unless_accepted_then_recorded(tmp_path: Path) -> None:
    key, blob = keypair(tmp_path, "a")
    kh = tmp_path / "known_hosts"
    table = KnownHosts(kh)
    with pytest.raises(UnknownHostKey, match=r"\[10.0.0.2\]:2222 is not in .*--accept-new-host-keys"):
        table.check("h", "[10.0.0.2]:2222", key, accept_new=False)
    assert not kh.exists()
    table.check("h", "[10.0.0.2]:2222", key, accept_new=True)
    assert kh.read_text() == f"[10.0.0.2]:2222 ssh-ed25519 {blob}\n"
    assert table.accepted and table.accepted[0].startswith("[10.0.0.2]:2222 ssh-ed25519 SHA256:")
    KnownHosts(kh).check("h", "[10.0.0.2]:2222", key, accept_new=False)  # persisted


def test_hashed_entries_and_revoked_keys(tmp_path: Path) -> None:
    key, blob = keypair(tmp_path, "a")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"10.0.0.3 ssh-ed25519 {blob}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "10.0.0.3" not in kh.read_text()
    KnownHosts(kh).check("h", "10.0.0.3", key, accept_new=False)
    kh.write_text(f"@revoked 10.0.0.4 ssh-ed25519 {blob}\n10.0.0.4 ssh-ed25519 {blob}\n")
    with pytest.raises(HostKeyChanged, match="@revoked"):
        KnownHosts(kh).check("h", "10.0.0.4", key, accept_new=True)


def test_host_name_form() -> None:
    assert KnownHosts.host_name("10.0.0.1", 22) == "10.0.0.1"
    assert KnownHosts.host_name("10.0.0.1", 2200) == "[10.0.0.1]:2200"


def test_an_accepted_key_never_joins_the_last_line_and_a_fifo_never_hangs(tmp_path: Path) -> None:
    """A known_hosts whose last line has no newline (an editor's doing) had the accepted entry
    joined to it, and that host's key lost; a FIFO in its place blocked the run for ever; a line
    that is not UTF-8 made every run fail with a traceback. Each is handled as OpenSSH would."""
    a, blob_a = keypair(tmp_path, "a")
    b, blob_b = keypair(tmp_path, "b")
    kh = tmp_path / "known_hosts"
    kh.write_bytes(b"\xff\xfe not text\n" + f"10.0.0.1 ssh-ed25519 {blob_a}".encode())  # no final newline
    table = KnownHosts(kh)
    table.check("h", "10.0.0.2", b, accept_new=True)
    assert kh.read_bytes().endswith(f"10.0.0.1 ssh-ed25519 {blob_a}\n10.0.0.2 ssh-ed25519 {blob_b}\n".encode())
    again = KnownHosts(kh)
    again.check("h", "10.0.0.1", a, accept_new=False)  # the old entry still whole
    again.check("h", "10.0.0.2", b, accept_new=False)

    fifo = tmp_path / "fifo_known_hosts"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file: known_hosts is read and appended to as one") as info:
        KnownHosts(fifo)
    assert str(fifo) in str(info.value)


def test_a_fleet_of_hashed_entries_each_found_by_its_own_name(tmp_path: Path) -> None:
    """A fleet's known_hosts as ``ssh-keyscan -H`` or OpenSSH's HashKnownHosts writes it: each name
    is found by hashing it with every entry's salt (the salts' HMAC states made once, each name's
    answer kept). Every host finds its own key and no other's, ports included; a name looked up
    before its key was accepted finds the key once it is."""
    keys = [keypair(tmp_path, f"k{i}") for i in range(3)]
    names = [f"10.9.{i // 250}.{i % 250}" for i in range(40)] + [f"[10.9.9.{i}]:2222" for i in range(8)]
    kh = tmp_path / "known_hosts"
    kh.write_text("".join(f"{n} ssh-ed25519 {keys[i % 2][1]}\n" for i, n in enumerate(names)))
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "10.9." not in kh.read_text() and len(set(line.split()[0] for line in kh.read_text().splitlines())) == 48
    table = KnownHosts(kh)
    for i, name in enumerate(names):
        right, wrong = keys[i % 2][0], keys[(i + 1) % 2][0]
        for _ in range(2):  # the second asking is answered from what the first found
            table.check("h", name, right, accept_new=False)
        with pytest.raises(HostKeyChanged, match="HOST KEY CHANGED"):
            table.check("h", name, wrong, accept_new=True)
    assert table.lookup("10.9.0.1")[0].line == 2 and table.lookup("10.9.0.3") != table.lookup("10.9.0.1")
    new = "10.9.8.8"
    with pytest.raises(UnknownHostKey):
        table.check("h", new, keys[2][0], accept_new=False)
    table.check("h", new, keys[2][0], accept_new=True)
    table.check("h", new, keys[2][0], accept_new=False)
    with pytest.raises(HostKeyChanged):
        table.check("h", new, keys[0][0], accept_new=True)
