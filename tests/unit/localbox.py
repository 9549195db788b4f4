"""This machine as a few ``connection: local`` containers, for whole runs in the unit tests.

Each container has its own deploy root under the test's directory; the agent runs as a local
subprocess exactly as it runs over SSH; ``serving.python`` is ``standin_vllm.py`` (see its
docstring for what it stands in for, and why).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config.inventory import Inventory, load_inventory
from orchestrator.config.playbook import Playbook, load_playbook
from orchestrator.deployment import Deployment
from orchestrator.engine.runner import RunOptions
from orchestrator.results import HostReport, RunReport

STANDIN = Path(__file__).with_name("standin_vllm.py")
GOOD_MASK = 5
K = 7

TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "layer_types": ["full_attention", "full_attention"],
}
DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 8,
    "dflash_config": {"mask_token_id": GOOD_MASK, "target_layer_ids": [1]},
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 64,
    "num_target_layers": 2,
    "layer_types": ["full_attention"],
    "bos_token_id": None,
}


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel handed out (bind to 0)
    is one it may hand out again as the source port of any outgoing connection (the agent's
    health polls, a store's), which then holds it when the server binds it: "Address already in use"
    (seen in a whole-run test of two controllers). The next ones up serve the tests that take
    ``port + 1``."""
    import random

    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    floor = max(1024, low - 12000)
    for _ in range(200):
        port = random.randrange(floor, low - 16)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port below {low}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:  # it ended between the two looks
        return False


