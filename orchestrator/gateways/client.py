"""The gateway in front of the servers: a host leaves its rotation before its server stops, and is
READY only once the gateway sends it traffic again.

One adapter per kind of gateway, as values: the ops that read the rotation, take a server out
and put it back (built on the agent's generic gateway ops, run on the gateway's own host), and
the readers of the gateway's answers, pure and strict (a gateway is not trusted more than a
host). ``GatewayClient`` runs them through the run's agent client, every call bounded by
``gateway.timeout_s``, and reads every change back: vllm-router answers "Successfully removed
worker" of a worker it never had, so no adapter takes a gateway's word for a change.
"""

from __future__ import annotations

import csv
import io
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.agent.protocol import Op
from orchestrator.config.inventory import Container, Inventory, Target
from orchestrator.config.playbook import Gateway, Playbook
from orchestrator.errors import AgentError, AgentProtocolError, GatewayError, InputError, TransportError
from orchestrator.rules import serving


@dataclass(frozen=True)
class Server:
    """A container's server as the gateway knows it: its name there, and the URL it is reached at."""

    name: str  # the container
    key: str  # the gateway's name for it: an HAProxy server, a worker URL, an endpoint's name
    url: str


@dataclass(frozen=True)
class Member:
    """A server as the gateway sees it now."""

    key: str
    in_rotation: bool
    in_flight: int | None  # requests the gateway holds on it (None: this gateway does not say)
    status: str  # the gateway's own word for it ("UP", "DRAIN", "healthy", "listed", ...)
    errors: int | None = None  # answers the gateway counted as failed from it, ever (HAProxy)


@dataclass(frozen=True)
class Rotation:
    """Every server the gateway knows, by its key."""

    members: dict[str, Member]

    def serving(self, besides: str | None = None) -> int:
        """How many servers take traffic now (``besides``: not counting that one)."""
        return sum(m.in_rotation for k, m in self.members.items() if k != besides)

    def of(self, server: Server) -> Member:
        """The server as the gateway sees it; absent is out of rotation."""
        return self.members.get(server.key) or Member(server.key, False, None, "absent")


# --- HAProxy: the runtime API on its stats socket (level admin) --------------------------------


def read_haproxy_stat(text: str, backend: str) -> Rotation:
    """``show stat``'s CSV: the servers of ``backend``, each in rotation when its status is UP (or
    "no check") and its weight above 0; in flight: current sessions plus those queued for it."""
    head, _, body = text.lstrip().partition("\n")
    if not head.startswith("# "):
        raise GatewayError(f"HAProxy's `show stat` did not answer with its CSV: {text.strip()[:200]!r}")
    rows = list(csv.reader(io.StringIO(head[2:] + "\n" + body)))
    columns = {name: i for i, name in enumerate(rows[0])}
    missing = {"pxname", "svname", "scur", "qcur", "status", "weight"} - set(columns)
    if missing:
        raise GatewayError(f"HAProxy's `show stat` has no column {', '.join(sorted(missing))}")
    members: dict[str, Member] = {}
    found = False
    for row in rows[1:]:
        if len(row) < len(columns) - 1 or row[columns["pxname"]] != backend:
            continue
        found = True
        name = row[columns["svname"]]
        if name in ("FRONTEND", "BACKEND"):
            continue
        status = row[columns["status"]]
        try:
            in_flight = int(row[columns["scur"]] or 0) + int(row[columns["qcur"]] or 0)
            weight = int(row[columns["weight"]] or 0)
        except ValueError:
            raise GatewayError(f"HAProxy's `show stat` row for {backend}/{name} is not numbers: {row[:8]}") from None
        serving_now = (status.startswith("UP") or status == "no check") and weight > 0
        # Failed answers: responses cut or refused (eresp) and 5xx sent back (hrsp_5xx), when shown.
        errors = None
        if "eresp" in columns and "hrsp_5xx" in columns:
            counts = [row[columns[c]] for c in ("eresp", "hrsp_5xx")]
            errors = sum(int(c) for c in counts if c.isdigit())
        members[name] = Member(name, serving_now, in_flight, status, errors)
    if not found:
        raise GatewayError(f"HAProxy has no backend {backend!r} (`show stat` lists none by that name)")
    return Rotation(members)


def haproxy_changed(answer: str, command: str) -> None:
    """A runtime API command that changes something answers nothing when it worked, else its words."""
    if answer.strip():
        raise GatewayError(f"HAProxy refused `{command}`: {answer.strip()[:300]}")


