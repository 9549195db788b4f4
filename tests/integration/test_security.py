"""Security defaults over real SSH: strict host keys, jump hosts, paths confined to the deploy root."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.config.inventory import load_inventory
from orchestrator.connectors.base import Command
from orchestrator.connectors.ssh import KnownHosts, SshConnector
from orchestrator.errors import AgentError
from tests.integration.conftest import Sandbox, write_playbook


def known_line(sandbox: Sandbox, name: str, key_of: str | None = None) -> str:
    pub = (Path(sandbox.host(key_of or name).files) / "ssh_host_ed25519_key.pub").read_text().split()
    return f"{sandbox.host(name).address} {pub[0]} {pub[1]}\n"


def inventory(tmp_path: Path, sandbox: Sandbox, known: str, body: str | None = None) -> Path:
    (tmp_path / "known_hosts").write_text(known)
    if body is None:
        body = "  sandbox:\n    containers:\n" + "".join(
            f"      {h.name}: {{address: {h.address}}}\n" for h in sandbox.hosts[:3]
        )
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"known_hosts: known_hosts\ndefaults:\n  key: {sandbox.box.client_key}\n  python: /usr/bin/python3\n"
        f"  connect_timeout: 5\nhosts:\n{body}"
    )
    return path


def test_changed_host_key_is_refused_even_with_accept_new(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    a, b, c = sandbox.names[:3]
    known = known_line(sandbox, a, key_of=b) + known_line(sandbox, b) + known_line(sandbox, c)
    inv = inventory(tmp_path, sandbox, known)
    pb = write_playbook(tmp_path, root_name)
    for extra in ([], ["--accept-new-host-keys"]):
        run = cli("deploy", pb, "-i", inv, "--json", *extra)
        assert run.code == 1
        bad = run.host(a)
        assert not bad["ready"] and "HOST KEY CHANGED" in bad["gates"]["connect"]["detail"]
        assert bad["ssh"]["retries"] == 0  # a host-key failure is never retried
        assert "files" not in bad["gates"]
        assert run.host(b)["ready"] and run.host(c)["ready"]
    assert not (sandbox.srv(a) / Path(root_name).name).exists()  # nothing was sent to it
    assert (tmp_path / "known_hosts").read_text() == known  # and nothing was learnt


def test_unknown_host_is_refused_by_default_and_accepted_only_when_asked(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    a, b, _ = sandbox.names[:3]
    inv = inventory(tmp_path, sandbox, known_line(sandbox, a))
    pb = write_playbook(tmp_path, root_name)
    refused = cli("deploy", pb, "-i", inv, "--json")
    assert refused.code == 1
    detail = refused.host(b)["gates"]["connect"]["detail"]
    assert f"host {sandbox.host(b).address} is not in" in detail and "--accept-new-host-keys" in detail
    assert refused.host(a)["ready"]

    accepted = cli("deploy", pb, "-i", inv, "--json", "--accept-new-host-keys")
    assert accepted.code == 0, accepted.stderr
    assert len(accepted.json["accepted_host_keys"]) == 2
    assert "accepted new host key" in accepted.stderr
    assert known_line(sandbox, b) in (tmp_path / "known_hosts").read_text()
    again = cli("deploy", pb, "-i", inv, "--json")
    assert again.code == 0 and again.json["accepted_host_keys"] == []


def test_jump_through_the_gpu_host_checks_both_keys(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    gw, inner = sandbox.hosts[0], sandbox.hosts[1]
    body = (
        f"  gpu-gw:\n    address: {gw.address}\n    containers:\n"
        f"      via-gw:\n        address: {inner.address}\n        jump: true\n"
    )
    inv = inventory(tmp_path, sandbox, known_line(sandbox, gw.name) + known_line(sandbox, inner.name), body)
    pb = write_playbook(tmp_path, root_name, {"x.txt": b"through the jump host\n"})
    ok = cli("deploy", pb, "-i", inv, "--json")
    assert ok.code == 0, ok.stderr
    assert (
        sandbox.srv(inner.name) / Path(root_name).name / "current" / "x.txt"
    ).read_bytes() == b"through the jump host\n"
    assert not (sandbox.srv(gw.name) / Path(root_name).name).exists()

    # The jump host's key is checked too: a wrong one stops the container before any byte is sent.
    (tmp_path / "known_hosts").write_text(
        known_line(sandbox, gw.name, key_of=inner.name) + known_line(sandbox, inner.name)
    )
    bad = cli("deploy", pb, "-i", inv, "--json")
    assert bad.code == 1 and "HOST KEY CHANGED" in bad.host("via-gw")["gates"]["connect"]["detail"]
    # ...and so is the container's own key behind the jump.
    (tmp_path / "known_hosts").write_text(
        known_line(sandbox, gw.name) + known_line(sandbox, inner.name, key_of=gw.name)
    )
    bad = cli("deploy", pb, "-i", inv, "--json")
    assert bad.code == 1 and "HOST KEY CHANGED" in bad.host("via-gw")["gates"]["connect"]["detail"]


def test_closing_a_run_through_a_jump_host_leaves_no_thread_failing(sandbox: Sandbox, tmp_path: Path) -> None:
    """A container reached through its GPU host, then the run closed: the connection behind the
    jump is closed before the jump host's own (its socket is a channel of it). The other way round,
    its reader thread sometimes sent on a closed connection and died with EOFError (paramiko,
    unhandled: 2 of 30 runs here, and once in CI)."""
    import threading

    import paramiko

    gw, inner = sandbox.hosts[0], sandbox.hosts[1]
    body = (
        f"  gpu-gw:\n    address: {gw.address}\n    containers:\n"
        f"      via-gw:\n        address: {inner.address}\n        jump: true\n"
    )
    inv = load_inventory(
        inventory(tmp_path, sandbox, known_line(sandbox, gw.name) + known_line(sandbox, inner.name), body)
    )
    failed: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: failed.append(f"{args.thread}: {args.exc_type.__name__}: {args.exc_value}")
    try:
        for _ in range(30):  # a race of two threads: many runs
            transport = SshConnector(KnownHosts(inv.known_hosts))
            (target,) = inv.resolve(["via-gw"])
            assert transport.run(target, Command(("true",))).ok
            readers = [t for t in threading.enumerate() if isinstance(t, paramiko.Transport)]
            transport.close()
            for thread in readers:
                thread.join(10)
                assert not thread.is_alive(), thread
    finally:
        threading.excepthook = previous
    assert failed == []


def test_one_host_reached_two_ways_is_not_two_containers(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    """The same sshd as a container of its own and again through a jump host: two inventory
    entries, one host. It was deployed twice and READY twice; now the host key it presents answers
    for one container only, and the second is refused, naming the first."""
    gw, inner = sandbox.hosts[0], sandbox.hosts[1]
    body = (
        f"  direct:\n    containers:\n      plain: {{address: {inner.address}}}\n"
        f"  gpu-gw:\n    address: {gw.address}\n    containers:\n"
        f"      via-gw:\n        address: {inner.address}\n        jump: true\n"
    )
    inv = inventory(tmp_path, sandbox, known_line(sandbox, gw.name) + known_line(sandbox, inner.name), body)
    pb = write_playbook(tmp_path, root_name, {"x.txt": b"one host\n"})
    run = cli("deploy", pb, "-i", inv, "--json", "--forks", "1")
    assert run.code == 1, run.stderr
    ready = [h["name"] for h in run.json["hosts"] if h["ready"]]
    (refused,) = [h for h in run.json["hosts"] if not h["ready"]]
    assert len(ready) == 1 and refused["name"] != ready[0]
    detail = refused["gates"]["connect"]["detail"]
    assert f"presents the host key of container {ready[0]} (ssh-ed25519 SHA256:" in detail
    assert "one host cannot be two containers" in detail and "files" not in refused["gates"]


def test_a_key_openssh_would_refuse_is_refused_in_one_line(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    """A private key others may read (OpenSSH: "UNPROTECTED PRIVATE KEY FILE"), one that needs a
    passphrase, and key files that are no file (a FIFO hung the run; a link to /dev/zero would be
    read without end) or larger than OpenSSH reads: each fails the connect gate with what to do,
    never a traceback or a hang (paramiko says a passphrase is missing with a TypeError, which once
    escaped as 106 lines)."""
    a = sandbox.names[0]
    open_key = tmp_path / "open_key"
    open_key.write_bytes(Path(sandbox.box.client_key).read_bytes())
    open_key.chmod(0o644)
    locked_key = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "a passphrase", "-f", str(locked_key)], check=True)
    fifo_key = tmp_path / "fifo_key"  # read for ever: the run hung at the connect
    os.mkfifo(fifo_key, 0o600)
    zero_key = tmp_path / "zero_key"
    zero_key.symlink_to("/dev/zero")
    big_key = tmp_path / "big_key"
    big_key.write_bytes(b"#" * (2 << 20))
    big_key.chmod(0o600)
    pb = write_playbook(tmp_path, root_name)
    for key, said in (
        (open_key, "others may read it (mode 0644), and OpenSSH refuses such a key: chmod 600 it"),
        (locked_key, "is protected by a passphrase: add it to ssh-agent (ssh-add)"),
        (fifo_key, f"cannot load private key {fifo_key}: it is not a regular file"),
        (zero_key, f"cannot load private key {zero_key}: it is not a regular file"),
        (big_key, f"cannot load private key {big_key}: it is 2097152 bytes, larger than a key file can be"),
    ):
        body = f"  sandbox:\n    containers:\n      {a}: {{address: {sandbox.host(a).address}, key: {key}}}\n"
        run = cli("deploy", pb, "-i", inventory(tmp_path, sandbox, known_line(sandbox, a), body), "--json")
        assert run.code == 1 and "Traceback" not in run.stderr
        assert said in run.host(a)["gates"]["connect"]["detail"]
    assert not (sandbox.srv(a) / Path(root_name).name).exists()


def test_a_known_hosts_that_is_no_file_is_one_clear_error_never_a_hang(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    """known_hosts replaced by a FIFO: the run blocked for ever opening it. Now it is bad input,
    said once before any host is touched."""
    inv = inventory(tmp_path, sandbox, "")
    (tmp_path / "known_hosts").unlink()
    os.mkfifo(tmp_path / "known_hosts")
    run = cli("deploy", write_playbook(tmp_path, root_name), "-i", inv, "--json", timeout=120)
    assert run.code == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"{tmp_path / 'known_hosts'}: not a regular file: known_hosts is read and appended to" in run.stderr
    assert not any((sandbox.srv(h.name) / Path(root_name).name).exists() for h in sandbox.hosts)


def test_agent_refuses_paths_outside_the_deploy_root_over_ssh(sandbox: Sandbox, tmp_path: Path, root_name: str) -> None:
    inv = load_inventory(sandbox.inventory)
    target = inv.resolve([sandbox.names[0]])[0]
    data = b"owned\n"
    with SshConnector(KnownHosts(inv.known_hosts)) as transport:
        client = AgentClient(transport)
        for path in ("../../etc/orchestrate-escape", "/etc/orchestrate-escape"):
            op = protocol.put(root_name, path, data)
            with pytest.raises(AgentError) as info:
                client.batch(target, [op])
            assert info.value.failure.code == "outside_root" and info.value.failure.op == "put"
    assert not Path("/etc/orchestrate-escape").exists()


def test_a_link_out_of_the_deploy_root_is_never_followed(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    """A link in place of the tool's own releases/ is refused and kept, never written through:
    the directory it pointed at stays as it was, and the host says which link and why."""
    victim = sandbox.names[1]
    base = sandbox.srv(victim) / Path(root_name).name
    outside = sandbox.srv(victim) / "outside"
    base.mkdir(parents=True)
    outside.mkdir()
    os.symlink("/srv/outside", base / "releases")  # resolves outside the root on the host
    pb = write_playbook(tmp_path, root_name)
    run = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert run.code == 1 and "is a symbolic link, not made by this tool" in json.dumps(run.host(victim)["gates"])
    assert list(outside.iterdir()) == []
    assert (base / "releases").is_symlink()


def test_bad_input_exits_2_with_file_line_and_key(sandbox: Sandbox, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  gpu-a:\n    containers:\n      serve-0:\n        address: 10.0.0.1\n        gpus: 0,1\n")
    pb = write_playbook(tmp_path, "/srv/x")
    run = cli("deploy", pb, "-i", inv)
    assert run.code == 2
    assert run.stderr.strip().endswith(f"{inv}:6 hosts.gpu-a.containers.serve-0.gpus: expected a list of integers")
    assert "Traceback" not in run.stderr
    assert cli("deploy", pb, "-i", inv, "--forks", "0").code == 2
    assert cli("verify", tmp_path / "missing.yaml", "-i", sandbox.inventory).code == 2
