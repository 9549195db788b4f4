"""Integration fixtures: a real ssh sandbox (sshd in network namespaces), real LXD, real CLI runs.

Each sandbox is brought up once per session under its worker's lane (tests/lanes.py: its own
prefix, subnet and ports), so it never touches a demo sandbox or another worker's, and is taken
down at the end by its own PIDs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.sandbox.lxdhosts import LxdSandbox
from orchestrator.sandbox.sshhosts import SandboxHost, SshSandbox
from tests import lanes
from tests.integration.gateway_parts import Fleet, Haproxy, free_port, make_fleet
from tests.lanes import Lane

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
GOOD_DRAFTER = REPO / "playbooks" / "files" / "qwen36-27b-dflash" / "config.json"
STALE_DRAFTER = DATA / "stale-drafter-config.json"
HOSTS = int(os.environ.get("ORCHESTRATE_TEST_HOSTS", "8"))


@dataclass
class Sandbox:
    box: SshSandbox
    hosts: list[SandboxHost]

    @property
    def inventory(self) -> Path:
        return self.box.inventory

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def host(self, name: str) -> SandboxHost:
        return next(h for h in self.hosts if h.name == name)

    def srv(self, name: str) -> Path:
        """What the host sees as /srv, from this machine."""
        return Path(self.host(name).files) / "srv"

    def carry(self, name: str, *files: Path) -> list[str]:
        """Copies ``files`` into the host's own /srv and returns the paths the host sees them at.

        A host's mount namespace has its own /srv and /root: a checkout (or a venv) under /root is
        not there, so a program a test runs inside a host must go with it, never be named where the
        checkout happens to live.
        """
        carried = self.srv(name) / ".carried"
        carried.mkdir(exist_ok=True)
        for f in files:
            shutil.copyfile(f, carried / f.name)
        return [f"/srv/.carried/{f.name}" for f in files]

    def nsenter(self, name: str, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a command in the host's mount namespace (for mounts the host alone must see)."""
        pid = self.host(name).pid
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-m", "--", *argv], capture_output=True, text=True, check=True
        )


@pytest.fixture(scope="session")
def sandbox(lane: Lane) -> Iterator[Sandbox]:
    if os.geteuid() != 0:
        pytest.fail("integration tests need root: they create network namespaces and run sshd")
    box = SshSandbox(lane.directory("sandbox"), prefix=lane.prefix("s"), subnet=lane.subnet(0))
    box.down()
    box.up(HOSTS)
    try:
        yield Sandbox(box, box.hosts())
    finally:
        box.down()


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)

    def host(self, name: str) -> dict[str, Any]:
        return next(h for h in self.json["hosts"] if h["name"] == name)  # type: ignore[no-any-return]


@pytest.fixture
def cli(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Run the real ``orchestrate`` command with a per-test state directory."""
    state = tmp_path / "state"

    def run(*args: str | Path, timeout: float = 300) -> CliResult:
        env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(state))
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator", *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        return CliResult(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture
def root_name(request: pytest.FixtureRequest) -> str:
    """A deploy root per test, so tests never see each other's releases."""
    # Only letters, digits and dashes: a parameter's id may hold YAML (": ", "&", "*").
    return "/srv/t-" + re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:60]


def write_playbook(
    directory: Path,
    deploy_root: str,
    files: dict[str, bytes] | None = None,
    drafter: Path | None = GOOD_DRAFTER,
    extra: str = "",
    name: str = "pb.yaml",
) -> Path:
    """A playbook in ``directory`` pushing ``files`` (dest -> bytes) and the drafter config."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["name: test", "targets: [all]", f"deploy_root: {deploy_root}"]
    if files:
        lines.append("files:")
        for i, (dest, content) in enumerate(files.items()):
            src = directory / f"src-{i}-{Path(dest).name}"
            src.write_bytes(content)
            lines.append(f"  - {{src: {src}, dest: {dest}}}")
    if drafter is not None:
        lines.append(f"drafter: {{config: {drafter}}}")
    path = directory / name
    path.write_text("\n".join(lines) + "\n" + textwrap.dedent(extra))
    return path


# --- the LXD sandbox (real containers), shared by the LXD and multi-node tests -------------


@pytest.fixture(scope="session")
def lxd_sandbox(lane: Lane) -> Iterator[LxdSandbox]:
    """One LXD sandbox (two containers) a session: its tests leave the containers as they found
    them (what a test changes in one it puts back, in a ``finally``)."""
    if os.geteuid() != 0:
        pytest.fail("LXD tests need root")
    box = LxdSandbox(lane.directory("lxd-sandbox"), prefix=lane.prefix("x"), jump_port=lane.jump_port)
    with lxd_turn():
        box.down()
        box.up(2)
    try:
        yield box
    finally:
        with lxd_turn():
            box.down()


@contextlib.contextmanager
def lxd_turn() -> Iterator[None]:
    """One sandbox at a time brings LXD up or down on this machine (its daemon, network, pool and
    image are shared by every lane's sandbox: two runs making them at once would race)."""
    lock = lanes.STATE / "lxd-sandboxes.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def inventory(box: LxdSandbox, tmp_path: Path, edit: Any = None) -> Path:
    """The sandbox's inventory, optionally edited, written with absolute paths."""
    data = yaml.safe_load(box.inventory.read_text())
    data["known_hosts"] = str(box.known_hosts)
    data["defaults"]["key"] = str(box.client_key)
    if edit is not None:
        edit(data)
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def in_container(box: LxdSandbox, name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command in a sandbox container over OpenSSH, through the sandbox's jump host.

    Not ``lxc exec``: Debian 12's LXD (5.0.2) can lose a command's output under CPU load and still
    exit 0 (LXD issue 11422, fixed in 5.14 by PR 11606). A test once read an empty ``readlink``
    of a link that was there; a ``pgrep`` read that way could even pass a check for leftovers.
    """
    return subprocess.run(
        ["ssh", "-F", str(box.ssh_config), "-o", "BatchMode=yes", name, "--", shlex.join(argv)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def run(*args: str | Path, tmp_path: Path) -> tuple[int, Any, str]:
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return proc.returncode, json.loads(proc.stdout) if proc.stdout else None, proc.stderr


def host(report: Any, name: str) -> Any:
    return next(h for h in report["hosts"] if h["name"] == name)


# The stand-in gateway tests' three servers and HAProxy in front of them (tests/integration/gateway_parts.py).
@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    yield from make_fleet(tmp_path)


@pytest.fixture
def haproxy(tmp_path: Path, fleet: Fleet) -> Iterator[Haproxy]:
    proxy = Haproxy(tmp_path, free_port(), fleet.port).start()
    yield proxy
    proxy.stop()
