"""The inventory: GPU hosts, the LXC containers on them, and how to reach each over SSH.

    known_hosts: known_hosts            # relative paths are relative to this file
    defaults:                           # SSH settings every host and container starts from
      user: root
      port: 22
      key: id_ed25519
      python: python3                   # interpreter that runs the remote agent
      connect_timeout: 10               # seconds for TCP, the SSH banner and key exchange (as ConnectTimeout)
      command_timeout: 120
      vars: {}
    groups:
      canary: {vars: {}}
    hosts:
      gpu-a:                            # a GPU host
        address: 10.0.0.10              # needed when a container jumps through it
        containers:
          serve-0:
            address: 10.10.0.2
            jump: true                  # reach it through gpu-a
            gpus: [0, 1, 2, 3]
            groups: [canary]
      this-box:
        containers:
          box-0:
            connection: local           # this machine, as this user: no SSH (an address, if
                                        # given, is where a group's other nodes reach it)
            deploy_root: /home/me/dflash  # where this container keeps releases (default: the playbook's)

Container names are unique across the inventory: they are what playbooks and the CLI target,
together with group names, GPU host names (all of that host's containers) and ``all``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.config.yamlsource import Document, Field, load_file
from orchestrator.errors import InputError

SSH = "ssh"
LOCAL = "local"


@dataclass(frozen=True)
class Connection:
    """A way of reaching a container, as the inventory names it (``connection:``): one row each in
    ``CONNECTIONS``, and one module of ``orchestrator.connectors`` registered under the same name.
    ``this_machine``: the controller's own machine, so no address is needed, a deploy root names
    the place, and what reaches other machines (``jump``, ``lxd``) is refused."""

    name: str
    this_machine: bool = False
    refuses: tuple[str, ...] = ()


CONNECTIONS = {c.name: c for c in (Connection(SSH), Connection(LOCAL, this_machine=True, refuses=("jump", "lxd")))}
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
SSH_KEYS = {"user", "port", "key", "python", "connect_timeout", "command_timeout"}


@dataclass(frozen=True)
class SshSettings:
    """How to reach a host over SSH: user, port, key, the agent's Python and the timeouts."""

    user: str = "root"
    port: int = 22
    key: Path | None = None
    python: str = "python3"
    connect_timeout: float = 10.0
    command_timeout: float = 120.0


@dataclass(frozen=True)
class Endpoint:
    """Something we open an SSH connection to."""

    name: str
    address: str
    ssh: SshSettings


@dataclass(frozen=True)
class LxdEndpoint:
    """How to reach a GPU host's LXD: ``local`` (unix socket) or HTTPS with a pinned certificate."""

    url: str = "local"
    client_cert: Path | None = None
    client_key: Path | None = None
    server_cert: Path | None = None
    project: str | None = None


@dataclass(frozen=True)
class ContainerLxd:
    """How LXD should build and equip a container."""

    image: str = "debian-bookworm"
    profiles: tuple[str, ...] = ("default",)
    config: dict[str, str] = field(default_factory=dict)
    gpu_pci: tuple[str, ...] = ()
    nvidia_runtime: bool = False


@dataclass(frozen=True)
class Container:
    """A serving container of a GPU host (or a plain host, or this machine): how to reach it, its
    GPUs, groups, deploy root and LXD shape."""

    name: str
    host: str
    address: str | None
    ssh: SshSettings
    jump: bool = False
    gpus: tuple[int, ...] = ()
    groups: tuple[str, ...] = ()
    vars: dict[str, Any] = field(default_factory=dict)
    lxd: ContainerLxd | None = None
    connection: str = SSH  # a name of CONNECTIONS: SSH, or LOCAL (this machine, no SSH)
    deploy_root: str | None = None  # overrides the playbook's for this container

    @property
    def on_this_machine(self) -> bool:
        """Reached on the controller's own machine (``connection: local``), not over a network."""
        return CONNECTIONS[self.connection].this_machine

    @property
    def endpoint(self) -> Endpoint:
        """Where SSH reaches the container: its address and port."""
        if self.address is None:
            raise InputError(f"container '{self.name}' has no address (and none was discovered through LXD)")
        return Endpoint(self.name, self.address, self.ssh)


