"""The remote agent: one stdlib-only file (``agent.py``) sent to each host with every batch.

This package only locates that file for the controller; it is never imported on a host.
"""

from importlib.resources import files


def source() -> bytes:
    """The agent's source, exactly as it will run on the host."""
    return files(__name__).joinpath("agent.py").read_bytes()
