"""The vLLM DFlash server of one container, as values: its argv and environment. Pure.

The drafter path is the release's own directory (``<root>/releases/<id>/drafter``), never
``current``: what the gates verified is what the server reads, even while ``current`` moves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.inventory import Container
from orchestrator.playbook import Playbook


@dataclass(frozen=True)
class ServerCommand:
    argv: tuple[str, ...]
    env: dict[str, str]

    def as_op(self, root: str, release_id: str, port: int) -> dict[str, Any]:
        return {
            "op": "launch",
            "root": root,
            "argv": list(self.argv),
            "env": self.env,
            "release_id": release_id,
            "port": port,
        }


def release_dir(playbook: Playbook, release_id: str) -> str:
    return f"{playbook.deploy_root}/releases/{release_id}"


def command(playbook: Playbook, container: Container, release_id: str) -> ServerCommand:
    s = playbook.serving
    if s.python is None or s.target is None:
        raise ValueError("serving.python and serving.target are needed to launch a server")
    tp = s.tensor_parallel_size or max(1, len(container.gpus))
    argv = [
        s.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        s.target,
        "--served-model-name",
        s.model_name,
        "--tensor-parallel-size",
        str(tp),
        "--host",
        s.host,
        "--port",
        str(s.port),
    ]
    if s.speculative:
        spec = {
            "method": "dflash",
            "model": f"{release_dir(playbook, release_id)}/drafter",
            "num_speculative_tokens": s.num_speculative_tokens,
        }
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    argv += list(s.extra_args)
    env = {"HF_HUB_OFFLINE": "1"}
    if container.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in container.gpus)
    env.update(s.env)
    return ServerCommand(tuple(argv), env)


def ready_record(release_id: str, report_gates: dict[str, Any], files: list[dict[str, Any]], pid: int | None) -> bytes:
    """``ready.json``: which release is READY, on what evidence, serving from which process."""
    body = {"release_id": release_id, "pid": pid, "gates": report_gates, "files": files}
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
