"""The gpus gate's judgement on what real H200s said (tests/data/gpu, recorded by scripts/gpu-check).

No GPU here: every input is nvidia-smi's or the NCCL preflight's recorded output from real H200
machines (one GPU, and two joined by NVLink); where a case could not be produced there (an old
driver, a PCI pin elsewhere), the recorded text is changed in one named field and the test says
which.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agent import protocol
from orchestrator.config.inventory import Container, ContainerLxd, SshSettings
from orchestrator.config.playbook import Playbook, load_playbook
from orchestrator.errors import InputError
from orchestrator.results import GATE_GPUS, Gate, HostReport
from orchestrator.rules import gates
from orchestrator.rules.gates import gpus
from remote_agent import checks as agent

H200 = Path(__file__).resolve().parent.parent / "data" / "gpu" / "h200"
H200X2 = H200.with_name("h200x2")
TWO = (H200X2 / "clean-gpus.csv").read_text()
TWO_HOLDER = (H200X2 / "holder-gpus.csv").read_text()
TWO_HOLDER_APPS = (H200X2 / "holder-apps.csv").read_text()
CLEAN = (H200 / "clean-gpus.csv").read_text()
HOLDER = (H200 / "holder-gpus.csv").read_text()
HOLDER_APPS = (H200 / "holder-apps.csv").read_text()
HOLDER_PID = int((H200 / "holder-pid.txt").read_text())
UUID = "GPU-d736370c-cd84-6fd8-5016-bdf1328fa481"


def files_only(tmp_path: Path, extra: str = "") -> Playbook:
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "pb.yaml").write_text(
        "name: gpu\ntargets: [all]\ndeploy_root: /srv/dflash\nfiles:\n  - {src: a.txt, dest: a.txt}\n" + extra
    )
    return load_playbook(tmp_path / "pb.yaml")


def serving(pb: Playbook, tp: int | None = 1, args: tuple[str, ...] = ()) -> Playbook:
    """The same playbook with a server to launch (a target model, TP, vLLM's arguments)."""
    s = replace(pb.serving, python="/opt/vllm/bin/python", target="/models/t", tensor_parallel_size=tp, extra_args=args)
    return replace(pb, serving=s)


def container(gpus_: tuple[int, ...] = (0,), lxd: ContainerLxd | None = None) -> Container:
    return Container("gpu0", "h200", "127.0.0.1", SshSettings(), gpus=gpus_, lxd=lxd)


def judge(pb: Playbook, c: Container, csv: str = CLEAN, apps: str = "", ours: set[int] | None = None,
          torch: str | None = "13.0", nodes: int = 1) -> list[str]:  # fmt: skip
    return gpus.judge(pb, c, gpus.parse_gpus(csv), gpus.parse_apps(apps), ours or set(), torch, nodes)


def test_the_recorded_h200_parses_to_its_numbers() -> None:
    [gpu] = gpus.parse_gpus(CLEAN)
    assert (gpu.index, gpu.uuid, gpu.name, gpu.pci) == (0, UUID, "NVIDIA H200", "00000000:00:06.0")
    assert (gpu.total_mib, gpu.used_mib, gpu.free_mib) == (143771, 0, 143156)
    assert (gpu.driver, gpu.compute_mode) == ("580.159.04", "Default")
    assert gpus.parse_apps((H200 / "clean-apps.csv").read_text()) == []
    [app] = gpus.parse_apps(HOLDER_APPS)
    assert (app.pid, app.gpu_uuid, app.used_mib) == (HOLDER_PID, UUID, 41570)
    assert app.name == "/opt/torch/.venv/bin/python3"


def test_a_free_h200_passes_files_only_and_serving(tmp_path: Path) -> None:
    pb = files_only(tmp_path)
    assert judge(pb, container()) == []
    assert judge(serving(pb), container()) == []
    assert gpus.describe(gpus.parse_gpus(CLEAN), "13.0") == (
        "1 x NVIDIA H200 (driver 580.159.04, torch CUDA 13.0; 0: 143156 MiB free)"
    )


def test_a_process_that_is_not_ours_is_named_with_its_pid_and_memory(tmp_path: Path) -> None:
    pb = serving(files_only(tmp_path), args=("--gpu-memory-utilization", "0.5"))
    problems = judge(pb, container(), HOLDER, HOLDER_APPS)
    assert problems == [
        f"GPU 0 is used by another process: pid {HOLDER_PID} (/opt/torch/.venv/bin/python3) holds 41570 MiB"
    ]
    # the same process, recorded as the server we started: the launch stops it, its memory is ours
    assert judge(pb, container(), HOLDER, HOLDER_APPS, ours={HOLDER_PID}) == []
    # and with vLLM's default 0.9 the memory check would pass for ours only because it is ours
    assert judge(serving(files_only(tmp_path)), container(), HOLDER, HOLDER_APPS, ours={HOLDER_PID}) == []


def test_free_memory_below_what_gpu_memory_utilization_asks_fails_with_the_numbers(tmp_path: Path) -> None:
    pb = files_only(tmp_path)
    # 101578 MiB free of 143771 (40 GiB held): vLLM's default 0.9 asks 129393
    default = judge(serving(pb), container(), HOLDER, "")
    assert default == ["GPU 0 has 101578 MiB free of 143771; --gpu-memory-utilization 0.9 asks 129393"]
    assert judge(serving(pb, args=("--gpu-memory-utilization=0.7",)), container(), HOLDER) == []
    assert judge(serving(pb, args=("--gpu-memory-utilization", "0.75")), container(), HOLDER) == [
        "GPU 0 has 101578 MiB free of 143771; --gpu-memory-utilization 0.75 asks 107828"
    ]
    assert judge(pb, container(), HOLDER) == []  # files only: nothing will load on it


def test_fewer_gpus_than_the_inventory_or_the_parallel_sizes_need(tmp_path: Path) -> None:
    pb = serving(files_only(tmp_path), tp=2)
    # a plain host: GPU 1 is promised and not there
    assert judge(pb, container((0, 1))) == ["GPU 1 of the inventory is not seen (seen: [0])"]
    # an LXD container counts what LXD gave it (it renumbers from 0)
    assert judge(pb, container((0, 1), ContainerLxd())) == ["the container sees 1 GPUs, the inventory gives it 2"]
    # TP 2 on a node the inventory gives one GPU
    assert judge(pb, container((0,))) == [
        "tensor x pipeline parallel needs 2 GPUs on this node, the inventory gives it 1"
    ]
    # TP 2 x PP 2 over two nodes: two GPUs a node
    two = replace(pb, serving=replace(pb.serving, pipeline_parallel_size=2))
    assert judge(two, container((0, 1)), TWO, nodes=2) == []
    assert judge(two, container((0,)), nodes=2) == [
        "tensor x pipeline parallel needs 2 GPUs on this node, the inventory gives it 1"
    ]


def test_a_gpu_pinned_by_pci_address_must_be_the_one_seen(tmp_path: Path) -> None:
    pb = files_only(tmp_path)
    # LXD and lspci write the address without nvidia-smi's 8-digit domain: the same GPU
    assert judge(pb, container((0,), ContainerLxd(gpu_pci=("0000:00:06.0",)))) == []
    assert judge(pb, container((0,), ContainerLxd(gpu_pci=("00:06.0",)))) == []
    assert judge(pb, container((0,), ContainerLxd(gpu_pci=("0000:17:00.0",)))) == [
        "GPU 0 is at PCI 00000000:00:06.0, the inventory pins 0000:17:00.0"
    ]


def test_a_driver_older_than_the_serving_torch_cuda_needs(tmp_path: Path) -> None:
    """The driver field of the recorded line is rewritten to 575.57.08 (CUDA 12.9's driver)."""
    pb, c = serving(files_only(tmp_path)), container()
    old = CLEAN.replace("580.159.04", "575.57.08")
    assert judge(pb, c, old, torch="13.0") == [
        "driver 575.57.08 is older than the serving torch's CUDA 13.0 needs (>= 580.65.06)"
    ]
    assert judge(pb, c, old, torch="12.8") == []  # CUDA 12 runs on any 12.x-era driver >= 525.60.13
    assert judge(pb, c, CLEAN.replace("580.159.04", "470.256.02"), torch="12.1") == [
        "driver 470.256.02 is older than the serving torch's CUDA 12.1 needs (>= 525.60.13)"
    ]
    assert judge(pb, c, CLEAN, torch="unknown") == []  # a torch whose version file says nothing


def test_a_serving_python_without_torch_or_with_a_cpu_build_cannot_use_the_gpus(tmp_path: Path) -> None:
    pb = serving(files_only(tmp_path))
    assert judge(pb, container(), torch="") == ["the serving python /opt/vllm/bin/python has no torch"]
    assert judge(pb, container(), torch="None") == [
        "the serving torch is a CPU build (torch.version.cuda is None): it cannot use these GPUs"
    ]
    assert judge(pb, container(), torch=None) == []  # no serving python: nothing to ask


def report_of(pb: Playbook, c: Container, facts: protocol.GpuFacts, nccl: protocol.AllReduce | None = None,
              failed: Gate | None = None) -> HostReport:  # fmt: skip
    report = HostReport("gpu0")
    gates.gpus.read_gpus(pb, c, facts, nccl, report, 1, failed)
    return report


def test_the_gate_reports_every_gpu_in_json_and_fails_without_nvidia_smi(tmp_path: Path) -> None:
    pb = files_only(tmp_path)
    report = report_of(pb, container(), protocol.GpuFacts(False, CLEAN, "", (), "13.0"))
    assert report.gates[GATE_GPUS].ok
    [gpu] = report.to_json("deploy")["gpus"]
    assert gpu["memory_free_mib"] == 143156 and gpu["pci"] == "00000000:00:06.0"
    missing = report_of(pb, container((0, 1)), protocol.GpuFacts(True))
    assert not missing.gates[GATE_GPUS].ok
    assert missing.gates[GATE_GPUS].detail == "no nvidia-smi in the container, but the inventory gives it GPUs [0, 1]"


@pytest.mark.parametrize(
    "garbage",
    ["0, GPU-x, NVIDIA H200\n", "zero, GPU-x, H200, 0:0.0, 1, 1, 1, 580.1, Default\n", "<html>error</html>\n"],
)
def test_nvidia_smi_output_that_is_not_the_query_fails_the_gate_saying_so(tmp_path: Path, garbage: str) -> None:
    report = report_of(files_only(tmp_path), container(), protocol.GpuFacts(False, garbage, "", (), None))
    gate = report.gates[GATE_GPUS]
    assert not gate.ok and gate.detail.startswith("nvidia-smi's answer could not be read: unexpected")


def recorded(name: str, machine: Path = H200) -> dict[str, Any]:
    return json.loads((machine / name).read_text())


def test_the_nccl_preflight_answer_is_read_and_judged_against_the_floor(tmp_path: Path) -> None:
    """Two H200s over NVLink: 297.4 GB/s; the same kept off peer-to-peer: 27.3 GB/s."""
    one = protocol.nccl("/srv/dflash", "python3", 1, {}).read(recorded("nccl.json")["value"])
    assert (one.gpus, one.right, one.nccl, one.busbw_gbps) == (1, True, "2.28.9", 0.0)  # one rank: no bus
    two = protocol.nccl("/srv/dflash", "python3", 2, {}).read(recorded("nccl.json", H200X2)["value"])
    p2p_off = protocol.nccl("/srv/dflash", "python3", 2, {}).read(recorded("nccl-p2p-off.json", H200X2)["value"])
    assert (two.gpus, two.right, round(two.busbw_gbps, 1), round(p2p_off.busbw_gbps, 1)) == (2, True, 297.4, 27.3)
    pb = serving(files_only(tmp_path, "gates:\n  nccl: {min_busbw_gbps: 100}\n"), tp=2)
    facts = protocol.GpuFacts(False, TWO, "", (), "13.0")
    gate = report_of(pb, container((0, 1)), facts, two).gates[GATE_GPUS]
    assert gate.ok and gate.data == {"busbw_gbps": 297.4, "nccl": "2.28.9"}
    assert gate.detail == (
        "2 x NVIDIA H200 (driver 580.159.04, torch CUDA 13.0; 0: 143156 MiB free, 1: 143156 MiB free); "
        "NCCL 2.28.9 all-reduce over 2 GPUs: 297.4 GB/s bus bandwidth"
    )
    slow = report_of(pb, container((0, 1)), facts, p2p_off).gates[GATE_GPUS]
    assert not slow.ok and slow.detail == "the all-reduce reached 27.3 GB/s bus bandwidth, below 100"
    assert report_of(serving(files_only(tmp_path), tp=2), container((0, 1)), facts, p2p_off).gates[GATE_GPUS].ok
    wrong = report_of(pb, container((0, 1)), facts, replace(two, right=False)).gates[GATE_GPUS]
    assert not wrong.ok and wrong.detail == "the all-reduce over 2 GPUs gave a wrong sum"
    skipped = report_of(pb, container((0, 1)), facts, protocol.AllReduce("our server holds the GPUs"))
    assert (
        skipped.gates[GATE_GPUS].ok
        and "NCCL preflight skipped: our server holds the GPUs" in skipped.gates[GATE_GPUS].detail
    )


def test_an_nccl_error_or_hang_fails_the_gate_with_nccls_own_words(tmp_path: Path) -> None:
    pb = serving(files_only(tmp_path), tp=2)
    facts = protocol.GpuFacts(False, TWO, "", (), "13.0")
    for name, words in (("nccl-error.json", "Bootstrap : no socket interface found"), ("nccl-timeout.json", "a hang")):
        answer = recorded(name, H200X2)
        failed = Gate(False, str(answer["message"]))
        gate = report_of(pb, container((0, 1)), facts, None, failed).gates[GATE_GPUS]
        assert not gate.ok and words in gate.detail
    # problems with the GPUs themselves come first: the preflight's failure says nothing more then
    busy = protocol.GpuFacts(False, TWO_HOLDER, TWO_HOLDER_APPS, (), "13.0")
    gate = report_of(pb, container((0, 1)), busy, None, Gate(False, "nccl: hang")).gates[GATE_GPUS]
    assert (
        gate.detail
        == "GPU 0 is used by another process: pid 897 (/opt/torch/.venv/bin/python3) holds 41570 MiB; "
        + ("GPU 0 has 101578 MiB free of 143771; --gpu-memory-utilization 0.9 asks 129393")
    )


@pytest.mark.parametrize("machine", [H200, H200X2])
def test_nccls_words_are_found_in_a_failed_runs_output(machine: Path) -> None:
    """One rank's failure, and two ranks' (with a C++ stack of 20 frames from the other rank)."""
    said = agent.nccl_said((machine / "nccl-error.out").read_text())
    assert said == (
        "Bootstrap : no socket interface found / torch.distributed.DistBackendError: NCCL error in: "
        "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3135, invalid usage "
        "(run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9"
    )
    assert agent.nccl_said("Segmentation fault\n") == "Segmentation fault"


def test_the_preflight_is_asked_only_for_more_than_one_gpu_with_a_serving_python(tmp_path: Path) -> None:
    pb = files_only(tmp_path, "gates:\n  nccl: {timeout_s: 30}\n")
    assert gates.gpus.GpuChecks(pb, "/srv/dflash", container(())).ops == []  # a CPU deployment: no gate
    one = gates.gpus.GpuChecks(serving(pb), "/srv/dflash", container((0,)))
    assert [op.request["op"] for op in one.ops] == ["gpus"]
    two = gates.gpus.GpuChecks(serving(pb, tp=2), "/srv/dflash", container((2, 3)))
    assert [op.request["op"] for op in two.ops] == ["gpus", "nccl"]
    nccl = two.ops[1].request
    assert (nccl["gpus"], nccl["env"], nccl["timeout"], nccl["python"]) == (
        2, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}, 30.0, "/opt/vllm/bin/python"
    )  # fmt: skip
    assert two.ops[1].budget_s == 40.0  # the timeout, plus the start


@pytest.mark.parametrize(
    ("nccl", "says"),
    [
        ("{min_busbw_gbps: .nan}", "min_busbw_gbps"),
        ("{min_busbw_gbps: -1}", "min_busbw_gbps"),
        ("{timeout_s: 0}", "timeout_s"),
        ("{timeout_s: '60'}", "timeout_s"),
        ("{timeout: 60}", "timeout"),
    ],
)
def test_bad_nccl_settings_are_refused_naming_the_key(tmp_path: Path, nccl: str, says: str) -> None:
    with pytest.raises(InputError) as refused:
        files_only(tmp_path, f"gates:\n  nccl: {nccl}\n")
    assert f"gates.nccl.{says}" in str(refused.value) and "pb.yaml" in str(refused.value)
