"""Real gateways for the rollout tests: HAProxy (Debian's package) and vllm-router (PyPI), each
started by the test as a process of its own and ended by its PID; a bounded load generator that
sends requests through the gateway and checks every answer whole; and three servers on this
machine (``connection: local`` containers, each on its own loopback address, 127.0.0.11-13).

The servers are the stand-in of ``tests/unit/standin_vllm.py``: these tests are about the
rollout's protocol with the gateway (drain, in-flight, graceful stop, admission), which the
stand-in honours as vLLM does (``--shutdown-timeout``: finish what it holds, else cut it;
``vllm:num_requests_running``, ``vllm:request_success_total``); each request takes
``STANDIN_TOKEN_S`` a token, so that requests are in flight when a server stops.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config.playbook import Playbook, load_playbook
from orchestrator.deployment import Deployment
from orchestrator.engine.runner import RunOptions
from orchestrator.results import RunReport
from tests.unit.localbox import DRAFTER_CONFIG, GOOD_MASK, K, alive, free_port, serving_side

HOSTS = {"g1": "127.0.0.11", "g2": "127.0.0.12", "g3": "127.0.0.13"}
# A load's request of 32 tokens takes 0.4 s: a few are always in flight under load. The gate's
# probe (5 prompts of 32 tokens, one at a time) takes 2 s a host: at 0.05 s a token (8-token loads)
# it took 8 s of every host's deploy, a third of these tests' time.
TOKEN_S = 0.0125
LOAD_TOKENS = 32
OPTIONS = RunOptions(forks=4, lock_timeout=10.0)


def wait_for(what: str, check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/")
        conn.getresponse().read()
        return True
    except OSError:
        return False


@dataclass
class Haproxy:
    """HAProxy in front of the three servers: round robin, /health checked every 200 ms (two failed
    checks take a server out, one passed puts it back)."""

    dir: Path
    port: int
    server_port: int
    level: str = "admin"
    proc: subprocess.Popen[bytes] | None = None
    hosts: dict[str, str] = field(default_factory=lambda: dict(HOSTS))

    @property
    def socket(self) -> Path:
        return self.dir / "haproxy.sock"

    def start(self) -> Haproxy:
        servers = "\n".join(
            f"    server {name} {address}:{self.server_port} check" for name, address in self.hosts.items()
        )
        config = f"""global
    stats socket {self.socket} mode 600 level {self.level}
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    # A check's answer may be slow on a loaded machine (a vLLM starting beside the one that serves,
    # another worker's tests): timed out at ``inter`` (HAProxy's default), one slow /health took the
    # only server left out of rotation during a rollout, and HAProxy answered 503. A stopped server
    # still fails its checks at once (connection refused).
    timeout check 5s
frontend users
    bind 127.0.0.1:{self.port}
    default_backend vllm
