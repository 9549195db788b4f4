"""How a run goes about its hosts (``RunOptions``) and how it is stopped (``Stop``): what the command
line parses into, importable without the engine (a command that only reads an inventory or prints
its help loads nothing else of it)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.config.limits import MAX_COUNT, MAX_SECONDS, RELEASE_ID, RELEASE_ID_RULE
from orchestrator.connectors.base import RetryPolicy
from orchestrator.errors import InputError

__all__ = ["MAX_COUNT", "RELEASE_ID", "RELEASE_ID_RULE", "RunOptions", "Stop", "stop_reason"]


class Stop(threading.Event):
    """A run's stop: set by a first Ctrl-C or SIGTERM (no reason: the run was interrupted), or by
    the run itself, with its reason (its rollout lease was lost): no new host starts."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    def halt(self, reason: str) -> None:
        self.reason = reason
        self.set()


def stop_reason(event: threading.Event) -> str | None:
    """Why the run stopped itself (None: nothing did, or an interrupt)."""
    return getattr(event, "reason", None)


@dataclass(frozen=True)
class RunOptions:
    """How a run goes about its hosts (what it does is the playbook's): the defaults are the CLI's."""

    # Hosts worked on at once. A host holds its fork for its whole chain, a server's load and
    # health wait included (minutes on a GPU): 256 deploys 1024 servers in 4 loads, not 64 at
    # Ansible-like 16. The controller's cost barely moves with it (1024 hosts, files changed:
    # 4.7 ms of CPU a host at 16, 5.2 at 256, 5.8 at 1024; 115-146 MiB); a rollout's canary and
    # batches, not forks, are what limit how many hosts change at once.
    forks: int = 256
    skip_containers: bool = False
    accept_new_host_keys: bool = False
    lock_timeout: float = 60.0
    release_id: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Where the controller keeps its state, its digest key among it (None: the default place).
    state_dir: Path | None = None
    # Set (by a first Ctrl-C): start nothing new; what is in flight finishes, bounded by its own
    # deadlines, and the run reports what happened.
    interrupt: threading.Event = field(default_factory=lambda: Stop(), compare=False)

    def __post_init__(self) -> None:
        # The library takes what the CLI takes, checked the same way: a caller from Python gets
        # the message the CLI's user does (forks=0 waited for ever; a release id is a directory
        # on every host).
        problems = _run_option_problems(self)
        if problems:
            raise InputError("; ".join(problems), key="RunOptions")

    def key(self) -> str:
        """The digest key the hosts' caches are signed with (``state.digest_key``)."""
        from orchestrator.store.state import digest_key  # the store only where a run signs

        return digest_key(self.state_dir)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(value: object) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        and 0 <= value <= MAX_SECONDS
    )  # fmt: skip


def _run_option_problems(o: RunOptions) -> list[str]:
    problems = []
    if not _whole(o.forks) or not 1 <= o.forks <= MAX_COUNT:
        problems.append(f"forks: expected a whole number from 1 to {MAX_COUNT}, got {o.forks!r}")
    if not _seconds(o.lock_timeout):
        problems.append(f"lock_timeout: expected seconds from 0 to {MAX_SECONDS:.0f}, got {o.lock_timeout!r}")
    if o.release_id is not None and not (isinstance(o.release_id, str) and RELEASE_ID.fullmatch(o.release_id)):
        problems.append(f"release_id: {o.release_id!r}: {RELEASE_ID_RULE}")
    r = o.retry
    if not _whole(r.attempts) or not 1 <= r.attempts <= 100:
        problems.append(f"retry.attempts: expected a whole number from 1 to 100, got {r.attempts!r}")
    for name in ("initial_wait", "max_wait"):
        if not _seconds(getattr(r, name)):
            problems.append(f"retry.{name}: expected seconds from 0 to {MAX_SECONDS:.0f}, got {getattr(r, name)!r}")
    for name in ("skip_containers", "accept_new_host_keys"):
        if not isinstance(getattr(o, name), bool):
            problems.append(f"{name}: expected true or false, got {getattr(o, name)!r}")
    if o.state_dir is not None and not isinstance(o.state_dir, Path):
        problems.append(f"state_dir: expected a Path, got {o.state_dir!r}")
    return problems
