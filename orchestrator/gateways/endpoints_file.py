"""An endpoints file a router reads (one JSON list of the servers in rotation), edited in place on the gateway's host."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.protocol import Op
from orchestrator.gateways.base import Adapter, Member, Rotation, Server


class EndpointsFileAdapter(Adapter):
    kind = "endpoints-file"
    drops_drained = True

    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        assert self.spec.path is not None
        op = protocol.gateway_endpoints(self.spec.path, "read", None, None, self.spec.timeout_s)
        urls = {s.key: s.url for s in servers}

        def read(answers: protocol.Answers) -> Rotation:
            # Listed under its name at another URL (an old address or port), the router sends
            # its users there, not to this server: out of rotation until put back at its own.
            return Rotation({
                e.name: Member(e.name, True, None, "listed")
                if urls.get(e.name, e.url) == e.url
                else Member(e.name, False, None, f"listed at {e.url}, not {urls[e.name]}")
                for e in answers[op]
            })  # fmt: skip

        return [op], read

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        assert self.spec.path is not None
        action, url = ("add", server.url) if into else ("remove", None)
        return protocol.gateway_endpoints(self.spec.path, action, server.name, url, self.spec.timeout_s), lambda a: None
