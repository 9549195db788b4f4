"""Files the tool writes on the controller where a person says: never replacing what is not a
regular file.

A path given for output can name a device (``/dev/stdout``, ``/dev/full``), a pipe, a directory
or a link. Writing by rename, as an atomic write does, would replace such a node with a regular
file (a device node gone, a link cut). So a regular file, or a link to one, is replaced
atomically at the file the link names, its mode kept; a device or a pipe is written through,
its own errors reported; anything else, and an empty name, is refused.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from orchestrator.errors import InputError


def write_output(path: Path, data: bytes, what: str) -> None:
    """``data`` at ``path``, which the user named as ``what`` (``--html``); an ``InputError``
    naming both when it cannot be written, and nothing replaced that was not a regular file."""
    if not str(path):
        raise InputError(f"{what}: an empty path")
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise InputError(f"{what} {path}: {exc.strerror or exc}") from None
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        try:
            # Through the device or the pipe: it stays what it is. A pipe nobody reads would
            # block the open for ever: opened without waiting, that is ENXIO, said as such.
            fd = os.open(real, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            why = "nothing reads the pipe" if exc.errno == errno.ENXIO else exc.strerror or str(exc)
            raise InputError(f"{what} {path}: {why}") from None
        try:
            os.set_blocking(fd, True)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise InputError(f"{what} {path}: {exc.strerror or exc}") from None
        return
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path}: not a regular file (a directory, a socket or a block device is not replaced)")
    replace_file(real, data, st.st_mode & 0o7777 if st is not None else None, what)


def replace_file(real: Path, data: bytes, mode: int | None, what: str) -> None:
    """Replace the regular file ``real`` (no link) atomically: a temporary file beside it, synced,
    renamed over it, the directory synced. ``mode``: the one to keep (None: the umask's)."""
    import tempfile  # here: it brings random (~2 ms), and most runs write no local file

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", dir=real.parent)
    except OSError as exc:
        raise InputError(f"{what} {real}: cannot write beside it: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"{what} {real}: {exc.strerror or exc} (it is unchanged)") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(real.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


KNOWN_HOSTS_IS_A_FILE = "known_hosts is read and appended to as one"


def open_regular(path: Path, flags: int, what: str) -> int | None:
    """A file descriptor of ``path`` opened with ``flags``, never so as to wait (a FIFO in its place
    would block: reading it, or writing to it with no reader); None when there is none. Anything
    but a regular file is bad input naming ``what`` it should be."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"cannot open: {exc.strerror or exc}", file=str(path)) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"not a regular file: {what}", file=str(path))
    os.set_blocking(fd, True)
    return fd
