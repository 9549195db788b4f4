"""The gateway in front of the servers: a host leaves its rotation before its server stops, and is
READY only once the gateway sends it traffic again.

One module per kind of gateway (``haproxy``, ``vllm_router``, ``endpoints_file``, ``command``),
each an ``Adapter``: the ops that read the rotation, take a server out and put it back (built on
the agent's generic gateway ops, run on the gateway's own host), and the readers of the gateway's
answers, pure and strict (a gateway is not trusted more than a host). ``client.GatewayClient``
runs them through the run's agent client, every call bounded by ``gateway.timeout_s``, and reads
every change back: vllm-router answers "Successfully removed worker" of a worker it never had, so
no adapter takes a gateway's word for a change. ``ADAPTERS`` is the one registry: a kind is one
module and one row here (and its keys, one row of ``config.gateway.KINDS``).
"""

from orchestrator.gateways.base import Adapter
from orchestrator.gateways.command import CommandAdapter
from orchestrator.gateways.endpoints_file import EndpointsFileAdapter
from orchestrator.gateways.haproxy import HaproxyAdapter
from orchestrator.gateways.vllm_router import RouterAdapter

ADAPTERS: dict[str, type[Adapter]] = {
    a.kind: a for a in (RouterAdapter, HaproxyAdapter, EndpointsFileAdapter, CommandAdapter)
}
