"""The protocol's machinery (``Op``, ``Answers``, the readers' field checks) and the ``core`` agent
module's ops: the deploy root's lock and a file put in place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from orchestrator.errors import AgentFailure

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ServerCommand:
    """A server's command as a value: argv, environment, and how long a stop may take before
    SIGKILL. The ``launch`` and ``engine_check`` ops carry it as it is (``rules.serving`` makes it)."""

    argv: tuple[str, ...]
    env: dict[str, str]
    stop_timeout: int = 30  # SIGTERM, then this long before SIGKILL (the unit's TimeoutStopSec)


A = TypeVar("A")


# Where the agent reaches a server that listens on loopback (the default ``serving.host``).
LOOPBACK = "127.0.0.1"


class AnswerError(ValueError):
    """An answer that does not have the shape its operation promises."""


def answer_field(value: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    if key not in value or value[key] is None:
        if optional:
            return None
        raise AnswerError(f"'{key}' is missing")
    got = value[key]
    if kind is float and isinstance(got, int) and not isinstance(got, bool):
        return float(got)
    if not isinstance(got, kind) or (kind is int and isinstance(got, bool)):
        raise AnswerError(f"'{key}' is {type(got).__name__}, expected {kind.__name__}")
    return got


def answer_sha256(value: dict[str, Any], key: str) -> str | None:
    digest = answer_field(value, key, str, optional=True)
    if digest is not None and (len(digest) != 64 or digest.strip("0123456789abcdef")):
        raise AnswerError(f"'{key}' is not a sha256 hex digest")
    return digest  # type: ignore[no-any-return]


def answer_mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AnswerError(f"{what} is {type(value).__name__}, expected an object")
    return value


def answer_names(v: dict[str, Any], key: str) -> tuple[str, ...]:
    names = answer_field(v, key, list, optional=True) or []
    if not all(isinstance(n, str) for n in names):
        raise AnswerError(f"'{key}' is not a list of names")
    return tuple(names)


def answer_items(value: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = answer_field(value, key, list)
    return [answer_mapping(item, f"an item of '{key}'") for item in items]


@dataclass(frozen=True)
class Locked:
    """lock: the deploy root's lock is held, after this long a wait."""

    waited_s: float


@dataclass(frozen=True)
class Written:
    """put: the path written, and whether its content changed."""

    path: str
    changed: bool


@dataclass(frozen=True)
class Op(Generic[A]):
    """One operation: its request, how long it may wait on the host, how its answer is read, and
    whether its failure stops the batch (the default) or is a finding of it."""

    request: dict[str, Any]
    reader: Callable[[dict[str, Any]], A] = field(repr=False, compare=False)
    budget_s: float = 0.0  # beyond a plain round trip: lock waits, server starts, probes
    is_finding: bool = False

    @property
    def name(self) -> str:
        """The operation's name, as the agent knows it."""
        return str(self.request["op"])

    @property
    def spec(self) -> OpSpec:
        """Its row of the contract."""
        return SPECS[self.name]

    @property
    def gate(self) -> str:
        """The gate its failure is reported under."""
        return self.spec.gate

    def finding(self) -> Op[A]:
        """The same op, whose failure is a finding: the batch goes on after it."""
        return replace(self, is_finding=True)

    @property
    def key(self) -> str:
        """What its answer is found by: the op, and the process it is about when it names one."""
        process = self.request.get("name")
        return f"{self.name}:{process}" if process else self.name

    def read(self, value: Any) -> A:
        return self.reader(answer_mapping(value, "the answer"))


