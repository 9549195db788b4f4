"""The loader gate proves the serving environment's transformers sees the intended values.

`AutoConfig` run by `serving.python` on the staged drafter dir, field by field, in the server's
environment (`serving.env` too: a `PYTHONPATH` there puts another transformers first for the server,
and for this check; the build check and the gpus gate's torch likewise) (the bytecode its imports
compile is kept where the site is writable, as the server's own start keeps it: a site installed
without bytecode, uv's default, compiles once, not at every check). A deploy keeps the view in the
deploy root's `.loader-cache`, signed with the controller's key; a later check (verify, a redeploy)
reuses it without starting the serving Python while the config's bytes, the fields, the interpreter,
that environment (but its `VLLM_*` variables: the view is loaded before vLLM is imported, so a
command changed only by one, the AOT guard say, reuses it), its import path's directories and every
transformers file the load imported are as they were (stat), and says so: 2 s a load on this
machine's transformers, 12-18 s on the H200's, under a millisecond reused. A deploy runs it in the
background with the engine check, in one serving-Python process (below).
"""

from __future__ import annotations

from orchestrator.agent import protocol
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    GATE_BUILD,
    GATE_LOADER,
    Gate,
    HostReport,
)
from orchestrator.rules import dflash


def read_loader(playbook: Playbook, view: protocol.LoaderView, report: HostReport) -> None:
    assert playbook.drafter is not None
    drops = dflash.loader_drops(playbook.drafter.values, view.fields)
    if drops:
        gate = Gate(False, "; ".join(p.message for p in drops) + f" (transformers {view.transformers})")
    else:
        kept = " (the view kept on the host: nothing it depends on changed)" if view.cached else ""
        gate = Gate(True, f"transformers {view.transformers} loads {view.config_class} with every intended value{kept}")
    set_before(report, GATE_LOADER, gate, GATE_BUILD)


def set_before(report: HostReport, name: str, gate: Gate, before: str) -> None:
    """A gate set in the chain's order: a check answered later (in the background) is still
    listed where it stands in the chain."""
    gates = report.gates
    if name in gates or before not in gates:
        gates[name] = gate
        return
    items = list(gates.items())
    items.insert(list(gates).index(before), (name, gate))
    gates.clear()
    gates.update(items)
