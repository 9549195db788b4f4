"""The agent protocol: the controller builds exactly the agent's operations, and reads answers warily."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import pytest

import remote_agent
from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.config.inventory import Container, SshSettings, Target
from orchestrator.connectors.base import Command, OnStderr, Result, Session
from orchestrator.errors import AgentError, AgentProtocolError
from orchestrator.rules.serving import ServerCommand

PACKAGE = Path(protocol.__file__).parents[2]  # the whole controller


def agent_ops() -> list[str]:
    """The agent's operations in its order, as the host runs it: the packed source of every module."""
    namespace: dict[str, Any] = {"__name__": "dflash-agent"}
    exec(compile(remote_agent.source(), "dflash-agent", "exec"), namespace)
    return list(namespace["OPS"])


def used_builders() -> set[str]:
    """``protocol.<name>(...)`` calls anywhere in the controller outside the protocol package."""
    used = set()
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[:2] == ("agent", "protocol"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "protocol"
            ):
                used.add(node.func.attr)
    return used


def test_the_controller_builds_exactly_the_agents_operations_and_uses_each() -> None:
    assert [spec.name for spec in protocol.OPS] == agent_ops()  # names and order
    assert set(protocol.SPECS) <= used_builders(), set(protocol.SPECS) - used_builders()


def build(name: str) -> protocol.Op[Any]:
    command = ServerCommand(("python3", "-m", "x"), {"A": "1"})
    args: dict[str, tuple[Any, ...]] = {
        "lock": ("/r", "me", 5.0),
        "gpus": ("/r", "/py"),
        "nccl": ("/r", "/py", 2, {"CUDA_VISIBLE_DEVICES": "0,1"}),
        "model_files": ("/r", "drafter", "/models/d"),
        "upload_status": ("/r", [("/models/d/a", 3, "a" * 64)]),
        "upload": ("/r", "/models/d/a", 3, "a" * 64),
        "compile_cache_files": ("/r", ["0123456789"], 1 << 30, 1000),
        "compile_cache_read": ("/r", "0123456789/rank_0_0/x", 0, 1 << 20),
        "compile_cache_place": ("/r", ["0123456789"]),
        "release_apply": ("/r", "R1", (), 3, False),
        "release_verify": ("/r", ["a"]),
        "release_inspect": ("/r", ["a"]),
        "release_list": ("/r",),
        "release_switch": ("/r", "R1"),
        "put": ("/r", "ready.json", b"{}"),
        "loader_view": ("/r", "R1", "/py", ["model_type"]),
        "vllm_build": ("/py",),
        "engine_check": ("/r", "dflash-serve", command),
        "serving_runs": ("/r", "dflash-serve", command, "R1"),
        "checks_start": ("/r", "R1", "/py", ["model_type"], "dflash-serve", command),
        "checks_wait": ("/r", "1796442498-b7e3cb74"),
        "launch": ("/r", "dflash-serve", command, "R1", 8000),
        "stop": ("/r", "dflash-serve"),
        "wait_health": ("/r", "dflash-serve", 8000, "m", 60.0),
        "serving_status": ("/r", "dflash-serve", 8000),
        "command": (["ray", "status"],),
        "probe": (8000, "m", ["p"], 16, 60.0),
        "metrics": (8000, ["vllm:spec_decode_"]),
        "sleep": ("/r", "dflash-serve", 8000, 1, 30.0),
        "wake_up": ("/r", "dflash-serve", 8000, 30.0),
        "load": (8000, "m", ["p"], 64, 4, 16, 120.0),
        "gateway_socket": ("/run/haproxy/admin.sock", "show stat", 10.0),
        "gateway_http": ("GET", "http://127.0.0.1:30000/workers", None, 10.0),
        "gateway_endpoints": ("/etc/dflash/endpoints.json", "read", None, None, 10.0),
    }
    return protocol.SPECS[name].build(*args[name])


