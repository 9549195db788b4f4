"""A local model directory's files with their digests: what ``push:`` sends and what the
``models`` gate holds a host's copy to. Hashed once per process and size/mtime."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import ArtifactError

CHUNK = 1 << 20


@dataclass(frozen=True)
class LocalFile:
    """A file of a model directory to push, with its size and digest."""

    rel: str  # relative to the model directory
    path: Path
    size: int
    sha256: str


_digests: dict[tuple[str, int, int], str] = {}
_digests_lock = threading.Lock()


def sha256_of(path: Path, size: int | None = None) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            left = size
            while left is None or left > 0:
                block = f.read(CHUNK if left is None else min(CHUNK, left))
                if not block:
                    break
                h.update(block)
                if left is not None:
                    left -= len(block)
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return h.hexdigest()


def local_files(directory: Path) -> list[LocalFile]:
    """A local model directory's files (hidden ones skipped, as on the host) with their digests,
    hashed once per process and size/mtime (every host of a run shares them)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(n for n in filenames if not n.startswith(".")):
            path = Path(dirpath) / name
            rel = str(path.relative_to(directory))
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                raise ArtifactError(
                    f"{path!r}: a model file name must be UTF-8 (vLLM and the release name it)"
                ) from None
            if any(c in rel for c in "\t\n\r\\"):
                # The host refuses such a name in a release's records: refused here, before any byte goes.
                raise ArtifactError(f"{path!r}: a model file name may not hold a tab, a line break or a backslash")
            try:
                st = path.stat()
            except OSError as exc:
                raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from exc
            key = (str(path), st.st_size, st.st_mtime_ns)
            with _digests_lock:
                digest = _digests.get(key)
            if digest is None:
                digest = sha256_of(path)
                with _digests_lock:
                    _digests[key] = digest
            files.append(LocalFile(rel, path, st.st_size, digest))
    return files
