"""What a watch round costs at fleet scale, against ``verify`` of the same hosts.

Its own ssh sandbox (prefix ``dfw``, 10.83.0.0/16). Every host gets a served release and a
stand-in server (tests/unit/standin_vllm.py: /health, /metrics with spec-decode counters; vLLM
itself is too big to run 128 times on one machine), so a round does what it does on a fleet: the
files the server reads against the release (through the host's digest cache), the server's
process and /health, the READY record, and the counters from /metrics. For each N: the median
wall and controller CPU (every thread of this process: paramiko's included) of a watch round over
the kept sessions, the first round (connecting, starting each agent) apart, and the same for an
``orchestrate verify`` process. Needs root.

    python bench/watch.py --hosts 8,32,128 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.deployment import Deployment
from orchestrator.inventory import load_inventory
from orchestrator.playbook import load_playbook
from orchestrator.runner import RunOptions
from orchestrator.sandbox.sshhosts import SshSandbox

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "unit" / "standin_vllm.py"
WORK = Path("/tmp/orchestrate-bench-watch")


def write_inputs(box: SshSandbox, n: int) -> tuple[Path, Path]:
    (WORK / "target").mkdir(parents=True, exist_ok=True)
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}
    target |= {"num_hidden_layers": 2, "vocab_size": 64, "layer_types": ["full_attention"] * 2}
    (WORK / "target" / "config.json").write_text(json.dumps(target))
    drafter = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8}
    drafter |= {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]}, "hidden_size": 64}
    drafter |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}
    drafter |= {"vocab_size": 64, "num_target_layers": 2, "layer_types": ["full_attention"]}
    (WORK / "drafter.json").write_text(json.dumps(drafter, indent=2))
    # The hosts see /tmp but not every path of this machine: the stand-in and the system Python.
    shutil.copyfile(STANDIN, WORK / STANDIN.name)
    python = WORK / "python"
    python.write_text(f'#!/bin/sh\nexec /usr/bin/python3 {WORK / STANDIN.name} "$@"\n')
    python.chmod(0o755)
    book = {
        "name": "bench-watch",
        "targets": ["all"],
        "deploy_root": "/srv/bench-watch",
        "drafter": {"config": "drafter.json", "target_config": "target/config.json"},
        "serving": {
            "python": str(python),
            "target": str(WORK / "target"),
            "model_name": "tiny",
            "num_speculative_tokens": 7,
            "port": 8000,
            "startup_timeout": 60,
            "env": {"STANDIN_GOOD_MASK": "5"},
        },
        "gates": {"acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32}},
    }
    (WORK / "pb.yaml").write_text(json.dumps(book))
    inv = box.inventory.read_text().split("    containers:\n")[0] + "    containers:\n"
    inv += "".join(f"      {h.name}:\n        address: {h.address}\n" for h in box.hosts()[:n])
    inv = inv.replace("key: id_ed25519", f"key: {box.client_key}")
    (WORK / "inventory.yaml").write_text(inv.replace("known_hosts: known_hosts", f"known_hosts: {box.known_hosts}"))
    return WORK / "pb.yaml", WORK / "inventory.yaml"


def orchestrate(*args: str | Path) -> tuple[float, float, int]:
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(WORK / "state"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args)], capture_output=True, env=env, timeout=1800
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        sys.exit(f"orchestrate {args[0]} failed ({done.returncode}):\n{done.stdout.decode()}{done.stderr.decode()}")
    return wall, cpu, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="8,32,128")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    box = SshSandbox(Path("/var/lib/dflash-orchestrator/bench-watch-sandbox"), prefix="dfw", subnet="10.83")
    box.down()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    box.up(max(sizes))
    rows = []
    try:
        for n in sizes:
            playbook, inventory = write_inputs(box, n)
            wall, _, code = orchestrate("deploy", playbook, "-i", inventory, "--forks", "32")
            print(f"N={n}: deploy {wall:.1f} s, exit {code}", file=sys.stderr)
            verifies = [orchestrate("verify", playbook, "-i", inventory, "--forks", str(n)) for _ in range(3)]
            pb, inv = load_playbook(playbook), load_inventory(inventory)
            watcher = Deployment(pb, inv, RunOptions(forks=n)).watcher()
            walls, cpus = [], []
            try:
                first_start = time.perf_counter()
                rounds, _ = watcher.round()
                first = time.perf_counter() - first_start
                states = {r.state for r in rounds}
                for _ in range(args.rounds):
                    cpu0, start = time.process_time(), time.perf_counter()
                    rounds, _ = watcher.round()
                    walls.append(time.perf_counter() - start)
                    cpus.append(time.process_time() - cpu0)
                    states |= {r.state for r in rounds}
            finally:
                watcher.close()
            rows.append(
                (
                    n,
                    statistics.median(v[0] for v in verifies),
                    statistics.median(v[1] for v in verifies),
                    first,
                    statistics.median(walls),
                    statistics.median(cpus),
                    ",".join(sorted(states)),
                )
            )
            print(f"N={n}: {rows[-1]}", file=sys.stderr)
            orchestrate("stop", playbook, "-i", inventory, "--forks", "32")
    finally:
        box.down()
    print(
        "| hosts | verify wall s | verify CPU s | watch first round s | watch round wall s | watch round CPU s | states |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for n, vw, vc, first, ww, wc, states in rows:
        print(f"| {n} | {vw:.2f} | {vc:.2f} | {first:.2f} | {ww:.3f} | {wc:.3f} | {states} |")


if __name__ == "__main__":
    main()