@pytest.mark.parametrize("name", sorted(protocol.SPECS))
def test_each_builder_names_its_operation(name: str) -> None:
    assert build(name).name == name


def test_a_batchs_deadline_is_the_command_timeout_plus_what_each_op_may_wait() -> None:
    ops = [build("lock"), build("wait_health"), build("probe"), build("release_list")]
    assert protocol.batch_timeout(ops, 120.0) == 120.0 + 5.0 + 60.0 + 60.0


GOOD = {
    "lock": {"waited_s": 0},
    "release_switch": {
        "release_id": "R1",
        "previous": None,
        "files": [{"path": "a", "remote_path": "/r/a", "sha256": "a" * 64}],
    },
    "stop": {"stopped": None, "gone": True},
    "serving_status": {"server": {"pid": 7, "alive": True, "release_id": "R1"}, "health": 200, "ready": None},
    "model_files": {"path": "/m", "files": [], "missing": [], "tokens": {"5": {"kind": "none", "vocab_size": 9}}},
    "probe": {"before": "", "after": "", "each": [""], "seconds": 1.0},
    "load": {"wall_s": 2, "requests": [{"tokens": 64, "seconds": 1.5, "first_token_s": 0.1, "error": None}]},
}
MODEL_DIR = GOOD["model_files"]
BAD = [
    ("lock", {}, "'waited_s' is missing"),
    ("model_files", {**MODEL_DIR, "tokens": {"x": {"kind": "none"}}}, "'tokens' is not a mapping of token ids"),
    ("model_files", {**MODEL_DIR, "tokens": {"5": {"kind": "evil"}}}, "'kind' is 'evil'"),
    ("model_files", {**MODEL_DIR, "tokens": {"5": {"kind": "added", "roles": [1]}}}, "'roles' is not a list"),
    ("lock", {"waited_s": "soon"}, "'waited_s' is str, expected float"),
    ("stop", {"stopped": True, "gone": True}, "'stopped' is bool, expected int"),
    (
        "release_switch",
        {**GOOD["release_switch"], "files": [{"path": "a", "remote_path": "/r/a", "sha256": "zz"}]},
        "not a sha256",
    ),
    ("release_switch", {**GOOD["release_switch"], "files": "all of them"}, "'files' is str, expected list"),
    ("release_switch", {**GOOD["release_switch"], "files": ["a"]}, "an item of 'files' is str"),
    ("serving_status", {**GOOD["serving_status"], "server": {"pid": 7}}, "'alive' is missing"),
    ("probe", {**GOOD["probe"], "each": []}, "'each' holds 0 scrapes for 1 prompts"),
    ("probe", {**GOOD["probe"], "each": [7]}, "or one that is not a text"),
    ("probe", {**GOOD["probe"], "each": None}, "'each' is missing"),
    ("load", {**GOOD["load"], "requests": [{"tokens": "64", "seconds": 1.0}]}, "'tokens' is str, expected int"),
    ("load", {"requests": []}, "'wall_s' is missing"),
    ("load", {**GOOD["load"], "metrics": "vllm:x 1"}, "'metrics' is str, expected dict"),
    ("load", {**GOOD["load"], "metrics": {"before": "", "after": 7}}, "'after' is int, expected str"),
]


@pytest.mark.parametrize(("name", "answer", "why"), BAD)
def test_answers_of_the_wrong_shape_are_refused_naming_the_field(name: str, answer: Any, why: str) -> None:
    op = build(name)
    assert op.read(GOOD[name]) is not None
    with pytest.raises(protocol.AnswerError, match=why):
        op.read(answer)


class Scripted:
    """A connector that answers with fixed bytes: how a hostile or broken host looks to the client."""

    def __init__(self, stdout: bytes) -> None:
        self.stdout = stdout

    def run(
        self,
        target: Target,
        command: Command,
        stdin: bytes = b"",
        timeout: float | None = None,
        on_stderr: OnStderr | None = None,
    ) -> Result:
        return Result(target.name, command, 0, self.stdout, b"")

    def open(self, target: Target, command: Command) -> Session:
        raise NotImplementedError("a scripted host answers single batches only")

    def close(self) -> None:
        pass


