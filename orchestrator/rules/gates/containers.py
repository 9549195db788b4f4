"""The containers gate proves each LXD container exists, runs, has its GPUs, model disks and config
keys.

Pylxd; LXD's own errors per host. What a container must look like (its spec from the inventory and
the playbook's disks) and the reading of LXD's answer against it are pure and live on the LXD
floor below this one (`orchestrator/lxd/containers.py`), where the LXD host that reads and repairs
containers uses them too; `deploy` makes a container right (creates, updates, starts it), `verify`
and `stop` only read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a run over SSH alone never loads the LXD floor
    from orchestrator.config.inventory import Container
    from orchestrator.config.playbook import Disk
    from orchestrator.lxd.containers import ContainerSpec, Found


def spec_for(container: Container, disks: tuple[Disk, ...] = ()) -> ContainerSpec:
    """The LXD shape the container must have (``lxd.containers.spec_for``)."""
    from orchestrator.lxd import containers

    return containers.spec_for(container, disks)


def read_instance(spec: ContainerSpec, host: str, instance: Mapping[str, Any] | None) -> Found:
    """LXD's instance against the spec (``lxd.containers.read_instance``): the gate's reading."""
    from orchestrator.lxd import containers

    return containers.read_instance(spec, host, instance)
