"""The controller's state: an embedded SQLite database of runs, per-host gates and file digests.

Lives in ``$ORCHESTRATE_STATE_DIR`` or ``$XDG_STATE_HOME/dflash-orchestrator`` (default
``~/.local/state/dflash-orchestrator``). Each run is written in one transaction at its end.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import StateError
from orchestrator.results import GATE_ACCEPTANCE, Gate, RunReport

if TYPE_CHECKING:
    from orchestrator.watch import Round, Transition

SCHEMA = """
CREATE TABLE IF NOT EXISTS checks (
    what TEXT PRIMARY KEY,
    at REAL NOT NULL
);
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
CREATE TABLE IF NOT EXISTS watch_transitions (
    at REAL NOT NULL,
    host TEXT NOT NULL,
    before TEXT,
    after TEXT NOT NULL,
    evidence TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS watch_transitions_by_host ON watch_transitions(host, at);
-- Acceptance over time, whatever measured it: a deploy's or verify's probe, or a watch window.
CREATE TABLE IF NOT EXISTS acceptance_samples (
    at REAL NOT NULL,
    host TEXT NOT NULL,
    source TEXT NOT NULL,
    release_id TEXT,
    mean_acceptance_length REAL NOT NULL,
    mean_acceptance_length_low REAL,
    acceptance_rate REAL NOT NULL,
    drafts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS acceptance_samples_by_host ON acceptance_samples(host, at);
"""


def default_state_dir() -> Path:
    """Where the state database lives: $ORCHESTRATE_STATE_DIR, else the user's XDG state directory."""
    explicit = os.environ.get("ORCHESTRATE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dflash-orchestrator"


DIGEST_KEY = "digest.key"


def digest_key(directory: Path | None = None) -> str:
    """The controller's key (hex) that signs the lines of the hosts' digest caches: made once, 32
    random bytes readable by this user alone, in the state directory. It travels with each request
    and is never stored on a host, so a cache line nobody signed with it (a planted one) is only
    ever a re-hash. Another controller, with another key, re-hashes once and signs anew."""
    base = directory or default_state_dir()
    path = base / DIGEST_KEY
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            text = path.read_text().strip()
            bytes.fromhex(text)
            if len(text) != 64:
                raise ValueError(f"{len(text)} hex digits") from None
            return text
        key = os.urandom(32).hex()
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key
    except (OSError, ValueError) as exc:
        raise StateError(f"the digest key {path} cannot be used: {exc}") from exc


class StateDB:
    """The embedded state (SQLite, one file per user): runs, per-host gates, digests and the audit
    log; watch's samples and transitions."""

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
        """Close the database (what was committed stays)."""
        self.db.close()

    def check_writable(self) -> None:
        """Write and commit a row, before a run touches any host: a database that is read-only,
        locked past its timeout or on a full disk is said now, not after the hosts changed."""
        try:
            with self.db:
                self.db.execute("INSERT OR REPLACE INTO checks VALUES ('writable', ?)", (time.time(),))
        except sqlite3.Error as exc:
            raise StateError(f"state database {self.path} cannot be written: {exc}") from exc

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
                    "INSERT INTO acceptance_samples VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (run.finished, h.name, run.kind, h.release_id, *numbers)
                        for h in run.hosts
                        if (numbers := _acceptance_numbers(h.gates.get(GATE_ACCEPTANCE))) is not None
                    ],
                )
                self.db.executemany(
                    "INSERT INTO audit VALUES (?, ?, ?, ?)",
                    [(run_id, run.finished, "host_key_accepted", key) for key in run.accepted_host_keys],
                )
        except sqlite3.Error as exc:
            raise StateError(f"state database {self.path}: {exc}") from exc
        return run_id

    def record_watch(self, transitions: list[Transition], rounds: list[Round]) -> None:
        """A watch round: its transitions with their evidence, and each window it judged."""
        try:
            with self.db:
                self.db.executemany(
                    "INSERT INTO watch_transitions VALUES (?, ?, ?, ?, ?)",
                    [(t.at, t.host, t.before, t.after, json.dumps(t.to_json())) for t in transitions],
                )
                self.db.executemany(
                    "INSERT INTO acceptance_samples VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            r.at,
                            r.host,
                            "watch",
                            r.release_id,
                            r.live.mean_acceptance_length,
                            r.live.mean_acceptance_length_low,
                            r.live.rate,
                            r.live.drafts,
                        )
                        for r in rounds
                        if r.live is not None and r.live.until == r.at  # judged in this round
                    ],
                )
        except sqlite3.Error as exc:
            raise StateError(f"state database {self.path}: {exc}") from exc

    def transitions(self, host: str | None = None) -> list[dict[str, Any]]:
        """watch's state changes of a host (or all hosts), oldest first."""
        query = "SELECT evidence FROM watch_transitions"
        args: list[Any] = []
        if host:
            query += " WHERE host = ?"
            args.append(host)
        return [json.loads(row[0]) for row in self.db.execute(query + " ORDER BY at, rowid", args)]

    def samples(self, host: str | None = None) -> list[dict[str, Any]]:
        """watch's live acceptance samples of a host (or all hosts), oldest first."""
        names: tuple[str, ...] = ("at", "host", "source", "release_id", "mean_acceptance_length")
        names += ("mean_acceptance_length_low", "acceptance_rate", "drafts")
        query = f"SELECT {', '.join(names)} FROM acceptance_samples"
        args: list[Any] = []
        if host:
            query += " WHERE host = ?"
            args.append(host)
        rows = self.db.execute(query + " ORDER BY at, rowid", args).fetchall()
        return [dict(zip(names, row, strict=True)) for row in rows]

    def history(self, limit: int = 20, host: str | None = None) -> list[dict[str, Any]]:
        """The runs recorded, newest first, with their per-host results."""
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
        """A run's per-host file digests: what each host served and what was expected."""
        rows = self.db.execute(
            "SELECT host, remote_path, sha256, expected_sha256, changed FROM file_digests WHERE run_id = ? ORDER BY host, remote_path",
            (run_id,),
        ).fetchall()
        return [
            {"host": r[0], "remote_path": r[1], "sha256": r[2], "expected_sha256": r[3], "changed": bool(r[4])}
            for r in rows
        ]


def _acceptance_numbers(gate: Gate | None) -> tuple[float, float | None, float, int] | None:
    """tau, its bound, rate and drafts from a probe's acceptance gate (None: no probe ran)."""
    data = gate.data if gate is not None else {}
    try:
        return (
            float(data["mean_acceptance_length"]),
            float(data["mean_acceptance_length_low"]) if data.get("mean_acceptance_length_low") is not None else None,
            float(data["acceptance_rate"]),
            int(data["drafts"]),
        )
    except (KeyError, TypeError, ValueError):
        return None