TARGET = Target(Container("h", "gpu", "127.0.0.1", SshSettings()), None)


def test_answers_are_found_by_op_even_two_of_a_kind() -> None:
    server, ray = protocol.stop("/r", "dflash-serve"), protocol.stop("/r", "dflash-ray")
    answer = (
        b'{"v": 1, "results": [{"op": "stop", "ok": true, "result": {"stopped": 12, "gone": true}},'
        b' {"op": "stop", "ok": true, "result": {"stopped": null, "gone": false}}]}'
    )
    answers = AgentClient(Scripted(answer)).batch(TARGET, [server, ray])
    assert answers[server] == protocol.Stopped(12, True) and answers[ray] == protocol.Stopped(None, False)


def test_a_failed_op_carries_the_answers_before_it() -> None:
    lock, listing = protocol.lock("/r", "me", 1.0), protocol.release_list("/r")
    answer = (
        b'{"v": 1, "results": [{"op": "lock", "ok": true, "result": {"waited_s": 0.1}},'
        b' {"op": "release_list", "ok": false, "error": {"op": "release_list", "code": "io", "message": "EIO"}}]}'
    )
    with pytest.raises(AgentError) as info:
        AgentClient(Scripted(answer)).batch(TARGET, [lock, listing])
    assert info.value.failure.code == "io" and info.value.done[lock] == protocol.Locked(0.1)


@pytest.mark.parametrize(
    ("stdout", "why"),
    [
        (b'{"v": 1, "results": []}', "expected 1 results, got 0"),
        (b'{"v": 1, "results": ["lock"]}', "unexpected result"),
        (b'{"v": 1, "results": [{"op": "put", "ok": true, "result": {}}]}', "answer for 'put' where 'lock' was asked"),
        (b'{"v": 1, "results": [{"op": "lock", "ok": true, "result": []}]}', "the answer is list"),
        (b'{"v": 1, "results": [{"op": "lock", "ok": true, "error": "x"}]}', "unexpected result"),
    ],
)
def test_a_malformed_batch_answer_is_a_protocol_error(stdout: bytes, why: str) -> None:
    with pytest.raises(AgentProtocolError, match=why):
        AgentClient(Scripted(stdout)).batch(TARGET, [protocol.lock("/r", "me", 1.0)])


def test_every_operation_has_words_for_progress_and_a_gate() -> None:
    assert all(spec.words and spec.gate for spec in protocol.OPS)


def test_each_op_is_built_in_the_protocol_module_named_for_its_agent_module() -> None:
    """The contract split as the agent is: ``protocol/serving.py`` builds the ops that
    ``remote_agent/serving.py`` runs, and so on for every module."""
    for spec in protocol.OPS:
        assert spec.build.__module__ == f"orchestrator.agent.protocol.{spec.module}", (spec.name, spec.module)
    modules = {p.stem for p in Path(protocol.__file__).parent.glob("*.py")} - {"__init__"}
    assert modules == {spec.module for spec in protocol.OPS}


def test_every_name_the_package_exports_resolves_and_those_loaded_late_from_their_own_module() -> None:
    """``protocol`` loads the serving hosts' modules when one of their names is first used: each
    name it promises is found, and the one its own module defines."""
    for name in protocol.__all__:
        found = getattr(protocol, name)
        home = getattr(found, "__module__", None)
        if home is not None and home.startswith("orchestrator.agent.protocol."):
            assert getattr(importlib.import_module(home), name) is found, name
    later = {n for m in protocol._LATER for n in vars(importlib.import_module(f"{protocol.__name__}.{m}"))}
    assert {n for n in protocol.__all__ if n not in vars(protocol)} <= later
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        protocol.nothing  # noqa: B018
