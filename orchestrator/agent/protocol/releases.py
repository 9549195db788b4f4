"""The ``releases`` agent module's ops: a release staged, verified, inspected, listed and made current."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config.playbook import FileSpec
from orchestrator.agent.protocol.core import (
    AnswerError,
    Op,
    answer_field,
    answer_items,
    answer_names,
    answer_sha256,
    ref,
)
from orchestrator.agent.protocol.models import ModelFiles


@dataclass(frozen=True)
class ServedFile:
    """A release file as the agent found it on the host."""

    path: str  # as the playbook names it, relative to the release
    remote_path: str  # where it is, links resolved: the path the server reads
    sha256: str | None  # None: missing
    changed: bool = False
    content: bytes | None = None  # release_inspect: small files' bytes, for diffs
    link: str | None = None  # an overlay link: where it points now (``remote_path``: where it should)
    verified: str | None = None  # an overlay link's digest: "cached" or "hashed" on the host
    pinned: str | None = None  # an overlay link's digest as the release that was current recorded it
    private: bool = False  # release_inspect: not world-readable on the host (its content is not sent)
    mode: str | None = None  # the file's permission bits, octal ("0644"), when it is the release's own

    @classmethod
    def read(cls, value: dict[str, Any]) -> ServedFile:
        content = answer_field(value, "content_b64", str, optional=True)
        if content is not None:
            import base64

            try:
                content_bytes: bytes | None = base64.b64decode(content, validate=True)
            except ValueError as exc:
                raise AnswerError("'content_b64' is not base64") from exc
        else:
            content_bytes = None
        verified = answer_field(value, "verified", str, optional=True)
        if verified not in (None, "cached", "hashed"):
            raise AnswerError(f"'verified' is {verified!r}")
        return cls(
            path=answer_field(value, "path", str),
            remote_path=answer_field(value, "remote_path", str),
            sha256=answer_sha256(value, "sha256"),
            changed=bool(answer_field(value, "changed", bool, optional=True)),
            content=content_bytes,
            link=answer_field(value, "link", str, optional=True),
            verified=verified,
            pinned=answer_sha256(value, "pinned"),
            private=bool(answer_field(value, "private", bool, optional=True)),
            mode=answer_field(value, "mode", str, optional=True),
        )


def _files(value: dict[str, Any]) -> tuple[ServedFile, ...]:
    return tuple(ServedFile.read(f) for f in answer_items(value, "files"))


@dataclass(frozen=True)
class Applied:
    """release_apply: the release that holds the files now (a new one, or current unchanged)."""

    release_id: str
    previous: str | None
    changed: bool
    switched: bool  # False: staged only, the switch comes after the gates
    files: tuple[ServedFile, ...]
    foreign: tuple[str, ...] = ()  # under releases/ but not made by the tool: reported, never removed
    retried: bool = False  # this run's own release, found in place by a retry (its first answer was lost)


@dataclass(frozen=True)
class Switched:
    """release_switch: the release now current, read back through ``current``."""

    release_id: str
    previous: str | None
    files: tuple[ServedFile, ...]
    foreign: tuple[str, ...] = ()  # under releases/ but not made by the tool: reported, never removed


@dataclass(frozen=True)
class Served:
    """release_verify / release_inspect: what ``current`` serves."""

    current: str | None
    previous: str | None
    files: tuple[ServedFile, ...]
    links: tuple[ServedFile, ...] = ()  # release_verify: every link of current's overlay
    manifest: dict[str, str] | None = None  # release_verify: current's own record of its digests
    models: dict[str, str] = field(default_factory=dict)  # release_verify: model file -> digest it was proven with
    extra: tuple[str, ...] = ()  # release_verify: files in the release that it does not record


@dataclass(frozen=True)
class Releases:
    """release_list: the releases on a host, oldest first, and which are current and previous."""

    current: str | None
    previous: str | None
    releases: tuple[str, ...]  # oldest first


def _applied(v: dict[str, Any]) -> Applied:
    return Applied(
        release_id=answer_field(v, "release_id", str),
        previous=answer_field(v, "previous", str, optional=True),
        changed=answer_field(v, "changed", bool),
        switched=answer_field(v, "switched", bool, optional=True) is not False,
        files=_files(v),
        foreign=answer_names(v, "foreign"),
        retried=bool(answer_field(v, "retried", bool, optional=True)),
    )


@dataclass(frozen=True)
class Overlay:
    """Links in the release at ``dest`` to the files of the model directory ``source`` (all of
    them, or the ``files`` a manifest names), except those the release pushes itself."""

    dest: str
    source: str
    files: tuple[str, ...] | None = None


def release_apply(
    root: str,
    release_id: str,
    files: Sequence[FileSpec],
    keep: int,
    switch: bool,
    reuse: bool = True,
    overlays: Sequence[Overlay] = (),
    models: Sequence[Op[ModelFiles]] = (),
    rehash: bool = False,
) -> Op[Applied]:
    """Stage a release (files travel inline, overlays as links), or find that ``current`` holds
    them already.

    ``switch``: make it current in the same op (nothing needs to run in between). ``reuse``: keep
    ``current`` when it holds these files (else always stage ``release_id``). ``models``: this
    batch's ``model_files`` ops (earlier in it), whose digests the release records as what it is
    proven with. ``rehash``: hash the overlay links' targets instead of trusting the cache.
    """
    entries = [{"path": f.dest, "sha256": f.sha256, "mode": f.mode, "content": f.content} for f in files]
    request = {
        "op": "release_apply",
        "root": root,
        "release_id": release_id,
        "keep": keep,
        "switch": switch,
        "reuse": reuse,
        "rehash": rehash,
        "files": entries,
        "overlays": [
            {"dest": o.dest, "source": o.source, "files": list(o.files) if o.files is not None else None}
            for o in overlays
        ],
        "models": [ref(m) for m in models],
    }
    return Op(request, _applied)


def _served(v: dict[str, Any]) -> Served:
    manifest = answer_field(v, "manifest", dict, optional=True)
    if manifest is not None and not all(isinstance(k, str) and isinstance(d, str) for k, d in manifest.items()):
        raise AnswerError("'manifest' is not a mapping of paths to digests")
    models = answer_field(v, "models", dict, optional=True) or {}
    if not all(isinstance(k, str) and isinstance(d, str) for k, d in models.items()):
        raise AnswerError("'models' is not a mapping of paths to digests")
    return Served(
        current=answer_field(v, "current", str, optional=True),
        previous=answer_field(v, "previous", str, optional=True),
        files=_files(v),
        links=tuple(ServedFile.read(f) for f in answer_items(v, "links")) if "links" in v else (),
        manifest=manifest,
        models=models,
        extra=answer_names(v, "extra"),
    )


def release_verify(root: str, paths: Iterable[str], rehash: bool = False) -> Op[Served]:
    """Read-only: the digests of the files the server reads, through ``current``, and its overlay's
    links (``rehash``: hash model files again instead of trusting the digest cache)."""
    request = {"op": "release_verify", "root": root, "files": [{"path": p} for p in paths], "rehash": rehash}
    return Op(request, _served)


# The largest file whose content a dry run shows as a diff (larger ones: digests only).
INSPECT_MAX_BYTES = 256 * 1024


def release_inspect(root: str, paths: Iterable[str]) -> Op[Served]:
    """Read-only: what ``current`` holds, with small files' contents (dry-run diffs)."""
    request = {"op": "release_inspect", "root": root, "files": [{"path": p} for p in paths]}
    return Op({**request, "max_bytes": INSPECT_MAX_BYTES}, _served)


def _releases(v: dict[str, Any]) -> Releases:
    return Releases(
        current=answer_field(v, "current", str, optional=True),
        previous=answer_field(v, "previous", str, optional=True),
        releases=tuple(answer_field(r, "release_id", str) for r in answer_items(v, "releases")),
    )


def release_list(root: str) -> Op[Releases]:
    """Read-only: the releases this tool made on the host, oldest first, and current and previous."""
    return Op({"op": "release_list", "root": root}, _releases)


def _switched(v: dict[str, Any]) -> Switched:
    return Switched(
        release_id=answer_field(v, "release_id", str),
        previous=answer_field(v, "previous", str, optional=True),
        files=_files(v),
        foreign=answer_names(v, "foreign"),
    )


def release_switch(root: str, release_id: str | None, keep: int | None = None) -> Op[Switched]:
    """Make a release current (the previous one when None), reading every file back through it."""
    return Op({"op": "release_switch", "root": root, "release_id": release_id, "keep": keep}, _switched)
