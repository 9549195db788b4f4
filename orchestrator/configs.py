"""Reading model config files (JSON) and reference values (JSON or YAML) with located errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.errors import InputError
from orchestrator.yamlsource import load_file, read_text


def read_json(path: Path) -> dict[str, Any]:
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON at column {exc.colno}: {exc.msg}", file=str(path), line=exc.lineno) from exc
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
