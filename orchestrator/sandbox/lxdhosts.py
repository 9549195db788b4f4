"""The ``lxd`` sandbox: real LXD system containers on this machine, which plays the GPU host.

This machine has no systemd as PID 1, so LXD (Debian's 5.0) is started by hand: ``lxcfs``, then
the daemon with its image-server lookups sent to a closed loopback port (nothing leaves the
machine). LXD gets a ``dir`` pool and a bridge with NAT and firewall off, so the containers reach
nothing beyond the bridge. Containers come from a locally built Debian image (``lxdimage``),
are created through ``orchestrator.lxd.host`` (pylxd) with our client key injected, and their SSH host
keys are read from the containers through LXD, never learnt by connecting. An sshd of the
sandbox's own, on the bridge address, stands for the GPU host's sshd: containers are reached
by jumping through it, as on a real GPU host.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchestrator.config.inventory import LxdEndpoint
from orchestrator.errors import SandboxError
from orchestrator.lxd.containers import ContainerSpec
from orchestrator.sandbox import lxdimage
from orchestrator.sandbox.processes import alive, proc_start, run, start_sshd, stop_process, write_file

STATE = Path("/var/lib/dflash-orchestrator")
MODELS = STATE / "models"  # the GPU host's model directory that playbooks/sandbox.yaml mounts
DAEMON_STATE = STATE / "lxd-daemon.json"
LOGS = Path("/var/log/dflash-orchestrator")
LXCFS = Path("/var/lib/lxcfs")
NETWORK = "dfolxd0"
BRIDGE_ADDRESS = "10.231.0.1"
POOL = "dfo-pool"
READY_TIMEOUT_S = 300  # a busy 2-core machine has taken over a minute to start LXD
PROFILE = "dfo-sandbox"
PACKAGES = ("lxd", "lxd-client", "lxcfs", "dnsmasq-base", "debootstrap", "nftables", "squashfs-tools")
PRESEED = f"""\
networks:
- name: {NETWORK}
  type: bridge
  config:
    ipv4.address: {BRIDGE_ADDRESS}/24
    ipv4.nat: "false"
    ipv4.firewall: "false"
    ipv6.address: none
storage_pools:
- name: {POOL}
  driver: dir
profiles:
- name: {PROFILE}
  devices:
    root: {{path: /, pool: {POOL}, type: disk}}
    eth0: {{name: eth0, network: {NETWORK}, type: nic}}
