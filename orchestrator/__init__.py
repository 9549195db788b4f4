"""dflash-orchestrator: deploy vLLM DFlash speculative decoding to LXC containers over SSH.

A host is READY only when every gate of the readiness chain has passed on it. The public API:
load an inventory and a playbook, then run ``deploy``, ``verify``, ``rollback`` or ``stop`` (a
multi-node playbook is run as one group: the library decides).

The names below load on first use, so that importing one submodule (``orchestrator.cli``,
``orchestrator.inventory``) does not import them all before its own first line runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.inventory import Inventory, load_inventory
    from orchestrator.playbook import Playbook, load_playbook
    from orchestrator.results import RunReport
    from orchestrator.runner import RunOptions
    from orchestrator.runs import deploy, dry_run, rollback, stop, verify

__version__ = "0.1.0"

_HOMES = {
    "RunOptions": "orchestrator.runner",
    "RunReport": "orchestrator.results",
    "deploy": "orchestrator.runs",
    "dry_run": "orchestrator.runs",
    "rollback": "orchestrator.runs",
    "stop": "orchestrator.runs",
    "verify": "orchestrator.runs",
    "Inventory": "orchestrator.inventory",
    "load_inventory": "orchestrator.inventory",
    "Playbook": "orchestrator.playbook",
    "load_playbook": "orchestrator.playbook",
}

__all__ = [
    "Inventory",
    "Playbook",
    "RunOptions",
    "RunReport",
    "deploy",
    "dry_run",
    "load_inventory",
    "load_playbook",
    "rollback",
    "stop",
    "verify",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
