"""The run's gateway: the container it runs on, and the client that reads its rotation, takes
servers out and puts them back through the kind's adapter (``ADAPTERS``), every change read back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.agent.protocol import Op
from orchestrator.config.inventory import Container, Inventory, Target
from orchestrator.config.playbook import Playbook
from orchestrator.errors import AgentError, AgentProtocolError, GatewayError, InputError, TransportError
from orchestrator.gateways import ADAPTERS
from orchestrator.gateways.base import Member, Rotation, Server
from orchestrator.rules import serving


def gateway_target(playbook: Playbook, inventory: Inventory) -> Target:
    """The container the gateway runs on, reached as hosts are."""
    assert playbook.gateway is not None
    name = playbook.gateway.runs_on
    found = [inventory.target(c) for c in inventory.containers if c.name == name]
    if not found:
        raise InputError(
            f"'{name}' is not a container of {inventory.file} (the gateway's host)",
            file=str(playbook.file),
            key="gateway.runs_on",
        )
    containers = {c.name for c in inventory.containers}
    for container in playbook.gateway.servers:
        if container not in containers:
            raise InputError(
                f"'{container}' is not a container of {inventory.file}: a server named for no container",
                file=str(playbook.file),
                key=f"gateway.servers.{container}",
            )
    target = found[0]
    if target.container.address is None and not target.container.on_this_machine:
        raise InputError(
            f"{name} needs an address in {inventory.file} (or connection: local): the gateway is reached there",
            file=str(playbook.file),
            key="gateway.runs_on",
        )
    return target


def check_servers(playbook: Playbook, targets: Sequence[Target]) -> None:
    """One container, one server: two containers the gateway would know by one name (a
    ``gateway.servers`` entry naming another container's server, two containers at one URL) is
    bad input: draining one would take the other out, and each would be judged by the other."""
    assert playbook.gateway is not None
    adapter = ADAPTERS[playbook.gateway.kind](playbook.gateway)
    keys: dict[str, str] = {}
    for target in targets:
        try:
            key = adapter.key(target.container.name, serving.url(playbook, target.container))
        except InputError:
            continue  # an address LXD gives only once it is located: checked when it is
        if key in keys:
            raise InputError(
                f"{keys[key]} and {target.name} are one server to the gateway ({key}): one container, one server",
                file=str(playbook.file),
                key="gateway.servers",
            )
        keys[key] = target.name


class GatewayClient:
    """The run's gateway: its rotation read, servers taken out and put back, requests sent through
    it, all on the gateway's host. Changes are made one at a time (a run's hosts in flight at once
    would otherwise each count the others as serving), and each is read back."""

    def __init__(self, playbook: Playbook, target: Target, client: AgentClient) -> None:
        assert playbook.gateway is not None
        self.playbook, self.spec, self.target, self.client = playbook, playbook.gateway, target, client
        self.adapter = ADAPTERS[self.spec.kind](self.spec)
        self.changing = threading.Lock()
        # The run's own servers: asked about with each, so that a gateway that answers only for
        # the servers named (the command hook) still counts the others serving.
        self.fleet: list[Server] = []

    @property
    def identity(self) -> str:
        """The gateway as every controller behind it names it: its kind, host and URL."""
        return f"{self.spec.kind} {self.spec.runs_on} {self.spec.url}"

    def server(self, container: Container, port: int | None = None) -> Server:
        """``container``'s server as the gateway knows it (``port``: where it listens when not
        serving.port, a host with a standby)."""
        url = serving.url(self.playbook, container, port)
        return Server(container.name, self.adapter.key(container.name, url), url)

    def _batch(self, ops: list[Op[Any]]) -> protocol.Answers:
        try:
            return self.client.batch(self.target, ops)
        except AgentError as exc:
            raise GatewayError(
                f"the {self.spec.kind} gateway on {self.target.name}: {exc.failure.describe()}"
            ) from None
        except (TransportError, AgentProtocolError) as exc:
            raise GatewayError(f"the {self.spec.kind} gateway's host {self.target.name}: {exc}") from None

    def rotation(self, servers: Sequence[Server] = ()) -> Rotation:
        """Every server the gateway knows now (the command hook: those named)."""
        return self.adapter.rotation(servers, self._batch)

    def put(self, server: Server, into: bool, others: Sequence[Server] = ()) -> Member:
        """Take ``server`` out of rotation or put it back, and read it back from the gateway. A
        change the gateway refuses because it already holds (vllm-router: ``HTTP 400: Worker ...
        already exists`` for a worker it still lists) is judged by that read-back, not its words:
        every change is idempotent. Put back, "where it was asked to be" is in rotation, or, for a
        gateway whose listing drops what is taken out, listed (healthy later): a HAProxy server in
        MAINT or a hook's host "out" is not, and its refusal is said in its words (a hook that
        refused ``in`` was taken for a listing that lags, waited on for a minute, and unsaid)."""
        op, check = self.adapter.change(server, into)
        try:
            check(self._batch([op])[op])
        except GatewayError:
            member = self.rotation([server, *others]).of(server)
            if into:
                there = member.in_rotation or (self.adapter.drops_drained and member.status != "absent")
            else:
                there = not member.in_rotation
            if there:
                return member  # already where it was asked to be
            raise
        member = self.rotation([server, *others]).of(server)
        if not into and member.in_rotation:
            raise GatewayError(
                f"the {self.spec.kind} gateway still sends traffic to {server.name} ({member.status}) after it was taken out"
            )
        return member

    def move(self, server: Server) -> None:
        """Make the gateway send ``server``'s traffic to its URL (a release that listens on the other
        port of a host with a standby), each step read back; nothing for a gateway that knows a
        server by its URL."""
        with self.changing:
            for op, check in self.adapter.move(server):
                check(self._batch([op])[op])

    def wait_in_rotation(self, server: Server, deadline: float) -> Member:
        """Until the gateway sends ``server`` traffic (HAProxy's health checks pass, a router marks it
        healthy), or the deadline."""
        delay = 0.25
        while True:
            member = self.rotation([server]).of(server)
            if member.in_rotation or time.monotonic() + delay > deadline:
                return member
            time.sleep(delay)  # a health check's interval: a second or two
            delay = min(delay * 2, 2.0)

    def send(self, model: str, prompt: str) -> protocol.HttpAnswer:
        """One completion through the gateway, as a client sends it."""
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        op = protocol.gateway_http("POST", f"{self.spec.url}/v1/completions", body, self.spec.timeout_s + 60.0)
        return self._batch([op])[op]
