"""dflash-orchestrator: deploy vLLM DFlash speculative decoding to LXC containers over SSH.

A host is READY only when every gate of the readiness chain has passed on it. The public API:
load an inventory and a playbook, make a ``Deployment`` of them, then ``deploy``, ``verify``,
``rollback``, ``stop`` or ``dry_run`` (a multi-node playbook is run as one group: the library
decides). An ``Observer`` sees the progress; ``connectors.fake.FakeConnector`` answers the agent's ops in a
test, without hosts.

The names below load on first use, so that importing one submodule (``orchestrator.cli.main``,
``orchestrator.config.inventory``) does not import them all before its own first line runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config.inventory import Inventory, load_inventory
    from orchestrator.config.playbook import Playbook, load_playbook
    from orchestrator.deployment import Deployment, select_targets
    from orchestrator.engine.observer import Observer, Step
    from orchestrator.engine.runner import RunOptions
    from orchestrator.results import HostReport, RunReport

__version__ = "0.1.0"

_HOMES = {
    "Deployment": "orchestrator.deployment",
    "select_targets": "orchestrator.deployment",
    "Observer": "orchestrator.engine.observer",
    "RunOptions": "orchestrator.engine.runner",
    "Step": "orchestrator.engine.observer",
    "HostReport": "orchestrator.results",
    "RunReport": "orchestrator.results",
    "Inventory": "orchestrator.config.inventory",
    "load_inventory": "orchestrator.config.inventory",
    "Playbook": "orchestrator.config.playbook",
    "load_playbook": "orchestrator.config.playbook",
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
