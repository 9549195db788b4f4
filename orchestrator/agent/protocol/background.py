"""The ``background`` agent module's ops: the loader and engine checks started beside the launch, and
waited for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from orchestrator.agent.protocol.checks import LoaderView, read_loader_view
from orchestrator.agent.protocol.core import Op, ServerCommand, answer_field, ref
from orchestrator.agent.protocol.releases import Applied
from orchestrator.agent.protocol.serving import ENGINE_CHECK_TIMEOUT, Engine, Refused, read_engine


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
    loader, engine = answer_field(v, "loader", dict, optional=True), answer_field(v, "engine", dict, optional=True)
    return ChecksStarted(
        answer_field(v, "token", str, optional=True),
        answer_field(v, "serving", bool),
        read_loader_view(loader) if loader is not None else None,
        read_engine(engine) if engine is not None else None,
    )


def _checks_done(v: dict[str, Any]) -> ChecksDone:
    loader, engine = answer_field(v, "loader", dict, optional=True), answer_field(v, "engine", dict, optional=True)
    view = error = verdict = refused = None
    if loader is not None:
        error = answer_field(loader, "error", str, optional=True)
        view = read_loader_view(loader) if error is None else None
    if engine is not None:
        said = answer_field(engine, "refused", dict, optional=True)
        if said is not None:
            refused = Refused(answer_field(said, "code", str), answer_field(said, "message", str))
        else:
            verdict = read_engine(engine)
    return ChecksDone(answer_field(v, "seconds", float), view, error, verdict, refused)


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