@dataclass(frozen=True)
class GpuHost:
    """A GPU host: its SSH settings, its LXD endpoint and the containers it holds."""

    name: str
    address: str | None
    ssh: SshSettings
    containers: tuple[Container, ...]
    vars: dict[str, Any] = field(default_factory=dict)
    lxd: LxdEndpoint | None = None

    @property
    def endpoint(self) -> Endpoint:
        """Where SSH reaches the GPU host (the jump host of its containers)."""
        if self.address is None:
            raise InputError(f"GPU host '{self.name}' has no address, but a container jumps through it")
        return Endpoint(self.name, self.address, self.ssh)


@dataclass(frozen=True)
class Target:
    """A container resolved for a run: where it is and how to get there."""

    container: Container
    jump: Endpoint | None

    @property
    def name(self) -> str:
        """The container's name: what runs, reports and --limit call it."""
        return self.container.name

    def at(self, address: str) -> Target:
        """The same target, reached at an address discovered at run time."""
        return Target(replace(self.container, address=address), self.jump)


@dataclass(frozen=True)
class Inventory:
    """Every GPU host and container of the fleet, with the known_hosts file that pins their keys."""

    file: Path
    known_hosts: Path
    hosts: dict[str, GpuHost]
    group_vars: dict[str, dict[str, Any]]
    default_vars: dict[str, Any] = field(default_factory=dict)

    @property
    def containers(self) -> list[Container]:
        """Every container of every GPU host, in inventory order."""
        return [c for h in self.hosts.values() for c in h.containers]

    @property
    def groups(self) -> dict[str, list[str]]:
        """Each group name with its containers, in inventory order."""
        out: dict[str, list[str]] = {name: [] for name in self.group_vars}
        for c in self.containers:
            for g in c.groups:
                out.setdefault(g, []).append(c.name)
        return out

    def resolve(self, patterns: tuple[str, ...] | list[str]) -> list[Target]:
        """Containers named by container, group or GPU host names (``all`` for every one), in inventory order."""
        by_name = {c.name: c for c in self.containers}
        groups = self.groups
        wanted: set[str] = set()
        for pattern in patterns:
            if pattern == "all":
                wanted.update(by_name)
            elif pattern in by_name:
                wanted.add(pattern)
            elif pattern in self.hosts:
                wanted.update(c.name for c in self.hosts[pattern].containers)
            elif pattern in groups:
                wanted.update(groups[pattern])
            else:
                raise InputError(
                    f"target '{pattern}' is not a container, group or GPU host in the inventory", file=str(self.file)
                )
        return [self.target(c) for c in self.containers if c.name in wanted]

    def target(self, container: Container) -> Target:
        """How a run reaches a container: directly, or through its GPU host when it says jump."""
        jump = self.hosts[container.host].endpoint if container.jump else None
        return Target(container, jump)

    def vars_for(self, container: Container) -> dict[str, Any]:
        """defaults.vars < group vars (in the container's order) < host vars < container vars."""
        merged: dict[str, Any] = dict(self.default_vars)
        for g in container.groups:
            merged.update(self.group_vars.get(g, {}))
        merged.update(self.hosts[container.host].vars)
        merged.update(container.vars)
        return merged


def load_inventory(path: Path | str) -> Inventory:
    """The inventory file as a typed Inventory; any bad key is one InputError naming file, line and
    key."""
    path = Path(path)
    return parse_inventory(load_file(path), path)


