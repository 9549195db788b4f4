"""The readiness chain: one module per gate, one row of ``GATES`` per gate, in chain order.

A gate's module is pure: the ops it asks a host (built with the agent protocol's builders), its
reader (typed answers in, a ``Gate`` out, with its reason codes) and its arithmetic. What a gate
does with hosts (a start, a load, a cache given or taken) lives under the same name in
``orchestrator/engine/``. A host's report lists its gates in this order; ``docs/gates.md`` is made
from these rows and the modules' docstrings (``scripts/docs``).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from orchestrator.results import (
    GATE_ACCEPTANCE,
    GATE_BUILD,
    GATE_COMPILE_CACHE,
    GATE_CONNECT,
    GATE_CONTAINERS,
    GATE_ENGINE,
    GATE_FILES,
    GATE_GATEWAY,
    GATE_GPUS,
    GATE_HEALTH,
    GATE_LINT,
    GATE_LOADER,
    GATE_MODELS,
    GATE_READY,
    GATE_SPEEDUP,
    GATE_WEIGHTS,
)

if TYPE_CHECKING:  # loaded when first named (``__getattr__``): a command imports the gates it runs
    from orchestrator.rules.gates import (
        acceptance,
        build,
        compile_cache,
        connect,
        containers,
        engine,
        files,
        gateway,
        gpus,
        health,
        lint,
        loader,
        models,
        ready,
        speedup,
        weights,
    )

# When a gate runs. Before any host is touched; on the host before anything is staged; on the
# staged release, before the server starts; on the started server; the record of it all.
PHASES = ("plan", "host", "staging", "serving", "record")


@dataclass(frozen=True)
class GateRow:
    """One gate of the chain: its name in the report, when it runs, its module, whether ``verify``
    runs it (``always``, ``never``, or the flag that asks for it) and the reason codes its failures
    carry (the diagnosis reads these, never the words)."""

    name: str
    phase: str
    module: ModuleType
    verify: str
    reasons: tuple[str, ...] = ()


def _table() -> tuple[GateRow, ...]:
    """The rows, their modules loaded (every gate's: the docs, the tests and a diagnosis read them)."""
    import orchestrator.rules.gates as this  # its modules, each loaded as it is named
    from orchestrator.rules import probe

    return (
        GateRow(GATE_LINT, "plan", this.lint, "always"),
        GateRow(GATE_CONTAINERS, "host", this.containers, "always"),
        GateRow(GATE_CONNECT, "host", this.connect, "always"),
        GateRow(GATE_GPUS, "host", this.gpus, "always"),
        GateRow(GATE_FILES, "staging", this.files, "always"),
        GateRow(GATE_MODELS, "staging", this.models, "always"),
        GateRow(GATE_WEIGHTS, "staging", this.weights, "always"),
        GateRow(GATE_LOADER, "staging", this.loader, "always"),
        GateRow(GATE_BUILD, "staging", this.build, "always", (this.build.KNOWN_BUGS,)),
        GateRow(GATE_ENGINE, "staging", this.engine, "--engine", (this.engine.NOT_GENERATIVE,)),
        GateRow(GATE_COMPILE_CACHE, "serving", this.compile_cache, "never", (this.compile_cache.KEY_DIFFERS,)),
        GateRow(GATE_HEALTH, "serving", this.health, "always", (this.health.ASLEEP, this.health.STANDBY_AWAKE)),
        GateRow(
            GATE_ACCEPTANCE,
            "serving",
            this.acceptance,
            "--probe",
            (
                probe.NO_SPECULATION,
                probe.RESTARTED,
                probe.UNREADABLE,
                probe.UNJUDGEABLE,
                probe.TOO_FEW_DRAFTS,
                probe.LOW_TAU,
                probe.LOW_RATE,
                this.acceptance.REGRESSED,
                this.acceptance.PREFIX_CACHE,
            ),
        ),
        GateRow(
            GATE_SPEEDUP,
            "serving",
            this.speedup,
            "--speedup",
            (this.speedup.NO_SPEEDUP, this.speedup.LOW_ACCEPTANCE, this.speedup.UNMEASURED),
        ),
        GateRow(
            GATE_GATEWAY,
            "serving",
            this.gateway,
            "always",
            (
                this.gateway.MIN_IN_ROTATION,
                this.gateway.UNREACHABLE,
                this.gateway.NOT_SERVED,
                this.gateway.IN_ROTATION_NOT_READY,
                this.gateway.OUT_OF_ROTATION,
            ),
        ),
        GateRow(GATE_READY, "record", this.ready, "always"),
    )


if TYPE_CHECKING:
    GATES: tuple[GateRow, ...]


# The gate modules (each loaded when first named) and the table's own names.
__all__ = [
    "GATES",
    "PHASES",
    "GateRow",
    "acceptance",
    "build",
    "compile_cache",
    "connect",
    "containers",
    "engine",
    "files",
    "gateway",
    "gpus",
    "health",
    "lint",
    "loader",
    "models",
    "ready",
    "row",
    "speedup",
    "weights",
]
_MODULES = frozenset(__all__) - {"GATES", "PHASES", "GateRow", "row"}


@functools.cache
def _gates() -> tuple[GateRow, ...]:
    return _table()


def __getattr__(name: str) -> Any:
    """``GATES`` built when first read, and a gate's module (``gates.speedup``) loaded when first
    named: a files-only deploy never loads the speed-up gate's arithmetic."""
    if name == "GATES":
        return _gates()
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def row(name: str) -> GateRow:
    """The row of a gate by its name in the report."""
    for gate in _gates():
        if gate.name == name:
            return gate
    raise KeyError(name)
