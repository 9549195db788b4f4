"""The remote agent: stdlib-only files sent to each host with every batch.

``loader.py`` runs first and finds the agent's compiled code (or compiles ``agent.py``).

This package only locates that file for the controller; it is never imported on a host.
"""

from pathlib import Path

# Beside this file (importlib.resources would cost ~3 ms of every start for the same answer).
_HERE = Path(__file__).resolve().parent


def source() -> bytes:
    """The agent's source, exactly as it will run on the host."""
    return (_HERE / "agent.py").read_bytes()


def loader_source() -> bytes:
    """The loader's source, exactly as it will run on the host."""
    return (_HERE / "loader.py").read_bytes()
