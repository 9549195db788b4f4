"""The gpus gate and the NCCL preflight in whole deploys and verifies, through the real agent.

There is no GPU here, so two things are stand-ins, and only these: ``nvidia-smi`` is a script on
PATH that checks it was asked the agent's exact queries and prints what a real H200 answered
(tests/data/gpu, recorded by scripts/gpu-check on one H200 and on two), and the NCCL preflight's program is run by ``standin_vllm.py``, which
records the environment it was given and answers what the H200 answered. Everything else (the
agent, the local connector, the engine, the reports) is real; scripts/gpu-check runs these same
gates on the real GPUs.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli import main as cli
from orchestrator.results import GATE_GPUS
from remote_agent import checks as agent
from tests.unit.localbox import Box, deploy, host, verify

H200 = Path(__file__).resolve().parent.parent / "data" / "gpu" / "h200"
HOLDER_PID = int((H200 / "holder-pid.txt").read_text())

FAKE_SMI = f"""#!{sys.executable}
# nvidia-smi's recorded answers to the agent's two queries, and nothing else.
import os, sys
from pathlib import Path
answers = {{
    "--query-gpu={agent.GPU_QUERY}": "gpus.csv",
    "--query-compute-apps={agent.APP_QUERY}": "apps.csv",
}}
if len(sys.argv) != 3 or sys.argv[2] != "--format=csv,noheader,nounits" or sys.argv[1] not in answers:
    sys.exit("fake nvidia-smi: unexpected arguments %r" % sys.argv[1:])
sys.stdout.write((Path(os.environ["FAKE_SMI_DIR"]) / answers[sys.argv[1]]).read_text())
"""


class Smi:
    """What the fake nvidia-smi answers: the recorded CSVs, changed per test."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def answer(self, gpus: str, apps: str = "") -> None:
        (self.dir / "gpus.csv").write_text(gpus)
        (self.dir / "apps.csv").write_text(apps)


@pytest.fixture
def smi(box: Box, monkeypatch: pytest.MonkeyPatch) -> Iterator[Smi]:
    directory = box.dir / "smi"
    directory.mkdir()
    script = directory / "nvidia-smi"
    script.write_text(FAKE_SMI)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_DIR", str(directory))
    monkeypatch.setenv("STANDIN_NCCL_ENV", str(box.dir / "nccl-env.json"))
    answers = Smi(directory)
    answers.answer((H200 / "clean-gpus.csv").read_text())
    yield answers


def give_gpus(box: Box, gpus: dict[str, list[int]]) -> None:
    """The box's inventory, with GPUs given to some of its containers."""
    doc = yaml.safe_load(box.inventory_path.read_text())
    for name, indices in gpus.items():
        doc["hosts"]["this-box"]["containers"][name]["gpus"] = indices
    box.inventory_path.write_text(yaml.safe_dump(doc))


def test_a_free_gpu_is_checked_before_staging_reported_and_checked_again_by_verify(box: Box, smi: Smi) -> None:
    give_gpus(box, {"solo": [0]})
    pb = box.playbook()
    run = deploy(box, pb)
    solo = host(run, "solo")
    assert run.ok, solo.gates
    assert list(solo.gates)[:4] == ["lint", "connect", "gpus", "files"]
    gate = solo.gates[GATE_GPUS]
    assert gate.detail == "1 x NVIDIA H200 (driver 580.159.04, torch CUDA 13.0; 0: 143156 MiB free)"
    [gpu] = run.to_json()["hosts"][0]["gpus"]
    assert gpu["uuid"] == "GPU-d736370c-cd84-6fd8-5016-bdf1328fa481" and gpu["memory_total_mib"] == 143771

    # Our own server on the GPU (pid and memory as the holder's): verify passes, and so does a redeploy.
    smi.answer(
        (H200 / "holder-gpus.csv").read_text(),
        f"{box.pid('solo')}, GPU-d736370c-cd84-6fd8-5016-bdf1328fa481, 41570, python\n",
    )
    checked = verify(box, pb)
    assert checked.ok and host(checked, "solo").gates[GATE_GPUS].ok
    again = deploy(box, pb)
    assert again.ok, host(again, "solo").gates


