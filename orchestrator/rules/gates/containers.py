"""The containers gate proves each LXD container exists, runs, has its GPUs, model disks and config
keys.

Pylxd; LXD's own errors per host.
"""
