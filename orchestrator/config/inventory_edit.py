"""Editing the inventory file in place, keeping every comment, the key order, the quoting, the
indentation and the blank lines of what the edit does not touch.

Each edit is a function on the round-trip document (ruamel.yaml). The edited text is parsed and
validated exactly as ``deploy`` would before anything is written; a refused edit leaves the file
byte-identical. The write is atomic (temp file in the same directory, fsync, rename) and keeps the
file's mode.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import io
import itertools
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.tokens import CommentToken

from orchestrator.config.inventory import Inventory, parse_inventory
from orchestrator.config.yamlsource import load_text
from orchestrator.errors import InputError

Edit = Callable[[CommentedMap], str]  # changes the document, returns what it did in words


@dataclass(frozen=True)
class EditResult:
    """What an `orchestrate inventory` edit did: the file, what changed, and the text written (or
    that would be, with --dry-run)."""

    path: Path
    summary: str
    diff: str
    written: bool


@dataclass(frozen=True)
class _Layout:
    """What of a file's bytes the YAML writer does not keep by itself, kept around it: a
    byte-order mark, CRLF line ends, the document markers, the indentation it guesses."""

    bom: bool
    crlf: bool
    start: bool
    end: bool
    mapping: int
    offset: int


def _layout(text: str) -> _Layout:
    body = text.removeprefix("\ufeff")
    lines = body.split("\n")
    crlf = body.count("\r\n") > 0 and body.count("\r\n") == body.count("\n")
    content = [line.rstrip("\r") for line in lines if line.strip() and not line.lstrip().startswith("#")]
    mapping = offset = None
    for here, there in itertools.pairwise(content):
        key = here.split(" #", 1)[0].rstrip()
        if not key.endswith(":") or key.lstrip().startswith("- "):
            continue  # not a key that opens a block (or one inside a sequence item)
        col, inner = len(here) - len(here.lstrip(" ")), len(there) - len(there.lstrip(" "))
        if there.lstrip().startswith("- ") and offset is None and inner >= col:
            offset = inner - col
        elif not there.lstrip().startswith("- ") and mapping is None and inner > col:
            mapping = inner - col
    return _Layout(
        bom=text.startswith("\ufeff"),
        crlf=crlf,
        start=bool(content) and content[0].startswith("---"),
        end=bool(content) and content[-1].rstrip() == "...",
        mapping=mapping or 2,
        offset=offset or 0,
    )


def _yaml(text: str) -> tuple[YAML, Any, _Layout]:
    layout = _layout(text)
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long lines
    yaml.indent(mapping=layout.mapping, sequence=layout.offset + 2, offset=layout.offset)
    yaml.explicit_start = layout.start
    yaml.explicit_end = layout.end
    try:
        return yaml, yaml.load(_plain(text, layout)), layout
    except YAMLError as exc:
        raise InputError(f"invalid YAML: {exc}") from exc


def _plain(text: str, layout: _Layout) -> str:
    text = text.removeprefix("\ufeff")
    return text.replace("\r\n", "\n") if layout.crlf else text


def _dump(yaml: YAML, data: Any, layout: _Layout) -> str:
    buffer = io.StringIO()
    yaml.dump(data, buffer)
    text = buffer.getvalue()
    if layout.crlf:
        text = text.replace("\n", "\r\n")
    return ("\ufeff" if layout.bom else "") + text


def _kept(before: str, yaml: YAML, data: Any, layout: _Layout, path: Path) -> None:
    """An edit changes only the bytes it means to change: the file as the writer would write it
    unedited must be the file as it is, else the edit would rewrite lines it does not touch
    (another indentation, a comment on a document marker, mixed line ends). Refused, naming the
    first such line, before anything is edited."""
    unedited = _dump(yaml, data, layout)
    if unedited == before:
        return
    old, new = before.split("\n"), unedited.split("\n")  # a line's "\r" is part of what differs
    n = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    was = old[n] if n < len(old) else "(the end of the file)"
    would = new[n] if n < len(new) else "(nothing)"
    raise InputError(
        f"an edit would also rewrite line {n + 1} ({was.rstrip(' ')[:80]!r} becomes {would.rstrip(' ')[:80]!r}): "
        "the YAML writer cannot keep this file's layout there, so the edit is refused; edit the file by hand, "
        "or lay that line out as the writer does",
        file=str(path),
        line=n + 1,
    )


def edit_inventory(path: Path, edit: Edit, dry_run: bool = False) -> EditResult:
    """Apply one edit: serialised with every other edit of the file (a lock beside it, the file
    read again under it), through a link to the file it names, keeping its owner and mode."""
    real = Path(os.path.realpath(path))
    try:
        regular = stat.S_ISREG(os.stat(real).st_mode)
    except FileNotFoundError:
        raise InputError("file not found", file=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", file=str(path)) from exc
    if not regular:
        # An edit replaces the file by a rename: a device, a pipe or a directory would be
        # replaced by a regular file (and opening a pipe to read it waits for a writer).
        raise InputError(f"not a regular file ({real}): an inventory is edited only when it is one", file=str(path))
    with _locked(real):
        return _edit(real, edit, dry_run)


@contextlib.contextmanager
def _locked(real: Path) -> Iterator[None]:
    """An exclusive lock on the file itself. An edit replaces the file (a rename), so a lock won
    on the file it replaced is no lock: try again until the locked file is the one at the path."""
    while True:
        try:
            fd = os.open(real, os.O_RDONLY)
        except FileNotFoundError:
            raise InputError("file not found", file=str(real)) from None
        except OSError as exc:
            raise InputError(f"cannot open for editing: {exc.strerror or exc}", file=str(real)) from exc
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            st = None
        held = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _edit(path: Path, edit: Edit, dry_run: bool) -> EditResult:
    try:
        with path.open(encoding="utf-8", newline="") as f:  # line ends as they are (CRLF kept)
            before = f.read()
    except FileNotFoundError:
        raise InputError("file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read: {exc}", file=str(path)) from exc
    yaml, data, layout = _yaml(before)
    if not isinstance(data, CommentedMap):
        raise InputError("the inventory must be a mapping", file=str(path), line=1)
    _kept(before, yaml, data, layout, path)
    summary = edit(data)
    after = _dump(yaml, data, layout)
    validate_text(after, path)  # refuse before writing: the file stays as it was
    diff = "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), fromfile=str(path), tofile=str(path)
        )
    )
    if dry_run or after == before:
        return EditResult(path, summary, diff, False)
    _atomic_replace(path, after)
    return EditResult(path, summary, diff, True)


def validate_text(text: str, path: Path) -> Inventory:
    """The edited inventory text loaded as the inventory it would be (an InputError if not), before
    it replaces the file."""
    return parse_inventory(load_text(text, str(path)), path)


def _atomic_replace(path: Path, text: str) -> None:
    st = path.stat()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise InputError(f"cannot write beside it: {exc.strerror or exc}", file=str(path)) from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, st.st_mode & 0o7777)
        if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
            os.chown(tmp, st.st_uid, st.st_gid)  # an edit as root keeps the file its owner's
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"cannot write: {exc.strerror or exc} (the file is unchanged)", file=str(path)) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# --- the edits ---------------------------------------------------------------------------


def _hosts(doc: CommentedMap) -> CommentedMap:
    hosts = doc.get("hosts")
    if hosts is None:
        hosts = doc["hosts"] = CommentedMap()
    if not isinstance(hosts, CommentedMap):
        raise InputError("hosts: expected a mapping")
    return hosts


def _container_names(doc: CommentedMap) -> dict[str, str]:
    out = {}
    for hname, host in _hosts(doc).items():
        for cname in (host or {}).get("containers") or {}:
            out[cname] = hname
    return out


def add_host(
    name: str,
    address: str,
    port: int | None = None,
    user: str | None = None,
    key: str | None = None,
    lxd_endpoint: str | None = None,
) -> Edit:
    """The edit that adds a GPU host to the inventory file, its comments and layout kept; refused if the name is
    taken."""

    def edit(doc: CommentedMap) -> str:
        hosts = _hosts(doc)
        if name in hosts or name in _container_names(doc):
            raise InputError(f"'{name}' is already in the inventory", key=f"hosts.{name}")
        host = CommentedMap()
        host["address"] = address
        for k, v in (("port", port), ("user", user), ("key", key)):
            if v is not None:
                host[k] = v
        if lxd_endpoint is not None:
            host["lxd"] = CommentedMap(endpoint=lxd_endpoint)
        host["containers"] = CommentedMap()
        hosts[name] = host
        return f"added GPU host {name}"

    return edit


def remove_host(name: str) -> Edit:
    """The edit that removes a GPU host and its containers from the inventory file."""

    def edit(doc: CommentedMap) -> str:
        hosts = _hosts(doc)
        if name not in hosts:
            raise InputError(f"no GPU host '{name}'", key=f"hosts.{name}")
        _delete(hosts, name)
        return f"removed GPU host {name}"

    return edit


def add_container(
    host: str, name: str, address: str | None = None, gpus: list[int] | None = None, groups: list[str] | None = None
) -> Edit:
    """The edit that adds a container to a GPU host in the inventory file; refused if the name is taken anywhere."""

    def edit(doc: CommentedMap) -> str:
        hosts = _hosts(doc)
        if host not in hosts:
            raise InputError(f"no GPU host '{host}'", key=f"hosts.{host}")
        if name in _container_names(doc) or name in hosts:
            raise InputError(f"'{name}' is already in the inventory", key=f"hosts.{host}.containers.{name}")
        entry = hosts[host]
        containers = entry.get("containers")
        if containers is None:
            containers = entry["containers"] = CommentedMap()
        container = CommentedMap()
        if address is not None:
            container["address"] = address
        if gpus:
            container["gpus"] = _flow(list(gpus))
        if groups:
            container["groups"] = _flow(list(groups))
        containers[name] = container
        return f"added container {name} on {host}"

    return edit


def remove_container(host: str, name: str) -> Edit:
    """The edit that removes a container from its GPU host in the inventory file."""

    def edit(doc: CommentedMap) -> str:
        containers = (_hosts(doc).get(host) or {}).get("containers") or {}
        if not isinstance(containers, CommentedMap) or name not in containers:
            raise InputError(f"no container '{name}' on GPU host '{host}'", key=f"hosts.{host}.containers.{name}")
        _delete(containers, name)
        return f"removed container {name} from {host}"

    return edit


def _last_slot(mapping: CommentedMap, key: str) -> tuple[CommentedMap, str]:
    """Where ruamel keeps the comment lines that follow an entry: on its deepest last key."""
    value = mapping[key]
    while isinstance(value, CommentedMap) and len(value) and not value.fa.flow_style():
        mapping, key = value, next(reversed(value))
        value = mapping[key]
    return mapping, key


def _delete(mapping: CommentedMap, key: str) -> None:
    """Remove an entry but not the comment lines after it: they head what follows (the next GPU
    host's comment, say), so they move to the entry before it, or to the start of its mapping."""
    owner, last = _last_slot(mapping, key)
    slots = owner.ca.items.get(last)
    token = slots[2] if slots and len(slots) > 2 else None
    carried = token.value[token.value.index("\n") + 1 :] if token is not None and "\n" in token.value else ""
    keys = list(mapping)
    before = keys[keys.index(key) - 1] if keys.index(key) > 0 else None
    del mapping[key]
    if token is None or not carried.strip():
        return
    if before is not None:
        owner, last = _last_slot(mapping, before)
        slots = owner.ca.items.setdefault(last, [None, None, None, None])
        while len(slots) < 4:
            slots.append(None)
        if slots[2] is None:
            slots[2] = CommentToken("\n" + carried, token.start_mark, None)
        else:
            slots[2].value = slots[2].value.rstrip("\n") + "\n" + carried
    else:
        lines = [line.strip() for line in carried.splitlines() if line.strip()]
        indent = len(carried.splitlines()[0]) - len(carried.splitlines()[0].lstrip()) if carried.strip() else 0
        mapping.yaml_set_start_comment("\n".join(line.lstrip("#").lstrip() for line in lines), indent=indent)


def parse_value(text: str) -> Any:
    """A YAML scalar or flow collection, as typed on the command line: ``'[0,1]'``, ``true``, ``8000``.
    Plain values only: a tag (``!!python/object/apply:...``) would make the file unsafe to read."""
    load_text(text, "the value")  # refuses tags, aliases and non-finite numbers with the safe loader
    try:
        value = YAML().load(text)
    except YAMLError as exc:
        raise InputError(f"cannot read value {text!r}: {exc}") from exc
    if isinstance(value, (CommentedMap, CommentedSeq)):
        value.fa.set_flow_style()  # '[0,1]' on the command line stays a flow list in the file
    return value


def set_key(path: str, value: Any) -> Edit:
    """The edit that sets one value at a dotted key path of the inventory file (plain values only), validated
    before it is written."""
    parts = _split(path)

    def edit(doc: CommentedMap) -> str:
        node = doc
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = CommentedMap()
            if not isinstance(child, CommentedMap):
                raise InputError(f"'{'.'.join(parts[: i + 1])}' is not a mapping", key=path)
            node = child
        if parts[-1] in node:
            node[parts[-1]] = value
        else:
            _append(node, parts[-1], value)
        return f"set {path}"

    return edit


def unset_key(path: str) -> Edit:
    """The edit that removes the value at a dotted key path of the inventory file, validated before it is written."""
    parts = _split(path)

    def edit(doc: CommentedMap) -> str:
        node: Any = doc
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, CommentedMap) else None
        if not isinstance(node, CommentedMap) or parts[-1] not in node:
            raise InputError("no such key", key=path)
        del node[parts[-1]]
        return f"unset {path}"

    return edit


def _append(mapping: CommentedMap, key: str, value: Any) -> None:
    """Add a key at the end of a mapping, before the blank lines that followed its last key."""
    last = next(reversed(mapping), None) if len(mapping) else None
    mapping[key] = value
    if last is None or isinstance(mapping[last], (dict, list)):
        return
    slots = mapping.ca.items.get(last)
    token = slots[2] if slots and len(slots) > 2 else None
    if token is None or "\n" not in token.value:
        return
    cut = token.value.index("\n") + 1
    if cut == len(token.value):
        return
    trailing = token.value[cut:]
    token.value = token.value[:cut]
    mapping.ca.items[key] = [None, None, CommentToken("\n" + trailing, token.start_mark, None), None]


def _split(path: str) -> list[str]:
    parts = path.split(".")
    if not path or any(not p for p in parts):
        raise InputError(f"bad key path {path!r}: expected names separated by dots")
    return parts


def _flow(items: list[Any]) -> Any:
    seq = CommentedSeq(items)
    seq.fa.set_flow_style()
    return seq
