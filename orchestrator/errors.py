"""The project's exception tree. Third-party errors are mapped into it at the transport boundary.

OrchestratorError                 exit code 1 unless a subclass says otherwise
├── InputError                    exit 2: a file, its line and the key path
├── TransportError                one host could not be reached or talked to
│   ├── HostKeyError              never retried
│   │   ├── UnknownHostKey
│   │   └── HostKeyChanged
│   ├── AuthenticationFailed      never retried
│   ├── ConnectFailed             transient: refused, unreachable, timed out
│   ├── ConnectionLost            transient: reset or closed during a command
│   └── CommandTimeout
├── AgentError                    the remote agent reported a structured failure (an AgentFailure)
├── AgentProtocolError            the agent's answer could not be understood or had the wrong shape
├── LxdError                      a GPU host's LXD: unreachable, refused, or a change that failed
├── ArtifactError                 a local file to push (``push:``) could not be read
├── StateError                    the local state database
└── SandboxError                  setting up or tearing down the local sandbox
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXIT_OK = 0
EXIT_NOT_READY = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class OrchestratorError(Exception):
    """The root of the tool's own errors; each carries the exit code the CLI ends with."""

    exit_code = EXIT_NOT_READY


class InputError(OrchestratorError):
    """Bad input: names the file, the line and the key path when they are known."""

    exit_code = EXIT_BAD_INPUT

    def __init__(
        self, message: str, *, file: str | None = None, line: int | None = None, key: str | None = None
    ) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.key = key
        super().__init__(self.render())

    def render(self) -> str:
        where = ""
        if self.file:
            where = self.file if self.line is None else f"{self.file}:{self.line}"
        if self.key:
            where = f"{where} {self.key}" if where else self.key
        return f"{where}: {self.message}" if where else self.message


class TransportError(OrchestratorError):
    """A host could not be reached or a command on it did not complete; transient ones are retried."""

    transient = False

    def __init__(self, host: str, message: str) -> None:
        self.host = host
        self.message = message
        super().__init__(f"{host}: {message}")


class HostKeyError(TransportError):
    """The host's SSH key is not the one known_hosts trusts for it."""


class UnknownHostKey(HostKeyError):
    """The host's key is not in known_hosts (refused unless --accept-new-host-keys)."""


class HostKeyChanged(HostKeyError):
    """The host's key differs from the one known_hosts holds: always refused."""


class AuthenticationFailed(TransportError):
    """The host refused the key or user it was given."""


class ConnectFailed(TransportError):
    """No SSH session could be made (refused, unreachable, dropped during the handshake): retried."""

    transient = True


class ConnectionLost(TransportError):
    """An open connection broke during a command: retried where the command can be repeated."""

    transient = True


class CommandTimeout(TransportError):
    """A command did not finish within its deadline (it was ended)."""


@dataclass(frozen=True)
class AgentFailure:
    """One failed operation, as the agent reported it, and the gate its failure is reported under
    (the op's row in ``protocol.OPS``)."""

    op: str
    code: str
    message: str
    path: str | None = None
    errno: int | None = None
    gate: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any], gate: str = "") -> AgentFailure:
        """The agent's error record, read warily (the host is not trusted)."""
        path, err = data.get("path"), data.get("errno")
        return cls(
            op=str(data.get("op")),
            code=str(data.get("code")),
            message=str(data.get("message")),
            path=path if isinstance(path, str) else None,
            errno=err if isinstance(err, int) and not isinstance(err, bool) else None,
            gate=gate,
        )

    def describe(self) -> str:
        """The failure in one line: the op, the path it was about, the agent's words."""
        where = f" {self.path}" if self.path else ""
        return f"{self.op}{where}: {self.message}"


class AgentError(OrchestratorError):
    """An operation of a batch failed and stopped it; ``done`` holds the answers of the ops before
    it (``protocol.Answers``, found by op, with the findings among them)."""

    def __init__(self, host: str, failure: AgentFailure, done: Any = None) -> None:
        self.host = host
        self.failure = failure
        self.done = done
        super().__init__(f"{host}: {failure.describe()}")


class AgentProtocolError(OrchestratorError):
    """The agent's answer could not be understood (wrong Python, crash, truncated output); ``gate``:
    that of the op whose answer it was, when one op's answer is at fault."""

    def __init__(self, host: str, message: str, exit_status: int, stderr: str, gate: str | None = None) -> None:
        self.host = host
        self.gate = gate
        self.exit_status = exit_status
        self.stderr = stderr
        tail = "\n".join(stderr.strip().splitlines()[-5:])
        detail = f" (exit {exit_status})" + (f"; stderr: {tail}" if tail else "")
        super().__init__(f"{host}: {message}{detail}")


class LxdError(OrchestratorError):
    """LXD refused or failed a request about one container, in LXD's words."""

    def __init__(self, host: str, message: str) -> None:
        self.host = host
        self.message = message
        super().__init__(f"{host}: {message}")


class ArtifactError(OrchestratorError):
    """A local model file to push could not be read (it changed or vanished since it was hashed)."""


class GatewayError(OrchestratorError):
    """The gateway in front of the servers could not be reached, refused, or answered what cannot
    be read or believed: its own words, where it gave some."""


class StateError(OrchestratorError):
    """The state database could not be opened, read or written."""


class LeaseWaitStopped(StateError):
    """The run was interrupted while it waited for another controller's rollout lease: nothing was
    taken and no host touched (the run ends as interrupted, every host named, and is recorded)."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(f"interrupted while waiting for {name}, which {holder} is rolling out")
        self.name, self.holder = name, holder


class SandboxError(OrchestratorError):
    """The local sandbox could not be brought up, read or down."""
