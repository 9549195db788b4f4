"""The readiness chain's table (``rules/gates/GATES``) against the rest of the code: every gate of
the chain has one row, in chain order, and one module whose docstring says what it proves; the
report lists gates in that order; reason codes are each one gate's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from orchestrator import results
from orchestrator.rules import gates

PACKAGE = Path(gates.__file__).parent
ROOT = PACKAGE.parents[2]

# The chain as results.py declares it, in its order (the gates of other runs follow GATE_READY).
CHAIN = [
    value
    for name, value in vars(results).items()
    if name.startswith("GATE_") and list(vars(results)).index(name) <= list(vars(results)).index("GATE_READY")
]


def test_one_row_per_gate_of_the_chain_in_its_order() -> None:
    assert [g.name for g in gates.GATES] == CHAIN
    assert all(g.phase in gates.PHASES for g in gates.GATES)
    phases = [gates.PHASES.index(g.phase) for g in gates.GATES]
    assert phases == sorted(phases), "a gate runs after every gate before it in the chain"
    assert all(g.verify in ("always", "never") or g.verify.startswith("--") for g in gates.GATES)


def test_each_gate_is_one_module_that_says_what_it_proves() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert modules == {g.name for g in gates.GATES}
    for g in gates.GATES:
        assert g.module.__name__ == f"orchestrator.rules.gates.{g.name}"
        assert (g.module.__doc__ or "").startswith(f"The {g.name} gate proves "), g.name


def test_gate_modules_are_pure_and_import_no_other_floor_of_the_engine() -> None:
    """Answers in, gates out: no module of a gate imports the engine, a connector, the store or LXD."""
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                top = node.module.split(".")[:2]
                assert top[1:] not in (["engine"], ["connectors"], ["store"], ["lxd"], ["gateways"]), (
                    path,
                    node.module,
                )


def test_a_reason_code_belongs_to_one_gate_and_every_code_in_the_code_is_in_a_row() -> None:
    codes = [code for g in gates.GATES for code in g.reasons]
    assert len(codes) == len(set(codes)), codes
    # Every reason a gate of the chain is given as a literal names a row's code.
    literal = re.compile(r'\breason="([a-z_]+)"')
    found = {m for p in (ROOT / "orchestrator").rglob("*.py") for m in literal.findall(p.read_text())}
    others = {"degraded", "unjudged"}  # the bake gate's: a gate of the rollout, not of the chain
    assert others <= found, found  # the scan reads the code
    assert found - others <= set(codes), found - others - set(codes)


def test_the_report_lists_gates_in_chain_order() -> None:
    """A deploy through the stand-in and one in an LXD container (tests/unit/test_runs.py,
    tests/integration/test_lxd.py) list their gates so; a gate set later is placed where it stands."""
    order = [g.name for g in gates.GATES]
    for listed in (
        ["lint", "connect", "files", "loader", "build", "engine", "health", "acceptance", "ready"],
        ["lint", "containers", "connect", "files", "models", "weights", "loader", "build", "engine", "health"],
    ):
        assert listed == sorted(listed, key=order.index)
    report = results.HostReport("h")
    report.gates[results.GATE_FILES] = results.Gate(True, "")
    report.gates[results.GATE_BUILD] = results.Gate(True, "")
    gates.loader.set_before(report, results.GATE_LOADER, results.Gate(True, ""), results.GATE_BUILD)
    assert list(report.gates) == sorted(report.gates, key=order.index)