def parse_inventory(doc: Document, path: Path) -> Inventory:
    """An already loaded YAML document as a typed Inventory (paths in it are relative to ``base``)."""
    top = Field(doc).mapping({"known_hosts", "defaults", "groups", "hosts"}, required=frozenset({"hosts"}))
    base = path.parent
    known_hosts = _path(top["known_hosts"].str("known_hosts"), base)

    defaults_field = top["defaults"].mapping(SSH_KEYS | {"vars"})
    defaults = _ssh(defaults_field, SshSettings(), base)
    group_vars: dict[str, dict[str, Any]] = {}
    for gname, gfield in top["groups"].items():
        _check_name(gfield, gname)
        gfield.mapping({"vars"})
        group_vars[gname] = _vars(gfield["vars"])

    hosts: dict[str, GpuHost] = {}
    seen: dict[str, str] = {}
    for hname, hfield in top["hosts"].mapping().items():
        _check_name(hfield, hname)
        hfield.mapping(SSH_KEYS | {"address", "vars", "containers", "lxd"})
        host_ssh = _ssh(hfield, defaults, base)
        address = hfield["address"].address(None)
        lxd = _lxd_endpoint(hfield["lxd"], base) if "lxd" in hfield else None
        containers: list[Container] = []
        for cname, cfield in hfield["containers"].items():
            _check_name(cfield, cname)
            if cname in seen:
                raise cfield.error(f"container name already used on GPU host '{seen[cname]}': names must be unique")
            if cname in hosts or cname == hname:
                raise cfield.error("a container cannot share its name with a GPU host")
            seen[cname] = hname
            connection = cfield["connection"].str(SSH)
            if connection not in CONNECTIONS:
                raise cfield["connection"].error(f"expected {' or '.join(repr(c) for c in CONNECTIONS)}")
            how = CONNECTIONS[connection]
            cfield.mapping(
                SSH_KEYS | {"address", "jump", "gpus", "groups", "vars", "lxd", "connection", "deploy_root"},
                required=frozenset() if lxd or how.this_machine else frozenset({"address"}),
            )
            # An address stays allowed on this machine: it is where the other nodes of a group reach it.
            for key in how.refuses:
                if key in cfield:
                    raise cfield[key].error(f"a container with connection: {connection} is this machine: no {key}")
            if how.this_machine and lxd is not None:
                raise cfield["connection"].error(
                    f"GPU host '{hname}' has an lxd: block, so its containers are LXD containers reached over SSH"
                )
            deploy_root = cfield["deploy_root"].directory(None)
            container_lxd = None
            if lxd is not None:
                container_lxd = _container_lxd(cfield["lxd"])
            elif "lxd" in cfield:
                raise cfield["lxd"].error(f"GPU host '{hname}' has no lxd: block, so its containers are not managed")
            jump = cfield["jump"].bool(False)
            if jump and address is None:
                raise cfield["jump"].error(f"jumps through GPU host '{hname}', which has no address")
            gpus = cfield["gpus"].int_list(())
            if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
                raise cfield["gpus"].error("expected a list of distinct GPU indices (integers >= 0)")
            groups = cfield["groups"].str_list(())
            for g in groups:
                _check_name(cfield["groups"], g)
                if g == "all" or g in hosts or g == hname:
                    raise cfield["groups"].error(f"group name '{g}' is reserved or names a GPU host")
            containers.append(
                Container(
                    name=cname,
                    host=hname,
                    address=cfield["address"].address(None),
                    ssh=_ssh(cfield, defaults, base),
                    jump=jump,
                    gpus=gpus,
                    groups=groups,
                    vars=_vars(cfield["vars"]),
                    lxd=container_lxd,
                    connection=connection,
                    deploy_root=deploy_root,
                )
            )
            if container_lxd and container_lxd.gpu_pci and len(container_lxd.gpu_pci) != len(gpus):
                raise cfield["lxd"]["gpu_pci"].error(f"expected one PCI address per GPU ({len(gpus)})")
        if hname in seen:
            raise hfield.error(f"GPU host name already used by a container on '{seen[hname]}'")
        hosts[hname] = GpuHost(hname, address, host_ssh, tuple(containers), _vars(hfield["vars"]), lxd)
    _check_distinct(top, hosts, group_vars)
    return Inventory(
        file=path,
        known_hosts=known_hosts,
        hosts=hosts,
        group_vars=group_vars,
        default_vars=_vars(defaults_field["vars"]),
    )


def _check_distinct(top: Field, hosts: dict[str, GpuHost], group_vars: dict[str, dict[str, Any]]) -> None:
    """No name means two things, and no two entries are one place: two containers at the same
    address, port and jump host (or two local ones on the same deploy root) would make one host
    deployed twice and reported READY twice while the other is never touched."""
    containers = {c.name: (h, c) for h in hosts.values() for c in h.containers}
    for gname in group_vars:
        if gname in containers or gname in hosts or gname == "all":
            raise top["groups"][gname].error(f"group name '{gname}' is already a container, a GPU host, or reserved")
    for h, c in containers.values():
        for g in c.groups:
            if g in containers:
                raise top["hosts"][h.name]["containers"][c.name]["groups"].error(f"group name '{g}' is a container")
    places: dict[tuple[Any, ...], str] = {}
    for h, c in containers.values():
        if c.on_this_machine:
            # As the agent will reach it: through every link on the way (``/srv/b`` a link to
            # ``/srv/a`` makes ``/srv/b/x`` and ``/srv/a/x`` one deploy root).
            place: tuple[Any, ...] = (c.connection, c.deploy_root and os.path.realpath(c.deploy_root))
        elif c.address is not None:
            place = (SSH, _one_spelling(c.address), c.ssh.port, h.name if c.jump else None)
        else:
            continue  # discovered through LXD: one container, one address
        if place in places:
            where = top["hosts"][h.name]["containers"][c.name]
            what = "the same deploy root on this machine" if c.on_this_machine else "the same address and port"
            raise where.error(f"{what} as container '{places[place]}': one place cannot be two containers")
        places[place] = c.name


