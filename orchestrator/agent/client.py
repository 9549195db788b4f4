"""Agent client: one exec per batch of operations, over any connector (SSH or local).

The agent's source travels with every request, compressed, behind a fixed bootstrap given to
``python3 -c``; nothing is installed on the host and no request data ever enters a shell string.
stdin carries ``<n>\\n<loader source><n> <key>\\n<zlib(agent source)><marshal request>``, where the
agent source is the modules the batch's ops need (``remote_agent.pack``: a files-only batch
carries no serving or GPU code); the loader reuses the host's compiled copy when its key (the
digest of what was sent) matches. The request goes as marshal (the host trusts what the controller sends: it runs the controller's
code); the answer comes back as JSON, which the controller parses without trusting the host.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import marshal
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import remote_agent
from orchestrator.agent.protocol import SPECS, AnswerError, Answers, Op, batch_timeout, modules
from orchestrator.config.inventory import Target
from orchestrator.connectors.base import Command, Connector, Session, Stdin
from orchestrator.errors import AgentError, AgentFailure, AgentProtocolError, ConnectionLost, TransportError

PROTOCOL_VERSION = 1
# The leading string names the process in `ps` on the host (and lets tests find it).
BOOTSTRAP = "'dflash-agent';import sys;b=sys.stdin.buffer;exec(b.read(int(b.readline())))"
# marshal format 4 is read by every Python the agent supports (3.4+).
MARSHAL_VERSION = 4


_packing = threading.Lock()
# Packs kept from one start to the next: packing parses and unparses every agent module (~0.2 s
# of CPU, as much as paramiko's import), for bytes that only change when the agent does.
_KEEP_PACKS = 32


def _packs_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-orchestrator" / "packs"


def _kept_pack(modules: tuple[str, ...]) -> bytes:
    """``remote_agent.pack(modules)``, from the user's cache when it holds that fingerprint's pack
    whole (each file carries its own digest: a torn or altered one is made again), else packed and
    kept. A cache that cannot be read or written costs the packing, never the run."""
    key = remote_agent.fingerprint(modules)
    folder = _packs_dir()
    path = folder / f"{key}.py"
    try:
        digest, _, kept = path.read_bytes().partition(b"\n")
        if hashlib.sha256(kept).hexdigest().encode() == digest:
            return kept
    except OSError:
        pass
    source = remote_agent.pack(modules)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = folder / f".{key}.{os.getpid()}.{threading.get_ident()}"
        temp.write_bytes(hashlib.sha256(source).hexdigest().encode() + b"\n" + source)
        os.replace(temp, path)
        older = sorted(folder.glob("*.py"), key=lambda p: p.stat().st_mtime, reverse=True)[_KEEP_PACKS:]
        for stale in older:
            stale.unlink(missing_ok=True)
    except OSError:
        pass
    return source


@cache
def _packed_agent_once(names: tuple[str, ...]) -> bytes:
    loader = remote_agent.loader_source()
    chosen = remote_agent.MODULES if names == ("*",) else remote_agent.closure(names)
    source = _kept_pack(chosen)
    packed = zlib.compress(source)
    # The host's cache key: the agent's version (all of its modules), then what this batch sends.
    version = remote_agent.fingerprint()[:16]
    key = f"{version}.{hashlib.sha256(source).hexdigest()[:16]}"
    return b"%d\n%s%d %s\n%s" % (len(loader), loader, len(packed), key.encode(), packed)


def packed_agent(names: tuple[str, ...] = ("*",)) -> bytes:
    """The loader and the agent modules ``names`` (every module: ``("*",)``), as stdin starts."""
    # Every host's thread asks at once when a run starts; pack once, not once per thread.
    with _packing:
        return _packed_agent_once(names)


def agent_command(python: str) -> Command:
    """The command that runs the agent on a host: its Python, isolated, with the bootstrap that
    reads the packed agent and the batch from stdin."""
    # -I: ignore PYTHON* variables and user site-packages on the host; -S: no site import (the
    # agent is stdlib-only, and this is the cost paid on every host for every batch).
    return Command((python, "-I", "-S", "-c", BOOTSTRAP))


def request_body(
    ops: Sequence[dict[str, Any]],
    findings: Sequence[int] = (),
    events: bool = False,
    session: bool = False,
    key: str = "",
) -> bytes:
    """A request as marshal data, framed by its length: every key the agent reads, always.
    ``key``: the controller's digest key (hex), which signs the host's digest cache lines; ""
    trusts no line there (every model file is hashed)."""
    body = {
        "v": PROTOCOL_VERSION,
        "session": session,
        "events": events,
        "ops": list(ops),
        "findings": list(findings),
        "key": key,
    }
    request = marshal.dumps(body, MARSHAL_VERSION)
    return b"%d\n" % len(request) + request


def encode_request(
    ops: Sequence[dict[str, Any]], events: bool = False, findings: Sequence[int] = (), key: str = ""
) -> bytes:
    """The agent modules these ops need (for its loader), then the request: a stream an op reads
    (an upload's bytes) may follow it. ``events``: ask for progress events on stderr.
    ``findings``: the indices of the ops whose failure does not stop the batch. ``key``: the
    controller's digest key."""
    agent = packed_agent(modules(str(op.get("op")) for op in ops))
    return agent + request_body(ops, findings, events, key=key)


def _findings(ops: Sequence[Op[Any]]) -> list[int]:
    return [i for i, op in enumerate(ops) if op.is_finding]


@dataclass(frozen=True)
class OpResult:
    """One op's outcome in a batch's answer: its value (still to be read by the op's reader), or the
    failure the agent reported, or skipped after an earlier op stopped the batch."""

    op: str
    ok: bool
    value: Any  # read (and checked) by its op's reader
    failure: AgentFailure | None = None
    skipped: bool = False


def decode_response(host: str, exit_status: int, stdout: bytes, stderr: bytes) -> list[OpResult]:
    """The agent's answer to a batch, read warily: one OpResult per op, or an AgentProtocolError
    that says what came back instead (and what the exit status suggests)."""
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
    return results_of(host, data, exit_status)


def results_of(host: str, data: Any, exit_status: int = 0) -> list[OpResult]:
    """The op results of a parsed answer, each checked for shape (the host is not trusted)."""
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
        error = item.get("error")
        name = str(item.get("op"))
        failure = AgentFailure.from_json(error, SPECS[name].gate if name in SPECS else "") if error else None
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


EVENT = b"@dflash-event "
_EVENT_LINE_MAX = 4096


@dataclass(frozen=True)
class Event:
    """One progress event of the agent, read warily (the host is not trusted)."""

    op: str
    elapsed_s: float | None = None
    log: str | None = None  # the server log's last line, during a health wait
    done: int | None = None  # the probe: prompts done, of ``of``
    of: int | None = None


def read_event(line: bytes) -> Event | None:
    """An event line's event; None for anything else (a warning the host printed, garbage)."""
    if not line.startswith(EVENT) or len(line) > _EVENT_LINE_MAX:
        return None
    try:
        data = json.loads(line[len(EVENT) :].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("op"), str):
        return None

    def number(key: str, kind: type | tuple[type, ...]) -> Any:
        value = data.get(key)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    log = data.get("log")
    return Event(
        op=data["op"][:40],
        elapsed_s=float(e) if (e := number("elapsed_s", (int, float))) is not None else None,
        log=log[:200] if isinstance(log, str) else None,
        done=number("done", int),
        of=number("of", int),
    )


class EventReader:
    """stderr chunks in, events out, line by line (a line may arrive in pieces)."""

    def __init__(self, sink: Callable[[Event], None]) -> None:
        self._sink = sink
        self._partial = b""

    def __call__(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-_EVENT_LINE_MAX:]
        for line in lines:
            event = read_event(line)
            if event is not None:
                self._sink(event)


def without_events(stderr: bytes) -> bytes:
    """stderr as the host wrote it, without the progress events (for error messages)."""
    if EVENT not in stderr:
        return stderr
    return b"\n".join(line for line in stderr.split(b"\n") if not line.startswith(EVENT))


class AgentClient:
    """Runs batches on targets through one connector."""

    def __init__(self, connector: Connector, key: str = "") -> None:
        """``key``: the controller's digest key (``state.digest_key``), sent with every batch."""
        self.connector = connector
        self.key = key

    def batch(
        self,
        target: Target,
        ops: Sequence[Op[Any]],
        timeout: float | None = None,
        stream: Iterable[bytes] = (),
        events: Callable[[Event], None] | None = None,
    ) -> Answers:
        """Run ops in one round trip; raise ``AgentError`` for the first failed op (with the
        answers of the ops before it). The deadline is ``protocol.batch_timeout`` unless given.
        ``stream``: bytes sent after the request, for the ops that read them (uploads).
        ``events``: the agent's progress as it works (each op as it starts, a health wait's
        seconds and the server log's last line, the probe's prompts)."""
        if timeout is None:
            timeout = batch_timeout(ops, target.container.ssh.command_timeout)
        ops_requests = [op.request for op in ops]
        request = encode_request(ops_requests, events=events is not None, findings=_findings(ops), key=self.key)
        stdin: Stdin = itertools.chain((request,), stream) if stream != () else request
        command = agent_command(target.container.ssh.python)
        on_stderr = EventReader(events) if events is not None else None
        result = self.connector.run(target, command, stdin, timeout, on_stderr)
        stderr = without_events(result.stderr)
        results = decode_response(target.name, result.exit_status, result.stdout, stderr)
        tail = "\n".join(stderr.decode("utf-8", "replace").rstrip().splitlines()[-10:])
        return read_answers(target.name, ops, results, result.exit_status, tail)


def read_answers(host: str, ops: Sequence[Op[Any]], results: list[OpResult], exit_status: int, tail: str) -> Answers:
    """Each op's answer read by its reader; a failed finding kept with the answers; ``AgentError``
    for the first failed op that is not a finding."""
    if len(results) != len(ops):
        raise AgentProtocolError(host, f"expected {len(ops)} results, got {len(results)}", exit_status, tail)
    values: list[tuple[Op[Any], Any]] = []
    failed: list[tuple[Op[Any], AgentFailure]] = []
    for op, r in zip(ops, results, strict=True):
        if r.failure is not None and op.is_finding:
            failed.append((op, r.failure))
            continue
        if r.failure is not None:
            raise AgentError(host, r.failure, Answers.of(values, failed))
        if r.skipped:
            raise AgentProtocolError(
                host, f"{op.name} was skipped, though no op before it failed", exit_status, tail, op.gate
            )
        if r.op != op.name:
            raise AgentProtocolError(host, f"answer for {r.op!r} where {op.name!r} was asked", exit_status, "", op.gate)
        try:
            values.append((op, op.read(r.value)))
        except AnswerError as exc:
            raise AgentProtocolError(host, f"{op.name} answered badly: {exc}", exit_status, "", op.gate) from None
    return Answers.of(values, failed)


# The largest answer a session accepts (a watch round's answers are a few KB).
MAX_FRAME = 64 << 20


class AgentSession:
    """One agent process on a target, kept for many batches (``orchestrate watch``): the agent is
    sent and started once, then each batch is a length-framed request and answer over the same
    channel. Any failure closes the session: its stream may be out of step, and the next
    ``open`` starts a fresh one."""

    def __init__(self, connector: Connector, target: Target, key: str = "") -> None:
        """``key``: the controller's digest key, sent with every batch."""
        self.connector, self.target, self.key = connector, target, key
        self._session: Session | None = None
        self._buffer = bytearray()
        self.pid: int | None = None  # the agent's process on the host
        self._asked: tuple[tuple[Op[Any], ...], bytes] | None = None  # the last ops, and their request

    @property
    def is_open(self) -> bool:
        """Whether the kept agent process still takes requests."""
        return self._session is not None

    def open(self, timeout: float | None = None) -> None:
        self.close()
        limit = timeout if timeout is not None else self.target.container.ssh.command_timeout
        session = self.connector.open(self.target, agent_command(self.target.container.ssh.python))
        self._session = session
        try:
            # A session may be asked any op: it carries every module.
            session.send(packed_agent() + request_body([], session=True), time.monotonic() + limit)
            hello = self._frame(time.monotonic() + limit)
            if not isinstance(hello.get("session"), int):
                raise AgentProtocolError(
                    self.target.name, f"the agent did not start a session: {str(hello)[:200]}", 0, ""
                )
            self.pid = hello["session"]
        except BaseException:
            self.close()
            raise

    def batch(self, ops: Sequence[Op[Any]], timeout: float | None = None) -> Answers:
        """Like ``AgentClient.batch``, over the open session."""
        if self._session is None:
            raise AgentProtocolError(self.target.name, "no agent session is open", -1, "")
        if timeout is None:
            timeout = batch_timeout(ops, self.target.container.ssh.command_timeout)
        deadline = time.monotonic() + timeout
        asked = self._asked
        if asked is not None and len(asked[0]) == len(ops) and all(a is b for a, b in zip(asked[0], ops, strict=True)):
            request = asked[1]  # a watch asks the very same ops every round
        else:
            request = request_body([op.request for op in ops], _findings(ops), key=self.key)
            self._asked = (tuple(ops), request)
        try:
            self._session.send(request, deadline)
            data = self._frame(deadline)
            results = results_of(self.target.name, data)
            return read_answers(self.target.name, ops, results, 0, "")
        except (AgentProtocolError, TransportError):
            self.close()
            raise

    def _frame(self, deadline: float) -> dict[str, Any]:
        """One answer: ``<n>\\n`` and n bytes of JSON."""
        assert self._session is not None
        while b"\n" not in self._buffer[:24]:
            if len(self._buffer) >= 24:
                raise self._garbled(bytes(self._buffer[:24]))
            self._more(deadline)
        head, _, rest = bytes(self._buffer).partition(b"\n")
        if not head.isdigit() or int(head) > MAX_FRAME:
            raise self._garbled(head)
        size = int(head)
        self._buffer[:] = rest
        while len(self._buffer) < size:
            self._more(deadline)
        body = bytes(self._buffer[:size])
        del self._buffer[:size]
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise self._garbled(body[:80]) from None
        if not isinstance(data, dict):
            raise self._garbled(body[:80])
        if data.get("error"):
            raise AgentProtocolError(self.target.name, f"the agent refused the request: {data['error']}", 0, "")
        return data

    def _more(self, deadline: float) -> None:
        assert self._session is not None
        chunk = self._session.recv(deadline)
        if not chunk:
            tail = without_events(self._session.stderr_tail().encode()).decode()
            raise ConnectionLost(self.target.name, "the agent ended its session" + (f": {tail}" if tail else ""))
        self._buffer += chunk

    def _garbled(self, seen: bytes) -> AgentProtocolError:
        return AgentProtocolError(self.target.name, f"unreadable answer in the agent's session: {seen[:80]!r}", 0, "")

    def close(self) -> None:
        session, self._session = self._session, None
        self._buffer.clear()
        self.pid = None
        if session is not None:
            session.close()
