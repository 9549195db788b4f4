"""The ``serving`` agent module's ops: vLLM's own check of the command, the server launched, stopped,
waited on, probed and loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    pass
from orchestrator.agent.protocol.core import (
    LOOPBACK,
    AnswerError,
    Op,
    ServerCommand,
    answer_field,
    answer_items,
    answer_mapping,
    answer_names,
    ref,
)
from orchestrator.agent.protocol.releases import Applied


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
        value = answer_mapping(value, "'startup'")
        lines = answer_field(value, "lines", list)
        if not all(isinstance(line, str) for line in lines):
            raise AnswerError("'startup.lines' holds something other than text")
        return Startup(
            answer_field(value, "launched_at", float),
            answer_field(value, "healthy_at", float),
            answer_field(value, "utc_offset", int),
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
    port: int | None = None  # where it listens, as its launch recorded it


def _server(server: tuple[str, str] | None) -> dict[str, str] | None:
    return None if server is None else {"root": server[0], "name": server[1]}


@dataclass(frozen=True)
class Status:
    """serving_status: the server we started, /health's answer and the READY record on the host."""

    server: Process | None
    health: int | None  # /health's HTTP status; None: not asked, or no answer
    ready: dict[str, Any] | None  # ready.json as the host holds it
    launched: str | None = None  # the release ``launched`` names: the one the server reads its drafter from
    # where ``launched`` points when it names no release under releases/ (out of the root, say)
    launched_elsewhere: str | None = None
    # where the command the READY record names listened (port, address), as the host recorded it
    ready_listened: tuple[int, str] | None = None
    # vLLM says it sleeps (``POST /sleep``): /health 200, and every request waits in its queue
    sleeping: bool = False


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
    # What vLLM would serve the target as (``ModelConfig.runner_type``): "generate", "pooling"...;
    # None from a build that cannot say.
    runner_type: str | None = None


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
    return Op(request, read_engine, budget_s=ENGINE_CHECK_TIMEOUT)


def read_engine(v: dict[str, Any]) -> Engine:
    skipped = answer_field(v, "skipped", str, optional=True)
    if skipped is not None:
        return Engine(skipped)
    runner = answer_field(v, "runner", str, optional=True)
    if runner not in (None, "v1", "v2"):
        raise AnswerError(f"'runner' is {runner!r}")
    checks = answer_field(v, "checks", dict, optional=True) or {}
    if not all(isinstance(k, str) and isinstance(c, str) for k, c in checks.items()):
        raise AnswerError("'checks' is not a mapping of names to verdicts")
    return Engine(
        None,
        answer_field(v, "version", str),
        answer_names(v, "target"),
        answer_names(v, "drafter"),
        runner,
        answer_field(v, "seconds", float),
        tuple(sorted(checks.items())),
        answer_field(v, "compile_key", str, optional=True),
        bool(answer_field(v, "cached", bool, optional=True)),
        answer_field(v, "runner_type", str, optional=True),
    )


@dataclass(frozen=True)
class Refused:
    """A check's refusal, as a gate's answer rather than the batch's failure: the agent's code
    (``engine_refused``, ``engine_mismatch``, ``timeout``...) and its words."""

    code: str
    message: str


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
    return Op(request, lambda v: bool(answer_field(v, "runs", bool)))


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
        answer_field(v, "pid", int),
        bool(answer_field(v, "kept", bool, optional=True)),
        answer_field(v, "unit", str, optional=True),
        bool(answer_field(v, "from_ready", bool, optional=True)),
    )


def stop(root: str, name: str, timeout: float = 30.0) -> Op[Stopped]:
    """Stop the process started under ``name`` and check that nothing of it is left."""
    request = {"op": "stop", "root": root, "name": name, "timeout": timeout}
    return Op(request, _stopped, budget_s=timeout + _STOP_MARGIN)


def _stopped(v: dict[str, Any]) -> Stopped:
    return Stopped(answer_field(v, "stopped", int, optional=True), answer_field(v, "gone", bool))


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
            answer_field(v, "pid", int),
            answer_field(v, "waited_s", float),
            Startup.read(answer_field(v, "startup", dict, optional=True)),
        ),
        budget_s=timeout,
    )


