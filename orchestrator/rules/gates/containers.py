"""The containers gate proves each LXD container exists, runs, has its GPUs, model disks and config
keys.

Pylxd; LXD's own errors per host. What a container must look like (its spec from the inventory and
the playbook's disks) and the reading of LXD's answer against it (`read_instance`) are pure and
live with the one module that talks to LXD (`orchestrator/lxd/containers.py`, a floor below this
one, which a gate module does not import): `deploy` makes a container right (creates, updates,
starts it), `verify` and `stop` only read.
"""
