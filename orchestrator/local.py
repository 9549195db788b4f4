"""The ``local`` connection: commands run on this machine, as this user, with no SSH.

For a single GPU box with no container (``connection: local`` in the inventory), like Ansible's
``local`` connection or pyinfra's ``@local``. The command is the very one SSH would run (the agent
behind its ``python3 -c`` bootstrap), started from its argv with no shell, its request on stdin.
"""

from __future__ import annotations

import subprocess
import threading

from orchestrator.connector import Command, Counters, Result
from orchestrator.errors import CommandTimeout
from orchestrator.inventory import Target


class LocalConnector:
    def __init__(self) -> None:
        self._counters: dict[str, Counters] = {}
        self._guard = threading.Lock()

    def counters(self, name: str) -> Counters:
        with self._guard:
            return self._counters.setdefault(name, Counters())

    def run(self, target: Target, command: Command, stdin: bytes = b"", timeout: float | None = None) -> Result:
        limit = timeout if timeout is not None else target.container.ssh.command_timeout
        self.counters(target.name).execs += 1
        try:
            proc = subprocess.run(list(command.argv), input=stdin, capture_output=True, timeout=limit, check=False)
        except subprocess.TimeoutExpired as exc:
            raise CommandTimeout(target.name, f"{command.argv[0]} did not finish within {limit:.0f} s") from exc
        except OSError as exc:
            # What a shell would answer over SSH: 127 not found, 126 not executable.
            status = 127 if isinstance(exc, FileNotFoundError) else 126
            message = f"{command.argv[0]}: {exc.strerror or exc}\n".encode()
            return Result(target.name, command, status, b"", message)
        return Result(target.name, command, proc.returncode, proc.stdout, proc.stderr)

    def close(self) -> None:
        """Nothing is held open between commands."""