def test_a_process_that_is_not_ours_on_the_gpu_stops_the_deploy_before_anything_is_staged(box: Box, smi: Smi) -> None:
    give_gpus(box, {"solo": [0]})
    smi.answer((H200 / "holder-gpus.csv").read_text(), (H200 / "holder-apps.csv").read_text())
    run = deploy(box, box.playbook())
    solo = host(run, "solo")
    assert not run.ok
    gate = solo.gates[GATE_GPUS]
    assert not gate.ok
    assert f"pid {HOLDER_PID} (/opt/torch/.venv/bin/python3) holds 41570 MiB" in gate.detail
    assert "101578 MiB free of 143771; --gpu-memory-utilization 0.9 asks 129393" in gate.detail
    assert "files" not in solo.gates and "ready" not in solo.gates
    assert not (box.root("solo") / "releases").exists() and not (box.root("solo") / "run").exists()
    # verify says the same of a host with nothing deployed
    assert f"pid {HOLDER_PID}" in host(verify(box, box.playbook()), "solo").gates[GATE_GPUS].detail


def test_no_nvidia_smi_where_the_inventory_promises_gpus_fails_and_a_cpu_container_has_no_gate(
    box: Box, smi: Smi, monkeypatch: pytest.MonkeyPatch
) -> None:
    pb = box.playbook()
    cpu = deploy(box, pb)
    assert cpu.ok and GATE_GPUS not in host(cpu, "solo").gates and "gpus" not in cpu.to_json()["hosts"][0]
    give_gpus(box, {"solo": [0, 1]})
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != str(smi.dir)))
    run = deploy(box, box.playbook(tensor_parallel_size=2))
    gate = host(run, "solo").gates[GATE_GPUS]
    assert not run.ok and gate.detail == "no nvidia-smi in the container, but the inventory gives it GPUs [0, 1]"


@pytest.mark.parametrize(("torch", "says"), [("None", "CPU build"), ("absent", "has no torch"), ("12.4", None)])
def test_the_serving_torch_must_be_a_cuda_build_the_driver_can_run(
    box: Box, smi: Smi, monkeypatch: pytest.MonkeyPatch, torch: str, says: str | None
) -> None:
    give_gpus(box, {"solo": [0]})
    monkeypatch.setenv("STANDIN_TORCH_CUDA", torch)
    smi.answer((H200 / "clean-gpus.csv").read_text().replace("580.159.04", "520.61.05"))  # driver rewritten
    gate = host(deploy(box, box.playbook()), "solo").gates[GATE_GPUS]
    assert not gate.ok
    assert (
        says in gate.detail
        if says
        else gate.detail == ("driver 520.61.05 is older than the serving torch's CUDA 12.4 needs (>= 525.60.13)")
    )


def gates(**nccl: float) -> dict[str, Any]:
    """The box's acceptance gate, with these NCCL settings."""
    acceptance = {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32}
    return {"gates": {"acceptance": acceptance, "nccl": nccl}}


