"""The ``models`` agent module's ops: model directories hashed on the host, and uploads into them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from orchestrator.agent.protocol.core import AnswerError, Op, answer_field, answer_items, answer_mapping, answer_sha256


@dataclass(frozen=True)
class ModelFile:
    """One model file on the host with its digest, from the host's cache or hashed now."""

    path: str  # relative to the model directory
    size: int
    sha256: str
    verified: str  # "cached" or "hashed"


@dataclass(frozen=True)
class ModelFiles:
    """A model directory on the host: its files and digests, and what was asked of it besides."""

    path: str
    files: tuple[ModelFile, ...]
    missing: tuple[str, ...]  # named (by a manifest) but not there
    pins: dict[str, str] | None = None  # digests the current release was proven with (None: it kept none)
    release_id: str | None = None  # that release
    config: str | None = None  # config.json's text, when asked (None: the directory has none)
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # safetensors file -> tensor -> dtype, shape
    tokens: dict[int, TokenFacts] | None = None  # the ids asked, in its tokenizer (None: no tokenizer files)
    extra: tuple[str, ...] = ()  # in the directory but not among the files asked for (pinned by name)


@dataclass(frozen=True)
class TokenFacts:
    """A token id as the model's tokenizer files know it."""

    kind: str  # "added" (an added token), "vocab" (a token of the vocabulary), "none" (no token)
    content: str | None = None
    special: bool = False
    roles: tuple[str, ...] = ()  # eos_token, pad_token ... when the tokenizer gives it one
    vocab_size: int | None = None  # the vocabulary's size, for "none"


def _token_facts(v: dict[str, Any]) -> TokenFacts:
    kind = answer_field(v, "kind", str)
    if kind not in ("added", "vocab", "none"):
        raise AnswerError(f"'kind' is {kind!r}")
    roles = answer_field(v, "roles", list, optional=True) or []
    if not all(isinstance(r, str) for r in roles):
        raise AnswerError("'roles' is not a list of names")
    return TokenFacts(
        kind,
        answer_field(v, "content", str, optional=True),
        bool(answer_field(v, "special", bool, optional=True)),
        tuple(roles),
        answer_field(v, "vocab_size", int, optional=True),
    )


def _model_files(v: dict[str, Any]) -> ModelFiles:
    files = []
    for item in answer_items(v, "files"):
        verified = answer_field(item, "verified", str)
        if verified not in ("cached", "hashed"):
            raise AnswerError(f"'verified' is {verified!r}")
        digest = answer_sha256(item, "sha256")
        if digest is None:
            raise AnswerError("'sha256' is missing")
        files.append(ModelFile(answer_field(item, "path", str), answer_field(item, "size", int), digest, verified))
    missing = answer_field(v, "missing", list)
    if not all(isinstance(m, str) for m in missing):
        raise AnswerError("'missing' is not a list of paths")
    headers = answer_field(v, "headers", dict, optional=True) or {}
    for name, tensors in headers.items():
        answer_mapping(tensors, f"the header of {name}")
    pins = answer_field(v, "pins", dict, optional=True)
    if pins is not None and not all(isinstance(k, str) and isinstance(d, str) for k, d in pins.items()):
        raise AnswerError("'pins' is not a mapping of paths to digests")
    tokens = answer_field(v, "tokens", dict, optional=True)
    if tokens is not None and not all(isinstance(k, str) and k.isdigit() for k in tokens):
        raise AnswerError("'tokens' is not a mapping of token ids")
    extra = answer_field(v, "extra", list, optional=True) or []
    if not all(isinstance(e, str) for e in extra):
        raise AnswerError("'extra' is not a list of paths")
    return ModelFiles(
        answer_field(v, "path", str),
        tuple(files),
        tuple(missing),
        pins,
        answer_field(v, "release_id", str, optional=True),
        answer_field(v, "config", str, optional=True),
        headers,
        {int(k): _token_facts(answer_mapping(t, f"token {k}")) for k, t in tokens.items()}
        if tokens is not None
        else None,
        tuple(extra),
    )


# Hashing a model the first time reads all of it (tens of GB on a target): minutes, not seconds.
MODEL_HASH_TIMEOUT = 1800.0


def model_files(
    root: str,
    role: str,
    path: str,
    files: Sequence[str] | None = None,
    config: bool = False,
    headers: bool = False,
    rehash: bool = False,
    record: bool = False,
    skip: Sequence[str] = (),
    tokens: Sequence[int] = (),
) -> Op[ModelFiles]:
    """A model directory's files (all, or those named) with their digests from the deploy root's
    digest cache or hashed now; its config.json (``config``); its safetensors headers
    (``headers``). ``record``: keep new digests in the cache (a deploy, under the lock). ``skip``:
    files the release replaces (the drafter's config.json). ``tokens``: ids to look up in its
    tokenizer files (the drafter's mask token, in the target's)."""
    request = {
        "op": "model_files",
        "name": role,
        "root": root,
        "path": path,
        "files": list(files) if files is not None else None,
        "config": config,
        "headers": headers,
        "rehash": rehash,
        "record": record,
        "skip": list(skip),
        "tokens": list(tokens),
    }
    return Op(request, _model_files, budget_s=MODEL_HASH_TIMEOUT)


@dataclass(frozen=True)
class UploadState:
    """upload_status: how much of each file to push is already on the host."""

    path: str
    present: bool  # already holds the digest pushed
    partial: int  # bytes an earlier, cut upload left (0: none)
    partial_sha256: str | None  # the digest of those bytes


def _upload_state(v: dict[str, Any]) -> UploadState:
    return UploadState(
        answer_field(v, "path", str),
        answer_field(v, "present", bool),
        answer_field(v, "partial", int),
        answer_sha256(v, "partial_sha256"),
    )


def upload_status(
    root: str, files: Sequence[tuple[str, int, str]], replace: bool = False
) -> Op[tuple[UploadState, ...]]:
    """For each (path, size, sha256) to push: there already, or what a cut upload left of it.
    Refused when a file the push would replace was not put there by a push (unless ``replace``)."""
    request = {
        "op": "upload_status",
        "root": root,
        "files": [{"path": p, "size": n, "sha256": d} for p, n, d in files],
        "replace": replace,
    }
    return Op(request, lambda v: tuple(_upload_state(f) for f in answer_items(v, "files")), budget_s=MODEL_HASH_TIMEOUT)


@dataclass(frozen=True)
class Uploaded:
    """upload: a file written and its digest checked on the host."""

    path: str
    written: int  # bytes sent this time (the rest was kept from a cut upload)


# An upload may not be slower than this on average; its deadline follows from its size.
SLOWEST_UPLOAD_BYTES_PER_S = 5e6


def upload(root: str, path: str, size: int, sha256: str, offset: int = 0, mode: str = "0644") -> Op[Uploaded]:
    """A file whose bytes from ``offset`` follow the request on stdin: appended to what a cut
    upload left, checked whole, renamed into place and read back."""
    request = {
        "op": "upload",
        "name": path,
        "root": root,
        "path": path,
        "size": size,
        "sha256": sha256,
        "offset": offset,
        "mode": mode,
    }
    reader = lambda v: Uploaded(answer_field(v, "path", str), answer_field(v, "written", int))  # noqa: E731
    return Op(request, reader, budget_s=60.0 + (size - offset) / SLOWEST_UPLOAD_BYTES_PER_S)
