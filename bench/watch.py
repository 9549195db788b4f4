"""What a watch round costs the controller: run by ``bench/run.py`` as a process of its own, so that
its peak memory is the watcher's alone.

    python bench/watch.py PLAYBOOK INVENTORY --rounds 10 --forks 16

The first round connects to every host and starts its agent; the later rounds are one framed
request a host over the kept sessions (the files the server reads against the release, through
the host's digest cache, the server's process and /health, the READY record, /metrics). Prints
JSON: the first round's wall, the median later round's wall and CPU (every thread of this
process, paramiko's included), the CPU a second of holding the sessions between rounds, the
sessions held, the states seen, and the peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from orchestrator.cli.main import more_files
from orchestrator.config.inventory import load_inventory
from orchestrator.config.playbook import load_playbook
from orchestrator.deployment import Deployment
from orchestrator.engine.runner import RunOptions


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("playbook", type=Path)
    parser.add_argument("inventory", type=Path)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--forks", type=int, default=16)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds to hold the sessions between rounds, measured")
    args = parser.parse_args()
    more_files()  # a session a host: past the usual 1024 descriptors, as the CLI does
    playbook, inventory = load_playbook(args.playbook), load_inventory(args.inventory)
    watcher = Deployment(playbook, inventory, RunOptions(forks=args.forks)).watcher()
    walls, cpus = [], []
    try:
        start = time.perf_counter()
        results, _ = watcher.round()
        first = time.perf_counter() - start
        states = {r.state for r in results}
        for _ in range(args.rounds):
            cpu0, start = time.process_time(), time.perf_counter()
            results, _ = watcher.round()
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu0)
            states |= {r.state for r in results}
        sessions = sum(1 for w in watcher.watched if w.session is not None and w.session.is_open)
        # Between rounds (30 s by default) the sessions are only held: what that costs a second.
        cpu0, start = time.process_time(), time.perf_counter()
        time.sleep(args.idle)
        idle = (time.process_time() - cpu0) / (time.perf_counter() - start)
    finally:
        watcher.close()
    json.dump(
        {
            "hosts": len(results),
            "first_round_s": first,
            "round_s": statistics.median(walls),
            "round_cpu_s": statistics.median(cpus),
            "sessions": sessions,
            "idle_cpu_s_a_second": idle,
            "states": sorted(states),
            "peak_mib": peak_rss_mib(),
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
