"""Processes the sandboxes start, and only those: started, identified and ended by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.errors import SandboxError

SSHD = "/usr/sbin/sshd"


def run(argv: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a sandbox command to its end; a missing program, a hang past timeout or (with check) a
    failure is one SandboxError saying which."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise SandboxError(f"{argv[0]} is not installed (apt-get install openssh-server iproute2)") from exc
    except subprocess.TimeoutExpired as exc:
        raise SandboxError(
            f"{' '.join(argv)} did not finish within {timeout:.0f} s (is the machine very busy?)"
        ) from exc
    if check and proc.returncode != 0:
        raise SandboxError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


# The measured command runs under a small Python of its own. The kernel folds the address space a
# process had before its exec into its peak RSS, and a child of ours has our address space until it
# execs (fork or vfork alike): wait4 on our own child reported our peak whenever it was the larger
# (a test worker's 470 MiB was once reported as the controller's). The trampoline's own address
# space, about 10 MiB, is the most it can add; it says the peak and the exit status on the pipe
# whose descriptor is its first argument.
_TRAMPOLINE = """
import os, sys
said = int(sys.argv[1])
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
os.write(said, f"{usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}".encode())
"""


def run_measured(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 1800
) -> tuple[subprocess.CompletedProcess[bytes], int]:
    """Run a command; its own peak resident memory (KiB), from the kernel's accounting of that one
    process (wait4, by a parent that is small: see ``_TRAMPOLINE``). RUSAGE_CHILDREN's ru_maxrss
    is the largest of every child the caller ever waited for, which says nothing about this one."""
    import sys
    import tempfile

    said_r, said_w = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", _TRAMPOLINE, str(said_w), *argv],
                stdout=out, stderr=err, env=env, pass_fds=(said_w,), start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(said_w)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            # The session is the trampoline's and the command's: both ours, ended together.
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        with os.fdopen(said_r, "rb") as said:
            words = said.read().split()
        peak, status = (int(words[0]), int(words[1])) if len(words) == 2 else (0, child.returncode or -9)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, status, out.read(), err.read()), peak


def proc_start(pid: int) -> str:
    """The process's start time: with the PID it identifies a process we started."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def alive(pid: int, start: str) -> bool:
    """Whether the process we started is still that process (same pid and start time) and not a
    zombie."""
    if pid <= 0 or not start or proc_start(pid) != start:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state in ("Z", "X"):
        # Our own child that has exited: reap it (when we are its parent) so its PID is free.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def descendants(pid: int) -> list[int]:
    """Every process below pid, from /proc (children first found, then theirs)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def stop_process(pid: int, start: str, grace: float = 10.0) -> None:
    """End a process we started, and its children, if it is still the one we started."""
    if not alive(pid, start):
        return
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)
    _end({pid: start}, grace)


def _end(victims: dict[int, str], grace: float) -> None:
    """SIGTERM each (PID, start time), wait up to ``grace`` for them to go, SIGKILL who is left."""
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(p, s) for p, s in victims.items()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid, start in victims.items():
        if alive(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stop_namespace(netns: Path, grace: float = 5.0) -> None:
    """End every process still inside a network namespace the sandbox created.

    Only our sshd and what it started ever run there, but a session whose parent exited first is
    reparented to init and escapes the walk down from the listener; left alone it waits forever
    on a connection whose peer is gone with the namespace.
    """
    try:
        st = os.stat(netns)
    except FileNotFoundError:
        return
    wanted = (st.st_dev, st.st_ino)
    victims: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ns = os.stat(entry / "ns" / "net")
                if (ns.st_dev, ns.st_ino) == wanted:
                    victims[int(entry.name)] = proc_start(int(entry.name))
    _end(victims, grace)


def write_file(path: Path, text: str, mode: int) -> None:
    """Write a file of the sandbox atomically, with its mode set before it appears."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def start_sshd(
    directory: Path,
    listen: str,
    authorized_keys: Path,
    name: str,
    preexec: Callable[[], None] | None = None,
    log_level: str = "ERROR",
) -> tuple[int, str]:
    """An ``sshd -D`` of our own (key-only root login), its host key and log in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    key = directory / "ssh_host_ed25519_key"
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)])
    config = directory / "sshd_config"
    settings = [
        f"ListenAddress {listen}",
        f"HostKey {key}",
        "PidFile none",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",  # the sandbox directory may live under a world-writable /tmp
        "AllowTcpForwarding yes",
        "X11Forwarding no",
        "PrintMotd no",
        "Subsystem sftp internal-sftp",
        "MaxStartups 500",
        "MaxSessions 100",
        f"LogLevel {log_level}",  # the benchmark counts SSH round trips from DEBUG1 lines
    ]
    config.write_text("\n".join(settings) + "\n")
    with open(directory / "sshd.log", "ab") as log:
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=preexec,
        )
    return proc.pid, proc_start(proc.pid)
