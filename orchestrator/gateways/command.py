"""A command hook: the user's own program, told ``in``, ``out`` or ``status`` on stdin, answers in JSON."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.protocol import Op
from orchestrator.errors import GatewayError
from orchestrator.gateways.base import Adapter, Member, Rotation, Server


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
    kind = "command"

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
