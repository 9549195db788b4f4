"""What a run tells whoever watches it: one method an event (``Observer``), a host's current step
in the user's words (``Step``). The CLI's progress printer is one observer; a library caller
passes its own, or none."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.agent import protocol
from orchestrator.agent.client import Event
from orchestrator.results import HostReport


@dataclass(frozen=True)
class Step:
    """What a host is doing now, for people watching a long run: "waiting for health", "41 s: ..."."""

    host: str
    what: str
    detail: str = ""  # the server log's last line, "prompt 2 of 3", "1.20 of 4.00 GB"
    elapsed_s: float | None = None  # the host's own count of a wait (the agent's)

    def describe(self) -> str:
        parts = [f"{self.elapsed_s:.0f} s" if self.elapsed_s is not None else "", self.detail]
        return ": ".join(p for p in parts if p)


class Observer:
    """What a run tells whoever watches it, one method per event, each a no-op here (as pyinfra's
    ``BaseStateCallback``): subclass it and override what you show. The CLI's progress printer is
    one; a library caller passes its own, or none. Called from the run's worker threads."""

    # Ask the agents for their progress events (each op as it starts, a health wait's seconds):
    # only when someone watches, since they cost the hosts a write per event.
    watching = False

    def host_started(self, report: HostReport) -> None:
        """A host's (or a group's node's) work began."""

    def host_done(self, report: HostReport) -> None:
        """A host's work ended (its gates are final), or it was not started (interrupted)."""

    def step(self, step: Step) -> None:
        """What a host is doing now, as it changes."""

    def say(self, message: str) -> None:
        """A line about the run as a whole (a group's steps, a push's progress)."""


def step_of(host: str, event: Event, bound: float | None = None) -> Step:
    """The agent's event in the user's words; ``bound``: how long the op may take at most (said,
    so that a long step under load is seen to be bounded, not hung)."""
    what = protocol.words(event.op)
    if event.op == "wait_health" and event.elapsed_s is not None:
        return Step(host, what, event.log or "", event.elapsed_s)
    if event.op == "probe" and event.done is not None and event.of:
        return Step(host, what, f"prompt {event.done + 1} of {event.of}")
    return Step(host, what, f"at most {bound:.0f} s" if bound else "")
