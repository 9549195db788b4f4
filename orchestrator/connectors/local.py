"""The ``local`` connection: commands run on this machine, as this user, with no SSH.

For a single GPU box with no container (``connection: local`` in the inventory), like Ansible's
``local`` connection or pyinfra's ``@local``. The command is the very one SSH would run (the agent
behind its ``python3 -c`` bootstrap), started from its argv with no shell, its request on stdin.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from typing import Any

from orchestrator.config.inventory import Target
from orchestrator.connectors.base import Command, Counters, Feed, OnStderr, Result, StderrTail, Stdin, readable
from orchestrator.errors import CommandTimeout, ConnectionLost


class LocalConnector:
    """Commands on this machine, as this user, with no SSH: the ``local`` connection."""

    def __init__(self) -> None:
        self._counters: dict[str, Counters] = {}
        self._guard = threading.Lock()

    def counters(self, name: str) -> Counters:
        with self._guard:
            return self._counters.setdefault(name, Counters())

    def run(
        self,
        target: Target,
        command: Command,
        stdin: Stdin = b"",
        timeout: float | None = None,
        on_stderr: OnStderr | None = None,
    ) -> Result:
        limit = timeout if timeout is not None else target.container.ssh.command_timeout
        deadline = time.monotonic() + limit
        self.counters(target.name).execs += 1
        try:
            # A session of its own, as sshd gives a remote agent: a Ctrl-C or a hang-up at the
            # controller's terminal reaches the controller only, and the agent finishes its
            # batch's atomic steps (killed mid-batch, it left current on an unproven release).
            proc = subprocess.Popen(
                list(command.argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            # What a shell would answer over SSH: 127 not found, 126 not executable.
            status = 127 if isinstance(exc, FileNotFoundError) else 126
            message = f"{command.argv[0]}: {exc.strerror or exc}\n".encode()
            return Result(target.name, command, status, b"", message)
        streams: dict[str, bytes] = {}
        failed: list[BaseException] = []

        def read(key: str, f: Any) -> None:
            chunks = []
            while chunk := f.read1(1 << 16):
                chunks.append(chunk)
                if key == "err" and on_stderr is not None:
                    on_stderr(chunk)
            streams[key] = b"".join(chunks)

        threads = [
            threading.Thread(target=read, args=(key, f), daemon=True)
            for key, f in (("out", proc.stdout), ("err", proc.stderr))
        ]
        threads.append(threading.Thread(target=self._feed, args=(proc, Feed(stdin), failed), daemon=True))
        for thread in threads:
            thread.start()
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.wait()
            raise CommandTimeout(target.name, f"{command.argv[0]} did not finish within {limit:.0f} s") from exc
        finally:
            for thread in threads:
                thread.join()
        if failed:
            raise failed[0]  # reading the stream failed (a local file): that error, not the command's
        return Result(target.name, command, proc.returncode, streams.get("out", b""), streams.get("err", b""))

    @staticmethod
    def _feed(proc: subprocess.Popen[bytes], pending: Feed, failed: list[BaseException]) -> None:
        """Write stdin (a stream is read as it is written), then close it; a command that exits
        without reading it all just gets no more."""
        assert proc.stdin is not None
        try:
            while pending:
                chunk = pending.take(1 << 20)
                proc.stdin.write(chunk)
                pending.advance(len(chunk))
        except BrokenPipeError:
            pending.drop()
        except Exception as exc:
            failed.append(exc)
            proc.kill()
        finally:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()

    def open(self, target: Target, command: Command) -> LocalSession:
        self.counters(target.name).execs += 1
        try:
            proc = subprocess.Popen(
                list(command.argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # as run(): the terminal's signals are the controller's
            )
        except OSError as exc:
            raise ConnectionLost(target.name, f"could not start {command.argv[0]}: {exc.strerror or exc}") from exc
        return LocalSession(target.name, proc)

    @property
    def accepted_host_keys(self) -> list[str]:
        return []  # this machine: no host key to trust

    def close(self) -> None:
        """Nothing is held open between commands (a session is closed by its owner)."""


class LocalSession:
    """A local process kept running for a conversation (``base.Session``)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self._name, self._proc = name, proc
        self._stderr = StderrTail()
        assert proc.stderr is not None
        self._reader = threading.Thread(target=self._drain, args=(proc.stderr,), daemon=True)
        self._reader.start()

    def _drain(self, stream: object) -> None:
        fd = stream.fileno()  # type: ignore[attr-defined]
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 1 << 16):
                self._stderr.add(chunk)

    def send(self, data: bytes, deadline: float) -> None:
        assert self._proc.stdin is not None
        if time.monotonic() > deadline:
            raise CommandTimeout(self._name, "could not send within the deadline")
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise ConnectionLost(self._name, "the command ended while we were sending") from exc

    def recv(self, deadline: float) -> bytes:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommandTimeout(self._name, "no answer within the deadline")
            if readable(fd, min(remaining, 1.0)):
                return os.read(fd, 1 << 16)

    def stderr_tail(self) -> str:
        return self._stderr.text()

    def close(self) -> None:
        """stdin closed: the agent exits; one that does not within 5 s is killed (it is ours)."""
        with contextlib.suppress(OSError, ValueError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(1)  # stderr ends with the process (unless a child of it still holds it)
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()
