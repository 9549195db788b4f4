"""What the real services the tests start (PostgreSQL, Prometheus) share: a free loopback port,
and an end by their own PID."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM, within: float = 30.0) -> None:
    """End a service we started: ``sig`` (its own clean shutdown), then SIGKILL after ``within`` s."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
