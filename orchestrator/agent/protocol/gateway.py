"""The ``gateway`` agent module's ops: a gateway asked over its socket or HTTP, an endpoints file
changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from orchestrator.agent.protocol.core import Op, answer_field, answer_items


@dataclass(frozen=True)
class HttpAnswer:
    """gateway_http: what the gateway answered (``status`` None: nothing did, ``text`` says why)."""

    status: int | None
    text: str


@dataclass(frozen=True)
class Endpoint:
    """One server in an endpoints file."""

    name: str
    url: str


def gateway_socket(path: str, command: str, timeout: float) -> Op[str]:
    """One command to a unix socket that answers and closes (HAProxy's runtime API): its answer."""
    request = {"op": "gateway_socket", "path": path, "command": command, "timeout": timeout}
    return Op(request, lambda v: str(answer_field(v, "text", str)), budget_s=timeout)


def gateway_http(method: str, url: str, body: str | None, timeout: float) -> Op[HttpAnswer]:
    """One HTTP exchange with the gateway, from its own host."""
    request = {"op": "gateway_http", "method": method, "url": url, "body": body, "timeout": timeout}
    reader = lambda v: HttpAnswer(answer_field(v, "status", int, optional=True), answer_field(v, "text", str))  # noqa: E731
    return Op(request, reader, budget_s=timeout)


def _endpoints(v: dict[str, Any]) -> tuple[Endpoint, ...]:
    return tuple(
        Endpoint(answer_field(e, "name", str), answer_field(e, "url", str)) for e in answer_items(v, "endpoints")
    )


def gateway_endpoints(
    path: str, action: str, name: str | None, url: str | None, timeout: float
) -> Op[tuple[Endpoint, ...]]:
    """An endpoints file read, or a server added to it or removed from it under its lock: the
    servers it lists after."""
    request = {"op": "gateway_endpoints", "path": path, "action": action, "name": name, "url": url, "timeout": timeout}
    return Op(request, _endpoints, budget_s=timeout)
