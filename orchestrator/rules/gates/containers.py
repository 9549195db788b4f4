"""The containers gate proves each LXD container exists, runs, has its GPUs, model disks and config
keys.

Pylxd; LXD's own errors per host. What a container must look like (its spec from the inventory and
the playbook's disks) and the reading of LXD's answer against it are pure and live on the LXD
floor below this one (`orchestrator/lxd/containers.py`), where the LXD host that reads and repairs
containers uses them too; `deploy` makes a container right (creates, updates, starts it), `verify`
and `stop` only read.
"""

from __future__ import annotations

from orchestrator.lxd.containers import Found, read_instance, spec_for

__all__ = ["Found", "read_instance", "spec_for"]
