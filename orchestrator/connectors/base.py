"""The seam between a run and the hosts: run one command on a target, get its result.

Two connectors implement it: ``ssh.SshConnector`` (the default: SSH, with jump hosts) and
``local.LocalConnector`` (``connection: local`` in the inventory: this machine, no SSH), the way
pyinfra's connectors or httpx's transports sit behind one interface. ``router.Connections``
routes each target to its connector; a test passes its own connector instead (as httpx's
``MockTransport``). This module is the interface only: it imports no connector.
"""

from __future__ import annotations

import select
import shlex
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from orchestrator.config.inventory import Target


@dataclass(frozen=True)
class Command:
    """A remote command as a value: an argv list, quoted in exactly one place."""

    argv: tuple[str, ...]

    def render(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class Result:
    """What one command did on one host: its exit status and both streams, with fabric's ok/tail
    helpers."""

    host: str
    command: Command
    exit_status: int
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    def tail(self, stream: str = "stderr", lines: int = 10) -> str:
        data = self.stderr if stream == "stderr" else self.stdout
        return "\n".join(data.decode("utf-8", "replace").rstrip().splitlines()[-lines:])


@dataclass
class Counters:
    """Per-target counts, so callers (and tests) can see what a run cost."""

    connects: int = 0
    execs: int = 0
    retries: int = 0
    bytes_sent: int = 0

    def to_json(self) -> dict[str, int]:
        return {"connects": self.connects, "execs": self.execs, "retries": self.retries}


# Called with each chunk of a command's stderr as it arrives (the agent's progress events).
OnStderr = Callable[[bytes], None]

# What a command reads on stdin: bytes, or chunks of a stream (a file pushed from an offset), read
# as they are sent so that memory stays flat whatever the size.
Stdin = bytes | Iterable[bytes]


class Feed:
    """What is left of a command's stdin to send, chunk by chunk."""

    def __init__(self, source: Stdin) -> None:
        self._chunks: Iterator[bytes] = iter((source,) if isinstance(source, bytes) else source)
        self._view = memoryview(b"")
        self._next()

    def _next(self) -> None:
        while not self._view:
            chunk = next(self._chunks, None)
            if chunk is None:
                return
            self._view = memoryview(chunk)

    def __bool__(self) -> bool:
        return bool(self._view)

    def take(self, limit: int) -> bytes:
        """Up to n bytes of what is still to be sent, without consuming them."""
        return bytes(self._view[:limit])

    def advance(self, sent: int) -> None:
        """Mark n bytes as sent."""
        self._view = self._view[sent:]
        if not self._view:
            self._next()

    def drop(self) -> None:
        """The command will read no more: what is left is not sent."""
        self._view = memoryview(b"")
        self._chunks = iter(())


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures (refused, reset, closed mid-command) are retried: never others."""

    attempts: int = 4
    initial_wait: float = 0.2
    max_wait: float = 5.0


class Session(Protocol):
    """A command kept running for a long conversation (the agent of ``orchestrate watch``): bytes
    written to its stdin, its stdout read as it comes. Transport failures are ``TransportError``s;
    a deadline passed is ``CommandTimeout`` (the session is then out of step: close it)."""

    def send(self, data: bytes, deadline: float) -> None: ...

    def recv(self, deadline: float) -> bytes:
        """What stdout has now (waiting until ``deadline``, a ``time.monotonic()`` value, for some);
        b"" once it has ended."""
        ...

    def stderr_tail(self) -> str:
        """The last lines the command wrote to stderr (for the message when it ends early)."""
        ...

    def close(self) -> None: ...


class Connector(Protocol):
    """The seam every way of reaching a host implements (SSH, local, a test's fake): run a command
    to its end, or open a kept session; count connects and execs per target."""

    def run(
        self,
        target: Target,
        command: Command,
        stdin: Stdin = b"",
        timeout: float | None = None,
        on_stderr: OnStderr | None = None,
    ) -> Result:
        """Run one command to completion: both streams whole, and its exit status; ``on_stderr``
        sees stderr's chunks as they arrive."""
        ...

    def open(self, target: Target, command: Command) -> Session:
        """Start a command for a long conversation over one connection (``Session``)."""
        ...

    def counters(self, name: str) -> Counters:
        """What reaching the target of this name cost so far (connections, execs, retries)."""
        ...

    @property
    def accepted_host_keys(self) -> list[str]:
        """The host keys this run trusted for the first time (--accept-new-host-keys): only a
        connector that checks host keys has any."""
        ...

    def close(self) -> None: ...


class StderrTail:
    """The last few KB a command wrote to stderr: kept for messages, bounded whatever it writes."""

    LIMIT = 8192

    def __init__(self) -> None:
        self._data = bytearray()
        self._lock = threading.Lock()

    def add(self, chunk: bytes) -> None:
        """Keep a chunk of stderr (only the tail is kept)."""
        with self._lock:
            self._data += chunk
            del self._data[: max(0, len(self._data) - self.LIMIT)]

    def text(self, lines: int = 10) -> str:
        """The kept tail of stderr, decoded."""
        with self._lock:
            data = bytes(self._data)
        return "\n".join(data.decode("utf-8", "replace").rstrip().splitlines()[-lines:])


def readable(source: Any, timeout: float) -> bool:
    """Wait until ``source`` (a channel or a file descriptor) is readable, or ``timeout`` s.
    poll, not select: a controller holding a session per host has descriptors past select's 1024
    (FD_SETSIZE) at fleet size, which select refuses ("filedescriptor out of range")."""
    poller = select.poll()
    poller.register(source, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))
