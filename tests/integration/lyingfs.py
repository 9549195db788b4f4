"""A passthrough FUSE filesystem with one hostile twist, for the read-back test.

Right after any rename onto a file named ``config.json`` it overwrites that file with the
bytes of STALE_FILE: a writer that changes the file the moment our rename lands, which is
what the read-back through a fresh open of the final path must catch. Reads bypass the page
cache (direct_io) so what a reader sees is what is on the backing disk.

    python lyingfs.py BACKING_DIR MOUNTPOINT STALE_FILE
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-untyped]  # fusepy raises OSError as -errno


class LyingFS(Operations):  # type: ignore[misc]
    def __init__(self, backing: str, stale: bytes) -> None:
        self.backing = backing
        self.stale = stale

    def _p(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        st = os.lstat(self._p(path))
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid", "st_ino")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._p(path))]

    def access(self, path: str, mode: int) -> None:
        if not os.access(self._p(path), mode):
            raise FuseOSError(errno.EACCES)

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._p(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._p(path), uid, gid)

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._p(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._p(path))

    def unlink(self, path: str) -> None:
        os.unlink(self._p(path))

    def symlink(self, target: str, source: str) -> None:
        os.symlink(source, self._p(target))

    def readlink(self, path: str) -> str:
        return os.readlink(self._p(path))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._p(old), self._p(new))
        if os.path.basename(new) == "config.json":
            with open(self._p(new), "wb") as f:
                f.write(self.stale)

    def utimens(self, path: str, times: Any = None) -> None:
        os.utime(self._p(path), times)

    def statfs(self, path: str) -> dict[str, Any]:
        sv = os.statvfs(self._p(path))
        keys = (
            "f_bavail",
            "f_bfree",
            "f_blocks",
            "f_bsize",
            "f_favail",
            "f_ffree",
            "f_files",
            "f_flag",
            "f_frsize",
            "f_namemax",
        )
        return {k: getattr(sv, k) for k in keys}

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def open(self, path: str, flags: int) -> int:
        return os.open(self._p(path), flags)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: Any = None) -> None:
        os.truncate(self._p(path), length)

    def flush(self, path: str, fh: int) -> None:
        return None

    def release(self, path: str, fh: int) -> None:
        os.close(fh)

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        os.fsync(fh)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
        return None


if __name__ == "__main__":
    backing, mountpoint, stale_file = sys.argv[1:4]
    with open(stale_file, "rb") as f:
        stale = f.read()
    FUSE(
        LyingFS(backing, stale),
        mountpoint,
        foreground=True,
        nothreads=True,
        allow_other=True,
        direct_io=True,
        attr_timeout=0,
        entry_timeout=0,
    )
