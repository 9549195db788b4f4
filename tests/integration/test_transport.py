"""The SSH transport against real sshd: streams, timeouts, and which failures are retried."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.config.inventory import Target, load_inventory
from orchestrator.connectors.ssh import Command, KnownHosts, RetryPolicy, SshConnector, _PromptAckSocket
from orchestrator.errors import AuthenticationFailed, CommandTimeout, ConnectFailed, ConnectionLost
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
    with SshConnector(kh) as transport:
        result = transport.run(t, Command(("cat",)), data)
        again = transport.run(t, Command(("sh", "-c", "echo to-stderr >&2; exit 3")))
    assert result.ok and result.stdout == data
    assert again.exit_status == 3 and again.tail() == "to-stderr"
    assert transport.counters(t.name).connects == 1 and transport.counters(t.name).execs == 2


# Streams through the transport, every byte compared. sshd sends the exit status as soon as the
# command exits, possibly ahead of output it still holds for lack of window: a transport that
# stops at the exit status loses the end of stdout (8 MiB through `cat` came back ~32 KB short,
# with status 0). Each case is (argv, expected (stdout, stderr, status) for the stdin sent).
SLOW_READER = (
    "import sys, time\n"
    "while True:\n"
    "    block = sys.stdin.buffer.read1(4096)\n"
    "    if not block:\n"
    "        break\n"
    "    sys.stdout.buffer.write(block)\n"
    "    sys.stdout.buffer.flush()\n"
    "    time.sleep(0.0005)\n"
)
StreamCase = tuple[tuple[str, ...], Callable[[bytes], tuple[bytes, bytes, int]]]
STREAM_CASES: dict[str, StreamCase] = {
    "echoes while reading": (("cat",), lambda d: (d, b"", 0)),
    "writes after reading all": (
        ("sh", "-c", 'f=$(mktemp) && cat >"$f" && cat "$f"; s=$?; rm -f "$f"; exit $s'),
        lambda d: (d, b"", 0),
    ),
    "stderr only, then a line of stdout": (("sh", "-c", "cat >&2; echo out; exit 5"), lambda d: (b"out\n", d, 5)),
    "both streams at once": (("sh", "-c", "tee /dev/stderr"), lambda d: (d, d, 0)),
    "closes stdout early, still reads": (
        ("sh", "-c", "exec 1>&-; cat >/dev/null; echo read-all >&2"),
        lambda d: (b"", b"read-all\n", 0),
    ),
    "exits before reading it all": (("head", "-c", "1000"), lambda d: (d[:1000], b"", 0)),
    "slow reader on the host": (("python3", "-c", SLOW_READER), lambda d: (d, b"", 0)),
}
# Around the SSH packet (32 KiB) and paramiko's window (2 MiB) sizes, and beyond.
SIZES = (0, 1, 4095, (32 << 10) - 1, 32 << 10, (32 << 10) + 1, 1 << 16, (1 << 20) + 7, 2 << 20, (2 << 20) + 1, 8 << 20)
ROUNDS = 3


@pytest.mark.parametrize("case", list(STREAM_CASES))
def test_every_byte_of_both_streams_comes_back_with_the_exit_status(sandbox: Sandbox, case: str) -> None:
    """Every size in SIZES, ROUNDS times, on four hosts at once (connections reused, as a run
    does): each stream byte for byte, and the command's own exit status."""
    argv, expect = STREAM_CASES[case]
    sizes = [s for s in SIZES if case != "slow reader on the host" or s <= 2 << 20]
    hosts = sandbox.names[:4]
    inv = load_inventory(sandbox.inventory)
    wrong: list[str] = []

    def one_host(name: str) -> int:
        t = inv.resolve([name])[0]
        runs = 0
        with SshConnector(KnownHosts(inv.known_hosts)) as transport:
            for round_ in range(ROUNDS):
                for size in sizes:
                    data = os.urandom(size)
                    result = transport.run(t, Command(argv), data, timeout=120)
                    out, err, status = expect(data)
                    got = (len(result.stdout), len(result.stderr), result.exit_status)
                    if (result.stdout, result.stderr, result.exit_status) != (out, err, status):
                        wrong.append(
                            f"{name} round {round_} size {size}: got {got}, expected {(len(out), len(err), status)}"
                        )
                    runs += 1
        return runs

    with ThreadPoolExecutor(len(hosts)) as pool:
        runs = sum(pool.map(one_host, hosts))
    assert not wrong, "\n".join(wrong)
    assert runs == len(hosts) * ROUNDS * len(sizes)


def test_64_mib_each_way_and_from_a_file(sandbox: Sandbox) -> None:
    """The largest streams: 64 MiB echoed through `cat`, and 64 MiB a command writes with no
    stdin at all and then exits non-zero (the exit status races the last of the data)."""
    name = sandbox.names[0]
    blob = os.urandom(64 << 20)
    (sandbox.srv(name) / "blob").write_bytes(blob)
    t, kh = target(sandbox)
    try:
        with SshConnector(kh) as transport:
            echoed = transport.run(t, Command(("cat",)), blob, timeout=300)
            written = transport.run(t, Command(("sh", "-c", 'cat "$1"; exit 7', "sh", "/srv/blob")), timeout=300)
    finally:
        (sandbox.srv(name) / "blob").unlink()
    assert echoed.exit_status == 0 and len(echoed.stdout) == len(blob) and echoed.stdout == blob
    assert written.exit_status == 7 and len(written.stdout) == len(blob) and written.stdout == blob


