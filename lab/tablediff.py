"""What a new vLLM wheel changes under the lint rules and the build table: the files their sources
cite, compared between two wheels definition by definition, and the DFlash-relevant files and
registry entries that are new, so that a release is the review of a short list, not a re-read.

    python3 -m lab.tablediff OLD.whl NEW.whl [--json]      (scripts/vllm-table-diff fetches them)

A row cites a file by its path under ``vllm/`` (``config/vllm.py``) or its name alone
(``qwen3_dflash.py``), and the definitions it relies on by name in the same sentence
(``config/vllm.py use_v2_model_runner``): each cited name that the file defines (a function, a
class, a method, an assignment at the top of a class or module) is compared by its syntax tree, so
that a moved line or a comment is not a change and a changed body is. A cited file that is in
neither wheel is another package's (transformers) or the project's own, and is said so.
Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE = re.compile(r"[\w/]+\.py\b")
NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
# Files whose appearance in a new wheel a DFlash review must see (paths under vllm/).
RELEVANT = re.compile(r"dflash|dspark|spec_decode|speculat|eagle|model_runner|/registry\.py$")
REGISTRY = "model_executor/models/registry.py"
REGISTRY_TABLE = "_SPECULATIVE_DECODING_MODELS"


@dataclass(frozen=True)
class Citation:
    """One source sentence of one row: the files it names and the identifiers beside them."""

    row: str
    text: str
    files: tuple[str, ...]
    names: frozenset[str]


@dataclass
class FileChange:
    row: str
    cited: str
    path: str | None  # resolved under vllm/, None when in neither wheel
    state: str  # unchanged | changed | new | gone | not-in-vllm
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ([], None)}


class Wheel:
    """A vLLM wheel's Python files, read from the zip (no install)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self.files = {
            n.removeprefix("vllm/"): n for n in self._zip.namelist() if n.startswith("vllm/") and n.endswith(".py")
        }
        self.version = _version(self._zip)

    def read(self, rel: str) -> str | None:
        name = self.files.get(rel)
        return self._zip.read(name).decode("utf-8", "replace") if name is not None else None

    def resolve(self, cited: str) -> list[str]:
        """The files a cited path means: itself, else every file whose path ends with it."""
        if cited in self.files:
            return [cited]
        return sorted(f for f in self.files if f.endswith("/" + cited))


