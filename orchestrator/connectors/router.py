"""Every target of a run to its connector: SSH unless the inventory says ``connection: local``.

The router above the seam (as mitogen's ``get_connection_class``): ``base`` is the interface,
``CONNECTORS`` the ways of reaching a host. A connector is made only when a target needs it, so
paramiko is not imported for a run that is all local.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from orchestrator.config.inventory import Inventory, Target
from orchestrator.config.localfiles import KNOWN_HOSTS_IS_A_FILE, open_regular
from orchestrator.connectors import CONNECTORS
from orchestrator.connectors.base import Command, Connector, Counters, OnStderr, Result, RetryPolicy, Session, Stdin


@dataclass
class Connections:
    """Every target of a run to its connector: SSH unless the inventory says ``connection: local``;
    every target to ``connector`` when one is given (a test's, or a library caller's own)."""

    inventory: Inventory
    accept_new_host_keys: bool = False
    retry: RetryPolicy | None = None
    connector: Connector | None = None
    _made: dict[str, Connector] = field(default_factory=dict, init=False)  # by connection name
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        # known_hosts is checked before any host is touched: one that is no file (a FIFO would
        # block the run opening it) is bad input, said once, not as every host's failure.
        if self.connector is None and not all(c.on_this_machine for c in self.inventory.containers):
            fd = open_regular(self.inventory.known_hosts, os.O_RDONLY, KNOWN_HOSTS_IS_A_FILE)
            if fd is not None:
                os.close(fd)

    def _for(self, target: Target) -> Connector:
        if self.connector is not None:
            return self.connector
        # Every host's thread asks at once when a run starts: one connector each, made once.
        how = target.container.connection
        with self._guard:
            made = self._made.get(how)
            if made is None:
                made = self._made[how] = CONNECTORS[how](
                    self.inventory, self.accept_new_host_keys, self.retry or RetryPolicy()
                )
            return made

    def run(
        self,
        target: Target,
        command: Command,
        stdin: Stdin = b"",
        timeout: float | None = None,
        on_stderr: OnStderr | None = None,
    ) -> Result:
        return self._for(target).run(target, command, stdin, timeout, on_stderr)

    def open(self, target: Target, command: Command) -> Session:
        return self._for(target).open(target, command)

    def counters(self, name: str) -> Counters:
        """What reaching the container of this name cost so far (connections, execs, retries)."""
        if self.connector is not None:
            return self.connector.counters(name)
        how = next((c.connection for c in self.inventory.containers if c.name == name), None)
        connector = self._made.get(how) if how is not None else None
        return connector.counters(name) if connector is not None else Counters()

    @property
    def accepted_host_keys(self) -> list[str]:
        """The host keys this run trusted for the first time (--accept-new-host-keys), to print and
        record."""
        return [key for c in self._made.values() for key in c.accepted_host_keys]

    def close(self) -> None:
        """Close what this router opened (a connector given to it is its caller's to close)."""
        for connector in self._made.values():
            connector.close()

    def __enter__(self) -> Connections:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