backend vllm
    balance roundrobin
    option httpchk GET /health
    default-server inter 200ms fall 2 rise 1
{servers}
"""
        (self.dir / "haproxy.cfg").write_text(config)
        self.socket.unlink(missing_ok=True)  # an earlier HAProxy's, in the same directory
        self.proc = subprocess.Popen(
            [shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", str(self.dir / "haproxy.cfg")],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "haproxy.log", "wb"),  # noqa: SIM115 - the process owns it
        )
        wait_for("HAProxy's stats socket", self._answers)
        return self

    def _answers(self) -> bool:
        try:
            return bool(self.command("show info"))
        except OSError:
            return False

    def command(self, line: str) -> str:
        import socket

        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def status(self) -> dict[str, str]:
        text = self.command("show stat")
        head, *rows = text.lstrip("# ").splitlines()
        columns = head.split(",")
        out = {}
        for row in rows:
            values = dict(zip(columns, row.split(","), strict=False))
            if values.get("pxname") == "vllm" and values.get("svname") in self.hosts:
                out[values["svname"]] = values["status"]
        return out

    def drained(self) -> dict[str, bool]:
        """Each server's admin state as `show servers state` gives it: drained by an operator (the
        SRV_ADMF_DRAIN bit, 0x08), whatever its health checks say."""
        out = {}
        for line in self.command("show servers state vllm").splitlines()[2:]:
            fields = line.split()
            if len(fields) > 6:
                out[fields[3]] = bool(int(fields[6]) & 0x08)
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)

    @contextlib.contextmanager
    def following(self, endpoints: Path) -> Iterator[None]:
        """HAProxy as a router that watches an endpoints file: every 10 ms the file's names are
        put in rotation (``ready``) and the rest drained (their requests finish, no new ones), as
        a file-discovery router does. Without it the endpoints-file tests sent their admission
        requests round robin to a host another run had just stopped (HTTP 502: the file said it
        was out, HAProxy did not know the file)."""
        done = threading.Event()
        states: dict[str, str] = {}

        def follow() -> None:
            while not done.wait(0.01):
                try:
                    listed = {e["name"] for e in json.loads(endpoints.read_text())["endpoints"]}
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # not written yet: the file is renamed into place whole
                for name in self.hosts:
                    state = "ready" if name in listed else "drain"
                    if states.get(name) != state:
                        self.command(f"set server vllm/{name} state {state}")
                        states[name] = state

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(10)
            for name in self.hosts:  # as the fixture made it, for what the test does next
                self.command(f"set server vllm/{name} state ready")


@dataclass
class Router:
    """vllm-router (the vLLM project's router, from PyPI) with no workers: the deploy adds them."""

    dir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Router:
        binary = Path(sys.executable).with_name("vllm-router")
        self.proc = subprocess.Popen(
            [
                str(binary),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--policy",
                "round_robin",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--worker-startup-timeout-secs",
                "20",
                "--health-check-interval-secs",
                "1",
            ],
            stdout=open(self.dir / "router.log", "wb"),  # noqa: SIM115 - the process owns it
            stderr=subprocess.STDOUT,
        )
        wait_for("vllm-router's admin API", lambda: self.workers() is not None)
        return self

    def workers(self) -> list[str] | None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/list_workers")
            return list(json.loads(conn.getresponse().read())["urls"])
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)


@dataclass
class Load:
    """Clients sending completions through the gateway until stopped, each answer checked whole
    (HTTP 200 and every token asked for): what was sent, served and lost."""

    port: int
    clients: int = 6
    tokens: int = LOAD_TOKENS
    pause: float = 0.0  # each client's pace: seconds between its requests (0: back to back)
    sent: int = 0
    served: int = 0
    lost: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _one(self) -> None:
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": self.tokens, "ignore_eos": True})
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            # every token asked for: vLLM's count of them (the stand-in writes a character a token)
            done = json.loads(data)["usage"]["completion_tokens"] if response.status == 200 else 0
            ok = response.status == 200 and done == self.tokens
            why = f"HTTP {response.status}: {data[:80]!r}" if not ok else ""
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.sent += 1
            if ok:
                self.served += 1
            else:
                self.lost.append(why)

    def start(self) -> Load:
        def client() -> None:
            while not self._stop.is_set():
                self._one()
                self._stop.wait(self.pause)

        self._threads = [threading.Thread(target=client, daemon=True) for _ in range(self.clients)]
        for t in self._threads:
            t.start()
        wait_for("the first answers through the gateway", lambda: self.served >= 3 * self.clients)
        return self

    def stop(self) -> Load:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        return self


