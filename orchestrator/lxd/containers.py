"""What a container should look like in LXD, and how it differs from what it is. Pure.

The devices we manage carry a ``dfo-`` prefix (``dfo-gpu0``, ``dfo-disk-models``); devices the
user added by hand are left alone and never reported as drift.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.inventory import Container
from orchestrator.config.playbook import Disk

DEVICE_PREFIX = "dfo-"


@dataclass(frozen=True)
class ContainerSpec:
    """The LXD shape a container must have: image, profiles, config keys and devices (GPUs, disks)."""

    name: str
    image: str
    profiles: tuple[str, ...]
    config: dict[str, str] = field(default_factory=dict)
    devices: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Drift:
    """One way a container differs from its spec: a config key or device, what was expected and what
    is there."""

    key: str
    expected: Any
    actual: Any

    def describe(self) -> str:
        if self.actual is None:
            return f"{self.key} is missing (expected {_show(self.expected)})"
        return f"{self.key} is {_show(self.actual)}, expected {_show(self.expected)}"


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={v}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def _slug(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")[:40] or "root"


def spec_for(container: Container, disks: tuple[Disk, ...] = ()) -> ContainerSpec:
    """The LXD shape a container must have: its GPUs, the playbook's disks, its config keys."""
    lxd = container.lxd
    if lxd is None:
        raise ValueError(f"container {container.name} is not managed through LXD")
    devices: dict[str, dict[str, str]] = {}
    for i, gpu in enumerate(container.gpus):
        if lxd.gpu_pci:
            devices[f"{DEVICE_PREFIX}gpu{gpu}"] = {"type": "gpu", "gputype": "physical", "pci": lxd.gpu_pci[i]}
        else:
            devices[f"{DEVICE_PREFIX}gpu{gpu}"] = {"type": "gpu", "gputype": "physical", "id": str(gpu)}
    for disk in disks:
        devices[f"{DEVICE_PREFIX}disk-{_slug(disk.path)}"] = {
            "type": "disk",
            "source": disk.source,
            "path": disk.path,
            "readonly": "true" if disk.readonly else "false",
        }
    config = dict(lxd.config)
    if lxd.nvidia_runtime:
        config["nvidia.runtime"] = "true"
    return ContainerSpec(container.name, lxd.image, lxd.profiles, config, devices)


def diff(spec: ContainerSpec, devices: dict[str, Any], config: dict[str, Any]) -> list[Drift]:
    """Every managed device or declared config key that is missing or different."""
    out: list[Drift] = []
    for name, want in sorted(spec.devices.items()):
        have = devices.get(name)
        if have != want:
            out.append(Drift(f"devices.{name}", want, have))
    for key, value in sorted(spec.config.items()):
        current = config.get(key)
        if current != value:
            out.append(Drift(f"config.{key}", value, current))
    return out


@dataclass(frozen=True)
class Found:
    """The containers gate's reading of one container: whether it is as its spec says and runs,
    in words, its LXD status, its address and the drift."""

    ok: bool
    detail: str
    status: str
    address: str | None
    drift: list[Drift]


def ipv4(network: Mapping[str, Any] | None) -> str | None:
    """The container's global IPv4 address on eth0 from LXD's state (``state.network``); only a
    well-formed one is taken (it becomes where SSH connects, as an inventory address would)."""
    for address in ((network or {}).get("eth0") or {}).get("addresses") or []:
        if address.get("family") == "inet" and address.get("scope") == "global":
            try:
                return str(ipaddress.IPv4Address(str(address.get("address"))))
            except ValueError:
                continue
    return None


def read_instance(spec: ContainerSpec, host: str, instance: Mapping[str, Any] | None) -> Found:
    """LXD's instance (``status``, ``devices``, ``config`` and ``state.network``, as its API
    answers ``GET /1.0/instances/NAME``; None: there is none) against the spec: read only."""
    if instance is None:
        return Found(False, f"container {spec.name} does not exist on {host}", "missing", None, [])
    drift = diff(spec, dict(instance.get("devices") or {}), dict(instance.get("config") or {}))
    status = str(instance.get("status"))
    address = ipv4((instance.get("state") or {}).get("network")) if status == "Running" else None
    problems = [d.describe() for d in drift]
    if status != "Running":
        problems.insert(0, f"container is {status.lower()}")
    detail = f"running, {address or 'no IPv4 yet'}" if not problems else "; ".join(problems)
    return Found(not problems, detail, status, address, drift)
