"""The ``ssh`` sandbox: N real OpenSSH hosts in network namespaces on this machine.

Each host is an ``sshd -D`` in its own network namespace (a veth into one bridge) and its own
mount namespace, where per-host directories are bind-mounted over /srv and /root: every host
has the same paths and separate files. Host keys are generated here and written to known_hosts
from the key files themselves, never learnt by connecting. Needs root.

    <dir>/sandbox.json          what is up (hosts, PIDs with their start times)
    <dir>/id_ed25519            client key        <dir>/known_hosts   <dir>/ssh_config
    <dir>/inventory.yaml        inventory for orchestrate
    <dir>/hosts/<name>/         sshd_config, host key, log; srv/ and root/ seen as /srv, /root
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import SandboxError
from orchestrator.sandbox import DEFAULT_DIR
from orchestrator.sandbox.processes import SSHD, alive, run, start_sshd, stop_namespace, stop_process, write_file

DEFAULT_PREFIX = "dfo"
DEFAULT_SUBNET = "10.77"

REMOTE_PYTHON = "/usr/bin/python3"

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

Say = Callable[[str], None]


@dataclass
class SandboxHost:
    """One host of the ssh sandbox: its namespace, address, directory and sshd."""

    name: str
    address: str
    netns: str
    veth: str
    files: str
    pid: int = 0
    pid_start: str = ""


def host_name(i: int) -> str:
    """The ssh sandbox's name of host i."""
    return f"node-{i:02d}"


def host_address(subnet: str, i: int) -> str:
    """Host i's address in the sandbox's /16."""
    # .0.1 is the bridge; hosts start at .0.2 and fill the /16.
    n = i + 1
    return f"{subnet}.{n // 256}.{n % 256}"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _enter_host(netns: str, files: str) -> Callable[[], None]:
    """Runs in the child before exec: private mounts, per-host /srv and /root, the host's netns."""

    def setup() -> None:
        libc = _libc()
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        if libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            raise OSError(ctypes.get_errno(), "make / private")
        for sub in ("srv", "root"):
            src = os.path.join(files, sub).encode()
            if libc.mount(src, f"/{sub}".encode(), None, MS_BIND | MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"bind {sub}")
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)

    return setup