class Answers:
    """A batch's answers, read and typed, found by op; and the failures of its findings.

    Found by the op itself first: two ops of one kind in a batch (the command hook asked about
    three servers) share a key, and by key alone each was given the last one's answer (a host
    draining read another's state, and was stopped undrained). By key only where the key is
    the batch's alone."""

    def __init__(
        self,
        values: dict[str, Any],
        failed: dict[str, AgentFailure] | None = None,
        by_op: dict[int, Any] | None = None,
        failed_by_op: dict[int, AgentFailure] | None = None,
    ) -> None:
        self._values = values
        self._failed = failed or {}
        self._by_op = by_op or {}
        self._failed_by_op = failed_by_op or {}

    @classmethod
    def of(
        cls, answered: Sequence[tuple[Op[Any], Any]], failed: Sequence[tuple[Op[Any], AgentFailure]] = ()
    ) -> Answers:
        """The answers of a batch's ops, each found by its op; a key two of them share is found by
        neither's key."""
        keys = [op.key for op, _ in answered] + [op.key for op, _ in failed]
        shared = {k for k in keys if keys.count(k) > 1}
        return cls(
            {op.key: v for op, v in answered if op.key not in shared},
            {op.key: f for op, f in failed if op.key not in shared},
            {id(op): v for op, v in answered},
            {id(op): f for op, f in failed},
        )

    def __getitem__(self, op: Op[A]) -> A:
        if id(op) in self._by_op:
            return self._by_op[id(op)]  # type: ignore[no-any-return]
        return self._values[op.key]  # type: ignore[no-any-return]

    def get(self, op: Op[A] | None) -> A | None:
        """The op's answer; None when it was not asked (None) or not answered (it, or an op
        before it, failed)."""
        if op is None or op not in self:
            return None
        return self[op]

    def __contains__(self, op: Op[Any]) -> bool:
        return id(op) in self._by_op or op.key in self._values

    def failure(self, op: Op[Any] | None) -> AgentFailure | None:
        """Why a finding failed (None: it was answered, or not asked)."""
        if op is None:
            return None
        return self._failed_by_op.get(id(op)) or self._failed.get(op.key)

    @property
    def failures(self) -> list[AgentFailure]:
        """Every finding that failed, in the batch's order; each names its gate."""
        return list(self._failed_by_op.values()) if self._failed_by_op else list(self._failed.values())

    def __or__(self, other: Answers) -> Answers:
        """Two batches' answers as one."""
        return Answers(
            {**self._values, **other._values},
            {**self._failed, **other._failed},
            {**self._by_op, **other._by_op},
            {**self._failed_by_op, **other._failed_by_op},
        )


def ref(op: Op[Any], field_name: str | None = None) -> dict[str, str]:
    """A request value the agent takes from ``op``'s answer in the same batch (the whole answer, or
    one of its fields); refused on the host if that op has not run."""
    return {"$ref": op.key} if field_name is None else {"$ref": op.key, "field": field_name}


def batch_timeout(ops: Iterable[Op[Any]], base: float) -> float:
    """The one place a batch's deadline is computed: the target's command timeout, plus what each
    op may wait for on the host (the lock, a server's start, the probe)."""
    return base + sum(op.budget_s for op in ops)


def lock(root: str, owner: str, timeout: float) -> Op[Locked]:
    """The deploy-root flock, held by the agent until its batch ends."""
    request = {"op": "lock", "root": root, "timeout": timeout, "owner": owner}
    return Op(request, lambda v: Locked(answer_field(v, "waited_s", float)), budget_s=timeout)


def put(root: str, path: str, content: bytes, mode: str = "0644") -> Op[Written]:
    """One file written with the atomic protocol (temp, fsync, verify, rename), e.g. ready.json."""
    digest = hashlib.sha256(content).hexdigest()
    request = {"op": "put", "root": root, "path": path, "content": content, "sha256": digest, "mode": mode}
    return Op(request, lambda v: Written(answer_field(v, "path", str), answer_field(v, "changed", bool)))


@dataclass(frozen=True)
class OpSpec:
    """One operation's contract: what the agent knows it by, the agent module a batch must carry
    for it, the gate its failure is reported under, its words for progress ("gpu-a: waiting for
    health, 41 s"); its builder is the function of its name in ``protocol/<module>.py``."""

    name: str
    module: str
    gate: str
    words: str

    @property
    def build(self) -> Callable[..., Op[Any]]:
        """The op's builder: the function of its name in the protocol module named as its agent module."""
        import importlib

        built: Callable[..., Op[Any]] = getattr(
            importlib.import_module(f"orchestrator.agent.protocol.{self.module}"), self.name
        )
        return built


# Every op's row by name, filled by the package (``OPS`` in ``__init__``).
SPECS: dict[str, OpSpec] = {}