def _version(z: zipfile.ZipFile) -> str:
    for name in z.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in z.read(name).decode("utf-8", "replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return "?"


def citations(rows: Iterable[tuple[str, Iterable[str]]]) -> list[Citation]:
    """Each (row, sources) sentence that names at least one file."""
    out = []
    for row, sources in rows:
        for text in sources:
            files = tuple(dict.fromkeys(FILE.findall(text)))
            if files:
                names = frozenset(n for n in NAME.findall(FILE.sub(" ", text)) if "_" in n or n[:1].isupper())
                out.append(Citation(row, text, files, names))
    return out


def definitions(source: str | None) -> dict[str, str]:
    """Every name a module defines at its top or a class's top, with its syntax tree (no line
    numbers): functions, classes, methods, assignments. An unparsable file defines nothing."""
    if source is None:
        return {}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    out: dict[str, str] = {}

    def take(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.setdefault(node.name, ast.dump(node))
                out[prefix + node.name] = ast.dump(node)
                if isinstance(node, ast.ClassDef):
                    take(node.body, f"{node.name}.")
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, ast.dump(node))
                        out[prefix + t.id] = ast.dump(node)

    take(tree.body, "")
    return out


def compare(cite: Citation, old: Wheel, new: Wheel) -> Iterator[FileChange]:
    for cited in cite.files:
        paths = sorted(set(old.resolve(cited)) | set(new.resolve(cited)))
        if not paths:
            yield FileChange(cite.row, cited, None, "not-in-vllm")
            continue
        for path in paths:
            a, b = old.read(path), new.read(path)
            if a is None or b is None:
                yield FileChange(cite.row, cited, path, "new" if a is None else "gone")
                continue
            da, db = definitions(a), definitions(b)
            named = sorted(n for n in cite.names if n in da or n in db)
            change = FileChange(cite.row, cited, path, "unchanged")
            for n in named:
                if n not in db:
                    change.gone.append(n)
                elif da.get(n) != db[n]:
                    change.changed.append(n)
                else:
                    change.unchanged.append(n)
            whole = _code(a) != _code(b)
            if change.changed or change.gone or (not named and whole):
                change.state = "changed"
            yield change


def _code(source: str) -> str:
    try:
        return ast.dump(ast.parse(source))
    except SyntaxError:
        return source


def registry(wheel: Wheel) -> dict[str, Any]:
    """The speculative decoding models vLLM's registry maps, name -> (module, class)."""
    source = wheel.read(REGISTRY)
    if source is None:
        return {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if isinstance(target, ast.Name) and target.id == REGISTRY_TABLE and node.value is not None:
            try:
                return dict(ast.literal_eval(node.value))
            except ValueError:
                return {}
    return {}


def review(old: Wheel, new: Wheel, rows: Iterable[tuple[str, Iterable[str]]]) -> dict[str, Any]:
    """The whole comparison: per cited file, the new relevant files, the registry's changes."""
    changes = [c for cite in citations(rows) for c in compare(cite, old, new)]
    before, after = registry(old), registry(new)
    new_files = sorted(f for f in set(new.files) - set(old.files) if RELEVANT.search(f))
    gone_files = sorted(f for f in set(old.files) - set(new.files) if RELEVANT.search(f))
    return {
        "old": old.version,
        "new": new.version,
        "rows": [c.to_json() for c in changes],
        "rows_to_review": sorted({c.row for c in changes if c.state in ("changed", "gone")}),
        "new_files": new_files,
        "gone_files": gone_files,
        "registry_added": {k: list(after[k]) for k in sorted(set(after) - set(before))},
        "registry_removed": sorted(set(before) - set(after)),
        "registry_changed": sorted(k for k in set(before) & set(after) if before[k] != after[k]),
    }


def table_rows() -> list[tuple[str, tuple[str, ...]]]:
    """The build table's and the lint rules' sources, by row code."""
    from orchestrator.rules import dflash

    rows = [(f"build:{b.code}", b.sources) for b in dflash.BUILD_TABLE]
    return rows + [(f"lint:{r.code}", r.sources) for r in dflash.RULES]


def render(result: dict[str, Any]) -> str:
    lines = [f"vLLM {result['old']} -> {result['new']}", ""]
    review_rows = result["rows_to_review"]
    lines.append(f"rows whose evidence changed ({len(review_rows)}): " + (", ".join(review_rows) or "none"))
    for c in result["rows"]:
        if c["state"] in ("changed", "gone", "new"):
            said = [f"{k} {', '.join(c[k])}" for k in ("changed", "gone") if c.get(k)]
            lines.append(
                f"  {c['row']}: {c.get('path', c['cited'])} {c['state']}" + (f" ({'; '.join(said)})" if said else "")
            )
    same = sorted({c["row"] for c in result["rows"]} - set(review_rows))
    lines.append(f"rows whose cited files are unchanged ({len(same)}): " + (", ".join(same) or "none"))
    outside = sorted({c["cited"] for c in result["rows"] if c["state"] == "not-in-vllm"})
    if outside:
        lines.append(f"cited files outside vLLM (not compared): {', '.join(outside)}")
    lines.append("")
    lines.append(f"new DFlash-relevant files ({len(result['new_files'])}):")
    lines += [f"  {f}" for f in result["new_files"]]
    if result["gone_files"]:
        lines.append(f"gone ({len(result['gone_files'])}): " + ", ".join(result["gone_files"]))
    lines.append("registry: added " + (", ".join(result["registry_added"]) or "none"))
    lines.append("registry: removed " + (", ".join(result["registry_removed"]) or "none"))
    lines.append("registry: mapped elsewhere " + (", ".join(result["registry_changed"]) or "none"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the wheel the table was last read from")
    parser.add_argument("new", type=Path, help="the new wheel")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for wheel in (args.old, args.new):
        if not zipfile.is_zipfile(wheel):
            print(f"tablediff: {wheel} is not a wheel (a zip file)", file=sys.stderr)
            return 2
    result = review(Wheel(args.old), Wheel(args.new), table_rows())
    print(json.dumps(result, indent=2) if args.json else render(result), end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