def ended(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` is gone within ``within`` seconds: a killed process takes a moment to end
    (its memory torn down), longer on a loaded machine."""
    deadline = time.monotonic() + within
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass
class Box:
    """This machine as a few ``connection: local`` containers, and playbooks to run on them."""

    dir: Path
    inventory_path: Path
    port: int

    @property
    def inventory(self) -> Inventory:
        return load_inventory(self.inventory_path)

    def root(self, name: str) -> Path:
        return self.dir / "roots" / name

    def playbook(
        self,
        name: str = "pb",
        mask: int = GOOD_MASK,
        targets: str = "[solo]",
        top: dict[str, Any] | None = None,
        drafter: dict[str, Any] | None = None,
        **serving: Any,
    ) -> Playbook:
        config = {
            **DRAFTER_CONFIG,
            "dflash_config": {"mask_token_id": mask, "target_layer_ids": [1]},
            **(drafter or {}),
        }
        (self.dir / f"{name}-drafter.json").write_text(json.dumps(config, indent=2) + "\n")
        notes = self.dir / "notes.txt"
        if not notes.exists():
            notes.write_text("release notes\n")
        book: dict[str, Any] = {
            "name": name,
            "targets": yaml.safe_load(targets),
            "deploy_root": "/nonexistent/overridden-per-container",
            "keep_releases": 3,
            "files": [{"src": "notes.txt", "dest": "notes.txt"}],
            "drafter": {"config": f"{name}-drafter.json", "target_config": "target/config.json"},
            "serving": {
                "python": str(self.dir / "bin" / "python"),
                "target": str(self.dir / "target"),
                "model_name": "tiny",
                "num_speculative_tokens": K,
                "port": self.port,
                "startup_timeout": 30,
                "env": {"STANDIN_GOOD_MASK": str(GOOD_MASK)},
                **serving,
            },
            "gates": {"acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32}},
            **(top or {}),
        }
        if "models" in book and "target" in book["models"]:
            del book["serving"]["target"]  # it defaults to models.target.path
        path = self.dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(book))
        return load_playbook(path)

    def group(self, name: str = "group", mask: int = GOOD_MASK, **serving: Any) -> Playbook:
        multi = {"nodes": ["n0", "n1"], "master_addr": "127.0.0.1", "master_port": free_port()}
        return self.playbook(name, mask, "[n0, n1]", tensor_parallel_size=2, multi_node=multi, **serving)

    def current(self, name: str) -> str:
        return os.readlink(self.root(name) / "current")

    def pid(self, name: str) -> int:
        return int(json.loads((self.root(name) / "run" / "dflash-serve.json").read_text())["pid"])


def serving_side(tmp_path: Path) -> None:
    """``bin/python`` (the stand-in, as ``serving.python``) and ``target/config.json``."""
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET_CONFIG))


def make_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the agent's compiled-code cache
    serving_side(tmp_path)
    containers = {
        name: {"connection": "local", "deploy_root": str(tmp_path / "roots" / name), "python": sys.executable}
        for name in ("solo", "n0", "n1")
    }
    containers["n0"]["address"] = containers["n1"]["address"] = "127.0.0.1"
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"this-box": {"containers": containers}}}))
    made = Box(tmp_path, inventory, free_port())
    yield made
    # End what the runs started, by the pids the agent recorded (a failing test leaves servers).
    for pidfile in tmp_path.glob("roots/*/run/*.json"):
        if pidfile.is_symlink() or not pidfile.is_file():  # planted by a hostile-root test
            continue
        pid = json.loads(pidfile.read_text())["pid"]
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


OPTIONS = RunOptions(forks=4, lock_timeout=5.0)


def deploy(box: Box, playbook: Playbook, **options: Any) -> RunReport:
    return Deployment(playbook, box.inventory, replace(OPTIONS, **options)).deploy()


def verify(box: Box, playbook: Playbook, probe: bool = False, engine: bool = False) -> RunReport:
    return Deployment(playbook, box.inventory, OPTIONS).verify(probe=probe, engine=engine)


def rollback(box: Box, playbook: Playbook, to: str | None = None) -> RunReport:
    return Deployment(playbook, box.inventory, OPTIONS).rollback(to=to)


def stop(box: Box, playbook: Playbook) -> RunReport:
    return Deployment(playbook, box.inventory, OPTIONS).stop()


def host(run: RunReport, name: str) -> HostReport:
    return next(h for h in run.hosts if h.name == name)


def safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A real safetensors file (header, then zeroed F32 tensors) with these tensors."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4
        for d in shape:
            size *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))


def drafter_shapes(
    layers: int = 1, taps: int = 1, hidden: int = 64, heads: int = 2, head_dim: int = 32
) -> dict[str, list[int]]:
    """The tensors of a DFlash drafter as vLLM's qwen3_dflash loader reads them."""
    shapes: dict[str, list[int]] = {
        "fc.weight": [hidden, hidden * taps],
        "hidden_norm.weight": [hidden],
        "norm.weight": [hidden],
    }
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": [heads * head_dim, hidden],
            p + "self_attn.k_proj.weight": [heads * head_dim, hidden],
            p + "self_attn.v_proj.weight": [heads * head_dim, hidden],
            p + "self_attn.o_proj.weight": [hidden, heads * head_dim],
            p + "self_attn.q_norm.weight": [head_dim],
            p + "self_attn.k_norm.weight": [head_dim],
            p + "input_layernorm.weight": [hidden],
            p + "post_attention_layernorm.weight": [hidden],
        }
    return shapes


def immutable(state: Path, on: bool) -> None:
    """The state database and its write-ahead log made immutable (chattr +i: not even root writes
    them), or not: a database that cannot take a write, for real ("disk I/O error"). Its shared
    memory file is left alone: SQLite maps it, and a write to a mapped immutable page is SIGBUS."""
    for name in ("state.db", "state.db-wal"):
        if (state / name).exists():
            subprocess.run(["chattr", "+i" if on else "-i", str(state / name)], check=True)


def files_only_book(box: Box, name: str, targets: list[str]) -> Path:
    """A playbook of one file (``a.txt``) and no server for ``targets``, written beside the box;
    its path."""
    (box.dir / "a.txt").write_text("a\n")
    book = {"name": name, "targets": targets, "deploy_root": "/unused", "files": [{"src": "a.txt", "dest": "a.txt"}]}
    path = box.dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(book))
    return path