def preflights_of(smi: Smi) -> list[int]:
    """The NCCL preflight programs still running that this test's agent started."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"allreduce.py") for a in argv) and f"FAKE_SMI_DIR={smi.dir}".encode() in env:
            found.append(int(proc.name))
    return found


def nccl_env(box: Box) -> dict[str, Any]:
    return json.loads((box.dir / "nccl-env.json").read_text())


def test_two_gpus_all_reduce_before_launch_with_the_servers_environment(
    box: Box, smi: Smi, monkeypatch: pytest.MonkeyPatch
) -> None:
    give_gpus(box, {"solo": [0, 1]})
    smi.answer((H200.with_name("h200x2") / "clean-gpus.csv").read_text())
    env = {"STANDIN_GOOD_MASK": "5", "NCCL_P2P_DISABLE": "0", "NCCL_NVLS_ENABLE": "1"}
    pb = box.playbook(tensor_parallel_size=2, env=env, top=gates(min_busbw_gbps=250))

    monkeypatch.setenv("STANDIN_BUSBW", "21.0")
    slow = host(deploy(box, pb), "solo")
    assert slow.gates[GATE_GPUS].detail == "the all-reduce reached 21.0 GB/s bus bandwidth, below 250"
    assert slow.gates[GATE_GPUS].data["busbw_gbps"] == 21.0
    assert not (box.root("solo") / "releases").exists() and not (box.root("solo") / "run").exists()

    monkeypatch.delenv("STANDIN_BUSBW")  # what two H200s over NVLink did
    run = deploy(box, pb)
    gate = host(run, "solo").gates[GATE_GPUS]
    assert run.ok, {k: g.detail for k, g in host(run, "solo").gates.items() if not g.ok}
    assert gate.data["busbw_gbps"] == 297.4 and gate.data["nccl"] == "2.28.9"
    assert gate.detail.endswith("NCCL 2.28.9 all-reduce over 2 GPUs: 297.4 GB/s bus bandwidth")
    # the server's GPUs and its NCCL settings, but never NVLink multicast, whatever the playbook says
    assert nccl_env(box) == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NCCL_DEBUG": "WARN",
        "NCCL_P2P_DISABLE": "0",
    }
    (box.dir / "nccl-env.json").unlink()
    # with our server holding the GPUs the preflight is skipped (its own all-reduce proves them),
    # by verify and by a redeploy, which stops that server only after the gate
    checked = host(verify(box, pb), "solo").gates[GATE_GPUS]
    assert checked.ok and "NCCL preflight skipped: the server we started holds these GPUs" in checked.detail
    again = deploy(box, box.playbook("again", tensor_parallel_size=2, env=env, top=gates(min_busbw_gbps=250)))
    assert again.ok and "NCCL preflight skipped" in host(again, "solo").gates[GATE_GPUS].detail
    assert not (box.dir / "nccl-env.json").exists()


@pytest.mark.parametrize("how", ["error", "hang"])
def test_an_nccl_error_or_hang_fails_the_gate_with_nccls_words_and_launches_nothing(
    box: Box, smi: Smi, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    give_gpus(box, {"solo": [0, 1]})
    smi.answer((H200.with_name("h200x2") / "clean-gpus.csv").read_text())
    monkeypatch.setenv("STANDIN_NCCL", how)
    pb = box.playbook(tensor_parallel_size=2, top=gates(timeout_s=2))
    run = deploy(box, pb)
    solo = host(run, "solo")
    gate = solo.gates[GATE_GPUS]
    assert not run.ok and not gate.ok
    if how == "error":
        assert "Bootstrap : no socket interface found" in gate.detail and "NCCL error" in gate.detail
    else:
        assert "the all-reduce over 2 GPUs did not finish in 2 s: a hang" in gate.detail
        assert 2 <= gate.data["seconds"] < 30
        assert preflights_of(smi) == []  # stopped, with everything it started
    # nvidia-smi's facts are still reported; nothing was staged or launched
    assert len(run.to_json()["hosts"][0]["gpus"]) == 2
    assert not (box.root("solo") / "releases").exists() and not (box.root("solo") / "run").exists()


def test_the_cli_json_carries_the_gate_and_the_gpus(box: Box, smi: Smi, capsys: pytest.CaptureFixture[str]) -> None:
    give_gpus(box, {"solo": [0]})
    smi.answer((H200 / "holder-gpus.csv").read_text(), (H200 / "holder-apps.csv").read_text())
    pb = box.playbook()
    state = box.dir / "state"
    code = cli.main(
        ["verify", str(box.dir / "pb.yaml"), "-i", str(box.inventory_path), "--json", "--state-dir", str(state)]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and pb.name == "pb"
    solo = out["hosts"][0]
    assert solo["gates"]["gpus"]["ok"] is False and f"pid {HOLDER_PID}" in solo["gates"]["gpus"]["detail"]
    assert solo["gpus"][0]["memory_used_mib"] == 41579
