"""The server command for GPU hosts we cannot run here: the exact argv and environment produced.

No GPU on this machine: these pin what a 4-GPU and an 8-GPU container would be started with.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config.inventory import load_inventory
from orchestrator.config.playbook import load_playbook
from orchestrator.rules import serving

REPO = Path(__file__).resolve().parents[2]

INV = """\
hosts:
  gpu-a:
    address: 192.0.2.10
    containers:
      serve-4: {address: 10.10.0.2, jump: true, gpus: [0, 1, 2, 3], groups: [serve]}
      serve-8: {address: 10.10.0.3, jump: true, gpus: [0, 1, 2, 3, 4, 5, 6, 7], groups: [serve]}
"""


def test_four_and_eight_gpu_containers(tmp_path: Path) -> None:
    (tmp_path / "inv.yaml").write_text(INV)
    inv = load_inventory(tmp_path / "inv.yaml")
    pb = load_playbook(REPO / "playbooks" / "qwen3-8b-dflash.yaml")  # tensor_parallel_size: 1 pinned
    four, eight = inv.hosts["gpu-a"].containers
    spec = json.dumps(
        {"method": "dflash", "model": "/srv/dflash-qwen3-8b/launched/drafter", "num_speculative_tokens": 15},
        separators=(",", ":"),
    )
    cmd = serving.command(pb, four, "R1")
    assert cmd.argv == (
        "/opt/vllm/bin/python", "-c", serving.VLLM_CLI, "serve",
        "/models/Qwen3-8B", "--served-model-name", "dflash", "--tensor-parallel-size", "1",
        "--host", "127.0.0.1", "--port", "8000", "--speculative-config", spec,
        "--attention-backend", "flash_attn", "--max-model-len", "32768",
    )  # fmt: skip
    # vLLM's own engine-start budget is the playbook's (900 s by default), not vLLM's 600 s
    # and CUDA numbers the GPUs as nvidia-smi (and so the gpus gate) does; vLLM's compile cache
    # lives under the deploy root, beside the releases, outliving each of them
    assert cmd.env == {
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENGINE_READY_TIMEOUT_S": "900",
        "VLLM_CACHE_ROOT": "/srv/dflash-qwen3-8b/cache/vllm",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }

    big = load_playbook(REPO / "playbooks" / "qwen36-27b-dflash.yaml")  # tensor_parallel_size: 4
    cmd8 = serving.command(big, eight, "R2")
    assert cmd8.argv[cmd8.argv.index("--tensor-parallel-size") + 1] == "4"
    assert cmd8.env == {
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENGINE_READY_TIMEOUT_S": "900",
        "VLLM_CACHE_ROOT": f"{serving.deploy_root(big, eight)}/cache/vllm",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    }
    assert json.loads(cmd8.argv[cmd8.argv.index("--speculative-config") + 1])["model"] == "/srv/dflash/launched/drafter"


def test_tensor_parallel_defaults_to_the_containers_gpu_count(tmp_path: Path) -> None:
    (tmp_path / "inv.yaml").write_text(INV)
    eight = load_inventory(tmp_path / "inv.yaml").hosts["gpu-a"].containers[1]
    text = (REPO / "playbooks" / "qwen3-8b-dflash.yaml").read_text().replace("  tensor_parallel_size: 1\n", "")
    (tmp_path / "pb.yaml").write_text(text)
    for rel in ("files",):
        (tmp_path / rel).symlink_to(REPO / "playbooks" / rel)
    cmd = serving.command(load_playbook(tmp_path / "pb.yaml"), eight, "R")
    assert cmd.argv[cmd.argv.index("--tensor-parallel-size") + 1] == "8"
