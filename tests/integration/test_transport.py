"""The SSH transport against real sshd: streams, timeouts, and which failures are retried."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.errors import AuthenticationFailed, CommandTimeout, ConnectFailed
from orchestrator.inventory import Target, load_inventory
from orchestrator.ssh import Command, KnownHosts, RetryPolicy, SshTransport, _PromptAckSocket
from tests.integration.conftest import Sandbox

FAST_RETRY = RetryPolicy(attempts=3, initial_wait=0.01, max_wait=0.05)


def target(sandbox: Sandbox, index: int = 0, **ssh: object) -> tuple[Target, KnownHosts]:
    inv = load_inventory(sandbox.inventory)
    t = inv.resolve([sandbox.names[index]])[0]
    container = replace(t.container, ssh=replace(t.container.ssh, **ssh))  # type: ignore[arg-type]
    return Target(container, None), KnownHosts(inv.known_hosts)


def test_large_stdin_to_a_command_that_echoes_as_it_reads(sandbox: Sandbox) -> None:
    t, kh = target(sandbox)
    data = os.urandom(8 << 20)
    with SshTransport(kh) as transport:
        result = transport.run(t, Command(("cat",)), data)
        again = transport.run(t, Command(("sh", "-c", "echo to-stderr >&2; exit 3")))
    assert result.ok and result.stdout == data
    assert again.exit_status == 3 and again.tail() == "to-stderr"
    assert transport.counters(t.name).connects == 1 and transport.counters(t.name).execs == 2


def test_argv_is_quoted_not_interpreted(sandbox: Sandbox) -> None:
    t, kh = target(sandbox)
    hostile = "$(touch /srv/pwned); `touch /srv/pwned2` 'quote"
    with SshTransport(kh) as transport:
        result = transport.run(t, Command(("printf", "%s", hostile)))
    assert result.stdout.decode() == hostile
    assert not (sandbox.srv(sandbox.names[0]) / "pwned").exists()


def test_command_timeout_is_not_retried(sandbox: Sandbox) -> None:
    t, kh = target(sandbox)
    with SshTransport(kh, retry=FAST_RETRY) as transport, pytest.raises(CommandTimeout, match="did not finish within"):
        transport.run(t, Command(("sleep", "30")), timeout=0.3)
    assert transport.counters(t.name).retries == 0


def test_refused_connections_are_retried_then_reported(sandbox: Sandbox) -> None:
    t, kh = target(sandbox, port=2222)
    with SshTransport(kh, retry=FAST_RETRY) as transport, pytest.raises(ConnectFailed, match="Connection refused"):
        transport.run(t, Command(("true",)))
    assert transport.counters(t.name).retries == FAST_RETRY.attempts - 1


def test_wrong_key_fails_authentication_without_retry(sandbox: Sandbox, tmp_path: Path) -> None:
    key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    t, kh = target(sandbox, key=key)
    with SshTransport(kh, retry=FAST_RETRY) as transport, pytest.raises(AuthenticationFailed, match="as root failed"):
        transport.run(t, Command(("true",)))
    assert transport.counters(t.name).retries == 0


def test_connections_neither_hold_writes_nor_delay_acks(sandbox: Sandbox) -> None:
    """sshd answers a channel open under Nagle after its post-auth notes; with our kernel delaying
    the ACK those notes wait for, each connection stalled ~40 ms twice. Timing is the benchmark's
    business (bench/); here: the live connection's socket has Nagle off and re-arms quick ACKs
    on every read (that re-arming itself is tested in tests/unit/test_ssh_socket.py)."""
    import socket

    t, kh = target(sandbox)
    with SshTransport(kh) as transport:
        assert transport.run(t, Command(("true",))).ok
        sock = transport._connections[t.name].sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert isinstance(sock, _PromptAckSocket)