def _status(v: dict[str, Any]) -> Status:
    server = answer_field(v, "server", dict, optional=True)
    ready = answer_field(v, "ready", dict, optional=True)
    process = None
    if server is not None:
        process = Process(
            pid=answer_field(server, "pid", int),
            alive=answer_field(server, "alive", bool),
            release_id=answer_field(server, "release_id", str, optional=True),
            port=answer_field(server, "port", int, optional=True),
        )
    return Status(
        process,
        answer_field(v, "health", int, optional=True),
        ready,
        answer_field(v, "launched", str, optional=True),
        answer_field(v, "launched_elsewhere", str, optional=True),
        _listened(answer_field(v, "ready_listened", dict, optional=True)),
        bool(answer_field(v, "sleeping", bool, optional=True)),
    )


def _listened(v: dict[str, Any] | None) -> tuple[int, str] | None:
    if v is None:
        return None
    port, host = answer_field(v, "port", int), answer_field(v, "host", str)
    if not 0 < port < 65536:
        raise AnswerError(f"ready_listened.port: {port} is no port")
    return port, host


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
    return Op(
        request, lambda v: Output(answer_field(v, "returncode", int), answer_field(v, "output", str)), budget_s=timeout
    )


def probe(
    port: int,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    timeout: float,
    host: str = LOOPBACK,
    warm: int = 0,
    server: tuple[str, str] | None = None,
) -> Op[Scrapes]:
    """Scrape /metrics, run the prompts (greedy, a fixed token budget), scrape again; ``warm``: then
    the first ``warm`` prompts once more, their prefixes cached, after a scrape between.
    ``server`` (root, name): ask where that server's record says it listens (else ``port``)."""
    request = {
        "op": "probe",
        "host": host,
        "port": port,
        "model": model,
        "prompts": list(prompts),
        "max_tokens": max_tokens,
        "timeout": timeout,
        "warm": warm,
        "server": _server(server),
    }
    return Op(request, lambda v: _scrapes(v, min(max(warm, 0), len(prompts)), len(prompts)), budget_s=timeout)


def _scrapes(v: dict[str, Any], warm: int, prompts: int) -> Scrapes:
    each = answer_field(v, "each", list)
    if len(each) != prompts or not all(isinstance(t, str) for t in each):
        raise AnswerError(f"'each' holds {len(each)} scrapes for {prompts} prompts, or one that is not a text")
    completions = v.get("completions")
    counts = (
        [c.get("tokens") for c in completions[:prompts] if isinstance(c, dict)] if isinstance(completions, list) else []
    )
    whole = [n for n in counts if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    own = sum(whole) if len(whole) == prompts else None
    return Scrapes(
        answer_field(v, "before", str),
        answer_field(v, "after", str),
        answer_field(v, "seconds", float, optional=True),
        answer_field(v, "middle", str, optional=True),
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
    # the server's load families of /metrics before and after the run (None: it shows none)
    metrics_before: str | None = None
    metrics_after: str | None = None


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
    a time, each timed, with the server's own numbers of the run (the speed-up gate's arms)."""
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
    # and the two reads of /metrics around the run (10 s each, 2 s waiting for the last request)
    return Op(request, _loaded, budget_s=timeout + 25)


def _loaded(v: dict[str, Any]) -> Loaded:
    sent = tuple(
        Sent(
            answer_field(r, "tokens", int),
            answer_field(r, "seconds", float),
            answer_field(r, "first_token_s", float, optional=True),
            answer_field(r, "error", str, optional=True),
        )
        for r in answer_items(v, "requests")
    )
    metrics = answer_field(v, "metrics", dict, optional=True)
    if metrics is None:
        return Loaded(answer_field(v, "wall_s", float), sent)
    return Loaded(
        answer_field(v, "wall_s", float),
        sent,
        answer_field(metrics, "before", str),
        answer_field(metrics, "after", str),
    )


def metrics(
    port: int,
    prefixes: Sequence[str],
    timeout: float = 10.0,
    host: str = LOOPBACK,
    server: tuple[str, str] | None = None,
) -> Op[str]:
    """The server's /metrics now, only the lines of the families named by ``prefixes``.
    ``server`` (root, name): ask where that server's record says it listens (else ``port``)."""
    request = {
        "op": "metrics",
        "host": host,
        "port": port,
        "prefixes": list(prefixes),
        "timeout": timeout,
        "server": _server(server),
    }
    return Op(request, lambda v: str(answer_field(v, "text", str)), budget_s=timeout)