"""

Say = Callable[[str], None]


@dataclass
class Node:
    """One container of the lxd sandbox: its name, address and the port of its sshd."""

    name: str
    address: str


def _lxd_ready(timeout: float = 1.0) -> bool:
    wait = max(1, int(timeout))
    return run(["lxd", "waitready", f"--timeout={wait}"], check=False, timeout=wait + 30).returncode == 0


def ensure_lxd(say: Say) -> None:
    """LXD installed, running, and set up with our network, pool, profile and image."""
    missing = [
        p
        for p in PACKAGES
        if run(["dpkg-query", "-W", "-f=${Status}", p], check=False).stdout != "install ok installed"
    ]
    if missing:
        say(f"lxd: installing {' '.join(missing)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        proc = subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            raise SandboxError(f"apt-get install {' '.join(missing)} failed: {proc.stderr.strip()[-400:]}")
    if not _lxd_ready():
        _start_daemon(say)
    if run(["lxc", "network", "show", NETWORK], check=False).returncode != 0:
        proc = subprocess.run(["lxd", "init", "--preseed"], input=PRESEED, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SandboxError(f"lxd init --preseed failed: {proc.stderr.strip()}")
    alias = lxdimage.image_alias()
    if run(["lxc", "image", "info", alias], check=False).returncode != 0:
        meta, rootfs = lxdimage.build(say)
        run(["lxc", "image", "import", str(meta), str(rootfs), "--alias", alias])
        say(f"lxd: image {alias} imported")


def _start_daemon(say: Say) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    STATE.mkdir(parents=True, exist_ok=True)
    started: dict[str, Any] = {}
    if run(["pgrep", "-x", "lxcfs"], check=False).returncode != 0:
        clear_dead_mount(LXCFS, say)
        with open(LOGS / "lxcfs.log", "ab") as log:
            lxcfs = subprocess.Popen(
                ["lxcfs", "/var/lib/lxcfs"], stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        started["lxcfs"] = [lxcfs.pid, proc_start(lxcfs.pid)]
    # LXD looks up instance types on its image server at every start: send that to a closed port.
    env = dict(os.environ, https_proxy="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9", no_proxy="")
    with open(LOGS / "lxd.stdout.log", "ab") as log:
        lxd = subprocess.Popen(
            ["lxd", "--group", "lxd", f"--logfile={LOGS / 'lxd.log'}"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=env,
        )
    started["lxd"] = [lxd.pid, proc_start(lxd.pid)]
    write_file(DAEMON_STATE, json.dumps(started), 0o644)
    if not _lxd_ready(READY_TIMEOUT_S):
        raise SandboxError(f"LXD did not become ready within {READY_TIMEOUT_S} s; see {LOGS / 'lxd.log'}")
    say("lxd: daemon started")


def clear_dead_mount(path: Path, say: Say) -> None:
    """Unmount lxcfs's FUSE mount at `path` when the daemon that served it is gone.

    A machine whose processes were all killed (a session's end, an OOM kill) leaves the mount
    behind with nothing serving it: every access then fails with ENOTCONN (a stat may still be
    answered from the kernel's attribute cache for a moment), and LXD cannot start containers.
    Only call this when no lxcfs runs: a lxcfs mount is then certainly dead.
    """
    if _fuse_mounted(path):
        # Lazy: a process that still has a file open there must not keep the new daemon out.
        proc = run(["umount", "--lazy", str(path)], check=False)
        if proc.returncode != 0:
            raise SandboxError(f"{path} is a dead lxcfs mount and umount failed: {proc.stderr.strip()}")
        say(f"lxd: removed the dead lxcfs mount at {path}")
    path.mkdir(parents=True, exist_ok=True)


def _fuse_mounted(path: Path) -> bool:
    # /proc/self/mounts escapes spaces and the like as octal (\040); the paths here have none.
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1] == str(path) and fields[2].startswith("fuse"):
            return True
    return False


def stop_lxd_if_ours(say: Say) -> None:
    """End the LXD daemon and lxcfs if we started them and no container is left on this LXD."""
    try:
        started = json.loads(DAEMON_STATE.read_text())
    except (OSError, ValueError):
        return
    if _lxd_ready():
        listing = run(["lxc", "list", "--format", "csv", "-c", "n"], check=False).stdout.split()
        if listing:
            return
        run(["lxd", "shutdown", "--timeout=30"], check=False)
    for name in ("lxd", "lxcfs"):
        if name in started:
            stop_process(*started[name])
    DAEMON_STATE.unlink(missing_ok=True)
    say("lxd: daemon stopped")


class LxdSandbox:
    """The lxd sandbox on this machine: LXD started by hand, a bridge, containers from the cached
    image and the GPU host's sshd in front of them."""

    kind = "lxd"

    def __init__(self, directory: Path, prefix: str | None = None, jump_port: int | None = None) -> None:
        self.dir = directory
        saved = self._saved()
        self.prefix = prefix or saved.get("prefix") or "dfo"
        self.jump_port = jump_port or saved.get("jump_port") or 2222
        self.state_file = directory / "sandbox.json"
        self.inventory = directory / "inventory.yaml"
        self.known_hosts = directory / "known_hosts"
        self.ssh_config = directory / "ssh_config"
        self.client_key = directory / "id_ed25519"

    def _saved(self) -> dict[str, Any]:
        try:
            data = json.loads((self.dir / "sandbox.json").read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise SandboxError(f"{self.dir / 'sandbox.json'} is unreadable: {exc}") from exc
        return data if isinstance(data, dict) else {}

    def nodes(self) -> list[Node]:
        """The sandbox's containers, from its state file."""
        return [Node(**n) for n in self._saved().get("nodes", [])]

    def _host(self) -> Any:
        from orchestrator.lxd.host import LxdHost

        return LxdHost("sandbox", LxdEndpoint("local"))

    def status(self) -> dict[str, object]:
        """What of the sandbox runs now: LXD, each container and its address, the GPU host's sshd."""
        saved = self._saved()
        nodes = self.nodes()
        jump = saved.get("jump", {})
        states: dict[str, str | None] = {}
        if nodes and _lxd_ready():
            host = self._host()
            states = {n.name: host.status(n.name) for n in nodes}
        return {
            "kind": self.kind,
            "up": bool(nodes)
            and all(states.get(n.name) == "Running" for n in nodes)
            and alive(jump.get("pid", 0), jump.get("pid_start", "")),
            "inventory": str(self.inventory),
            "ssh_config": str(self.ssh_config),
            "known_hosts": str(self.known_hosts),
            "hosts": [
                {"name": n.name, "address": n.address, "running": states.get(n.name) == "Running"} for n in nodes
            ],
        }

    def up(self, count: int, say: Say = lambda _m: None, timeout: float = 180.0) -> dict[str, object]:
        """Bring the sandbox up (idempotent): LXD, the image, the containers, the GPU host's sshd,
        the inventory."""
        if os.geteuid() != 0:
            raise SandboxError("the lxd sandbox needs root (it installs and starts LXD)")
        started = time.monotonic()
        ensure_lxd(say)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.client_key.exists():
            run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "orchestrate-sandbox", "-f", str(self.client_key)]
            )
        pubkey = self.client_key.with_suffix(".pub").read_text().strip()
        shutil.copyfile(self.client_key.with_suffix(".pub"), self.dir / "authorized_keys")
        os.chmod(self.dir / "authorized_keys", 0o600)

        MODELS.mkdir(parents=True, exist_ok=True)
        readme = MODELS / "README"
        if not readme.exists():
            readme.write_text("Model weights live here on a GPU host; containers mount this directory read-only.\n")
        os.chmod(MODELS, 0o755)
        os.chmod(readme, 0o644)  # unprivileged containers see it as nobody: it must be world-readable

        host = self._host()
        names = [f"{self.prefix}-node-{i:02d}" for i in range(1, count + 1)]
        for extra in (n for n in self.nodes() if n.name not in names):
            host.delete(extra.name)
        # Containers with our names that our state does not record were left by a sandbox whose
        # directory is gone (a `down` while LXD was not running, on a machine whose processes were
        # all killed): they trust a client key that no longer exists. Made afresh, not kept.
        known = {n.name for n in self.nodes()}
        for name in host.names(f"{self.prefix}-node-"):
            if name not in known:
                say(f"sandbox: removing {name}, left by a sandbox whose state is gone")
                host.delete(name)
        specs = [
            ContainerSpec(name, lxdimage.image_alias(), (PROFILE,), {"user.ssh_authorized_keys": pubkey})
            for name in names
        ]
        with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
            reports = list(pool.map(lambda spec: host.ensure(spec, address_timeout=timeout), specs))
        nodes = [Node(r.name, r.address or "") for r in reports]
        deadline = time.monotonic() + timeout
        host_keys = {n.name: self._host_key(host, n, deadline) for n in nodes}
        jump = self._jump_sshd()
        self._save(nodes, jump)
        self._write_client_files(nodes, host_keys)
        say(f"sandbox: {len(nodes)} LXD containers up in {time.monotonic() - started:.1f} s")
        return self.status()

    def _host_key(self, host: Any, node: Node, deadline: float) -> str:
        """The container's own host key, read through LXD once first boot has made it, then sshd up."""
        delay = 0.1
        while True:
            key = host.read_file(node.name, "/etc/ssh/ssh_host_ed25519_key.pub")
            if key:
                try:
                    with socket.create_connection((node.address, 22), timeout=1):
                        return " ".join(key.decode().split()[:2])
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise SandboxError(f"{node.name}: sshd did not come up (no host key or port 22 closed)")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _jump_sshd(self) -> dict[str, Any]:
        saved = self._saved().get("jump", {})
        if alive(saved.get("pid", 0), saved.get("pid_start", "")):
            return dict(saved)
        directory = self.dir / "gpu-host"
        pid, start = start_sshd(
            directory, f"{BRIDGE_ADDRESS}:{self.jump_port}", self.dir / "authorized_keys", "sandbox-gpu-host"
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((BRIDGE_ADDRESS, self.jump_port), timeout=1):
                    break
            except OSError:
                if not alive(pid, start) or time.monotonic() > deadline:
                    log = (directory / "sshd.log").read_text(errors="replace").strip()[-300:]
                    raise SandboxError(f"the GPU host's sshd did not start: {log}") from None
                time.sleep(0.05)
        key = " ".join((directory / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        return {"pid": pid, "pid_start": start, "key": key}

    def _save(self, nodes: list[Node], jump: dict[str, Any]) -> None:
        state = {
            "kind": self.kind,
            "prefix": self.prefix,
            "jump_port": self.jump_port,
            "jump": jump,
            "nodes": [asdict(n) for n in nodes],
        }
        write_file(self.state_file, json.dumps(state, indent=2), 0o644)

    def _write_client_files(self, nodes: list[Node], host_keys: dict[str, str]) -> None:
        jump = self._saved()["jump"]
        jump_name = f"[{BRIDGE_ADDRESS}]:{self.jump_port}"
        known = [f"{jump_name} {jump['key']}"] + [f"{n.address} {host_keys[n.name]}" for n in nodes]
        write_file(self.known_hosts, "\n".join(known) + "\n", 0o600)
        common = f"  User root\n  IdentityFile {self.client_key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {self.known_hosts}\n  StrictHostKeyChecking yes\n"
        config = [f"Host {self.prefix}-gpu-host\n  HostName {BRIDGE_ADDRESS}\n  Port {self.jump_port}\n{common}"]
        config += [
            f"Host {n.name}\n  HostName {n.address}\n  ProxyJump {self.prefix}-gpu-host\n{common}" for n in nodes
        ]
        write_file(self.ssh_config, "\n".join(config), 0o600)
        pubkey = self.client_key.with_suffix(".pub").read_text().strip()
        containers = "".join(
            f"      {n.name}:            # address discovered through LXD\n"
            f"        jump: true\n"
            f"        groups: [sandbox-nodes]\n"
            f"        lxd:\n"
            f"          image: {lxdimage.image_alias()}\n"
            f"          profiles: [{PROFILE}]\n"
            f'          config: {{user.ssh_authorized_keys: "{pubkey}"}}\n'
            for n in nodes
        )
        write_file(
            self.inventory,
            "# Written by `orchestrate sandbox up --kind lxd`: LXD containers on this machine, which\n"
            "# plays the GPU host (its sandbox sshd on the LXD bridge is the jump host).\n"
            "known_hosts: known_hosts\n"
            "defaults:\n"
            "  user: root\n"
            "  key: id_ed25519\n"
            "  python: /usr/bin/python3\n"
            "hosts:\n"
            "  sandbox:\n"
            f"    address: {BRIDGE_ADDRESS}\n"
            f"    port: {self.jump_port}\n"
            "    lxd: {endpoint: local}\n"
            "    containers:\n" + containers,
            0o644,
        )

    def down(self, say: Say = lambda _m: None, purge: bool = False) -> None:
        """Delete the sandbox's containers, end the GPU host's sshd by PID and LXD if the sandbox
        started it; with purge, also its image, profile, network and pool (when no container is
        left) and the image cache."""
        nodes = self.nodes()
        if nodes and _lxd_ready():
            host = self._host()
            for n in nodes:
                host.delete(n.name)
        jump = self._saved().get("jump", {})
        stop_process(jump.get("pid", 0), jump.get("pid_start", ""))
        if self.dir.exists():
            shutil.rmtree(self.dir)
        if purge and _lxd_ready():
            listing = run(["lxc", "list", "--format", "csv", "-c", "n"], check=False).stdout.split()
            if not listing:
                run(["lxc", "image", "delete", lxdimage.image_alias()], check=False)
                run(["lxc", "profile", "delete", PROFILE], check=False)
                run(["lxc", "network", "delete", NETWORK], check=False)
                run(["lxc", "storage", "delete", POOL], check=False)
            shutil.rmtree(lxdimage.CACHE / "images", ignore_errors=True)
        say(f"sandbox: {len(nodes)} LXD containers removed")
        stop_lxd_if_ours(say)