# --- vllm-router: its admin API -------------------------------------------------------------------


def read_router_workers(status: int | None, text: str) -> Rotation:
    """``GET /workers``: ``{"workers": [{"url", "load", "is_healthy"}]}``; in rotation when listed
    and healthy, in flight the router's load on it (-1 or absent: it does not say)."""
    doc = _router_json(status, text, "GET /workers")
    workers = doc.get("workers") if isinstance(doc, dict) else None
    if not isinstance(workers, list):
        raise GatewayError(f'vllm-router\'s /workers is not {{"workers": [...]}}: {text[:200]!r}')
    members = {}
    for worker in workers:
        url = worker.get("url") if isinstance(worker, dict) else None
        if not isinstance(url, str):
            raise GatewayError(f"vllm-router's /workers lists a worker without a url: {str(worker)[:200]}")
        load = worker.get("load")
        healthy = worker.get("is_healthy", True)
        in_flight = load if isinstance(load, int) and not isinstance(load, bool) and load >= 0 else None
        members[url] = Member(url, healthy is True, in_flight, "healthy" if healthy is True else "unhealthy")
    return Rotation(members)


def read_router_urls(status: int | None, text: str) -> Rotation:
    """``GET /list_workers`` (routers without ``/workers``): ``{"urls": [...]}``, no loads."""
    doc = _router_json(status, text, "GET /list_workers")
    urls = doc.get("urls") if isinstance(doc, dict) else None
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise GatewayError(f'vllm-router\'s /list_workers is not {{"urls": [...]}}: {text[:200]!r}')
    return Rotation({u: Member(u, True, None, "listed") for u in urls})


def _router_json(status: int | None, text: str, what: str) -> Any:
    if status != 200:
        raise GatewayError(f"vllm-router: {what}: {_said(status, text)}")
    try:
        return json.loads(text)
    except ValueError:
        raise GatewayError(f"vllm-router: {what} is not JSON: {text[:200]!r}") from None


def _said(status: int | None, text: str) -> str:
    return f"no answer ({text.strip()[:300]})" if status is None else f"HTTP {status}: {text.strip()[:300]}"


# --- the adapters -----------------------------------------------------------------------------------


class Adapter:
    """One kind of gateway: its ops and how their answers read. ``state`` may need several ops
    (the command hook is asked per server); changes are one op each, checked by ``check``."""

    def __init__(self, spec: Gateway) -> None:
        self.spec = spec

    def key(self, container: str, url: str) -> str:
        return container

    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        raise NotImplementedError

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        """The op that puts ``server`` into rotation (``into``) or takes it out, and its check."""
        raise NotImplementedError


class HaproxyAdapter(Adapter):
    def key(self, container: str, url: str) -> str:
        return self.spec.server(container)

    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        assert self.spec.socket is not None and self.spec.backend is not None
        op = protocol.gateway_socket(self.spec.socket, "show stat", self.spec.timeout_s)
        backend = self.spec.backend
        return [op], lambda answers: read_haproxy_stat(answers[op], backend)

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        assert self.spec.socket is not None
        # drain: weight 0, so no new request goes to it while those it holds finish (maint would
        # also stop its health checks, and a server coming back would wait for none).
        command = f"set server {self.spec.backend}/{server.key} state {'ready' if into else 'drain'}"
        return protocol.gateway_socket(self.spec.socket, command, self.spec.timeout_s), lambda a: haproxy_changed(
            a, command
        )


class RouterAdapter(Adapter):
    def key(self, container: str, url: str) -> str:
        return url

    @property
    def admin(self) -> str:
        return self.spec.admin or self.spec.url

    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        op = protocol.gateway_http("GET", f"{self.admin}/workers", None, self.spec.timeout_s)
        return [op], lambda answers: read_router_workers(answers[op].status, answers[op].text)

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        path = "add_worker" if into else "remove_worker"
        url = f"{self.admin}/{path}?url={urllib.parse.quote(server.url, safe='')}"
        op = protocol.gateway_http("POST", url, None, self.spec.timeout_s)

        def check(answer: protocol.HttpAnswer) -> None:
            if answer.status != 200:
                raise GatewayError(f"vllm-router: POST /{path} {server.url}: {_said(answer.status, answer.text)}")

        return op, check


class EndpointsFileAdapter(Adapter):
    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        assert self.spec.path is not None
        op = protocol.gateway_endpoints(self.spec.path, "read", None, None, self.spec.timeout_s)
        return [op], lambda answers: Rotation({e.name: Member(e.name, True, None, "listed") for e in answers[op]})

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        assert self.spec.path is not None
        action, url = ("add", server.url) if into else ("remove", None)
        return protocol.gateway_endpoints(self.spec.path, action, server.name, url, self.spec.timeout_s), lambda a: None


