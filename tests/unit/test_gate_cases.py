"""The gates' golden cases (tests/data/gates/<gate>/*.yaml): an answer in as the agent sends it,
the gate out, read by the gate's own reader through the op's own answer reader. pyinfra tests its
operations and facts this way: a data file a case, nothing started."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.agent import protocol
from orchestrator.config.inventory import Container, SshSettings
from orchestrator.config.playbook import Playbook, load_playbook
from orchestrator.results import GATE_READY, FileState, Gate, HostReport
from orchestrator.rules import gates

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "data" / "gates"
ROOT_DIR, SERVER = "/srv/dflash", "vllm"

Reader = Callable[[Playbook, Any, dict[str, Any], HostReport], None]


def _engine(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    op = protocol.engine_check(ROOT_DIR, SERVER, protocol.ServerCommand(("vllm", "serve"), {}))
    gates.engine.read_engine(op.read(answer), report)


def _health(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    if context.get("verify"):  # verify's reading: the server's status, not a start's health wait
        status = protocol.serving_status(ROOT_DIR, SERVER, playbook.serving.port)
        gates.health.read_serving_status(status.read(answer), report)
        return
    op = gates.health.health_op(playbook, ROOT_DIR, SERVER)
    report.release_id = context.get("release_id")
    gates.health.read_health(op.read(answer), bool(context.get("kept")), report, context.get("last_ready"))


def _build(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    op = protocol.vllm_build(playbook.serving.python, playbook.serving.env)
    gates.build.read_build(playbook, op.read(answer), report)


def _loader(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    op = protocol.loader_view(ROOT_DIR, None, playbook.serving.python, sorted(playbook.drafter.values))
    gates.loader.read_loader(playbook, op.read(answer), report)


def _acceptance(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    op = gates.acceptance.probe_op(playbook)
    gates.acceptance.read_probe(playbook, op.read(answer), report, context.get("last_ready"))


def _gpus(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    gpus = tuple(context.get("gpus", [0]))
    container = Container("gpu", "host", "10.0.0.2", SshSettings(), gpus=gpus)
    op = protocol.gpus(ROOT_DIR, playbook.serving.python)
    gates.gpus.read_gpus(playbook, container, op.read(answer), None, report)


def _files(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    op = protocol.release_verify(ROOT_DIR, gates.files.paths(playbook))
    gates.files.read_verified(playbook, op.read(answer), report, ROOT_DIR)


def _weights(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    assert playbook.drafter is not None
    op = protocol.model_files(ROOT_DIR, "drafter", "/models/drafter", headers=True)
    gates.models.read_weights(playbook, op.read(answer), playbook.drafter.target, report)


def _models(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    read = protocol.model_files(ROOT_DIR, "target", "/m", config=True).read
    found = {role: read(answer[role]) if answer.get(role) is not None else None for role in ("target", "drafter")}
    gates.models.read_models(playbook, found["target"], found["drafter"], report)


def _ready(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    op = protocol.serving_status(ROOT_DIR, SERVER, playbook.serving.port)
    report.release_id = context.get("release_id")
    report.files = [
        FileState(f.dest, f"{ROOT_DIR}/current/{f.dest}", f.sha256, f.sha256, False) for f in playbook.release_files
    ]
    report.gates[GATE_READY] = gates.ready.ready_gate(op.read(answer), report)


def _gate(recorded: dict[str, Any]) -> Gate:
    """A gate as a report's JSON writes it (``Gate.to_json``)."""
    data = {k: v for k, v in recorded.items() if k not in ("ok", "detail", "reason")}
    return Gate(recorded["ok"], recorded["detail"], data, recorded.get("reason", ""))


