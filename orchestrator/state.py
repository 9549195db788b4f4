"""The controller's state: an embedded SQLite database of runs, per-host gates and file digests.

Lives in ``$ORCHESTRATE_STATE_DIR`` or ``$XDG_STATE_HOME/dflash-orchestrator`` (default
``~/.local/state/dflash-orchestrator``). Each run is written in one transaction at its end.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from orchestrator.errors import StateError
from orchestrator.results import RunReport

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    playbook TEXT NOT NULL,
    inventory TEXT NOT NULL,
    release_id TEXT,
    started REAL NOT NULL,
    finished REAL NOT NULL,
    ok INTEGER NOT NULL,
    hosts_total INTEGER NOT NULL,
    hosts_ready INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS host_results (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    host TEXT NOT NULL,
    ready INTEGER NOT NULL,
    release_id TEXT,
    changed INTEGER NOT NULL,
    gates TEXT NOT NULL,
    duration_s REAL NOT NULL,
    PRIMARY KEY (run_id, host)
);
CREATE TABLE IF NOT EXISTS file_digests (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    host TEXT NOT NULL,
    remote_path TEXT NOT NULL,
    sha256 TEXT,
    expected_sha256 TEXT NOT NULL,
    changed INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    run_id INTEGER REFERENCES runs(id),
    at REAL NOT NULL,
    event TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS host_results_by_host ON host_results(host);
"""


def default_state_dir() -> Path:
    explicit = os.environ.get("ORCHESTRATE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dflash-orchestrator"


class StateDB:
    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_state_dir()
        self.path = self.directory / "state.db"
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.db = sqlite3.connect(self.path, timeout=30)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise StateError(f"state database {self.path}: {exc}") from exc

    def close(self) -> None:
        self.db.close()

    def record(self, run: RunReport) -> int:
        try:
            with self.db:
                cur = self.db.execute(
                    "INSERT INTO runs (kind, playbook, inventory, release_id, started, finished, ok, hosts_total, hosts_ready)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        run.kind,
                        run.playbook,
                        run.inventory,
                        run.release_id,
                        run.started,
                        run.finished,
                        int(run.ok),
                        len(run.hosts),
                        sum(h.ready for h in run.hosts),
                    ),
                )
                run_id = int(cur.lastrowid or 0)
                self.db.executemany(
                    "INSERT INTO host_results VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            run_id,
                            h.name,
                            int(h.ready),
                            h.release_id,
                            int(h.changed),
                            json.dumps({k: g.to_json() for k, g in h.gates.items()}),
                            h.duration_s,
                        )
                        for h in run.hosts
                    ],
                )
                self.db.executemany(
                    "INSERT INTO file_digests VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (run_id, h.name, f.remote_path, f.sha256, f.expected, int(f.changed))
                        for h in run.hosts
                        for f in h.files
                    ],
                )
                self.db.executemany(
                    "INSERT INTO audit VALUES (?, ?, ?, ?)",
                    [(run_id, run.finished, "host_key_accepted", key) for key in run.accepted_host_keys],
                )
        except sqlite3.Error as exc:
            raise StateError(f"state database {self.path}: {exc}") from exc
        return run_id

    def history(self, limit: int = 20, host: str | None = None) -> list[dict[str, Any]]:
        query = "SELECT id, kind, playbook, release_id, started, finished, ok, hosts_total, hosts_ready FROM runs"
        args: list[Any] = []
        if host:
            query += " WHERE id IN (SELECT run_id FROM host_results WHERE host = ?)"
            args.append(host)
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        rows = self.db.execute(query, args).fetchall()
        runs = []
        for row in rows:
            run = dict(
                zip(
                    ("id", "kind", "playbook", "release_id", "started", "finished", "ok", "hosts_total", "hosts_ready"),
                    row,
                    strict=True,
                )
            )
            run["ok"] = bool(run["ok"])
            hosts = self.db.execute(
                "SELECT host, ready, release_id, changed, gates, duration_s FROM host_results WHERE run_id = ? ORDER BY host",
                (run["id"],),
            ).fetchall()
            run["hosts"] = [
                {
                    "name": h[0],
                    "ready": bool(h[1]),
                    "release_id": h[2],
                    "changed": bool(h[3]),
                    "gates": json.loads(h[4]),
                    "duration_s": h[5],
                }
                for h in hosts
                if host is None or h[0] == host
            ]
            runs.append(run)
        return runs

    def files(self, run_id: int) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT host, remote_path, sha256, expected_sha256, changed FROM file_digests WHERE run_id = ? ORDER BY host, remote_path",
            (run_id,),
        ).fetchall()
        return [
            {"host": r[0], "remote_path": r[1], "sha256": r[2], "expected_sha256": r[3], "changed": bool(r[4])}
            for r in rows
        ]
