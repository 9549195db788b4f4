"""Agent client: one exec per batch of operations, over any connector (SSH or local).

The agent's source travels with every request, compressed, behind a fixed bootstrap given to
``python3 -c``; nothing is installed on the host and no request data ever enters a shell string.
stdin carries ``<n>\\n<loader source><n> <key>\\n<zlib(agent source)><marshal request>``; the loader
reuses the host's compiled copy of the agent when its key (the source's digest) matches. The
request goes as marshal (the host trusts what the controller sends: it runs the controller's
code); the answer comes back as JSON, which the controller parses without trusting the host.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import marshal
import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import remote_agent
from orchestrator.connector import Command, Connector, Stdin
from orchestrator.errors import AgentError, AgentFailure, AgentProtocolError
from orchestrator.inventory import Target
from orchestrator.protocol import AnswerError, Answers, Op, batch_timeout

PROTOCOL_VERSION = 1
# The leading string names the process in `ps` on the host (and lets tests find it).
BOOTSTRAP = "'dflash-agent';import sys;b=sys.stdin.buffer;exec(b.read(int(b.readline())))"
# marshal format 4 is read by every Python the agent supports (3.4+).
MARSHAL_VERSION = 4


_packing = threading.Lock()


@cache
def _packed_agent_once() -> bytes:
    loader = remote_agent.loader_source()
    source = remote_agent.source()
    packed = zlib.compress(source)
    key = hashlib.sha256(source).hexdigest()[:32]
    return b"%d\n%s%d %s\n%s" % (len(loader), loader, len(packed), key.encode(), packed)


def _packed_agent() -> bytes:
    # Every host's thread asks at once when a run starts; pack once, not once per thread.
    with _packing:
        return _packed_agent_once()


def agent_command(python: str) -> Command:
    # -I: ignore PYTHON* variables and user site-packages on the host; -S: no site import (the
    # agent is stdlib-only, and this is the cost paid on every host for every batch).
    return Command((python, "-I", "-S", "-c", BOOTSTRAP))


def encode_request(ops: Sequence[dict[str, Any]]) -> bytes:
    """The agent (for its loader), then the request framed by its length: a stream an op reads
    (an upload's bytes) may follow it."""
    request = marshal.dumps({"v": PROTOCOL_VERSION, "ops": ops}, MARSHAL_VERSION)
    return _packed_agent() + b"%d\n" % len(request) + request


@dataclass(frozen=True)
class OpResult:
    op: str
    ok: bool
    value: Any  # read (and checked) by its op's reader
    failure: AgentFailure | None = None
    skipped: bool = False


def decode_response(host: str, exit_status: int, stdout: bytes, stderr: bytes) -> list[OpResult]:
    try:
        data = json.loads(stdout.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        first = stderr.decode("utf-8", "replace").strip().splitlines()
        hint = ""
        if exit_status == 127:
            hint = ": the agent's Python interpreter was not found (set python: in the inventory)"
        elif first and "SyntaxError" in first[-1]:
            hint = ": the host's Python is too old (the agent needs 3.8+)"
        raise AgentProtocolError(
            host, f"the agent gave no readable answer{hint}", exit_status, stderr.decode("utf-8", "replace")
        ) from None
    if not isinstance(data, dict) or data.get("v") != PROTOCOL_VERSION or not isinstance(data.get("results"), list):
        raise AgentProtocolError(host, f"unexpected agent answer: {str(data)[:200]}", exit_status, "")
    if data.get("error"):
        raise AgentProtocolError(host, f"the agent refused the request: {data['error']}", exit_status, "")
    results = []
    for item in data["results"]:
        if not isinstance(item, dict) or not isinstance(item.get("error") or {}, dict):
            raise AgentProtocolError(
                host, f"unexpected result in the agent's answer: {str(item)[:200]}", exit_status, ""
            )
        failure = AgentFailure.from_json(item["error"]) if item.get("error") else None
        results.append(
            OpResult(
                op=str(item.get("op")),
                ok=bool(item.get("ok")),
                value=item.get("result", {}),
                failure=failure,
                skipped=bool(item.get("skipped")),
            )
        )
    return results


class AgentClient:
    """Runs batches on targets through one connector."""

    def __init__(self, connector: Connector) -> None:
        self.connector = connector

    def batch(
        self, target: Target, ops: Sequence[Op[Any]], timeout: float | None = None, stream: Iterable[bytes] = ()
    ) -> Answers:
        """Run ops in one round trip; raise ``AgentError`` for the first failed op (with the
        answers of the ops before it). The deadline is ``protocol.batch_timeout`` unless given.
        ``stream``: bytes sent after the request, for the ops that read them (uploads)."""
        if timeout is None:
            timeout = batch_timeout(ops, target.container.ssh.command_timeout)
        request = encode_request([op.request for op in ops])
        stdin: Stdin = itertools.chain((request,), stream) if stream != () else request
        result = self.connector.run(target, agent_command(target.container.ssh.python), stdin, timeout)
        results = decode_response(target.name, result.exit_status, result.stdout, result.stderr)
        if len(results) != len(ops):
            raise AgentProtocolError(
                target.name, f"expected {len(ops)} results, got {len(results)}", result.exit_status, result.tail()
            )
        values: dict[str, Any] = {}
        for op, r in zip(ops, results, strict=True):
            if r.failure is not None:
                raise AgentError(target.name, r.failure, Answers(values))
            if r.op != op.name:
                raise AgentProtocolError(
                    target.name, f"answer for {r.op!r} where {op.name!r} was asked", result.exit_status, ""
                )
            try:
                values[op.key] = op.read(r.value)
            except AnswerError as exc:
                raise AgentProtocolError(
                    target.name, f"{op.name} answered badly: {exc}", result.exit_status, ""
                ) from None
        return Answers(values)
