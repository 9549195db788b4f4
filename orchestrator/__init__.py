"""dflash-orchestrator: deploy vLLM DFlash speculative decoding to LXC containers over SSH.

A host is READY only when every gate of the readiness chain has passed on it. The public API:
load an inventory and a playbook, then run ``deploy``, ``verify`` or ``rollback``.
"""

from orchestrator.engine import RunOptions, RunReport, deploy, dry_run, rollback, verify
from orchestrator.inventory import Inventory, load_inventory
from orchestrator.playbook import Playbook, load_playbook

__version__ = "0.1.0"

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
    "verify",
]