def hook_request(action: str, server: Server) -> str:
    """What the command hook reads on stdin: the action and the host (``in``, ``out``, ``status``)."""
    url = urllib.parse.urlsplit(server.url)
    host = {"name": server.name, "url": server.url, "address": url.hostname, "port": url.port}
    return json.dumps({"action": action, "host": host}, sort_keys=True)


def read_hook(output: protocol.Output, action: str, server: Server) -> Member:
    """The hook's answer: exit 0 and, as the last line of its output, ``{"in_rotation": bool,
    "in_flight": int|null}`` (its other lines are its own)."""
    said = output.output.strip()
    if output.returncode != 0:
        raise GatewayError(f"the gateway hook ({action} {server.name}) exited {output.returncode}: {said[-300:]}")
    last = said.splitlines()[-1] if said else ""
    try:
        doc = json.loads(last)
    except ValueError:
        doc = None
    in_rotation = doc.get("in_rotation") if isinstance(doc, dict) else None
    in_flight = doc.get("in_flight") if isinstance(doc, dict) else None
    if not isinstance(in_rotation, bool) or not (
        in_flight is None or (isinstance(in_flight, int) and not isinstance(in_flight, bool) and in_flight >= 0)
    ):
        raise GatewayError(
            f'the gateway hook ({action} {server.name}) must end with {{"in_rotation": true|false, '
            f'"in_flight": N|null}}, said: {last[:200]!r}'
        )
    return Member(server.key, in_rotation, in_flight, "in" if in_rotation else "out")


class CommandAdapter(Adapter):
    def _op(self, action: str, server: Server) -> Op[protocol.Output]:
        return protocol.command(self.spec.command, self.spec.timeout_s, stdin=hook_request(action, server))

    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        ops = {s.key: (s, self._op("status", s)) for s in servers}
        return [op for _, op in ops.values()], lambda answers: Rotation(
            {key: read_hook(answers[op], "status", s) for key, (s, op) in ops.items()}
        )

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        action = "in" if into else "out"

        def check(output: protocol.Output) -> None:
            read_hook(output, action, server)  # its refusal or an unreadable answer raises

        return self._op(action, server), check


ADAPTERS: dict[str, type[Adapter]] = {
    "haproxy": HaproxyAdapter,
    "vllm-router": RouterAdapter,
    "endpoints-file": EndpointsFileAdapter,
    "command": CommandAdapter,
}


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
    target = found[0]
    if target.container.address is None and target.container.connection != "local":
        raise InputError(
            f"{name} needs an address in {inventory.file} (or connection: local): the gateway is reached there",
            file=str(playbook.file),
            key="gateway.runs_on",
        )
    return target


class GatewayClient:
    """The run's gateway: its rotation read, servers taken out and put back, requests sent through
    it, all on the gateway's host. Changes are made one at a time (a run's hosts in flight at once
    would otherwise each count the others as serving), and each is read back."""

    def __init__(self, playbook: Playbook, target: Target, client: AgentClient) -> None:
        assert playbook.gateway is not None
        self.playbook, self.spec, self.target, self.client = playbook, playbook.gateway, target, client
        self.adapter = ADAPTERS[self.spec.kind](self.spec)
        self.changing = threading.Lock()

    def server(self, container: Container) -> Server:
        url = serving.url(self.playbook, container)
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
        ops, read = self.adapter.state(servers)
        answers = self._batch(ops)
        if isinstance(self.adapter, RouterAdapter) and answers[ops[0]].status == 404:
            # A router without /workers (before 0.1.x): its plain list, with no loads.
            op = protocol.gateway_http("GET", f"{self.adapter.admin}/list_workers", None, self.spec.timeout_s)
            answer = self._batch([op])[op]
            return read_router_urls(answer.status, answer.text)
        return read(answers)

    def put(self, server: Server, into: bool, others: Sequence[Server] = ()) -> Member:
        """Take ``server`` out of rotation or put it back, and read it back from the gateway."""
        op, check = self.adapter.change(server, into)
        check(self._batch([op])[op])
        member = self.rotation([server, *others]).of(server)
        if not into and member.in_rotation:
            raise GatewayError(
                f"the {self.spec.kind} gateway still sends traffic to {server.name} ({member.status}) after it was taken out"
            )
        return member

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
