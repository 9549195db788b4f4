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

import contextlib
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

# A Linux bridge takes at most 1023 ports ("RTNETLINK answers: Exchange full" at the 1024th:
# BR_MAX_PORTS in the kernel's net/bridge): hosts go 1000 to a bridge. The first bridge holds the
# controller's address for the whole /16; the others none, with a route per host instead.
HOSTS_PER_BRIDGE = 1000
MAX_HOSTS = 2000
# What one host costs this machine (its sshd, namespaces, veth pair), measured as the fall of
# MemAvailable over 64 hosts brought up: 2.3 MiB each. Asked for with a margin.
HOST_MEMORY = 4 * 2**20
# The kernel's ARP table holds 1024 entries by default (net.ipv4.neigh.default.gc_thresh3): past
# about that many hosts, "neighbor table overflow" and hosts that cannot be reached. Raised for a
# large sandbox, and put back as it was when the sandbox goes down.
NEIGH = Path("/proc/sys/net/ipv4/neigh/default")

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


def _removed_already(_func: object, _path: str, exc_info: tuple[type[BaseException], BaseException, object]) -> None:
    """rmtree's error hook: a second ``down`` of the same sandbox at the same time removes what
    this one was about to; what is gone is done. Anything else is raised."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


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
        found = saved.get("neighbours")
        self.neighbours: dict[str, int] | None = found if isinstance(found, dict) else None

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
        if self.neighbours:
            state["neighbours"] = self.neighbours  # the ARP table's own sizes, put back at down
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
        if count < 1 or count > MAX_HOSTS:
            raise SandboxError(f"--hosts must be between 1 and {MAX_HOSTS}")
        self._check_capacity(count)
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
        self._neighbours(count, say)

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
        self._wait_ready(hosts, time.monotonic() + timeout)  # from when the last sshd started
        self._write_client_files(hosts)
        say(f"sandbox: {len(hosts)} ssh hosts up in {time.monotonic() - started:.1f} s")
        return self.status()

    def _check_capacity(self, count: int) -> None:
        """Refuse, before anything starts, a count this machine cannot hold: memory for each new
        host, processes and open files for their sshds."""
        new = count - sum(1 for h in self.hosts() if alive(h.pid, h.pid_start))
        if new <= 0:
            return
        try:
            meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            available = int(meminfo["MemAvailable"].split()[0]) * 1024
            pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        except (OSError, KeyError, ValueError):
            return  # not Linux as we know it: the first failure will say what
        need = new * HOST_MEMORY
        if need > available * 0.8:
            raise SandboxError(
                f"{count} hosts need about {need / 2**30:.1f} GiB more memory ({HOST_MEMORY // 2**20} MiB a host), "
                f"and {available / 2**30:.1f} GiB is available: ask for at most "
                f"{count - new + int(available * 0.8 // HOST_MEMORY)} hosts"
            )
        running = sum(1 for entry in Path("/proc").iterdir() if entry.name.isdigit())
        if running + new * 2 > pid_max * 0.8:
            raise SandboxError(f"{count} hosts need {new * 2} more processes; kernel.pid_max is {pid_max}")

    def _neighbours(self, count: int, say: Say) -> None:
        """Room in the ARP table for every host (and what this machine already talks to)."""
        need = count + 256  # the hosts, and what this machine already talks to
        names = ("gc_thresh1", "gc_thresh2", "gc_thresh3")
        try:
            now = tuple(int((NEIGH / n).read_text()) for n in names)
        except (OSError, ValueError):
            return
        if need <= now[1]:
            return  # below the table's soft limit already: a small sandbox changes nothing
        want = (now[0], 2 * need, 4 * need)
        if self.neighbours is None:  # the sizes before any sandbox raised them
            self.neighbours = dict(zip(names, now, strict=True))
            self._save(self.hosts())
        for name, old, new in zip(names, now, want, strict=True):
            (NEIGH / name).write_text(str(max(old, new)))
        say(f"sandbox: ARP table raised to {max(now[2], want[2])} entries for {count} hosts "
            f"(net.ipv4.neigh.default.gc_thresh3 was {now[2]}; put back at down)")  # fmt: skip

    def _bridge_name(self, k: int) -> str:
        return f"{self.prefix}-br{k}"

    def _bridges(self) -> list[str]:
        """The sandbox's bridges that exist now."""
        return [self._bridge_name(k) for k in range(MAX_HOSTS // HOSTS_PER_BRIDGE + 1)
                if run(["ip", "link", "show", self._bridge_name(k)], check=False).returncode == 0]  # fmt: skip

    def _bridge(self, k: int = 0) -> str:
        name = self._bridge_name(k)
        if run(["ip", "link", "show", name], check=False).returncode != 0:
            run(["ip", "link", "add", name, "type", "bridge"])
            if k == 0:
                run(["ip", "addr", "add", f"{self.subnet}.0.1/16", "dev", name])
        run(["ip", "link", "set", name, "up"])
        return name

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
            k = (i - 1) // HOSTS_PER_BRIDGE
            bridge = self._bridge(k)
            run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns])
            run(["ip", "link", "set", host.veth, "master", bridge, "up"])
            run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/16", "dev", "eth0"])
            run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
            run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            if k:
                # Past the first bridge: the host is reached by its own route, and it reaches the
                # controller's address (on the first bridge) through this one, which answers ARP
                # for it as for any address of this machine.
                run(["ip", "route", "replace", f"{host.address}/32", "dev", bridge, "src", f"{self.subnet}.0.1"])
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
        for bridge in self._bridges():  # a host's route goes with its bridge
            run(["ip", "link", "del", bridge], check=False)
        for name, value in (self.neighbours or {}).items():
            with contextlib.suppress(OSError):
                (NEIGH / name).write_text(str(int(value)))
        if self.dir.exists():
            shutil.rmtree(self.dir, onerror=_removed_already)
        say(f"sandbox: {len(hosts)} ssh hosts removed")
