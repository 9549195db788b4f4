"""What every gateway adapter shares: servers as the gateway knows them, its rotation, and the
adapter interface. One module per kind beside this one, each registered in ``KINDS``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from orchestrator.agent import protocol
from orchestrator.agent.protocol import Op
from orchestrator.config.gateway import Gateway


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


class Adapter:
    """One kind of gateway: its ops and how their answers read. ``state`` may need several ops
    (the command hook is asked per server); changes are one op each, checked by ``check``.
    ``kind`` is the playbook's ``gateway.kind`` (``config.gateway.KINDS`` says its keys)."""

    kind: ClassVar[str]
    # Whether a server out of rotation drops out of what the gateway lists (an endpoints file, a
    # router's workers): then the listing cannot say how many servers there are, and a capacity
    # floor is waited for, never refused as one that can never be kept (another controller's
    # drained hosts are in neither this run's fleet nor the listing).
    drops_drained: ClassVar[bool] = False

    def __init__(self, spec: Gateway) -> None:
        self.spec = spec

    def key(self, container: str, url: str) -> str:
        return container

    def state(self, servers: Sequence[Server]) -> tuple[list[Op[Any]], Callable[[protocol.Answers], Rotation]]:
        raise NotImplementedError

    def change(self, server: Server, into: bool) -> tuple[Op[Any], Callable[[Any], None]]:
        """The op that puts ``server`` into rotation (``into``) or takes it out, and its check."""
        raise NotImplementedError

    def move(self, server: Server) -> list[tuple[Op[Any], Callable[[Any], None]]]:
        """The ops (each with its check) that make the gateway send ``server``'s traffic to its URL
        where that URL moved (a host whose releases alternate between two ports: the standby keeps
        its port asleep). None for a gateway that knows a server by its URL (vllm-router's worker,
        an endpoints file's entry, the command hook's request): putting it back there is enough."""
        return []

    def rotation(self, servers: Sequence[Server], batch: Callable[[list[Op[Any]]], protocol.Answers]) -> Rotation:
        """Every server the gateway knows now (the command hook: those named), read through ``batch``."""
        ops, read = self.state(servers)
        return read(batch(ops))


def said(status: int | None, text: str) -> str:
    return f"no answer ({text.strip()[:300]})" if status is None else f"HTTP {status}: {text.strip()[:300]}"