def test_argv_is_quoted_not_interpreted(sandbox: Sandbox) -> None:
    t, kh = target(sandbox)
    hostile = "$(touch /srv/pwned); `touch /srv/pwned2` 'quote"
    with SshConnector(kh) as transport:
        result = transport.run(t, Command(("printf", "%s", hostile)))
    assert result.stdout.decode() == hostile
    assert not (sandbox.srv(sandbox.names[0]) / "pwned").exists()


def test_command_timeout_is_not_retried(sandbox: Sandbox) -> None:
    t, kh = target(sandbox)
    with SshConnector(kh, retry=FAST_RETRY) as transport, pytest.raises(CommandTimeout, match="did not finish within"):
        transport.run(t, Command(("sleep", "30")), timeout=0.3)
    assert transport.counters(t.name).retries == 0


def test_refused_connections_are_retried_then_reported(sandbox: Sandbox) -> None:
    t, kh = target(sandbox, port=2222)
    with SshConnector(kh, retry=FAST_RETRY) as transport, pytest.raises(ConnectFailed, match="Connection refused"):
        transport.run(t, Command(("true",)))
    assert transport.counters(t.name).retries == FAST_RETRY.attempts - 1


def test_wrong_key_fails_authentication_without_retry(sandbox: Sandbox, tmp_path: Path) -> None:
    key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    t, kh = target(sandbox, key=key)
    with SshConnector(kh, retry=FAST_RETRY) as transport, pytest.raises(AuthenticationFailed, match="as root failed"):
        transport.run(t, Command(("true",)))
    assert transport.counters(t.name).retries == 0


def test_connections_neither_hold_writes_nor_delay_acks(sandbox: Sandbox) -> None:
    """sshd answers a channel open under Nagle after its post-auth notes; with our kernel delaying
    the ACK those notes wait for, each connection stalled ~40 ms twice. Timing is the benchmark's
    business (bench/); here: the live connection's socket has Nagle off and re-arms quick ACKs
    on every read (that re-arming itself is tested in tests/unit/test_ssh_socket.py)."""
    import socket

    t, kh = target(sandbox)
    with SshConnector(kh) as transport:
        assert transport.run(t, Command(("true",))).ok
        sock = transport._connections[t.name].sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert isinstance(sock, _PromptAckSocket)


def test_bulk_streams_use_aes_gcm_with_sshd(sandbox: Sandbox) -> None:
    """Model pushes are bulk transfers: AES-GCM (no separate MAC) is negotiated with OpenSSH
    (throughput is the benchmark's business: bench/models.py)."""
    t, kh = target(sandbox)
    with SshConnector(kh) as transport:
        assert transport.run(t, Command(("true",))).ok
        connection = transport._connections[t.name]
        assert connection.local_cipher == connection.remote_cipher == "aes128-gcm@openssh.com"


def test_a_kept_session_carries_exchange_after_exchange_and_says_when_its_command_ends(sandbox: Sandbox) -> None:
    """The channel watch keeps open (``SshConnector.open``): bytes go both ways as often as asked
    over one exec, every byte compared; a command that ends says so (b"" and its stderr), never a
    hang; closing the session ends the command on the host."""
    t, kh = target(sandbox)
    with SshConnector(kh) as transport:
        session = transport.open(t, Command(("cat",)))
        try:
            for size in (1, 4095, 32768, 1 << 20):
                data = os.urandom(size)
                deadline = time.monotonic() + 30
                session.send(data, deadline)
                got = bytearray()
                while len(got) < size:
                    got += session.recv(deadline)
                assert bytes(got) == data
        finally:
            session.close()
        # Once recv says the command ended, send says so too, whether or not its exit status has
        # arrived yet (it can trail the end of stdout; sshd still takes bytes for the channel).
        for _ in range(25):
            ended = transport.open(t, Command(("sh", "-c", "echo gone >&2; exit 3")))
            deadline = time.monotonic() + 30
            assert ended.recv(deadline) == b"" and ended.stderr_tail() == "gone"
            with pytest.raises(ConnectionLost):
                ended.send(b"x" * 100, deadline)
            ended.close()
        quiet = transport.open(t, Command(("sleep", "30")))
        with pytest.raises(CommandTimeout):
            quiet.recv(time.monotonic() + 0.3)
        quiet.close()
    counters = transport.counters(t.name)
    assert counters.connects == 1 and counters.execs == 27


def test_held_connections_stay_quiet_and_closing_ends_their_reader_threads(sandbox: Sandbox) -> None:
    """paramiko's reader thread wakes from a read that timed out to see whether its transport was
    closed: every 0.1 s on every connection, which took a watch holding 1024 sessions to 416 s of
    CPU for 10 rounds (bench/README.md). Ours read with a 5 s timeout (data still wakes them at
    once: the sessions above carry exchange after exchange), and closing shuts the socket down so
    each reader thread ends now, not at its next timeout."""
    import threading

    kh = target(sandbox)[1]
    targets = [target(sandbox, i)[0] for i in range(len(sandbox.names))]
    before = set(threading.enumerate())
    with SshConnector(kh) as transport:
        for t in targets:
            assert transport.run(t, Command(("true",))).ok
        held = [transport._connections[t.name] for t in targets]
        assert all(c.sock.gettimeout() == 5.0 for c in held)
        readers = [thread for thread in threading.enumerate() if thread not in before]
        assert set(readers) == set(held)  # a paramiko Transport is its reader thread
    deadline = time.monotonic() + 2.0  # well inside the read timeout: only the shutdown ends them
    while any(thread.is_alive() for thread in readers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [thread.name for thread in readers if thread.is_alive()]
