"""Reading model config files (JSON) and reference values (JSON or YAML) with located errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.config.yamlsource import MAX_DIGITS, load_file, read_text
from orchestrator.errors import InputError


class _Refused(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A config.json with a key twice loads as the last one in Python and as either in other
    # readers: a stale dflash_config first and a right one after must not lint clean.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_DIGITS:
        raise _Refused(f"an integer of {digits} digits is past any value a config holds")
    return int(text)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a local file, strictly: a key given twice, NaN or Infinity, or any other
    value than an object is an InputError naming the file and line."""
    return parse_json(read_text(path), path)


def parse_json(content: str | bytes, path: Path) -> dict[str, Any]:
    """A JSON object from bytes already read (``path`` names them in errors), as ``read_json``:
    what is judged is then exactly what was read, whatever the file holds by now."""
    if isinstance(content, bytes):
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"cannot read: {exc}", file=str(path)) from exc
    else:
        text = content
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_int=_int)
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON at column {exc.colno}: {exc.msg}", file=str(path), line=exc.lineno) from exc
    except _Refused as exc:
        raise InputError(f"invalid JSON: {exc}", file=str(path)) from None
    except RecursionError:
        raise InputError("invalid JSON: nested too deeply", file=str(path)) from None
    if not isinstance(data, dict):
        raise InputError("expected a JSON object", file=str(path), line=1)
    return data


def read_mapping(path: Path) -> dict[str, Any]:
    """A reference: JSON (a config.json) or YAML (pinned values), either way a mapping."""
    if path.suffix == ".json":
        return read_json(path)
    data = load_file(path).data
    if not isinstance(data, dict):
        raise InputError("expected a mapping of field names to values", file=str(path), line=1)
    return data
