"""The playbook's ``gateway:`` block: what sends users' requests to the servers, typed, with one
row per kind of gateway (``KINDS``: the keys it takes and those it needs). Each kind's adapter is
one module of ``orchestrator.gateways``, registered there under the same name."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field

from orchestrator.config.yamlsource import Field


@dataclass(frozen=True)
class GatewayKind:
    """One kind of gateway as the playbook writes it: its own keys beside ``kind``, ``runs_on``,
    ``url`` and ``timeout_s``, and which of them it cannot do without."""

    name: str
    keys: tuple[str, ...]
    required: tuple[str, ...] = ()


KINDS = {
    k.name: k
    for k in (
        GatewayKind("vllm-router", ("admin",)),
        GatewayKind("haproxy", ("socket", "backend", "servers"), ("socket", "backend")),
        GatewayKind("endpoints-file", ("path",), ("path",)),
        GatewayKind("command", ("command",), ("command",)),
    )
}
KIND_KEYS = frozenset(key for k in KINDS.values() for key in k.keys)
# HAProxy's runtime API takes a line of commands split at ';' and spaces: a backend or server name
# is a plain identifier, checked here so that no name can carry a second command.
_HAPROXY_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class Gateway:
    """What sends users' requests to the servers: the adapter, where it runs (an inventory container,
    reached as hosts are) and how it is told that a host leaves or comes back."""

    kind: str
    runs_on: str  # the inventory container the gateway runs on (``connection: local`` for this machine)
    url: str  # where clients send requests, as seen from ``on``: READY's probe goes through it
    admin: str | None = None  # vllm-router: its admin API (default: ``url``)
    socket: str | None = None  # haproxy: the runtime API's unix socket
    backend: str | None = None  # haproxy: the backend that holds the servers
    servers: dict[str, str] = field(default_factory=dict)  # haproxy: container -> server name
    path: str | None = None  # endpoints-file: the file the router reads
    command: tuple[str, ...] = ()  # command: the hook's argv
    timeout_s: float = 10.0  # one call to the gateway

    def server(self, container: str) -> str:
        """The gateway's name for a container's server (HAProxy's server name, else the container's)."""
        return self.servers.get(container, container)


def _http_url(f: Field) -> str:
    url: str = f.str()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.query or parts.fragment or parts.username:
        raise f.error(f"expected http://HOST:PORT (as seen from the gateway's host), got {url!r}")
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise f.error(f"{url!r}: {exc}") from None
    host = parts.hostname
    if not (host.isascii() and host.isprintable()):  # as every address the tool is given (Field.address)
        raise f.error(f"{url!r}: {host!r} is not an IP address or a host name (ASCII letters, digits, '-' and '.')")
    return url.rstrip("/")


def parse_gateway(f: Field, has_target: bool) -> Gateway:
    """The playbook's ``gateway:`` block, typed; a key its kind does not take is named."""
    f.mapping({"kind", "runs_on", "url", "timeout_s"} | KIND_KEYS, required=frozenset({"kind", "runs_on", "url"}))
    kind = f["kind"].str()
    if kind not in KINDS:
        raise f["kind"].error(f"expected one of {', '.join(KINDS)}")
    if not has_target:
        raise f.error("a gateway sends traffic to servers: the playbook needs serving.target")
    own = KINDS[kind]
    for key in own.required:
        if key not in f:
            raise f.error(f"a {kind} gateway needs '{key}'")
    for key in sorted(KIND_KEYS - set(own.keys)):
        if key in f:
            raise f[key].error(f"not a key of a {kind} gateway (its keys: {', '.join(own.keys)})")
    servers = f["servers"].str_map({})
    for name in [f["backend"].str(None), *servers.values()]:
        if name is not None and not _HAPROXY_NAME.fullmatch(name):
            raise f.error(f"{name!r} is not an HAProxy name (letters, digits, '_.:-')")
    seen: dict[str, str] = {}
    for container, name in servers.items():
        if name in seen:
            # Draining one would take the other's server out, and each would be judged by the other's state.
            raise f["servers"][container].error(f"server {name!r} is {seen[name]}'s too: one container, one server")
        seen[name] = container
    for key in ("socket", "path"):
        if key in f and not f[key].str().startswith("/"):
            raise f[key].error("expected an absolute path on the gateway's host")
    command = tuple(f["command"].str_list(()))
    if "command" in f and not command:
        raise f["command"].error("expected the hook's argv: [program, args...]")
    return Gateway(
        kind=kind,
        runs_on=f["runs_on"].str(),
        url=_http_url(f["url"]),
        admin=_http_url(f["admin"]) if "admin" in f else None,
        socket=f["socket"].str(None),
        backend=f["backend"].str(None),
        servers=servers,
        path=f["path"].str(None),
        command=command,
        timeout_s=f["timeout_s"].seconds(Gateway.timeout_s, minimum=1),
    )
