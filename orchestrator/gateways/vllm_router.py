"""vllm-router (the vLLM project's router): its admin API over HTTP, from the gateway's host."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.agent import protocol
from orchestrator.agent.protocol import Op
from orchestrator.errors import GatewayError
from orchestrator.gateways.base import Adapter, Member, Rotation, Server, said


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
        raise GatewayError(f"vllm-router: {what}: {said(status, text)}")
    try:
        return json.loads(text)
    except ValueError:
        raise GatewayError(f"vllm-router: {what} is not JSON: {text[:200]!r}") from None


class RouterAdapter(Adapter):
    kind = "vllm-router"
    drops_drained = True  # remove_worker: out of its listing

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
                raise GatewayError(f"vllm-router: POST /{path} {server.url}: {said(answer.status, answer.text)}")

        return op, check

    def rotation(self, servers: Sequence[Server], batch: Callable[[list[Op[Any]]], protocol.Answers]) -> Rotation:
        ops, read = self.state(servers)
        answers = batch(ops)
        if answers[ops[0]].status == 404:
            # A router without /workers (before 0.1.x): its plain list, with no loads.
            op = protocol.gateway_http("GET", f"{self.admin}/list_workers", None, self.spec.timeout_s)
            answer = batch([op])[op]
            return read_router_urls(answer.status, answer.text)
        return read(answers)