def _compile_cache(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    # In: the gate the gift wrote before the start, and the start's health gate (its ledger).
    report.gates["compile_cache"] = gates.compile_cache.read_use(_gate(context["given"]), _gate(answer["health"]))


def _speedup(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    # In: each level's pairs (a baseline run, the drafter run beside it) as the store keeps runs.
    su = gates.speedup
    levels = [
        su.paired_level(int(c), [(su.Run.from_json(b), su.Run.from_json(d)) for b, d in pairs])
        for c, pairs in answer["levels"].items()
    ]
    minimum = context["min"]
    verdict = su.judge(
        levels,
        minimum,
        context.get("tau"),
        context.get("min_tau"),
        context.get("k", 0),
        context.get("on_inconclusive", "refuse"),
    )
    outcomes = [lv.outcome(minimum) for lv in levels]
    report.gates["speedup"] = Gate(verdict.ok, verdict.detail, {"outcomes": outcomes}, verdict.reason)


def _gateway(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    # In: the gateway's own answer (HAProxy's `show stat`, vllm-router's /workers) read by its
    # adapter, and whether the host is READY (verify's other gates).
    from orchestrator.errors import GatewayError
    from orchestrator.gateways.base import Server
    from orchestrator.gateways.haproxy import read_haproxy_stat
    from orchestrator.gateways.vllm_router import read_router_workers

    try:
        if "haproxy" in answer:
            rotation = read_haproxy_stat(answer["haproxy"], "vllm")
        else:
            rotation = read_router_workers(200, answer["router_workers"])
    except GatewayError as exc:
        report.gates["gateway"] = gates.gateway.unreachable(str(exc))
        return
    member = rotation.of(Server("host", answer["server"], answer["server"]))
    report.gates["gateway"] = gates.gateway.read_rotation(
        member.in_rotation, member.status, member.in_flight, context["ready"]
    )


def _lint(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    # In: the drafter config (whole, or the playbook's with dotted ``set`` changes) and whether a
    # reference is pinned; out: the gate and the rules that found errors and warnings.
    import copy
    from dataclasses import replace

    assert playbook.drafter is not None
    values = copy.deepcopy(answer.get("drafter", playbook.drafter.values))
    for dotted, value in (answer.get("set") or {}).items():
        *parents, last = dotted.split(".")
        node = values
        for key in parents:
            node = node[key]
        node[last] = value
    drafter = replace(playbook.drafter, values=values)
    if "reference" in answer:
        drafter = replace(drafter, reference=answer["reference"])
    changed = replace(playbook, drafter=drafter)
    problems = gates.lint.lint_playbook(changed)
    gate = gates.lint.lint_gate(changed, problems)
    assert gate is not None
    found = {
        kind: sorted({p.rule for p in problems if p.severity == severity})
        for kind, severity in (("errors", "error"), ("warnings", "warning"))
    }
    report.gates["lint"] = Gate(gate.ok, gate.detail, found, gate.reason)


def _containers(playbook: Playbook, answer: Any, context: dict[str, Any], report: HostReport) -> None:
    # In: LXD's instance (None: LXD answered 404) and the container's inventory entry (on GPU host
    # gpu-a, LXD on its socket); out: the gate, its status, address and the drifted keys.
    import tempfile

    from orchestrator.config.inventory import load_inventory
    from orchestrator.lxd import containers

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "inventory.yaml"
        host = {"address": "192.0.2.10", "lxd": {"endpoint": "local"}, "containers": {"serve-0": context["container"]}}
        path.write_text(yaml.safe_dump({"hosts": {"gpu-a": host}}))
        container = load_inventory(path).containers[0]
    found = containers.read_instance(containers.spec_for(container, playbook.disks), "gpu-a", answer)
    data = {"status": found.status, "address": found.address, "drift": [d.key for d in found.drift]}
    report.gates["containers"] = Gate(found.ok, found.detail, data)


# One reader a gate that has cases; a gate's folder with no row here fails below.
READERS: dict[str, Reader] = {
    "acceptance": _acceptance,
    "ready": _ready,
    "models": _models,
    "weights": _weights,
    "files": _files,
    "gpus": _gpus,
    "engine": _engine,
    "health": _health,
    "build": _build,
    "loader": _loader,
    "compile_cache": _compile_cache,
    "speedup": _speedup,
    "gateway": _gateway,
    "lint": _lint,
    "containers": _containers,
}


def cases() -> list[Path]:
    return sorted(CASES.glob("*/*.yaml"))


@pytest.mark.parametrize("path", cases(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_gate_reads_the_answer_as_recorded(path: Path) -> None:
    case = yaml.safe_load(path.read_text())
    gate = path.parent.name
    playbook = load_playbook(ROOT / "playbooks" / case["playbook"])
    report = HostReport("host")
    expect = case["expect"]
    if "error" in expect:
        with pytest.raises(protocol.AnswerError) as refused:
            READERS[gate](playbook, case["answer"], case.get("context") or {}, report)
        assert expect["error"] in str(refused.value)
        return
    READERS[gate](playbook, case["answer"], case.get("context") or {}, report)
    found = report.gates[gate]
    assert found.ok == expect["ok"], found
    assert found.reason == expect.get("reason", ""), found
    for words in expect.get("detail", []):
        assert words in found.detail, found.detail
    assert {k: found.data.get(k) for k in expect.get("data", {})} == expect.get("data", {}), found.data


def test_every_gate_with_cases_has_a_reader_and_every_case_says_what_it_shows() -> None:
    folders = {p.name for p in CASES.iterdir() if p.is_dir()}
    assert folders == set(READERS)
    assert folders <= {g.name for g in gates.GATES}
    for path in cases():
        assert path.read_text().startswith("# "), f"{path}: its first line says what the case shows"
