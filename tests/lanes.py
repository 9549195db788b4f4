"""Each pytest worker has a lane of its own: the names, subnets, ports and state directories of
the sandboxes it brings up, so that two workers (pytest-xdist) share one machine without meeting.

A second run beside the first takes lanes above the first's: ``ORCHESTRATE_TEST_LANE=2`` (the
first run's workers hold lanes 0 and 1). Every sandbox a test brings up is named from its lane,
never from a fixed name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LETTERS = "tuvwxyzabcdefghijk"  # a lane's letter in every name: dt*, du*, ...
STATE = Path("/var/lib/dflash-orchestrator")


@dataclass(frozen=True)
class Lane:
    index: int

    def prefix(self, role: str = "t") -> str:
        """A three-letter prefix (LXD containers, network namespaces, bridges): lane and role."""
        return f"d{LETTERS[self.index]}{role}"

    def subnet(self, role: int = 0) -> str:
        """The first two octets of a /16 of this lane's own (eight a lane, from 10.100)."""
        if not 0 <= role < 8:
            raise ValueError(f"a lane has eight subnets, not {role + 1}")
        return f"10.{100 + self.index * 8 + role}"

    @property
    def jump_port(self) -> int:
        """The LXD sandbox's GPU-host sshd port (on the shared LXD bridge)."""
        return 2223 + self.index

    def directory(self, name: str) -> Path:
        return STATE / f"test-{name}-{self.index}"


def current() -> Lane:
    base = int(os.environ.get("ORCHESTRATE_TEST_LANE", "0"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw0", "gw1", ...; none without xdist
    index = base + int(worker.removeprefix("gw"))
    if index >= len(LETTERS):
        raise ValueError(f"lane {index}: at most {len(LETTERS)} lanes (ORCHESTRATE_TEST_LANE plus the worker)")
    return Lane(index)
