"""Which sandbox a directory holds: the ssh one or the lxd one, never both."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import SandboxError
from orchestrator.sandbox import DEFAULT_DIR
from orchestrator.sandbox.lxdhosts import LxdSandbox
from orchestrator.sandbox.sshhosts import SshSandbox


def open_sandbox(
    directory: Path | None = None,
    kind: str | None = None,
    prefix: str | None = None,
    jump_port: int | None = None,
    subnet: str | None = None,
) -> SshSandbox | LxdSandbox:
    """The sandbox in ``directory``, of the kind it holds (``kind`` asks for one: a directory that
    holds the other kind is refused, never mixed); an empty directory gets ``kind``, else lxd."""
    directory = directory or DEFAULT_DIR
    try:
        existing = json.loads((directory / "sandbox.json").read_text()).get("kind")
    except (OSError, ValueError):
        existing = None
    if kind and existing and kind != existing:
        raise SandboxError(f"{directory} holds a {existing} sandbox: run 'orchestrate sandbox down' first")
    if (kind or existing or "lxd") == "lxd":
        return LxdSandbox(directory, prefix, jump_port)
    return SshSandbox(directory, prefix, subnet)