@dataclass
class Fleet:
    """Three servers and a gateway host on this machine, and playbooks for them."""

    dir: Path
    port: int

    @property
    def inventory(self) -> Path:
        return self.dir / "inventory.yaml"

    def root(self, name: str) -> Path:
        return self.dir / "roots" / name

    def playbook(
        self, gateway: dict[str, Any] | None, notes: str = "release 1\n", name: str = "pb", **top: Any
    ) -> Playbook:
        (self.dir / "drafter.json").write_text(json.dumps(DRAFTER_CONFIG, indent=2) + "\n")
        (self.dir / f"{name}-notes.txt").write_text(notes)
        book: dict[str, Any] = {
            "name": name,
            "targets": list(HOSTS),
            "deploy_root": "/nonexistent/overridden-per-container",
            "keep_releases": 3,
            "files": [{"src": f"{name}-notes.txt", "dest": "notes.txt"}],
            "drafter": {"config": "drafter.json", "target_config": "target/config.json"},
            "serving": {
                "python": str(self.dir / "bin" / "python"),
                "target": str(self.dir / "target"),
                "model_name": "tiny",
                "num_speculative_tokens": K,
                "host": "address",
                "port": self.port,
                "startup_timeout": 30,
                "env": {"STANDIN_GOOD_MASK": str(GOOD_MASK), "STANDIN_TOKEN_S": str(TOKEN_S)},
            },
            "gates": {"acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32}},
            "rollout": {"batch_size": 1},
            **top,
        }
        if gateway is not None:
            book["gateway"] = gateway
        path = self.dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(book))
        return load_playbook(path)

    def deploy(self, playbook: Playbook) -> RunReport:
        from orchestrator.config.inventory import load_inventory

        return Deployment(playbook, load_inventory(self.inventory), OPTIONS).deploy()

    def verify(self, playbook: Playbook) -> RunReport:
        from orchestrator.config.inventory import load_inventory

        return Deployment(playbook, load_inventory(self.inventory), OPTIONS).verify()

    def stop(self, playbook: Playbook) -> RunReport:
        from orchestrator.config.inventory import load_inventory

        return Deployment(playbook, load_inventory(self.inventory), OPTIONS).stop()

    def watch_round(self, playbook: Playbook) -> dict[str, Any]:
        """One watch round: each host's round, by name."""
        from orchestrator.config.inventory import load_inventory

        watcher = Deployment(playbook, load_inventory(self.inventory), OPTIONS).watcher()
        try:
            rounds, _ = watcher.round()
        finally:
            watcher.close()
        return {r.host: r for r in rounds}

    def pid(self, name: str) -> int:
        return int(json.loads((self.root(name) / "run" / "dflash-serve.json").read_text())["pid"])


def write_inventory(directory: Path, servers: dict[str, str]) -> None:
    """``connection: local`` containers on their loopback addresses, each with its deploy root under
    ``directory/roots``, and the gateway's host ``gw``."""
    containers: dict[str, Any] = {
        name: {"connection": "local", "address": address, "deploy_root": str(directory / "roots" / name)}
        for name, address in servers.items()
    }
    containers["gw"] = {"connection": "local", "address": "127.0.0.1", "deploy_root": str(directory / "roots" / "gw")}
    for c in containers.values():
        c["python"] = sys.executable
    (directory / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {"this-box": {"containers": containers}}}))


def end_servers(directory: Path) -> None:
    """End what the runs started under ``directory/roots``, by the pid each recorded."""
    for pidfile in directory.glob("roots/*/run/*.json"):
        pid = json.loads(pidfile.read_text())["pid"]
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def make_fleet(tmp_path: Path) -> Iterator[Fleet]:
    serving_side(tmp_path)
    write_inventory(tmp_path, HOSTS)
    yield Fleet(tmp_path, free_port())
    end_servers(tmp_path)


def haproxy_gateway(proxy: Haproxy) -> dict[str, object]:
    return {
        "kind": "haproxy",
        "runs_on": "gw",
        "url": f"http://127.0.0.1:{proxy.port}",
        "socket": str(proxy.socket),
        "backend": "vllm",
    }


def by_name(report: RunReport) -> dict[str, object]:
    return {h.name: h for h in report.hosts}


def failures(report: RunReport) -> dict[str, str]:
    return {h.name: f"{h.failed_gate}: {h.gates[h.failed_gate].detail}" for h in report.hosts if h.failed_gate}
