"""The controller's floors: each package imports only from floors below it, and no module imports
itself back through others. Read from the source (every import, lazy and type-only ones too), so an
upward arrow or a circle fails here the day it is written."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import orchestrator
from tests.floors import FLOORS

PACKAGE = Path(orchestrator.__file__).parent

FACE = ("orchestrator", "orchestrator.__main__")  # the public names and `python -m`: above every floor


def sources() -> dict[str, str]:
    """Every controller module's name and source."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text()
    return out


def imports(module: str, source: str, known: Mapping[str, str]) -> Iterator[str]:
    """The controller modules ``module`` imports, anywhere in its body."""
    package = module if module in known and _is_package(module, known) else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("orchestrator") and name != module:
                yield name


def _is_package(module: str, known: Mapping[str, str]) -> bool:
    return any(other.startswith(module + ".") for other in known)


def floor_of(module: str) -> tuple[int, str] | None:
    """(the floor's index from the top, the package) of a module; None for the public face."""
    if module in FACE:
        return None
    top = module.split(".")[1]
    for index, floor in enumerate(FLOORS):
        if top in floor:
            return index, top
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS")


def violations(known: Mapping[str, str]) -> list[str]:
    """Upward and sideways arrows between packages, and circles between modules."""
    graph = {module: sorted(set(imports(module, source, known))) for module, source in known.items()}
    found = []
    for module, targets in graph.items():
        here = floor_of(module)
        for target in targets:
            there = floor_of(target)
            if there is None:
                found.append(f"{module} imports the public face {target}")
            elif here is not None and here[1] != there[1] and there[0] <= here[0]:
                way = "up" if there[0] < here[0] else "sideways"
                found.append(f"{module} imports {target}: {way}, from {here[1]} to {there[1]}")
    found += [" -> ".join(circle) for circle in circles(graph)]
    return found


def circles(graph: Mapping[str, list[str]]) -> list[list[str]]:
    """One circle through each strongly connected set of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                found.append([*sorted(members), sorted(members)[0]])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_goes_down_a_floor_and_none_closes_a_circle() -> None:
    assert violations(sources()) == []


def test_a_planted_upward_import_fails() -> None:
    known = sources()
    known["orchestrator.config.playbook"] += "\n\ndef late() -> None:\n    from orchestrator.engine import runner\n"
    found = violations(known)
    assert found[0] == "orchestrator.config.playbook imports orchestrator.engine.runner: up, from config to engine"
    assert all(" -> " in f for f in found[1:])  # and the circles it closes


def test_the_circle_the_floors_came_to_remove_fails() -> None:
    """models -> push -> runner -> plan -> models, as a lazy import in models once closed it."""
    known = {
        "orchestrator.rules.gates.models": "def f():\n    from orchestrator.engine import push\n",
        "orchestrator.engine.push": "from orchestrator.engine.runner import Run\n",
        "orchestrator.engine.runner": "from orchestrator.rules import plan\n",
        "orchestrator.rules.plan": "from orchestrator.rules.gates import models\n",
        "orchestrator.engine": "",
        "orchestrator.rules": "",
        "orchestrator.rules.gates": "",
    }
    found = violations(known)
    assert "orchestrator.rules.gates.models imports orchestrator.engine.push: up, from rules to engine" in found
    assert [
        "orchestrator.engine.push",
        "orchestrator.engine.runner",
        "orchestrator.rules.gates.models",
        "orchestrator.rules.plan",
        "orchestrator.engine.push",
    ] in [c.split(" -> ") for c in found]


def test_siblings_do_not_import_each_other_and_nothing_imports_the_cli() -> None:
    known = sources()
    known["orchestrator.store.metrics"] += "\nfrom orchestrator.gateways import client\n"
    known["orchestrator.engine.runs"] += "\nfrom orchestrator.cli import render\n"
    found = violations(known)
    assert "orchestrator.engine.runs imports orchestrator.cli.render: up, from engine to cli" in found
    assert "orchestrator.store.metrics imports orchestrator.gateways.client: sideways, from store to gateways" in found


def test_each_package_is_on_the_lowest_floor_its_imports_allow() -> None:
    """A package a floor too high hides what it really needs (the sandbox sat beside the
    deployment while it needs only LXD, the config and errors)."""
    known = sources()
    graph = {module: set(imports(module, source, known)) for module, source in known.items()}
    for index, floor in enumerate(FLOORS[:-1]):
        for package in floor:
            needs = [
                floor_of(t)
                for m, targets in graph.items()
                if m.split(".")[1:2] == [package]
                for t in targets
                if t.split(".")[1:2] != [package]
            ]
            deepest_needed = min((n[0] for n in needs if n is not None), default=len(FLOORS))
            assert deepest_needed == index + 1, f"{package} could sit lower: it needs nothing of floor {index + 1}"


def _tree_imports(folder: str) -> dict[str, set[str]]:
    """Each Python file under the checkout's ``folder`` and the top-level names it imports."""
    out = {}
    for path in sorted((PACKAGE.parent / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(PACKAGE.parent))] = names
    return out


def test_the_agent_imports_nothing_of_the_controller_and_nothing_installed_imports_lab_or_bench() -> None:
    """The agent runs on hosts where the controller is not installed; ``lab/`` and ``bench/`` are
    the checkout's, not the package's."""
    agent = _tree_imports("remote_agent")
    assert agent and not [f for f, names in agent.items() if "orchestrator" in names]
    installed = {**_tree_imports("orchestrator"), **agent}
    assert not [f for f, names in installed.items() if names & {"lab", "bench", "tests", "scripts"}]


def test_what_one_module_takes_from_another_is_that_modules_public_api() -> None:
    """A name another module imports is part of its owner's API and is spelled so: a leading
    underscore promises that the name can change without looking elsewhere (the agent's modules
    are one namespace on the wire, but modules in the tree, held to the same rule)."""
    private = []
    for folder in ("orchestrator", "remote_agent"):
        for path in sorted((PACKAGE.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in {
                    "orchestrator",
                    "remote_agent",
                }:
                    private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []
