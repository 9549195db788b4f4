"""How a command reaches a host: the seam (``base``), the router that picks each target's
connector (``router``), and one module a way of reaching a host: ``ssh`` (the only paramiko
importer), ``local`` (this machine), and ``fake`` (in memory, for tests).

``CONNECTORS`` is the one registry, by the inventory's ``connection:`` names (``config.inventory.
CONNECTIONS`` says what each takes there): each row makes its connector for a run, importing its
module only then, so a run that is all local never imports paramiko.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.config.inventory import LOCAL, SSH, Inventory
from orchestrator.connectors.base import Connector, RetryPolicy


def _ssh(inventory: Inventory, accept_new_host_keys: bool, retry: RetryPolicy) -> Connector:
    from orchestrator.connectors.ssh import KnownHosts, SshConnector

    return SshConnector(KnownHosts(inventory.known_hosts), accept_new_host_keys=accept_new_host_keys, retry=retry)


def _local(inventory: Inventory, accept_new_host_keys: bool, retry: RetryPolicy) -> Connector:
    from orchestrator.connectors.local import LocalConnector

    return LocalConnector()


CONNECTORS: dict[str, Callable[[Inventory, bool, RetryPolicy], Connector]] = {SSH: _ssh, LOCAL: _local}
