"""The likely causes of a host's failure, across its gates."""

from __future__ import annotations

import re

from orchestrator.config.playbook import Playbook
from orchestrator.errors import AgentFailure
from orchestrator.results import (
    GATE_ACCEPTANCE,
    GATE_BUILD,
    GATE_HEALTH,
    GATE_LOADER,
    GATE_SPEEDUP,
    HostReport,
)
from orchestrator.rules import dflash

# The agent's probe failing on a status the server sent ("completion failed: 404 ...").
_ANSWERED = re.compile(r"failed: ([1-5][0-9][0-9])\b")


def diagnose(playbook: Playbook, report: HostReport, failure: AgentFailure | None = None) -> list[str]:
    """The likely causes, most specific first, from everything this run knows."""
    # The gates' reason codes, loaded here: a diagnosis runs only where a host failed.
    from orchestrator.rules import probe
    from orchestrator.rules.gates import speedup
    from orchestrator.rules.gates.build import KNOWN_BUGS

    out: list[str] = []
    drafter = playbook.drafter
    acceptance = report.gates.get(GATE_ACCEPTANCE)
    tau = acceptance.data.get("mean_acceptance_length") if acceptance else None
    if drafter is not None and drafter.reference:
        diffs = [p for p in dflash.lint(drafter.values, None, drafter.reference) if p.rule == dflash.REFERENCE]
        if diffs:
            out.append(
                "the drafter config differs from its pinned reference: "
                + ", ".join(f"{p.field} {p.actual!r} (expected {p.expected!r})" for p in diffs)
            )
    loader = report.gates.get(GATE_LOADER)
    if loader is not None and not loader.ok:
        out.append(f"the serving loader drops intended values: {loader.detail}")
    build = report.gates.get(GATE_BUILD)
    if build is not None and build.reason == KNOWN_BUGS:
        out.append(f"the vLLM build has known DFlash problems: {build.detail}")
    if tau is not None and tau < speedup.LOW_TAU:
        cfg = drafter.values.get("dflash_config", {}) if drafter else {}
        out.append(
            f"mean acceptance length {tau:.2f} on a healthy server: the drafter does not match the target. Check "
            f"drafter/config.json: dflash_config.mask_token_id ({cfg.get('mask_token_id')}), target_layer_ids "
            f"({cfg.get('target_layer_ids')}), and that this drafter was trained for this target"
        )
    elif acceptance is not None and not acceptance.ok and acceptance.reason == probe.NO_SPECULATION:
        out.append("no speculative decoding on the server: check serving.speculative and --speculative-config")
    elif acceptance is not None and not acceptance.ok and acceptance.reason == probe.RESTARTED:
        out.append("the server restarted during the probe: see its log")
    fast = report.gates.get(GATE_SPEEDUP)
    if fast is not None and not fast.ok and fast.reason == speedup.NO_SPEEDUP:
        out.append(
            "the drafter's tokens are accepted but speculation does not pay at this load: each step drafts K "
            "tokens and runs the drafter, which costs more than it saves where the target is small or the batch "
            "is large; try a lower num_speculative_tokens, less load per host, or no speculation on this hardware"
        )
    elif fast is not None and not fast.ok and fast.reason == speedup.UNMEASURED:
        out.append(f"the speed-up could not be measured: {fast.detail}")
    if failure is not None and failure.gate == GATE_HEALTH and forced_aot_miss(playbook, failure.message):
        # vLLM 0.32.0 compilation/decorators.py _try_load_aot_compiled_fn re-raises what failed the
        # load (a missing artifact: FileNotFoundError on .../torch_aot_compile/<hash>/rank_*/model)
        out.append(
            "VLLM_FORCE_AOT_LOAD=1 (serving.env) and vLLM's compile cache holds no AOT artifact this start could "
            "load: vLLM refused to compile again, as the guard asks. The key follows the server's arguments, the "
            "drafter's config and path, the vLLM build and its VLLM_* variables: start this command once without "
            "the guard to fill the cache"
        )
    if failure is not None and failure.gate == GATE_HEALTH:
        out.append(f"the server did not become healthy: see {failure.path or 'its log'}")
    elif failure is not None and failure.gate == GATE_ACCEPTANCE and (answered := _ANSWERED.search(failure.message)):
        # An HTTP status is an answer: the server runs (a 404 on /v1/completions: it serves no
        # completions, a target vLLM took for pooling)
        out.append(
            f"the server answered the probe with HTTP {answered.group(1)}: it runs, but does not serve what the "
            "probe asks (see the acceptance gate's words)"
        )
    elif failure is not None and failure.gate == GATE_ACCEPTANCE:
        out.append("the probe failed while talking to the server (it died or stopped answering)")
    return out


def forced_aot_miss(playbook: Playbook, said: str) -> bool:
    """A start that died on vLLM's AOT guard: the guard set, and the load of an artifact failing."""
    return playbook.serving.env.get("VLLM_FORCE_AOT_LOAD") == "1" and "torch_aot_compile" in said
