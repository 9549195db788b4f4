"""The controller's state: runs, per-host gates and file digests, watch's transitions and the
acceptance series, and the rollout leases of controllers that share it.

Two stores behind one small SQL layer (DB-API 2, the same statements for both):

- SQLite, the embedded default: ``$ORCHESTRATE_STATE_DIR`` or ``$XDG_STATE_HOME/dflash-orchestrator``
  (``~/.local/state/dflash-orchestrator``), one file per user, the standard library only;
- PostgreSQL, for a team: ``--state-url`` / ``$ORCHESTRATE_STATE_URL`` ``postgresql://...``, through
  psycopg 3 (the ``postgres`` extra). Shared by every controller and watcher; it adds the
  fleet-wide rollout lock (``rollout_lock``), session-scoped advisory locks a dead controller
  cannot leave behind.

The schema carries its version; a store of an older version is upgraded on open, one of a newer
version is refused. Each run is written in one transaction at its end, with who ran it.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import hashlib
import json
import math
import os
import re
import socket
import sqlite3
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from orchestrator.errors import EXIT_BAD_INPUT, LeaseWaitStopped, StateError
from orchestrator.results import GATE_ACCEPTANCE, Gate, RunReport

if TYPE_CHECKING:
    from orchestrator.rules.watch import Round, Transition

SCHEMA_VERSION = 4  # 4: serving_load (the requests each watched server ran)

# The tables, written once for both stores: {id} is each dialect's generated key, {real} its float.
SCHEMA = """
CREATE TABLE IF NOT EXISTS checks (
    what TEXT PRIMARY KEY,
    at {real} NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id {id},
    kind TEXT NOT NULL,
    playbook TEXT NOT NULL,
    inventory TEXT NOT NULL,
    release_id TEXT,
    started {real} NOT NULL,
    finished {real} NOT NULL,
    ok INTEGER NOT NULL,
    hosts_total INTEGER NOT NULL,
    hosts_ready INTEGER NOT NULL,
    user_name TEXT,
    controller TEXT,
    pid INTEGER
);
CREATE TABLE IF NOT EXISTS host_results (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    host TEXT NOT NULL,
    ready INTEGER NOT NULL,
    release_id TEXT,
    changed INTEGER NOT NULL,
    gates TEXT NOT NULL,
    duration_s {real} NOT NULL,
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
    at {real} NOT NULL,
    event TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS host_results_by_host ON host_results(host);
CREATE TABLE IF NOT EXISTS watch_transitions (
    {seq}
    at {real} NOT NULL,
    host TEXT NOT NULL,
    before TEXT,
    after TEXT NOT NULL,
    evidence TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS watch_transitions_by_host ON watch_transitions(host, at);
CREATE TABLE IF NOT EXISTS acceptance_samples (
    {seq}
    at {real} NOT NULL,
    host TEXT NOT NULL,
    source TEXT NOT NULL,
    release_id TEXT,
    mean_acceptance_length {real} NOT NULL,
    mean_acceptance_length_low {real},
    acceptance_rate {real} NOT NULL,
    drafts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS acceptance_samples_by_host ON acceptance_samples(host, at);
CREATE TABLE IF NOT EXISTS speedup_baselines (
    {seq}
    at {real} NOT NULL,
    key TEXT NOT NULL,
    concurrency INTEGER NOT NULL,
    host TEXT NOT NULL,
    what TEXT NOT NULL,
    runs TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS speedup_baselines_by_key ON speedup_baselines(key, concurrency);
CREATE TABLE IF NOT EXISTS serving_load (
    {seq}
    at {real} NOT NULL,
    host TEXT NOT NULL,
    running {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS serving_load_by_host ON serving_load(host, at);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    user_name TEXT NOT NULL,
    controller TEXT NOT NULL,
    pid INTEGER NOT NULL,
    since {real} NOT NULL,
    run TEXT NOT NULL
);
"""

# Upgrades from each version to the next (SQLite files written before the schema had a version
# are version 1: no who-ran-it columns, no leases).
UPGRADES: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE runs ADD COLUMN user_name TEXT",
        "ALTER TABLE runs ADD COLUMN controller TEXT",
        "ALTER TABLE runs ADD COLUMN pid INTEGER",
    ),
}


@dataclass(frozen=True)
class Holder:
    """Who holds a rollout lease: the controller's user, host and pid, since when, and its run."""

    user: str
    controller: str
    pid: int
    since: float
    run: str

    @classmethod
    def of(cls, row: Sequence[Any]) -> Holder:
        """A holder from its leases row (user_name, controller, pid, since, run)."""
        return cls(str(row[0]), str(row[1]), int(row[2]), float(row[3]), str(row[4]))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{self.user}@{self.controller} pid {self.pid}, since {when}, run {self.run}"


class LockHeld(StateError):
    """Another controller holds the rollout lease of some of the targets past --lock-timeout."""

    def __init__(self, name: str, holder: Holder | None, waited: float) -> None:
        who = holder.describe() if holder else "a controller that left no record"
        super().__init__(f"{name} is being rolled out by {who} (waited {waited:g} s; --lock-timeout)")
        self.name, self.holder = name, holder


class StateUrlError(StateError):
    """A state URL this controller cannot use: its scheme, its form, the driver, the credentials or
    a store of a newer schema (bad input: exit 2)."""

    exit_code = EXIT_BAD_INPUT


# libpq takes a password in the query string too (``?password=...``, and ``sslpassword`` for
# the client key), its keys and values percent-decoded (``pass%77ord=`` is ``password=``): each
# is a secret wherever it is written, under any spelling libpq reads.
_SECRET_KEYS = frozenset({"password", "sslpassword"})
# libpq's other form, ``host=... password=...`` (a value quoted in '' may hold spaces and \'):
# not a state URL, but said back in the error that refuses it.
_CONNINFO_SECRET = re.compile(r"(?i)\b((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|\S*)")


def _redact_query(query: str) -> str:
    items = re.split(r"([&;])", query)
    for i in range(0, len(items), 2):
        key, eq, _ = items[i].partition("=")
        if eq and unquote(key).strip().lower() in _SECRET_KEYS:
            items[i] = f"{key}=***"
    return "".join(items)


def redact(url: str) -> str:
    """The URL with its passwords replaced (the user's, and any in its query string under any
    spelling libpq decodes), as every message shows it; a libpq ``key=value`` string (no
    ``scheme://``) with its ``password=`` values replaced."""
    if "://" not in url:
        return _CONNINFO_SECRET.sub(r"\1***", url)
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        user = netloc[0].split(":", 1)[0]
        parts = parts._replace(netloc=f"{user}:***@{netloc[1]}")
    query, fragment = _redact_query(parts.query), _redact_query(parts.fragment)
    if parts.password is None and (query, fragment) == (parts.query, parts.fragment):
        return url  # nothing secret: as written
    return urlunsplit(parts._replace(query=query, fragment=fragment))


def whoami() -> tuple[str, str, int]:
    """The controller as runs and leases name it: its user, host and pid."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return user, socket.gethostname(), os.getpid()


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
        if not os.path.lexists(path):
            _create_key(path)
        text = _read_key(path).strip()
        bytes.fromhex(text)
        if len(text) != 64:
            raise ValueError(f"{len(text)} hex digits") from None
        return text
    except (OSError, ValueError) as exc:
        raise StateError(f"the digest key {path} cannot be used: {exc}") from exc


def _read_key(path: Path) -> str:
    """The key file's text, only from a regular file of this user that no one else may read (as
    OpenSSH takes a private key): a link is not followed, a FIFO or device is not waited on, and
    a key others could read could sign a planted digest cache line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError("it is a symbolic link, not the key file") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError("it is not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(f"it belongs to uid {st.st_uid}, not this user")
        if st.st_mode & 0o077:
            raise OSError(f"others may read or write it (mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 it")
        data = f.read(1024)
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("it is not hex text") from None


def _create_key(path: Path) -> None:
    """The key written whole in a file of its own, then linked into place only if none is there:
    a controller killed mid-write leaves no empty key, and of two made at once the first linked
    is the one both use."""
    fd, tmp = tempfile.mkstemp(prefix=".digest-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


@dataclass(frozen=True)
class _Dialect:
    """What differs between the two stores: the generated key, floats, the order rows were written
    in, the parameter mark, and how to ask whether a table exists."""

    name: str
    id: str
    bigint: str
    real: str
    seq_column: str  # a column of its own for write order ("" where the store has rowid)
    seq: str
    mark: str
    has_table: str

    def schema(self) -> list[str]:
        text = SCHEMA.format(id=self.id, real=self.real, seq=self.seq_column, bigint=self.bigint)
        return [stmt.strip() for stmt in text.split(";") if stmt.strip()]

    def sql(self, text: str) -> str:
        return text if self.mark == "?" else text.replace("?", self.mark)


SQLITE = _Dialect(
    "sqlite", "INTEGER PRIMARY KEY", "INTEGER", "REAL", "", "rowid", "?",
    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
)  # fmt: skip
POSTGRESQL = _Dialect(
    "postgresql", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY", "BIGINT", "DOUBLE PRECISION",
    "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,", "id", "%s", "SELECT to_regclass(?) IS NOT NULL",
)  # fmt: skip
_SCHEMA_LOCK = 0x64666C617368  # serialises two controllers opening a new PostgreSQL store at once


def _present(rows: list[Any]) -> bool:
    """What a dialect's ``has_table`` answered: a row (SQLite) or a true one (PostgreSQL)."""
    return bool(rows) and bool(rows[0][0])


def _lock_key(name: str) -> int:
    """The advisory lock key of a rollout lease (a signed 64-bit int, as PostgreSQL takes it)."""
    return int.from_bytes(
        hashlib.sha256(f"dflash-orchestrator rollout {name}".encode()).digest()[:8], "big", signed=True
    )


class StateDB:
    """The controller's state, on SQLite (the default: a file per user) or on PostgreSQL (a team's,
    shared): runs, per-host gates, digests and the audit log; watch's samples and transitions;
    rollout leases."""

    def __init__(self, directory: Path | None = None, url: str | None = None) -> None:
        url = url or os.environ.get("ORCHESTRATE_STATE_URL") or None
        self.directory = directory or default_state_dir()
        self._baselines_lock = threading.Lock()
        self._load_at: dict[str, float] = {}  # when each host's watched load was last sampled
        self._load_pruned_at = float("-inf")
        self._abandoned = False  # a write left blocked on the connection (abandon)
        self.url = url
        self.conn: Any
        if url is None:
            self.path: Path | None = self.directory / "state.db"
            self.where = str(self.path)
            self._open_sqlite(self.path)
        else:
            parts = urlsplit(url)
            scheme = parts.scheme.split("+", 1)[0]
            self.where = redact(url)
            if scheme == "sqlite":
                if not parts.path or parts.path == "/":
                    raise StateUrlError(f"state URL {self.where}: no database file (sqlite:///path/to/state.db)")
                self.path = Path(parts.path)
                self._open_sqlite(self.path)
            elif scheme in ("postgresql", "postgres"):
                self.path = None
                self._open_postgresql(urlunsplit(parts._replace(scheme="postgresql")))
            elif not parts.scheme:  # libpq's key=value form, or a path
                raise StateUrlError(
                    f"state URL {self.where}: not a URL (postgresql://user@host/database or sqlite:///path/state.db)"
                )
            else:
                raise StateUrlError(f"state URL {self.where}: scheme {parts.scheme!r} is neither sqlite nor postgresql")
        deadline = time.monotonic() + 30
        while True:
            try:
                self._migrate()
                return
            except StateError as exc:
                # A new SQLite file that another controller is switching to WAL, making or
                # recovering answers "locked" at once, without its busy timeout: asked again, as long.
                if self.dialect is not SQLITE or "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    # --- the two stores ------------------------------------------------------------------

    def _open_sqlite(self, path: Path) -> None:
        self.dialect = SQLITE
        self._errors: tuple[type[Exception], ...] = (sqlite3.Error,)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # autocommit: every transaction is our own BEGIN IMMEDIATE ... COMMIT
            # one connection for the run's threads: the speed-up gate's baselines are read and
            # kept from the hosts' threads, one at a time (``_baselines_lock``)
            self.conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise StateError(f"state database {self.where}: {exc}") from exc

    def _open_postgresql(self, dsn: str) -> None:
        self.dialect = POSTGRESQL
        self._dsn = dsn
        try:
            import psycopg
        except ImportError:
            raise StateUrlError(
                f"state URL {self.where}: PostgreSQL needs psycopg 3 (pip install 'dflash-orchestrator[postgres]')"
            ) from None
        self._errors = (psycopg.Error,)
        self.conn = self._pg_connect()

    def _pg_connect(self, autocommit: bool = False) -> Any:
        import psycopg

        try:
            return psycopg.connect(self._dsn, autocommit=autocommit, connect_timeout=10, application_name="orchestrate")
        except psycopg.Error as exc:
            text = " ".join(str(exc).split())
            # credentials, or a database or role that is not there: the URL is wrong, not the network
            if any(w in text for w in ("password authentication failed", "no password supplied", "does not exist")):
                raise StateUrlError(f"state database {self.where}: {text}") from None
            raise StateError(f"state database {self.where} cannot be reached: {text}") from None

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        """PostgreSQL: the block's calls give up after ``STORE_CALL_S`` (``_answered``); a session
        a call before was cut from is replaced first. SQLite has its own busy timeout."""
        if self.dialect is not POSTGRESQL:
            yield
            return
        if (self.conn.closed or self.conn.broken) and not self._abandoned:
            self.conn = self._pg_connect()
        with _answered(self.conn, STORE_CALL_S, self.where):
            yield

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction, committed at the end or rolled back on any error; errors of either
        store come out as StateError naming the store."""
        self._alive()
        with self._answering(), self._tx_unbounded() as cur:
            yield cur

    def _alive(self) -> None:
        """PostgreSQL: a session the server ended (a restart, a failover, an administrator) is
        replaced before a write is sent on it (a run's record was lost on the old session after a
        restart). One round trip; a write that fails past it is not sent again (it may have been
        committed)."""
        if self.dialect is not POSTGRESQL or self._abandoned:
            return
        try:
            with self._answering():
                self.conn.execute("SELECT 1")
                self.conn.rollback()
        except StoreUnanswered:
            raise
        except Exception as exc:
            ended = isinstance(exc, (StateError, *self._errors)) and (self.conn.closed or self.conn.broken)
            if not ended:
                raise
            self.conn = self._pg_connect()

    @contextlib.contextmanager
    def _tx_unbounded(self) -> Iterator[Any]:
        cur = None
        try:
            cur = self.conn.cursor()
            if self.dialect is SQLITE:
                cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                with contextlib.suppress(*self._errors):
                    self.conn.rollback() if self.dialect is POSTGRESQL else cur.execute("ROLLBACK")
                raise
            if self.dialect is SQLITE:
                cur.execute("COMMIT")
            else:
                self.conn.commit()
        except self._errors as exc:
            raise StateError(f"state database {self.where}: {' '.join(str(exc).split())}") from exc
        finally:
            if cur is not None:
                with contextlib.suppress(*self._errors):
                    cur.close()

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            with self._answering():
                return self._query_unbounded(sql, args)
        except StoreUnanswered:
            raise
        except StateError:
            # a read on a session the server ended (a restart): asked again on a new one
            retry = self.dialect is POSTGRESQL and not self._abandoned and sql.lstrip().upper().startswith("SELECT")
            if not retry or not (self.conn.closed or self.conn.broken):
                raise
        with self._answering():  # a new session: the one that failed is broken
            return self._query_unbounded(sql, args)

    def _query_unbounded(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            cur = self.conn.cursor()
            try:
                cur.execute(self.dialect.sql(sql), tuple(args))
                rows = list(cur.fetchall())
            finally:
                cur.close()
            if self.dialect is POSTGRESQL:
                self.conn.rollback()  # end the read's transaction: no session left idle in one
            return rows
        except self._errors as exc:
            raise StateError(f"state database {self.where}: {' '.join(str(exc).split())}") from exc

    def _migrate(self) -> None:
        """Bring the store to SCHEMA_VERSION: create it when new, upgrade it when older, refuse it
        when newer (this controller would misread it)."""
        d = self.dialect
        if d is SQLITE:
            self._query("PRAGMA journal_mode=WAL")
        # A store at this version is only read (no write transaction): it opens read-only too
        # (history, report), and says it cannot be written only where a run writes.
        if _present(self._query(d.has_table, ("schema_version",))):
            rows = self._query("SELECT version FROM schema_version")
            if rows and self._version(rows[0][0]) == SCHEMA_VERSION:
                return
        if d is POSTGRESQL:
            # Two controllers opening a new store at once: one makes it, the other waits and finds
            # it made. A session lock taken before the transaction, so the transaction that follows
            # sees the catalog as the first left it.
            self._query("SELECT pg_advisory_lock(?)", (_SCHEMA_LOCK,))
        try:
            self._upgrade()
        finally:
            if d is POSTGRESQL:
                self._query("SELECT pg_advisory_unlock(?)", (_SCHEMA_LOCK,))

    def _version(self, value: object) -> int:
        """The stored schema version, which only this tool writes: anything but a small integer
        means the store is not one it wrote, or was damaged, and nothing is written to it."""
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**6:
            return value
        shown = repr(value)[:40]
        raise StateUrlError(
            f"state database {self.where} has schema version {shown}, not a version this tool writes: "
            "it was not made by orchestrate, or it was damaged"
        )

    def _upgrade(self) -> None:
        d = self.dialect
        with self._tx() as cur:
            cur.execute(d.sql(d.has_table), ("schema_version",))  # again: another may have made it
            row = None
            existed = _present(cur.fetchall())
            if existed:
                cur.execute("SELECT version FROM schema_version")
                row = cur.fetchone()
            else:
                cur.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            if row is None and existed:
                # the table this tool makes with its row, emptied since (by hand, by another tool):
                # the version cannot be known, and guessing the oldest upgraded a current store
                # ("duplicate column name"). Nothing is written.
                raise StateUrlError(
                    f"state database {self.where} has an empty schema_version table: its version cannot be known "
                    "(it was emptied, or not made by orchestrate); restore its row or use another store"
                )
            if row is None:
                cur.execute(d.sql(d.has_table), ("runs",))
                version = 1 if _present(cur.fetchall()) else 0  # 1: a file from before versions
                cur.execute(d.sql("INSERT INTO schema_version (version) VALUES (?)"), (version,))
            else:
                version = self._version(row[0])
            if version > SCHEMA_VERSION:
                raise StateUrlError(
                    f"state database {self.where} has schema version {version}, newer than this orchestrate knows "
                    f"({SCHEMA_VERSION}): use the orchestrate that wrote it, or a newer one"
                )
            if version and version < SCHEMA_VERSION:
                for v in range(version, SCHEMA_VERSION):
                    for stmt in UPGRADES.get(v, ()):
                        cur.execute(stmt)
            if version < SCHEMA_VERSION:
                for stmt in d.schema():
                    cur.execute(stmt)
                cur.execute(d.sql("UPDATE schema_version SET version = ?"), (SCHEMA_VERSION,))

    def abandon(self) -> None:
        """A write on this store did not answer in time, and its thread is left blocked on the
        connection: ``close`` then leaves the connection to the process's end. Closing it under
        that thread freed libpq's state while the thread was still in it, and when the server
        answered the process aborted (``Fatal Python error: Aborted``)."""
        self._abandoned = True

    def close(self) -> None:
        """Close the store (what was committed stays), unless a write left blocked on it holds
        its connection (``abandon``)."""
        if self._abandoned:
            return
        with contextlib.suppress(*self._errors):
            self.conn.close()

    def check_writable(self) -> None:
        """Write and commit a row, before a run touches any host: a store that is read-only,
        locked past its timeout, full or gone is said now, not after the hosts changed."""
        try:
            with self._tx() as cur:
                cur.execute(
                    self.dialect.sql(
                        "INSERT INTO checks (what, at) VALUES ('writable', ?) "
                        "ON CONFLICT (what) DO UPDATE SET at = excluded.at"
                    ),
                    (time.time(),),
                )
        except StateError as exc:
            raise StateError(f"{exc} (cannot be written)") from exc

    # --- what is recorded ------------------------------------------------------------------

    def record(self, run: RunReport) -> int:
        """A run, its hosts' gates, digests and acceptance, and the host keys it accepted, in one
        transaction, with who ran it (user, host, pid)."""
        q = self.dialect.sql
        user, controller, pid = whoami()
        with self._tx() as cur:
            cur.execute(
                q(
                    "INSERT INTO runs (kind, playbook, inventory, release_id, started, finished, ok, hosts_total, "
                    "hosts_ready, user_name, controller, pid) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id"
                ),
                (
                    str(run.kind),  # the value, as every driver stores a str
                    run.playbook,
                    run.inventory,
                    run.release_id,
                    run.started,
                    run.finished,
                    int(run.ok),
                    len(run.hosts),
                    sum(h.ready for h in run.hosts),
                    user,
                    controller,
                    pid,
                ),
            )
            run_id = int(cur.fetchone()[0])
            cur.executemany(
                q(
                    "INSERT INTO host_results (run_id, host, ready, release_id, changed, gates, duration_s) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)"
                ),
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
            digests = [
                (run_id, h.name, f.remote_path, f.sha256, f.expected, int(f.changed))
                for h in run.hosts
                for f in h.files
            ]
            if digests:
                cur.executemany(
                    q(
                        "INSERT INTO file_digests (run_id, host, remote_path, sha256, expected_sha256, changed) "
                        "VALUES (?, ?, ?, ?, ?, ?)"
                    ),
                    digests,
                )
            self._insert_samples(
                cur,
                [
                    (run.finished, h.name, str(run.kind), h.release_id, *numbers)
                    for h in run.hosts
                    if (numbers := _acceptance_numbers(h.gates.get(GATE_ACCEPTANCE))) is not None
                ],
            )
            keys = [(run_id, run.finished, "host_key_accepted", key) for key in run.accepted_host_keys]
            if keys:
                cur.executemany(q("INSERT INTO audit (run_id, at, event, detail) VALUES (?, ?, ?, ?)"), keys)
        return run_id

    def _insert_samples(self, cur: Any, rows: list[tuple[Any, ...]]) -> None:
        if rows:
            cur.executemany(
                self.dialect.sql(
                    "INSERT INTO acceptance_samples (at, host, source, release_id, mean_acceptance_length, "
                    "mean_acceptance_length_low, acceptance_rate, drafts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                ),
                rows,
            )

    def record_watch(self, transitions: list[Transition], rounds: list[Round]) -> None:
        """A watch round: its transitions with their evidence, and each window it judged."""
        with self._tx() as cur:
            if transitions:
                cur.executemany(
                    self.dialect.sql(
                        "INSERT INTO watch_transitions (at, host, before, after, evidence) VALUES (?, ?, ?, ?, ?)"
                    ),
                    [(t.at, t.host, t.before, t.after, json.dumps(t.to_json())) for t in transitions],
                )
            self._insert_samples(
                cur,
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
            # The load a speed-up gate reads (``concurrency: observed``): one sample a host a
            # minute, kept a week. A row a host a round grew by 8.8 million rows a day at 1,024
            # hosts; a week of these is at most 10 million, and a median or 90th percentile of the
            # requests running does not move for the rounds between them.
            now = time.time()
            if now - self._load_pruned_at >= LOAD_PRUNE_S:
                cur.execute(self.dialect.sql("DELETE FROM serving_load WHERE at < ?"), (now - LOAD_KEEP_S,))
                self._load_pruned_at = now
            load = []
            for r in rounds:
                if r.running is not None and r.at - self._load_at.get(r.host, float("-inf")) >= LOAD_SAMPLE_S:
                    self._load_at[r.host] = r.at
                    load.append((r.at, r.host, r.running))
            if load:
                cur.executemany(self.dialect.sql("INSERT INTO serving_load (at, host, running) VALUES (?, ?, ?)"), load)

    def keep_baseline(self, key: str, what: str, host: str, runs: dict[int, list[dict[str, Any]]]) -> None:
        """The speed-up gate's baseline arm as one host measured it: per concurrency its runs
        (``speedup.Run.to_json``), under the key of what it depends on (``what`` says it in words)."""
        now = time.time()
        rows = [(now, key, c, host, what, json.dumps(r)) for c, r in sorted(runs.items())]
        with self._baselines_lock, self._tx() as cur:
            cur.executemany(
                self.dialect.sql(
                    "INSERT INTO speedup_baselines (at, key, concurrency, host, what, runs) VALUES (?, ?, ?, ?, ?, ?)"
                ),
                rows,
            )

    def observed_load(self, hosts: Sequence[str], since: float) -> list[tuple[str, float]]:
        """The requests each of ``hosts``' servers ran at each watch round since ``since``:
        (host, running), oldest first."""
        if not hosts:
            return []
        marks = ", ".join("?" for _ in hosts)
        rows = self._query(
            f"SELECT host, running FROM serving_load WHERE at >= ? AND host IN ({marks}) ORDER BY at, {self.dialect.seq}",
            (since, *hosts),
        )
        # a row another writer put there (text, NaN, a negative count) is no observation
        return [
            (str(h), float(r))
            for h, r in rows
            if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and 0 <= r <= 1 << 20
        ]

    def baseline(self, key: str) -> dict[int, dict[str, Any]]:
        """The last baseline kept under ``key``, per concurrency: its runs, who measured it, when."""
        with self._baselines_lock:
            rows = self._query(
                f"SELECT concurrency, at, host, what, runs FROM speedup_baselines WHERE key = ? "
                f"ORDER BY at, {self.dialect.seq}",
                (key,),
            )
        out: dict[int, dict[str, Any]] = {}
        for c, at, host, what, runs in rows:
            # A row is data (another tool's, a damaged one): one that does not read as a level's
            # runs is no baseline, never an error in the middle of a rollout.
            try:
                level, when, kept = int(c), float(at), json.loads(runs)
            except (TypeError, ValueError, RecursionError):
                continue
            if isinstance(c, bool) or not 1 <= level <= 4096 or not math.isfinite(when):
                continue
            if isinstance(kept, list) and all(isinstance(r, dict) for r in kept):
                out[level] = {"at": when, "host": str(host), "what": str(what), "runs": kept}
        return out

    # --- what is read ----------------------------------------------------------------------

    def transitions(self, host: str | None = None) -> list[dict[str, Any]]:
        """watch's state changes of a host (or all hosts), oldest first: in the order they were
        recorded, which is the order they happened (one watcher of a group records at a time).
        Each ``at`` is the clock of the watcher that saw it: ordered by those, a watcher whose
        clock was behind the one before it put its later changes first, and a host's last state
        was an older one."""
        query, args = "SELECT evidence FROM watch_transitions", []
        if host:
            query += " WHERE host = ?"
            args.append(host)
        rows = self._query(f"{query} ORDER BY {self.dialect.seq}", args)
        return [json.loads(row[0]) for row in rows]

    def last_states(self) -> dict[str, str]:
        """Each host's state as last recorded by watch (its last transition's, in write order)."""
        rows = self._query(f"SELECT host, after FROM watch_transitions ORDER BY {self.dialect.seq}")
        return {host: after for host, after in rows}

    def samples(self, host: str | None = None) -> list[dict[str, Any]]:
        """Acceptance samples of a host (or all hosts), oldest first."""
        names: tuple[str, ...] = ("at", "host", "source", "release_id", "mean_acceptance_length")
        names += ("mean_acceptance_length_low", "acceptance_rate", "drafts")
        query, args = f"SELECT {', '.join(names)} FROM acceptance_samples", []
        if host:
            query += " WHERE host = ?"
            args.append(host)
        rows = self._query(f"{query} ORDER BY at, {self.dialect.seq}", args)
        return [dict(zip(names, row, strict=True)) for row in rows]

    RUN_COLUMNS = (
        "id", "kind", "playbook", "release_id", "started", "finished", "ok", "hosts_total", "hosts_ready",
        "user_name", "controller", "pid",
    )  # fmt: skip

    def history(self, limit: int = 20, host: str | None = None) -> list[dict[str, Any]]:
        """The runs recorded (by every controller that shares the store), newest first, with their
        per-host results and who ran each (``by``: user, host, pid; None for runs recorded before
        the store kept it)."""
        query, args = f"SELECT {', '.join(self.RUN_COLUMNS)} FROM runs", []
        if host:
            query += " WHERE id IN (SELECT run_id FROM host_results WHERE host = ?)"
            args.append(host)
        rows = self._query(query + " ORDER BY id DESC LIMIT ?", [*args, limit])
        runs = []
        for row in rows:
            run = dict(zip(self.RUN_COLUMNS, row, strict=True))
            run["ok"] = bool(run["ok"])
            user, controller, pid = run.pop("user_name"), run.pop("controller"), run.pop("pid")
            run["by"] = {"user": user, "host": controller, "pid": pid} if user is not None else None
            hosts = self._query(
                "SELECT host, ready, release_id, changed, gates, duration_s FROM host_results WHERE run_id = ? "
                "ORDER BY host",
                (run["id"],),
            )
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
        rows = self._query(
            "SELECT host, remote_path, sha256, expected_sha256, changed FROM file_digests WHERE run_id = ? "
            "ORDER BY host, remote_path",
            (run_id,),
        )
        return [
            {"host": r[0], "remote_path": r[1], "sha256": r[2], "expected_sha256": r[3], "changed": bool(r[4])}
            for r in rows
        ]

    # --- the fleet-wide rollout lock ----------------------------------------------------------

    @contextlib.contextmanager
    def rollout_lock(
        self,
        names: Sequence[str],
        run: str,
        timeout: float,
        on_wait: Callable[[str, Holder | None], None] | None = None,
        stop: threading.Event | None = None,
        on_lost: Callable[[str], None] | None = None,
        on_unanswered: Callable[[str], None] | None = None,
    ) -> Iterator[None]:
        """Hold the rollout lease of each target for the block: on PostgreSQL a session-scoped
        advisory lock per target (disjoint rollouts run side by side; a controller that dies
        releases its leases with its session) and a row that names the holder. A lease another
        controller holds is waited for up to ``timeout`` seconds (``on_wait`` is told once per
        holder), then LockHeld names it; ``stop`` set while waiting (a run's interrupt) ends the wait
        as a Ctrl-C always did. On SQLite (one controller's own file) there is nothing
        to share: each host's deploy-root lock keeps runs apart.

        Held, the lease is checked every ``LEASE_CHECK_S``: a session the database ended (a
        restart, a failover, an administrator) took the advisory locks with it, and another
        controller could roll out these hosts beside this one. It is taken again on a new session
        if no one took it meanwhile; otherwise ``on_lost`` is told why, once, and the caller
        starts no new host. Let go within ``LET_GO_S`` at the block's end: a store that stops
        answering (its server stopped, not down) is left holding it until this controller's session
        ends, and ``on_unanswered`` is told (the controller waited there, before its table, for as
        long as the server was stopped)."""
        if self.dialect is not POSTGRESQL or not names:
            yield
            return
        import psycopg

        session = self._pg_connect(autocommit=True)
        keys = sorted({_lock_key(n): n for n in names}.items())
        deadline = time.monotonic() + timeout
        told: Holder | str | None = "nobody"
        try:
            while True:
                with _answered(session, STORE_CALL_S, self.where):  # each poll of the wait
                    rows = session.execute(
                        "SELECT k, pg_try_advisory_lock(k) FROM unnest(%s::bigint[]) AS k", ([k for k, _ in keys],)
                    ).fetchall()
                    blocked = [k for k, got in rows if not got]
                    if not blocked:
                        break
                    taken = [k for k, got in rows if got]
                    if taken:
                        session.execute("SELECT pg_advisory_unlock(k) FROM unnest(%s::bigint[]) AS k", (taken,))
                    name = dict(keys)[blocked[0]]
                    holder = self._holder(session, name)
                if time.monotonic() >= deadline:
                    raise LockHeld(name, holder, timeout)
                if on_wait is not None and holder != told:
                    on_wait(name, holder)
                    told = holder
                pause = min(0.1, max(0.0, deadline - time.monotonic()))
                if stop is None:
                    time.sleep(pause)
                elif stop.wait(pause):
                    # nothing was taken yet: the run ends as interrupted, every host named
                    raise LeaseWaitStopped(name, holder.describe() if holder else "a controller that left no record")
            user, controller, pid = whoami()
            _name_holder(session, keys, (user, controller, pid, time.time(), run))
            keeper = _LeaseKeeper(self, session, keys, (user, controller, pid, time.time(), run), on_lost)
            try:
                yield
            finally:
                held = keeper.close(LET_GO_S)

                def let_go() -> None:
                    with contextlib.suppress(psycopg.Error):
                        held.execute(
                            "DELETE FROM leases WHERE name = ANY(%s) AND controller = %s AND pid = %s",
                            ([n for _, n in keys], controller, pid),
                        )
                    _release(held)

                session = None  # let go here, or left to the session's end
                answered = held is not None and _within(let_go, LET_GO_S)
                if not answered and on_unanswered is not None:
                    on_unanswered(
                        f"the rollout lease was not let go: state database {self.where} did not answer within "
                        f"{LET_GO_S:g} s (it holds the lease until this controller's session ends)"
                    )
        except psycopg.Error as exc:
            raise StateError(f"state database {self.where}: {' '.join(str(exc).split())}") from exc
        finally:
            if session is not None:
                _release(session)

    @contextlib.contextmanager
    def gateway_lock(self, gateway: str, timeout: float) -> Iterator[None]:
        """Held while a controller reads a gateway's rotation and takes a server out: controllers
        with disjoint targets behind one gateway each counted the other's host as serving, and
        took theirs out at once, under ``rollout.min_in_rotation``. On PostgreSQL a session
        advisory lock; on SQLite an flock beside the database file (controllers of one machine).
        StateError when another holds it past ``timeout``."""
        deadline = time.monotonic() + timeout
        if self.dialect is POSTGRESQL:
            import psycopg

            session = self._pg_connect(autocommit=True)
            try:
                key = _lock_key(f"gateway {gateway}")

                def taken() -> bool:
                    with _answered(session, STORE_CALL_S, self.where):
                        return bool(session.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0])

                while not taken():
                    if time.monotonic() > deadline:
                        raise StateError(f"the rotation lock of gateway {gateway} was held past {timeout:g} s")
                    time.sleep(0.05)
                yield
            except psycopg.Error as exc:
                raise StateError(f"state database {self.where}: {' '.join(str(exc).split())}") from exc
            finally:
                _release(session)
            return
        import fcntl

        assert self.path is not None
        digest = hashlib.sha256(gateway.encode()).hexdigest()[:16]
        path = self.path.resolve().parent / f"{self.path.name}.gateway-{digest}.lock"
        try:
            f = open(path, "a")  # noqa: SIM115 - held for the block
        except OSError as exc:
            raise StateError(f"the rotation lock {path}: {exc.strerror or exc}") from None
        try:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise StateError(
                            f"the rotation lock of gateway {gateway} was held past {timeout:g} s"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            f.close()

    def watch_lead(self, group: str) -> WatchLead:
        """The lead of a watch group: the one watcher of many that records transitions and runs
        --on-change (``WatchLead``)."""
        return WatchLead(self, group)

    @staticmethod
    def _holder(session: Any, name: str) -> Holder | None:
        row = session.execute(
            "SELECT user_name, controller, pid, since, run FROM leases WHERE name = %s", (name,)
        ).fetchone()
        return Holder.of(row) if row else None


# How often a held rollout lease is checked: the longest a controller may go on not knowing
# that its database session (and the advisory locks with it) ended.
LEASE_CHECK_S = 1.0
_HELD = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()"


def _name_holder(session: Any, keys: list[tuple[int, str]], row: tuple[Any, ...]) -> None:
    """The leases rows that name this controller as the holder of ``keys``."""
    with session.transaction():
        session.cursor().executemany(
            "INSERT INTO leases (name, user_name, controller, pid, since, run) VALUES (%s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (name) DO UPDATE SET user_name = excluded.user_name, controller = excluded.controller, "
            "pid = excluded.pid, since = excluded.since, run = excluded.run",
            [(n, *row) for _, n in keys],
        )


# The watched load (``serving_load``): one sample a host this often, kept this long (the speed-up
# gate's ``concurrency: observed`` reads a week: rules.gates.speedup.OBSERVED_DAYS), pruned this often.
LOAD_SAMPLE_S = 60.0
LOAD_KEEP_S = 7 * 86400.0
LOAD_PRUNE_S = 3600.0

# How long a controller waits for the store to let its rollout lease go, the run done.
LET_GO_S = 15.0
# How long a block of PostgreSQL calls (a transaction, a read, one poll of the lease wait) may go
# unanswered. A server stopped (SIGSTOP, a frozen VM) has its kernel acknowledge every packet, and a
# network that drops without a reset sends nothing back: no socket option ends either wait, and
# ``watch`` ran no round for as long, its metrics keeping a dead host READY. Far above what any
# statement of the tool takes (a run's record of 1,024 hosts: under a second).
STORE_CALL_S = 60.0


class StoreUnanswered(StateError):
    """A call on a shared store that did not answer in time (its session was given up)."""


@contextlib.contextmanager
def _answered(conn: Any, seconds: float, where: str) -> Iterator[None]:
    """The block's calls on ``conn`` (psycopg) fail as StateError after ``seconds``: a timer shuts
    the session's socket (the blocked read then ends with an error in this thread: nothing is left
    waiting), and the session is not used again."""
    fired = threading.Event()
    fd = conn.fileno()

    def cut() -> None:
        fired.set()
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as exc:
        if fired.is_set():
            raise StoreUnanswered(
                f"state database {where} did not answer within {seconds:g} s (its server stopped, or the network "
                "to it dropped without a reset); the session was given up"
            ) from exc
        raise
    else:
        if fired.is_set():  # cut as the block ended: the session is not used again
            with contextlib.suppress(Exception):
                conn.close()
    finally:
        timer.cancel()


def _within(work: Callable[[], None], seconds: float) -> bool:
    """``work`` in a thread of its own, waited for at most ``seconds``: whether it ended. One left
    blocked on a store that does not answer ends with the process (a daemon thread)."""
    thread = threading.Thread(target=work, name="store-let-go", daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def _release(session: Any) -> None:
    """A session's advisory locks released, then the session closed. Unlocked first, and waited
    for: a closed connection's locks go when the server has ended its backend, after ``close``
    returned, and a controller starting at once found the lock held and the holder's row gone
    ("a controller that left no record")."""
    import psycopg

    with contextlib.suppress(psycopg.Error):
        session.execute("SELECT pg_advisory_unlock_all()")
    with contextlib.suppress(psycopg.Error):
        session.close()


class _LeaseKeeper:
    """A thread that checks a held rollout lease every ``LEASE_CHECK_S`` and takes it again on a
    new session when the database ended the old one, or tells ``on_lost`` that it cannot."""

    def __init__(
        self,
        db: StateDB,
        session: Any,
        keys: list[tuple[int, str]],
        row: tuple[Any, ...],
        on_lost: Callable[[str], None] | None,
    ) -> None:
        self.db, self.session, self.keys, self.row, self.on_lost = db, session, keys, row, on_lost
        self.lock = threading.Lock()  # the session is used by one thread at a time
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._keep, name="rollout-lease", daemon=True)
        self.thread.start()

    def close(self, timeout: float) -> Any:
        """Stop checking; the session that holds the lease now (the caller ends it), or None when
        the check in flight did not end within ``timeout`` (the store does not answer)."""
        self.done.set()
        self.thread.join(timeout)
        return None if self.thread.is_alive() else self.session

    def _keep(self) -> None:
        import psycopg

        while not self.done.wait(LEASE_CHECK_S):
            try:
                with self.lock:
                    held = int(self.session.execute(_HELD).fetchone()[0])
            except psycopg.Error:
                held = 0
            if held >= len(self.keys):
                continue
            why = self._take_again()
            if why is None:
                continue
            if self.on_lost is not None:
                self.on_lost(why)
            return

    def _take_again(self) -> str | None:
        """The lease on a new session (None), or why it cannot be."""
        import psycopg

        with contextlib.suppress(psycopg.Error):
            self.session.close()
        try:
            fresh = self.db._pg_connect(autocommit=True)
        except StateError as exc:
            return f"the rollout lease was lost with its database session, and cannot be taken again: {exc}"
        try:
            rows = fresh.execute(
                "SELECT k, pg_try_advisory_lock(k) FROM unnest(%s::bigint[]) AS k", ([k for k, _ in self.keys],)
            ).fetchall()
            blocked = [k for k, got in rows if not got]
            if blocked:
                name = dict(self.keys)[blocked[0]]
                holder = StateDB._holder(fresh, name)
                ours = holder is not None and (holder.user, holder.controller, holder.pid) == self.row[:3]
                who = holder.describe() if holder and not ours else "a controller that left no record"
                fresh.close()
                return f"the rollout lease of {name} was lost with its database session, and {who} holds it now"
            _name_holder(fresh, self.keys, self.row)
        except psycopg.Error as exc:
            with contextlib.suppress(psycopg.Error):
                fresh.close()
            return f"the rollout lease was lost with its database session, and cannot be taken again: {exc}"
        with self.lock:
            self.session = fresh
        return None


class WatchLead:
    """Which of the watchers of one group leads it. Every watcher runs its rounds and serves its
    metrics; the one holding the group's lock records the transitions and runs --on-change. The
    lock is a PostgreSQL session advisory lock on a shared store, an flock beside the file of a
    SQLite one: either goes with the process that held it, so a follower takes the lead at its
    next round (``poll``) after the leader dies. ``unreachable``: why the lock could not be asked
    for at the last poll (the store is down): then nobody can say who leads."""

    def __init__(self, db: StateDB, group: str) -> None:
        self.db, self.group = db, group
        self.leading = False
        self.unreachable: str | None = None
        self.name = f"watch {group}"
        self._session: Any = None
        self._file: Any = None

    def poll(self) -> bool:
        """Try for the lead if not holding it, check it is still held if holding it; whether this
        watcher leads now."""
        if self.db.dialect is POSTGRESQL:
            self.leading = self._poll_postgresql()
        else:
            self.leading = self._poll_file()
        return self.leading

    def holder(self) -> Holder | None:
        """Who leads the group, as the leader recorded it (None: nobody has, or it cannot be read)."""
        if self.db.dialect is POSTGRESQL:
            try:
                rows = self.db._query(
                    "SELECT user_name, controller, pid, since, run FROM leases WHERE name = ?", (self.name,)
                )
            except StateError:
                return None
            return Holder.of(rows[0]) if rows else None
        try:
            data = json.loads(self._path().read_text() or "null")
            return Holder.of((data["user"], data["host"], data["pid"], data["since"], data["run"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def close(self) -> None:
        """Give the lead up (a follower takes it at its next round)."""
        if self._session is not None:
            with contextlib.suppress(Exception):
                self._session.close()
            self._session = None
        if self._file is not None:
            self._file.close()  # the flock goes with the descriptor
            self._file = None
        self.leading = False

    def _poll_postgresql(self) -> bool:
        import psycopg

        try:
            if self._session is None or self._session.closed:
                self._session = self.db._pg_connect(autocommit=True)
                self.leading = False
            with _answered(self._session, STORE_CALL_S, self.db.where):
                return self._lead_postgresql()
        except (psycopg.Error, StateError) as exc:
            with contextlib.suppress(Exception):
                if self._session is not None:
                    self._session.close()
            self._session = None
            self.unreachable = " ".join(str(exc).split())
            return False

    def _lead_postgresql(self) -> bool:
        """Hold or take the lead on the watcher's session (the caller bounds its wait)."""
        if self.leading:
            self._session.execute("SELECT 1")  # a session lost (the database restarted) is a lead lost
            return True
        got = self._session.execute("SELECT pg_try_advisory_lock(%s)", (_lock_key(self.name),)).fetchone()[0]
        if got:
            user, controller, pid = whoami()
            self._session.execute(
                "INSERT INTO leases (name, user_name, controller, pid, since, run) VALUES (%s, %s, %s, %s, %s, "
                "'watch') ON CONFLICT (name) DO UPDATE SET user_name = excluded.user_name, controller = "
                "excluded.controller, pid = excluded.pid, since = excluded.since, run = excluded.run",
                (self.name, user, controller, pid, time.time()),
            )
        self.unreachable = None
        return bool(got)

    def _path(self) -> Path:
        """Beside the database the watchers share (its file's own directory): in the state
        directory, two watchers with one ``sqlite:///`` URL and two state directories each took
        a lead of their own, and every change was paged twice."""
        safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in self.group)
        if safe != self.group or len(safe) > 100:
            # written another way (``team/a`` and ``team_a`` shared one lead, and one of the two
            # groups never led), or too long for a file name: the exact name's digest tells them apart
            safe = f"{safe[:100]}-{hashlib.sha256(self.group.encode()).hexdigest()[:16]}"
        assert self.db.path is not None  # SQLite: a file
        return self.db.path.resolve().parent / f"{self.db.path.name}.watch-{safe}.lead"

    def _poll_file(self) -> bool:
        import fcntl

        if self._file is not None:
            return True
        path = self._path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            f = open(path, "a+")  # noqa: SIM115 - held open for as long as the lead is
        except OSError as exc:
            self.unreachable = f"{path}: {exc.strerror or exc}"
            return False
        self.unreachable = None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        user, controller, pid = whoami()
        f.truncate(0)
        f.write(json.dumps({"user": user, "host": controller, "pid": pid, "since": time.time(), "run": "watch"}))
        f.flush()
        self._file = f
        return True


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
