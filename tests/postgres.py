"""A real PostgreSQL for the tests: Debian's ``postgresql`` binaries, a cluster made in a temporary
directory, listening on a unix socket (trust, for the fixture's own role) and on a loopback port
(passwords, for the role the tests log in with), started and stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.services import free_port, stop

PASSWORD = "s3cret-for-tests"  # the loopback role's password (the fixture's own cluster only)


def _bindir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found:
        pytest.fail("PostgreSQL is not installed: scripts/bootstrap installs Debian's postgresql package")
    return found[-1].parent


@dataclass
class Postgres:
    """A running cluster: its socket directory, loopback port and PID."""

    dir: Path
    socket_dir: Path
    port: int
    pid: int
    bindir: Path

    def psql(self, sql: str, database: str = "postgres") -> str:
        out = subprocess.run(
            [str(self.bindir / "psql"), "-h", str(self.socket_dir), "-p", str(self.port), "-U", "postgres",
             "-d", database, "-v", "ON_ERROR_STOP=1", "-Atc", sql],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        return out.stdout.strip()

    def new_database(self) -> str:
        """A database of its own for one test, owned by the password role; its name."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.psql(f"CREATE DATABASE {name} OWNER alice")
        return name

    def socket_url(self, database: str) -> str:
        """The database through the unix socket (no password asked)."""
        return f"postgresql://postgres@/{database}?host={self.socket_dir}&port={self.port}"

    def tcp_url(self, database: str) -> str:
        """The database over loopback TCP as the role with a password; the password is not in it
        (it comes from PGPASSWORD or ~/.pgpass, as it should)."""
        return f"postgresql://alice@127.0.0.1:{self.port}/{database}"


@contextlib.contextmanager
def running_postgres(base: Path) -> Iterator[Postgres]:
    bindir = _bindir()
    user = pwd.getpwnam("postgres")
    base.mkdir(parents=True, exist_ok=True)
    data, sockets = base / "data", base / "sockets"
    sockets.mkdir(exist_ok=True)
    for path in (base, sockets):
        os.chown(path, user.pw_uid, user.pw_gid)
    as_postgres = {"user": user.pw_uid, "group": user.pw_gid, "env": {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}}
    subprocess.run(
        [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth-local=trust", "--auth-host=scram-sha-256",
         "-E", "UTF8", "--no-instructions"],
        check=True, capture_output=True, timeout=120, cwd=base, **as_postgres,  # type: ignore[arg-type]
    )  # fmt: skip
    port = free_port()
    log = (base / "postgres.log").open("w")
    proc = subprocess.Popen(
        [str(bindir / "postgres"), "-D", str(data), "-k", str(sockets), "-p", str(port),
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
        stdout=log, stderr=subprocess.STDOUT, cwd=base, **as_postgres,  # type: ignore[arg-type]
    )  # fmt: skip
    pg = Postgres(base, sockets, port, proc.pid, bindir)
    try:
        deadline = time.monotonic() + 60
        while True:
            ready = subprocess.run(
                [str(bindir / "pg_isready"), "-h", str(sockets), "-p", str(port)], capture_output=True, timeout=10
            )
            if ready.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start: {(base / 'postgres.log').read_text()[-2000:]}")
            time.sleep(0.05)
        pg.psql(f"CREATE ROLE alice LOGIN PASSWORD '{PASSWORD}'")
        yield pg
    finally:
        stop(proc, signal.SIGINT)  # fast shutdown: ends the sessions, then the server
        log.close()
        shutil.rmtree(base, ignore_errors=True)
