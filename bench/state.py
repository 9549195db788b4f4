"""What the shared state costs: a run's record and a rollout lease, on PostgreSQL against SQLite.

For each N hosts: the median wall time of ``StateDB.record`` of one run (each host with its gates,
two file digests and an acceptance sample: what a deploy writes), and of taking and giving back
the rollout lease of N targets (PostgreSQL only: SQLite has none). PostgreSQL is a local cluster
on a unix socket, made by the tests' own fixture (tests/postgres.py), so the figure is the
database's work and a local round trip, not a network's. Needs root (the cluster runs as the
postgres user).

    python bench/state.py --hosts 8,128,1024 --reps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.results import FileState, Gate, HostReport, RunReport
from orchestrator.store.state import StateDB
from tests.postgres import running_postgres


def a_run(hosts: int) -> RunReport:
    reports = []
    for i in range(hosts):
        h = HostReport(f"gpu-{i:04d}/serve-0", release_id="20261203T070000Z-abc", changed=True, duration_s=2.5)
        for name in ("lint", "connect", "files", "loader", "build", "engine", "health"):
            h.gates[name] = Gate(True, f"{name} ok", data={"seconds": 0.1})
        h.gates["acceptance"] = Gate(
            True, "tau 6.50", data={"mean_acceptance_length": 6.5, "acceptance_rate": 0.78, "drafts": 400}
        )
        h.files = [
            FileState("drafter/config.json", f"/srv/dflash/releases/r/drafter/{i}", "a" * 64, "a" * 64, True),
            FileState("notes.txt", f"/srv/dflash/releases/r/notes-{i}", "b" * 64, "b" * 64, True),
        ]
        reports.append(h)
    now = time.time()
    return RunReport("deploy", "pb.yaml", "inv.yaml", "20261203T070000Z-abc", reports, now, finished=now + 3)


def median_ms(work: object, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        work()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="8,128,1024")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    sizes = [int(n) for n in args.hosts.split(",")]
    base = Path(tempfile.mkdtemp(prefix="dflash-bench-pg-"))
    print("| hosts | record, SQLite | record, PostgreSQL | rollout lease, PostgreSQL |")
    print("| --- | --- | --- | --- |")
    with running_postgres(base) as pg, tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            run = a_run(n)
            sqlite = StateDB(Path(tmp) / f"s{n}")
            postgres = StateDB(Path(tmp), pg.socket_url(pg.new_database()))
            try:
                names = [h.name for h in run.hosts]

                def lease(db: StateDB = postgres, names: list[str] = names) -> None:
                    with db.rollout_lock(names, "deploy bench", 0.0):
                        pass

                row = (
                    median_ms(lambda db=sqlite, run=run: db.record(run), args.reps),
                    median_ms(lambda db=postgres, run=run: db.record(run), args.reps),
                    median_ms(lease, args.reps),
                )
            finally:
                sqlite.close()
                postgres.close()
            print(f"| {n} | {row[0]:.1f} ms | {row[1]:.1f} ms | {row[2]:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
