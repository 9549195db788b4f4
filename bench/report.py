"""How the HTML fleet report scales: its size, the time to render it, and how long headless
Chromium takes to load it, at N hosts (a made-up history: tests/fleet.py). The load time is the
wall time of ``chromium --dump-dom`` on the page less that of a blank page (the browser's own
start), median of the repetitions.

    python bench/report.py --hosts 128,1024 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.store import report as fleetreport
from tests.fleet import fleet_history

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def load_s(page: Path) -> float:
    with tempfile.TemporaryDirectory() as profile:
        start = time.perf_counter()
        subprocess.run(
            ["chromium", *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
            capture_output=True, check=True, timeout=120,
        )  # fmt: skip
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="128,1024")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print("| hosts | page | render | load in Chromium |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        blank = Path(tmp) / "blank.html"
        blank.write_text("<!DOCTYPE html><title>blank</title>")
        base = statistics.median(load_s(blank) for _ in range(args.reps))
        for n in (int(x) for x in args.hosts.split(",")):
            now = time.time()
            start = time.perf_counter()
            hosts = fleetreport.collect(*fleet_history(n, now))
            html = fleetreport.render_html(hosts, now)
            render = time.perf_counter() - start
            page = Path(tmp) / f"fleet-{n}.html"
            page.write_text(html)
            load = statistics.median(load_s(page) for _ in range(args.reps)) - base
            print(f"| {n} | {len(html) / 2**20:.1f} MiB | {render:.2f} s | {load:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
