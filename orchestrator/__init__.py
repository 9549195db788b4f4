"""dflash-orchestrator: deploy vLLM DFlash speculative decoding to LXC containers over SSH.

A host is READY only when every gate of the readiness chain has passed on it. The public API:
load an inventory and a playbook, make a ``Deployment`` of them, then ``deploy``, ``verify``,
``rollback``, ``stop`` or ``dry_run`` (a multi-node playbook is run as one group: the library
decides). An ``Observer`` sees the progress; ``fake.FakeConnector`` answers the agent's ops in a
test, without hosts.

The names below load on first use, so that importing one submodule (``orchestrator.cli``,
``orchestrator.inventory``) does not import them all before its own first line runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.deployment import Deployment, select_targets
    from orchestrator.inventory import Inventory, load_inventory
    from orchestrator.playbook import Playbook, load_playbook
    from orchestrator.results import HostReport, RunReport
    from orchestrator.runner import Observer, RunOptions, Step

__version__ = "0.1.0"

_HOMES = {
    "Deployment": "orchestrator.deployment",
    "select_targets": "orchestrator.deployment",
    "Observer": "orchestrator.runner",
    "RunOptions": "orchestrator.runner",
    "Step": "orchestrator.runner",
    "HostReport": "orchestrator.results",
    "RunReport": "orchestrator.results",
    "Inventory": "orchestrator.inventory",
    "load_inventory": "orchestrator.inventory",
    "Playbook": "orchestrator.playbook",
    "load_playbook": "orchestrator.playbook",
}

__all__ = [
    "Deployment",
    "HostReport",
    "Inventory",
    "Observer",
    "Playbook",
    "RunOptions",
    "RunReport",
    "Step",
    "load_inventory",
    "load_playbook",
    "select_targets",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
