"""YAML loading that remembers where every key came from.

Inventory and playbook errors must name the file, the line and the key path, so we compose
the node tree ourselves instead of calling ``yaml.safe_load``: every mapping key and every
sequence item records its line. Duplicate keys, which PyYAML silently lets win, are errors.
A ``Field`` walks the data with its path and turns each wrong type into one ``InputError``.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config.limits import MAX_SECONDS as MAX_SECONDS
from orchestrator.errors import InputError

KeyPath = tuple[str | int, ...]


# A DNS name as RFC 1123 spells it: ASCII letters, digits and '-' in dot-separated labels.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class Document:
    """A YAML file's data with the line of every key, so that an error can name file, line and key."""

    file: str
    data: Any
    lines: dict[KeyPath, int]

    def line_of(self, path: KeyPath) -> int | None:
        """Line of the deepest known prefix of ``path`` (a missing key points at its parent)."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return None


def read_text(path: Path) -> str:
    """A text input file, or one InputError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read: {exc}", file=str(path)) from exc


def load_file(path: Path) -> Document:
    """A YAML file with the line of every key; YAML aliases, tags and duplicate keys are refused
    with file and line."""
    return load_text(read_text(path), str(path))


# libyaml's parser when PyYAML was built with it (the usual wheels are): same nodes and marks,
# several times faster than the pure-Python one on big inventories.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_text(text: str, file: str) -> Document:
    """YAML text (named ``file`` in errors) with the line of every key, as load_file reads it."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        lines: dict[KeyPath, int] = {}
        data = _build(loader, node, (), lines, file, set()) if node is not None else None
    except RecursionError:
        raise InputError("invalid YAML: nested too deeply", file=file) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        raise InputError(f"invalid YAML: {exc.problem or exc.context}", file=file, line=line) from exc
    except yaml.YAMLError as exc:
        raise InputError(f"invalid YAML: {exc}", file=file) from exc
    finally:
        loader.dispose()
    return Document(file, data, lines)


def _build(
    loader: yaml.SafeLoader, node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], file: str, seen: set[int]
) -> Any:
    # An alias is the anchored node again: refused, as are merge keys (made of aliases). A value
    # used twice is written twice; a 600-byte alias bomb would otherwise expand to gigabytes,
    # and a self-referencing alias never end.
    if id(node) in seen and isinstance(node, (yaml.MappingNode, yaml.SequenceNode, yaml.ScalarNode)):
        raise InputError(
            f"YAML aliases are not supported (this one repeats the value anchored at line {node.start_mark.line + 1}):"
            " write the value out",
            file=file,
            line=node.start_mark.line + 1,
            key=_dotted(path) or None,
        )
    seen.add(id(node))
    if node.tag not in _PLAIN_TAGS:
        raise InputError(
            f"YAML tags are not supported ({node.tag}): plain values only",
            file=file,
            line=node.start_mark.line + 1,
            key=_dotted(path) or None,
        )
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _scalar(loader, key_node, path, file)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise InputError(
                    "mapping keys must be strings", file=file, line=key_node.start_mark.line + 1, key=_dotted(path)
                )
            key = str(key)
            child = (*path, key)
            if key in out:
                raise InputError(
                    f"duplicate key (first at line {lines[child]})",
                    file=file,
                    line=key_node.start_mark.line + 1,
                    key=_dotted(child),
                )
            lines[child] = key_node.start_mark.line + 1
            out[key] = _build(loader, value_node, child, lines, file, seen)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(loader, item, (*path, i), lines, file, seen) for i, item in enumerate(node.value)]
    return _scalar(loader, node, path, file)


def _scalar(loader: yaml.SafeLoader, node: yaml.Node, path: KeyPath, file: str) -> Any:
    """A plain value as YAML resolves it; one its constructor cannot make (an integer past
    Python's 4,300 digits, a date that does not exist) is bad input at its line, never a
    traceback."""
    line = node.start_mark.line + 1
    if node.tag.endswith(":int") and len(str(node.value)) > MAX_DIGITS:
        raise InputError(
            f"an integer of {len(str(node.value))} digits is past any value this tool takes",
            file=file, line=line, key=_dotted(path) or None,
        )  # fmt: skip
    try:
        return loader.construct_object(node, deep=True)
    except (ValueError, OverflowError) as exc:
        shown = str(node.value)[:40]
        raise InputError(f"cannot read {shown!r}: {exc}", file=file, line=line, key=_dotted(path) or None) from None


# What plain YAML resolves to by itself; anything else was tagged by hand (``!!python/...``).
_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("map", "seq", "str", "int", "float", "bool", "null", "timestamp")
)


def _dotted(path: KeyPath) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


_MISSING: Any = object()
# An integer's characters past any count, size or id an input holds (Python itself refuses to
# read one of more than 4,300 digits, with a traceback).
MAX_DIGITS = 100


class Field:
    """A value inside a document, with its key path; typed accessors raise located errors."""

    def __init__(self, doc: Document, path: KeyPath = (), value: Any = _MISSING) -> None:
        self.doc = doc
        self.path = path
        self.value = doc.data if value is _MISSING else value

    @property
    def key(self) -> str:
        """The field's dotted key path, as errors name it."""
        return _dotted(self.path)

    def error(self, message: str) -> InputError:
        return InputError(message, file=self.doc.file, line=self.doc.line_of(self.path), key=self.key or None)

    # --- structure ---------------------------------------------------------------------

    def mapping(self, allowed: set[str] | None = None, *, required: frozenset[str] = frozenset()) -> Field:
        """The field as a mapping with only the allowed keys (and the required ones present); absent
        is empty."""
        if self.value is None and not required:
            self.value = {}
        if not isinstance(self.value, dict):
            raise self.error(f"expected a mapping, got {_kind(self.value)}")
        if allowed is not None:
            for name in self.value:
                if name not in allowed:
                    import difflib  # only on the error's path

                    hint = difflib.get_close_matches(name, sorted(allowed), n=1)
                    also = f" (did you mean '{hint[0]}'?)" if hint else f"; allowed: {', '.join(sorted(allowed))}"
                    raise self[name].error(f"unknown key{also}")
        for name in sorted(required):
            if name not in self.value:
                raise self.error(f"missing required key '{name}'")
        return self

    def __getitem__(self, key: str | int) -> Field:
        child = (*self.path, key)
        if isinstance(key, int):
            return Field(self.doc, child, self.value[key])
        if isinstance(self.value, dict) and key in self.value:
            return Field(self.doc, child, self.value[key])
        return _Absent(self.doc, child)

    def __contains__(self, key: str) -> bool:
        return isinstance(self.value, dict) and key in self.value

    def items(self) -> Iterator[tuple[str, Field]]:
        """The mapping's entries as fields, in file order."""
        self.mapping()
        for name in self.value:
            yield name, self[name]

    def sequence(self) -> list[Field]:
        """The field as a list of fields; absent is empty."""
        if self.value is None:
            return []
        if not isinstance(self.value, list):
            raise self.error(f"expected a list, got {_kind(self.value)}")
        return [self[i] for i in range(len(self.value))]

    @property
    def present(self) -> bool:
        """Whether the file gives this key."""
        return True

    # --- scalars -----------------------------------------------------------------------

    def str(self, default: Any = _MISSING) -> Any:
        """The field as a string; the default when absent (an error when there is none)."""
        if not self.present:
            return self._default(default)
        if not isinstance(self.value, str) or not self.value:
            raise self.error(f"expected a non-empty string, got {_kind(self.value)}")
        return self.value

    def int(self, default: Any = _MISSING, *, minimum: int | None = None, maximum: int | None = None) -> Any:
        """The field as an integer within bounds (a bool is not one); the default when absent."""
        if not self.present:
            return self._default(default)
        if not isinstance(self.value, int) or isinstance(self.value, bool):
            raise self.error(f"expected an integer, got {_kind(self.value)}")
        if minimum is not None and self.value < minimum:
            raise self.error(f"must be at least {minimum}, got {self.value}")
        if maximum is not None and self.value > maximum:
            raise self.error(f"must be at most {maximum}, got {self.value}")
        return self.value

    def choice(self, allowed: tuple[Any, ...], default: Any = _MISSING) -> Any:
        """The field as one of ``allowed`` words; the default when absent."""
        if not self.present:
            return self._default(default)
        if self.value not in allowed:
            raise self.error(f"expected one of {', '.join(allowed)}, got {_kind(self.value)}")
        return self.value

    def number(self, default: Any = _MISSING, *, minimum: float | None = None) -> Any:
        """The field as a finite number within bounds; the default when absent."""
        if not self.present:
            return self._default(default)
        if not isinstance(self.value, (int, float)) or isinstance(self.value, bool):
            raise self.error(f"expected a number, got {_kind(self.value)}")
        if not math.isfinite(self.value):
            raise self.error(f"expected a finite number, got {self.value}")
        if minimum is not None and self.value < minimum:
            raise self.error(f"must be at least {minimum}, got {self.value}")
        return float(self.value)

    def seconds(self, default: Any = _MISSING, *, minimum: float = 0.0) -> Any:
        """The field as a number of seconds: finite, at least ``minimum``, at most a week (a
        deadline past that is a typo, and the clocks it is added to overflow long before 1e300)."""
        value = self.number(default, minimum=minimum)
        if value is not None and value > MAX_SECONDS:
            raise self.error(f"at most {MAX_SECONDS:.0f} seconds (a week), got {self.value}")
        return value

    def directory(self, default: Any = _MISSING) -> Any:
        """The field as an absolute, normalised directory other than ``/``, without a trailing
        slash: one directory has one spelling (``/srv/d`` and ``/srv/d/`` are one place), and no
        tool's tree lands at the filesystem's root."""
        value = self.str(default)
        if value is None or not self.present:
            return value
        if not value.startswith("/") or posixpath.normpath(value) != value.rstrip("/") or value.rstrip("/") == "":
            raise self.error(f"expected an absolute, normalised directory other than /, got {value!r}")
        return value.rstrip("/")

    def address(self, default: Any = _MISSING) -> Any:
        """The field as an address: an IP address or an ASCII host name, refused otherwise. The
        resolver folds fullwidth digits and drops invisible characters (IDNA), so fullwidth
        ``10.0.0.1`` or ``10.0.0.1`` with a zero-width space would reach another machine than the
        one written (the inventory's containers and hosts, the playbook's servers and groups)."""
        value = self.str(default)
        if value is None or not self.present:
            return value
        if value.isascii() and value.isprintable():
            try:
                ipaddress.ip_address(value)
                return str(value)
            except ValueError:
                pass
            name = value[:-1] if value.endswith(".") else value
            if len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split(".")):
                return str(value)
        raise self.error(f"{value!r} is not an IP address or a host name (ASCII letters, digits, '-' and '.')")

    def bool(self, default: Any = _MISSING) -> Any:
        """The field as a boolean; the default when absent."""
        if not self.present:
            return self._default(default)
        if not isinstance(self.value, bool):
            raise self.error(f"expected true or false, got {_kind(self.value)}")
        return self.value

    def int_list(self, default: Any = _MISSING) -> Any:
        """The field as a list of integers."""
        if not self.present:
            return self._default(default)
        ok = isinstance(self.value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in self.value)
        if not ok:
            raise self.error("expected a list of integers")
        return tuple(self.value)

    def str_list(self, default: Any = _MISSING) -> Any:
        """The field as a list of strings; the default when absent."""
        if not self.present:
            return self._default(default)
        if isinstance(self.value, str):
            if not self.value:
                raise self.error("expected a non-empty string (or a list of them), got an empty one")
            return (self.value,)
        if not isinstance(self.value, list):
            raise self.error(f"expected a list of strings, got {_kind(self.value)}")
        for i, v in enumerate(self.value):  # the element named, at its own line
            if not isinstance(v, str):
                raise self[i].error(f"expected a string, got {_kind(v)}")
            if not v:
                raise self[i].error("expected a non-empty string, got an empty one")
        return tuple(self.value)

    def str_map(self, default: Any = _MISSING) -> Any:
        """The field as a mapping of strings to strings; the default when absent."""
        if not self.present:
            return self._default(default)
        ok = isinstance(self.value, dict) and all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in self.value.values()
        )
        if not ok:
            raise self.error("expected a mapping of names to strings")
        return {k: str(v) for k, v in self.value.items()}

    def _default(self, default: Any) -> Any:
        if default is _MISSING:
            raise self.error("missing required key")
        return default


class _Absent(Field):
    """A key that is not in the document: accessors return their default or say it is missing."""

    def __init__(self, doc: Document, path: KeyPath) -> None:
        super().__init__(doc, path, None)

    @property
    def present(self) -> bool:
        return False


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})" if value else "an empty string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__
