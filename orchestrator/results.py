"""What a run found: gates per host, the files each host serves, the run as a whole. Pure data.

Rendering (``cli.render``) and the state database (``store.state``) read these; they never need the code
that ran the hosts. The JSON written here is the ``--json`` output and the audit record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class RunKind(StrEnum):
    """The runs a user asks for, by the name they are recorded and shown under."""

    DEPLOY = "deploy"
    VERIFY = "verify"
    ROLLBACK = "rollback"
    STOP = "stop"
    DRY_RUN = "dry-run"

    @property
    def rolls_out(self) -> bool:
        """Whether it changes what hosts serve: such a run holds its targets' rollout lease, while
        verify and dry-run only read and go on beside it."""
        return self in (RunKind.DEPLOY, RunKind.ROLLBACK, RunKind.STOP)


@dataclass(frozen=True)
class Problem:
    """One finding of lint, the build table or the weights gate: the field it is about, how bad it
    is, what was expected and found, the fix, and what real vLLM does with it."""

    field: str
    severity: str  # "error" | "warning" | "info" (said, costs nothing)
    message: str
    expected: Any = None
    actual: Any = None
    fix: str = ""
    # What vLLM itself does with it, where that was observed (tests/data/real-drafters): REFUSES
    # (it does not start), FIRST_REQUEST (it starts healthy, then the first request kills the
    # engine), or "" (it serves; the cost, if any, is in the message).
    vllm: str = ""
    rule: str = ""  # the lint rule (``RULES``) that found it

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("fix", "vllm", "rule"):
            if not out[name]:
                out.pop(name)
        return out

    def line(self) -> str:
        """The problem in one line, as lint prints it."""
        values = ""
        if self.expected is not None or self.actual is not None:
            values = f" (expected {self.expected!r}, got {self.actual!r})"
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{self.severity}: {self.field}: {self.message}{values}{fix}"


# The readiness chain, in order, and the gates of the other runs.
GATE_LINT = "lint"
GATE_CONTAINERS = "containers"
GATE_CONNECT = "connect"
GATE_GPUS = "gpus"
GATE_FILES = "files"
GATE_MODELS = "models"
GATE_WEIGHTS = "weights"
GATE_LOADER = "loader"
GATE_BUILD = "build"
GATE_ENGINE = "engine"  # the installed vLLM's own verdict on the exact command, before launch
# serving.compile_cache: share: the cache given to a host before its start, or taken from it once READY
GATE_COMPILE_CACHE = "compile_cache"
GATE_HEALTH = "health"
GATE_ACCEPTANCE = "acceptance"
GATE_SPEEDUP = "speedup"  # speculation pays at the fleet's load: the drafter arm against the baseline
GATE_GATEWAY = "gateway"  # drained before the stop, and served through the gateway before READY
GATE_READY = "ready"
GATE_BAKE = "bake"  # the canary's live acceptance and gateway errors, watched before the next batch
GATE_GROUP = "group"  # multi-node: what the other nodes of the group did
GATE_RAY = "ray"
GATE_ROLLOUT = "rollout"
GATE_STOPPED = "stopped"
GATE_INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class Gate:
    """One link of the readiness chain on one host: passed or not, in words, with the numbers it
    decided on."""

    ok: bool
    detail: str
    data: dict[str, Any] = field(default_factory=dict)  # numbers the gate decided on
    # Why it failed (or what it found), as a code a program can match: the diagnosis reads these,
    # never the detail's words. "" where the detail is all there is to say.
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail, **self.data, **({"reason": self.reason} if self.reason else {})}


@dataclass(frozen=True)
class FileState:
    """One release file on one host, as the server will read it."""

    dest: str
    remote_path: str
    sha256: str | None
    expected: str
    changed: bool = False

    @property
    def drift(self) -> bool:
        return self.sha256 != self.expected

    def record(self) -> dict[str, Any]:
        """As the READY record names it."""
        return {"path": self.dest, "remote_path": self.remote_path, "sha256": self.sha256}


@dataclass
class HostReport:
    """Everything a run learned of one host: its gates in order, the files it serves, its releases,
    the diagnosis."""

    name: str
    gates: dict[str, Gate] = field(default_factory=dict)
    files: list[FileState] = field(default_factory=list)
    release_id: str | None = None
    previous: str | None = None
    changed: bool = False
    diffs: list[str] = field(default_factory=list)
    container: dict[str, Any] | None = None
    diagnosis: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    ssh: dict[str, int] = field(default_factory=dict)
    models: list[dict[str, Any]] = field(default_factory=list)  # per model directory: files, bytes, drift
    gpus: list[dict[str, Any]] = field(default_factory=list)  # what nvidia-smi said of each GPU
    # Where the host's time went when the run started a server: vLLM's start, the probe, the
    # speed-up gate's arms, the tool's own share (rules.startup.time_split).
    time: dict[str, float] | None = None
    # The gates of the start that went back to the previous release after a failure (its own
    # vLLM start and probe: vLLM's time, not the tool's); kept for the time split only.
    rollback_gates: dict[str, Any] | None = None
    # The READY release kept asleep on the host (``serving.standby``): its release, port, process,
    # sleep state and memory; None: no standby.
    standby: dict[str, Any] | None = None

    @property
    def ready(self) -> bool:
        """Whether every gate the host got passed."""
        return bool(self.gates) and all(g.ok for g in self.gates.values())

    @property
    def failed_gate(self) -> str | None:
        """The first gate that failed, in chain order, or None."""
        return next((name for name, g in self.gates.items() if not g.ok), None)

    def to_json(self, kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "ready": self.ready,
            "release_id": self.release_id,
            "previous_release_id": self.previous,
            "changed": self.changed,
            "gates": {name: g.to_json() for name, g in self.gates.items()},
            "files": [
                {
                    "path": f.dest,
                    "remote_path": f.remote_path,
                    "sha256": f.sha256,
                    "expected_sha256": f.expected,
                    "changed": f.changed,
                    "drift": f.drift,
                }
                for f in self.files
            ],
            "duration_s": round(self.duration_s, 3),
            "ssh": self.ssh,
        }
        if kind == "verify":
            out["in_sync"] = self.ready
        if self.standby is not None:
            out["standby"] = self.standby
        if self.models:
            out["models"] = self.models
        if self.gpus:
            out["gpus"] = self.gpus
        if self.container is not None:
            out["container"] = self.container
        if self.diagnosis:
            out["diagnosis"] = self.diagnosis
        if self.diffs:
            out["diffs"] = self.diffs
        if self.time is not None:
            out["time"] = self.time
        return out


@dataclass
class RunReport:
    """One run over its hosts: what was asked, each host's report, and whether every host passed."""

    kind: RunKind
    playbook: str
    inventory: str
    release_id: str | None
    hosts: list[HostReport]
    started: float
    finished: float = 0.0
    accepted_host_keys: list[str] = field(default_factory=list)
    lint: list[Problem] | None = None
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return bool(self.hosts) and all(h.ready for h in self.hosts)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "playbook": self.playbook,
            "release_id": self.release_id,
            "ok": self.ok,
            "duration_s": round(self.finished - self.started, 3),
            "accepted_host_keys": self.accepted_host_keys,
        }
        if self.interrupted:
            out["interrupted"] = True
        if self.lint is not None:
            out["lint"] = {
                "ok": not any(p.severity == "error" for p in self.lint),
                "problems": [p.to_json() for p in self.lint],
            }
        out["hosts"] = [h.to_json(self.kind) for h in self.hosts]
        return out
