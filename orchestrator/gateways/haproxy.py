"""HAProxy: the runtime API on its stats socket (``level admin``), run on the gateway's host."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.protocol import Op
from orchestrator.errors import GatewayError
from orchestrator.gateways.base import Adapter, Member, Rotation, Server


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


def read_server_address(text: str, backend: str, server: str) -> tuple[str, int]:
    """``show servers state BACKEND``: where HAProxy sends ``server``'s traffic now (its address
    and port). Its answer: a version line, a ``# ``-header naming the columns, a row a server."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 2 or not lines[1].startswith("# "):
        raise GatewayError(f"HAProxy's `show servers state {backend}` did not answer with its table: {text[:200]!r}")
    columns = {name: i for i, name in enumerate(lines[1][2:].split())}
    if not {"be_name", "srv_name", "srv_addr", "srv_port"} <= set(columns):
        raise GatewayError(f"HAProxy's `show servers state` has no srv_addr and srv_port: {lines[1][:200]!r}")
    for line in lines[2:]:
        row = line.split()
        if len(row) < len(columns) or row[columns["be_name"]] != backend or row[columns["srv_name"]] != server:
            continue
        port = row[columns["srv_port"]]
        if not port.isdigit():
            raise GatewayError(f"HAProxy's `show servers state` gives {backend}/{server} port {port!r}")
        return row[columns["srv_addr"]], int(port)
    raise GatewayError(f"HAProxy's backend {backend!r} has no server {server!r} (`show servers state`)")


def haproxy_moved(answer: str, command: str) -> None:
    """``set server B/S addr A port P`` answers what it did ("port changed from '18001' to '18002'",
    "no need to change the port"), each part in turn; anything else is its refusal."""
    said = answer.strip()
    parts = [p.strip() for p in said.split(" by '")[0].split(",")] if said else []
    fine = ("no need to change the addr", "no need to change the port", "IP changed from", "port changed from")
    if not parts or not all(p.startswith(fine) for p in parts):
        raise GatewayError(f"HAProxy refused `{command}`: {said[:300] or 'no answer'}")


def haproxy_changed(answer: str, command: str) -> None:
    """A runtime API command that changes something answers nothing when it worked, else its words."""
    if answer.strip():
        raise GatewayError(f"HAProxy refused `{command}`: {answer.strip()[:300]}")


class HaproxyAdapter(Adapter):
    kind = "haproxy"

    def key(self, container: str, url: str) -> str:
        return self.spec.server(container)

    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        assert self.spec.socket is not None and self.spec.backend is not None
        op = protocol.gateway_socket(self.spec.socket, "show stat", self.spec.timeout_s)
        backend = self.spec.backend
        return [op], lambda answers: read_haproxy_stat(answers[op], backend)

    def rotation(self, servers: Sequence[Server], batch: Callable[[list[Op[Any]]], protocol.Answers]) -> Rotation:
        """The backend's servers; one asked about that the backend does not have is an error, not
        "out of rotation": HAProxy's servers are its configuration's, so the name is wrong (the
        host would be restarted undrained while HAProxy sends users to it under its own name)."""
        found = super().rotation(servers, batch)
        unknown = sorted({s.key for s in servers if s.key not in found.members})
        if unknown:
            raise GatewayError(
                f"HAProxy's backend {self.spec.backend!r} has no server {', '.join(map(repr, unknown))} (it has: "
                f"{', '.join(sorted(found.members)) or 'none'}): name each container's server in gateway.servers"
            )
        return found

    def move(self, server: Server) -> list[tuple[Op[Any], Callable[[Any], None]]]:
        """Send the server's traffic to the address and port of its URL (a release that listens on
        the other port of a host with a standby), then read back where HAProxy sends it. A port
        past 65535 is refused here: HAProxy 2.6 takes it modulo 65536 and says it changed."""
        assert self.spec.socket is not None and self.spec.backend is not None
        address, port = _address(server.url)
        command = f"set server {self.spec.backend}/{server.key} addr {address} port {port}"
        moved = protocol.gateway_socket(self.spec.socket, command, self.spec.timeout_s)
        shown = protocol.gateway_socket(
            self.spec.socket, f"show servers state {self.spec.backend}", self.spec.timeout_s
        )
        backend = self.spec.backend

        def landed(answer: str) -> None:
            found = read_server_address(answer, backend, server.key)
            if found != (address, port):
                raise GatewayError(
                    f"HAProxy sends {backend}/{server.key} to {found[0]}:{found[1]}, not {address}:{port}, after `{command}`"
                )

        return [(moved, lambda a: haproxy_moved(a, command)), (shown, landed)]

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        assert self.spec.socket is not None
        # drain: weight 0, so no new request goes to it while those it holds finish (maint would
        # also stop its health checks, and a server coming back would wait for none).
        command = f"set server {self.spec.backend}/{server.key} state {'ready' if into else 'drain'}"
        return protocol.gateway_socket(self.spec.socket, command, self.spec.timeout_s), lambda a: haproxy_changed(
            a, command
        )


def _address(url: str) -> tuple[str, int]:
    """A server URL's address and port, as HAProxy's runtime API takes them."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or not 0 < port < 65536:
        raise GatewayError(f"a server URL HAProxy can be moved to needs an address and a port of 1-65535: {url!r}")
    return parts.hostname, port
