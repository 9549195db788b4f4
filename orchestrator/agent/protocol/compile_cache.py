"""The ``compile_cache`` agent module's ops: a host's vLLM compile cache listed, read and placed."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from orchestrator.agent.protocol.core import AnswerError, Op, answer_field, answer_mapping, answer_names, answer_sha256
from orchestrator.agent.protocol.models import MODEL_HASH_TIMEOUT, SLOWEST_UPLOAD_BYTES_PER_S


@dataclass(frozen=True)
class CacheFile:
    """A file of vLLM's compile cache on a host: its path under ``torch_compile_cache``."""

    path: str  # "<hash>/rank_0_0/..." or "torch_aot_compile/<hash>/..."
    size: int
    sha256: str


def _cache_files(v: dict[str, Any]) -> dict[str, tuple[CacheFile, ...] | None]:
    dirs = answer_mapping(v.get("dirs"), "dirs")
    out: dict[str, tuple[CacheFile, ...] | None] = {}
    for name, files in dirs.items():
        if files is None:
            out[name] = None
            continue
        if not isinstance(files, list):
            raise AnswerError(f"dirs[{name!r}] is not a list")
        out[name] = tuple(
            CacheFile(answer_field(f, "path", str), answer_field(f, "size", int), answer_sha256(f, "sha256") or "")
            for f in (answer_mapping(x, f"dirs[{name!r}][]") for x in files)
        )
    return out


def compile_cache_files(
    root: str, dirs: Sequence[str], max_bytes: int, max_files: int, digests: bool = True
) -> Op[dict[str, tuple[CacheFile, ...] | None]]:
    """The files of these hash directories of a host's compile cache (None: it has none of that
    key), each hashed unless not ``digests`` (whether the host has them is all a gift asks):
    refused where one holds what vLLM never writes (a link, a FIFO) or more than ``max_files`` /
    ``max_bytes`` in all."""
    request = {
        "op": "compile_cache_files",
        "root": root,
        "dirs": list(dirs),
        "max_bytes": max_bytes,
        "max_files": max_files,
        "digests": digests,
    }
    return Op(request, _cache_files, budget_s=MODEL_HASH_TIMEOUT)


# Where a given compile cache is uploaded before it is placed, under the host's torch_compile_cache.
GIVEN = ".given"


@dataclass(frozen=True)
class Placed:
    """compile_cache_place: the hash directories moved where vLLM reads them, and those the host
    had of its own by then (kept)."""

    placed: tuple[str, ...]
    kept: tuple[str, ...]


def compile_cache_place(root: str, dirs: Sequence[str]) -> Op[Placed]:
    """Move uploaded hash directories (``.given/<dir>``) where vLLM reads them, each whole."""
    request = {"op": "compile_cache_place", "root": root, "dirs": list(dirs)}
    return Op(request, lambda v: Placed(answer_names(v, "placed"), answer_names(v, "kept")))


def compile_cache_read(root: str, path: str, offset: int, length: int) -> Op[tuple[int, bytes]]:
    """Up to ``length`` bytes of a compile-cache file from ``offset``, and the file's size."""
    request = {
        "op": "compile_cache_read",
        "name": f"{path}@{offset}",
        "root": root,
        "path": path,
        "offset": offset,
        "length": length,
    }

    def read(v: dict[str, Any]) -> tuple[int, bytes]:
        try:
            data = base64.b64decode(answer_field(v, "data", str), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise AnswerError(f"data is not base64: {exc}") from exc
        return answer_field(v, "size", int), data

    return Op(request, read, budget_s=60.0 + length / SLOWEST_UPLOAD_BYTES_PER_S)
