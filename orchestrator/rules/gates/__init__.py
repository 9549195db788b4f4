"""The readiness chain: one module per gate, one row of ``GATES`` per gate, in chain order.

A gate's module is pure: the ops it asks a host (built with the agent protocol's builders), its
reader (typed answers in, a ``Gate`` out, with its reason codes) and its arithmetic. What a gate
does with hosts (a start, a load, a cache given or taken) lives under the same name in
``orchestrator/engine/``. A host's report lists its gates in this order; ``docs/gates.md`` is made
from these rows and the modules' docstrings (``scripts/docs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

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
from orchestrator.rules import probe
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


GATES: tuple[GateRow, ...] = (
    GateRow(GATE_LINT, "plan", lint, "always"),
    GateRow(GATE_CONTAINERS, "host", containers, "always"),
    GateRow(GATE_CONNECT, "host", connect, "always"),
    GateRow(GATE_GPUS, "host", gpus, "always"),
    GateRow(GATE_FILES, "staging", files, "always"),
    GateRow(GATE_MODELS, "staging", models, "always"),
    GateRow(GATE_WEIGHTS, "staging", weights, "always"),
    GateRow(GATE_LOADER, "staging", loader, "always"),
    GateRow(GATE_BUILD, "staging", build, "always", (build.KNOWN_BUGS,)),
    GateRow(GATE_ENGINE, "staging", engine, "--engine", (engine.NOT_GENERATIVE,)),
    GateRow(GATE_COMPILE_CACHE, "serving", compile_cache, "never", (compile_cache.KEY_DIFFERS,)),
    GateRow(GATE_HEALTH, "serving", health, "always", (health.ASLEEP,)),
    GateRow(
        GATE_ACCEPTANCE,
        "serving",
        acceptance,
        "--probe",
        (
            probe.NO_SPECULATION,
            probe.RESTARTED,
            probe.UNREADABLE,
            probe.UNJUDGEABLE,
            probe.TOO_FEW_DRAFTS,
            probe.LOW_TAU,
            probe.LOW_RATE,
            acceptance.REGRESSED,
            acceptance.PREFIX_CACHE,
        ),
    ),
    GateRow(
        GATE_SPEEDUP, "serving", speedup, "--speedup", (speedup.NO_SPEEDUP, speedup.LOW_ACCEPTANCE, speedup.UNMEASURED)
    ),
    GateRow(
        GATE_GATEWAY,
        "serving",
        gateway,
        "always",
        (
            gateway.MIN_IN_ROTATION,
            gateway.UNREACHABLE,
            gateway.NOT_SERVED,
            gateway.IN_ROTATION_NOT_READY,
            gateway.OUT_OF_ROTATION,
        ),
    ),
    GateRow(GATE_READY, "record", ready, "always"),
)


def row(name: str) -> GateRow:
    """The row of a gate by its name in the report."""
    for gate in GATES:
        if gate.name == name:
            return gate
    raise KeyError(name)
