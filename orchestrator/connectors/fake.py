"""A connector that answers the agent's batches in memory, for tests (as httpx's ``MockTransport``).

    def handler(target: Target, ops: list[dict]) -> list[dict]:
        return [fake.answer(op, {...}) for op in ops]

    report = Deployment(playbook, inventory, connector=FakeConnector(handler)).deploy()

The handler gets each batch's ops as the agent would (the decoded requests, every key the
controller sent) and returns one result per op (``answer``, ``failure``), or raises a
``TransportError`` to play a host that cannot be reached. Everything above the connector is the
real code: the agent client packs and frames the batch, reads the answers warily, and the run
decides from them. So failure paths (a malformed answer during a launch, a connection lost
between two execs) are tested in milliseconds; whole runs against the real agent are the local
connector's and SSH's tests.
"""

from __future__ import annotations

import json
import marshal
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.inventory import Target
from orchestrator.connectors.base import Command, Counters, OnStderr, Result, Session, Stdin
from orchestrator.errors import AgentProtocolError

Handler = Callable[[Target, list[dict[str, Any]]], list[dict[str, Any]]]


def answer(op: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """An op that succeeded, with its answer."""
    return {"op": op["op"], "ok": True, "result": result}


def failure(op: dict[str, Any], code: str, message: str, path: str | None = None) -> dict[str, Any]:
    """An op that failed, as the agent reports it."""
    error = {"op": op["op"], "code": code, "message": message, "path": path, "errno": None}
    return {"op": op["op"], "ok": False, "error": error}


def skipped(op: dict[str, Any]) -> dict[str, Any]:
    """An op the agent did not run (an op before it failed)."""
    return {"op": op["op"], "ok": False, "skipped": True}


@dataclass(frozen=True)
class Batch:
    """One batch as the host received it: the agent source it carried and the request."""

    target: str
    source: bytes  # the agent's modules, packed (what the host would compile)
    request: dict[str, Any]

    @property
    def ops(self) -> list[dict[str, Any]]:
        """The batch's ops as the agent would decode them."""
        return list(self.request["ops"])

    @property
    def names(self) -> list[str]:
        """The batch's op names, in order."""
        return [str(op["op"]) for op in self.request["ops"]]


def decode(stdin: bytes) -> tuple[bytes, dict[str, Any]]:
    """stdin as the agent client writes it: the loader, the packed agent, the framed request."""
    at = 0

    def line() -> bytes:
        nonlocal at
        end = stdin.index(b"\n", at)
        text, at = stdin[at:end], end + 1
        return text

    def take(n: int) -> bytes:
        nonlocal at
        chunk, at = stdin[at : at + n], at + n
        return chunk

    take(int(line()))  # the loader
    size, _key = line().split()
    source = zlib.decompress(take(int(size)))
    request = marshal.loads(take(int(line())))
    return source, request


@dataclass
class FakeConnector:
    """Every target's batches answered by ``handler``; each batch kept in ``batches``."""

    handler: Handler
    batches: list[Batch] = field(default_factory=list)
    _counters: dict[str, Counters] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(
        self,
        target: Target,
        command: Command,
        stdin: Stdin = b"",
        timeout: float | None = None,
        on_stderr: OnStderr | None = None,
    ) -> Result:
        """One batch: decoded, answered by the handler, encoded as the agent answers."""
        data = stdin if isinstance(stdin, bytes) else b"".join(stdin)
        source, request = decode(data)
        with self._lock:
            self.batches.append(Batch(target.name, source, request))
            self.counters(target.name).execs += 1
        results = self.handler(target, list(request["ops"]))
        stdout = json.dumps({"v": request["v"], "results": results}).encode()
        return Result(target.name, command, 0, stdout, b"")

    def open(self, target: Target, command: Command) -> Session:
        raise AgentProtocolError(target.name, "the fake connector answers single batches, not sessions", -1, "")

    def counters(self, name: str) -> Counters:
        """Execs per target (a fake has no connections to count)."""
        return self._counters.setdefault(name, Counters())

    @property
    def accepted_host_keys(self) -> list[str]:
        return []  # no host keys: no hosts

    def close(self) -> None:
        """Nothing to close."""