class SshSandbox:
    """The ssh sandbox on this machine: an sshd per host, each in its own network and mount
    namespace."""

    kind = "ssh"

    def __init__(
        self,
        directory: Path = DEFAULT_DIR,
        prefix: str | None = None,
        subnet: str | None = None,
        log_level: str = "ERROR",
    ) -> None:
        """``prefix`` names the bridge, namespaces and veths; ``subnet`` is the /16's first two octets.

        Two sandboxes (the demo and the test suite) can be up at once with different ones. When
        not given they come from the sandbox already in ``directory``, else the defaults.
        """
        self.dir = directory
        saved = self._saved()
        self.prefix = prefix or saved.get("prefix") or DEFAULT_PREFIX
        self.subnet = subnet or saved.get("subnet") or DEFAULT_SUBNET
        if not (self.prefix.isalnum() and len(self.prefix) <= 5):
            raise SandboxError("the sandbox prefix must be 1-5 letters or digits (it names network devices)")
        octets = self.subnet.split(".")
        if len(octets) != 2 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise SandboxError(f"subnet must be the first two octets of a /16, like 10.77; got {self.subnet!r}")
        self.bridge = f"{self.prefix}-br0"
        self.log_level = log_level
        self.state_file = self.dir / "sandbox.json"
        self.inventory = self.dir / "inventory.yaml"
        self.known_hosts = self.dir / "known_hosts"
        self.ssh_config = self.dir / "ssh_config"
        self.client_key = self.dir / "id_ed25519"

    # --- state ---------------------------------------------------------------------------

    def _saved(self) -> dict[str, Any]:
        state_file = self.dir / "sandbox.json"
        try:
            data = json.loads(state_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise SandboxError(f"{state_file} is unreadable: {exc}; remove {self.dir} by hand") from exc
        return data if isinstance(data, dict) else {}

    def hosts(self) -> list[SandboxHost]:
        """The sandbox's hosts, from its state file."""
        return [SandboxHost(**h) for h in self._saved().get("hosts", [])]

    def _save(self, hosts: list[SandboxHost]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        state = {"kind": self.kind, "prefix": self.prefix, "subnet": self.subnet, "hosts": [asdict(h) for h in hosts]}
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.state_file)

    def status(self) -> dict[str, object]:
        """Which of the sandbox's hosts has its sshd running."""
        hosts = self.hosts()
        return {
            "kind": self.kind,
            "up": bool(hosts) and all(alive(h.pid, h.pid_start) for h in hosts),
            "inventory": str(self.inventory),
            "ssh_config": str(self.ssh_config),
            "known_hosts": str(self.known_hosts),
            "hosts": [
                {"name": h.name, "address": h.address, "running": alive(h.pid, h.pid_start), "files": h.files}
                for h in hosts
            ],
        }

    # --- up ------------------------------------------------------------------------------

    def up(self, count: int, say: Say = lambda _m: None, timeout: float = 60.0) -> dict[str, object]:
        """Bring the hosts up (idempotent): keys, namespaces, the bridge, an sshd each, the
        inventory."""
        if os.geteuid() != 0:
            raise SandboxError("the ssh sandbox needs root (network namespaces and bind mounts)")
        if count < 1 or count > 2000:
            raise SandboxError("--hosts must be between 1 and 2000")
        for tool in (SSHD, shutil.which("ssh-keygen"), shutil.which("ip")):
            if not tool or not os.path.exists(tool):
                raise SandboxError("OpenSSH server and iproute2 are needed: apt-get install openssh-server iproute2")
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        if not self.client_key.exists():
            run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "orchestrate-sandbox", "-f", str(self.client_key)]
            )
        shutil.copyfile(self.client_key.with_suffix(".pub"), self.dir / "authorized_keys")
        os.chmod(self.dir / "authorized_keys", 0o600)
        self._bridge()

        existing = {h.name: h for h in self.hosts()}
        hosts: list[SandboxHost] = []
        started = time.monotonic()
        for i in range(1, count + 1):
            name = host_name(i)
            host = existing.pop(name, None)
            if host is not None and alive(host.pid, host.pid_start):
                hosts.append(host)
                continue
            host = self._start_host(i)
            hosts.append(host)
            self._save(hosts + list(existing.values()))
        for extra in existing.values():  # `up --hosts 4` after `up --hosts 8`: end the extra hosts
            self._stop_host(extra)
        self._save(hosts)
        self._wait_ready(hosts, started + timeout)
        self._write_client_files(hosts)
        say(f"sandbox: {len(hosts)} ssh hosts up in {time.monotonic() - started:.1f} s")
        return self.status()

    def _bridge(self) -> None:
        if run(["ip", "link", "show", self.bridge], check=False).returncode != 0:
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "addr", "add", f"{self.subnet}.0.1/16", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])

    def _start_host(self, i: int) -> SandboxHost:
        name = host_name(i)
        host = SandboxHost(
            name=name,
            address=host_address(self.subnet, i),
            netns=f"{self.prefix}-{name}",
            veth=f"{self.prefix}-v{i:04d}",
            files=str(self.dir / "hosts" / name),
        )
        hdir = Path(host.files)
        for sub in ("srv", "root"):
            (hdir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(hdir / "root", 0o700)
        if not Path(f"/run/netns/{host.netns}").exists():
            run(["ip", "netns", "add", host.netns])
        if run(["ip", "link", "show", host.veth], check=False).returncode != 0:
            run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns])
            run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
            run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/16", "dev", "eth0"])
            run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
            run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        host.pid, host.pid_start = start_sshd(
            hdir,
            f"{host.address}:22",
            self.dir / "authorized_keys",
            name,
            _enter_host(host.netns, host.files),
            self.log_level,
        )
        return host

    def _wait_ready(self, hosts: list[SandboxHost], deadline: float) -> None:
        pending = list(hosts)
        delay = 0.02
        while pending:
            for h in list(pending):
                if not alive(h.pid, h.pid_start):
                    log = (Path(h.files) / "sshd.log").read_text(errors="replace").strip().splitlines()[-3:]
                    raise SandboxError(f"sshd of {h.name} exited: {' / '.join(log) or 'no log'}")
                try:
                    with socket.create_connection((h.address, 22), timeout=1):
                        pending.remove(h)
                except OSError:
                    continue
            if pending:
                if time.monotonic() > deadline:
                    raise SandboxError(f"hosts not reachable in time: {', '.join(h.name for h in pending)}")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _write_client_files(self, hosts: list[SandboxHost]) -> None:
        known, config, inv = [], [], []
        for h in hosts:
            pub = (Path(h.files) / "ssh_host_ed25519_key.pub").read_text().split()
            known.append(f"{h.address} {pub[0]} {pub[1]}")
            config.append(
                f"Host {h.name}\n  HostName {h.address}\n  User root\n  IdentityFile {self.client_key}\n"
                f"  IdentitiesOnly yes\n  UserKnownHostsFile {self.known_hosts}\n  StrictHostKeyChecking yes\n"
            )
            inv.append(f"      {h.name}:\n        address: {h.address}\n")
        write_file(self.known_hosts, "\n".join(known) + "\n", 0o600)
        write_file(self.ssh_config, "\n".join(config), 0o600)
        write_file(
            self.inventory,
            "# Written by `orchestrate sandbox up --kind ssh`: each node is an sshd in a network\n"
            "# namespace on this machine, standing in for one LXC container.\n"
            "known_hosts: known_hosts\n"
            "defaults:\n"
            "  user: root\n"
            "  key: id_ed25519\n"
            f"  python: {REMOTE_PYTHON}\n"
            "hosts:\n"
            "  sandbox:   # the GPU host: this machine\n"
            "    containers:\n" + "".join(inv),
            0o644,
        )

    # --- down ----------------------------------------------------------------------------

    def _stop_host(self, host: SandboxHost) -> None:
        stop_process(host.pid, host.pid_start)
        stop_namespace(Path(f"/run/netns/{host.netns}"))
        if Path(f"/run/netns/{host.netns}").exists():
            run(["ip", "netns", "del", host.netns], check=False)
        run(["ip", "link", "del", host.veth], check=False)

    def down(self, say: Say = lambda _m: None) -> None:
        """End every sshd the sandbox started, by PID, and delete its namespaces, links and bridge."""
        hosts = self.hosts()
        for h in hosts:
            self._stop_host(h)
        if run(["ip", "link", "show", self.bridge], check=False).returncode == 0:
            run(["ip", "link", "del", self.bridge], check=False)
        if self.dir.exists():
            shutil.rmtree(self.dir)
        say(f"sandbox: {len(hosts)} ssh hosts removed")