def _one_spelling(address: str) -> str:
    """An address as the resolver reads it: IPv4 in its short and numeric forms (``10.66.2`` and
    ``172097538`` are 10.66.0.2 to glibc), IPv6 compressed, a name in lower case. (Two names of
    one host are caught when they connect: each host key answers for one container.)"""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        return socket.inet_ntoa(socket.inet_aton(address))
    except OSError:
        return address.lower().rstrip(".")


def _ssh(f: Field, base_settings: SshSettings, base: Path) -> SshSettings:
    key = f["key"].str(None)
    return replace(
        base_settings,
        user=f["user"].str(base_settings.user),
        port=f["port"].int(base_settings.port, minimum=1, maximum=65535),
        key=_path(key, base) if key is not None else base_settings.key,
        python=f["python"].str(base_settings.python),
        connect_timeout=f["connect_timeout"].seconds(base_settings.connect_timeout, minimum=0.1),
        command_timeout=f["command_timeout"].seconds(base_settings.command_timeout, minimum=0.1),
    )


def _lxd_endpoint(f: Field, base: Path) -> LxdEndpoint:
    f.mapping({"endpoint", "client_cert", "client_key", "server_cert", "project"})
    url = f["endpoint"].str("local")
    if url != "local" and not url.startswith("https://"):
        raise f["endpoint"].error("expected 'local' (the unix socket) or an https:// URL")
    files = {}
    for key in ("client_cert", "client_key", "server_cert"):
        value = f[key].str(None)
        files[key] = _path(value, base) if value is not None else None
        if url != "local" and value is None:
            raise f.error(
                f"missing required key '{key}' (HTTPS to LXD needs a client certificate and a pinned server certificate)"
            )
    return LxdEndpoint(url, files["client_cert"], files["client_key"], files["server_cert"], f["project"].str(None))


def _container_lxd(f: Field) -> ContainerLxd:
    f.mapping({"image", "profiles", "config", "gpu_pci", "nvidia_runtime"})
    default = ContainerLxd()
    return ContainerLxd(
        image=f["image"].str(default.image),
        profiles=f["profiles"].str_list(default.profiles),
        config=f["config"].str_map({}),
        gpu_pci=f["gpu_pci"].str_list(()),
        nvidia_runtime=f["nvidia_runtime"].bool(False),
    )


def _vars(f: Field) -> dict[str, Any]:
    return dict(f.mapping().value)


def _path(value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p)


def _check_name(f: Field, name: str) -> None:
    if not name or not set(name) <= NAME_CHARS or name.startswith("-"):
        raise f.error("names may hold letters, digits, '-', '_' and '.' only")


def inventory_view(inventory: Inventory) -> dict[str, Any]:
    """Everything resolved, as plain data: for `inventory list/show` and machines."""

    def ssh(s: SshSettings) -> dict[str, Any]:
        return {"user": s.user, "port": s.port, "key": str(s.key) if s.key else None, "python": s.python}

    hosts = []
    for h in inventory.hosts.values():
        hosts.append(
            {
                "name": h.name,
                "address": h.address,
                "ssh": ssh(h.ssh),
                "lxd": h.lxd.url if h.lxd else None,
                "vars": h.vars,
                "containers": [
                    {
                        "name": c.name,
                        "connection": c.connection,
                        "address": c.address,
                        "jump": c.jump,
                        "gpus": list(c.gpus),
                        "groups": list(c.groups),
                        "ssh": ssh(c.ssh),
                        "vars": inventory.vars_for(c),
                    }
                    for c in h.containers
                ],
            }
        )
    return {
        "file": str(inventory.file),
        "known_hosts": str(inventory.known_hosts),
        "hosts": hosts,
        "groups": inventory.groups,
    }


def show_one(view: dict[str, Any], name: str) -> dict[str, Any]:
    """`orchestrate inventory show NAME`: one GPU host, or one container with its host's name; an
    InputError when neither has that name."""
    for host in view["hosts"]:
        if host["name"] == name:
            return dict(host)
        for c in host["containers"]:
            if c["name"] == name:
                return {"host": host["name"], **c}
    raise InputError(f"'{name}' is not a GPU host or container in {view['file']}")
