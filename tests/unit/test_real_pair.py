"""The real pair as the H200 measured it (tests/data/gpu/real-pair, scripts/gpu-real-pair and
lab/gpu/realpair.sh): the drafter trained there is the one the repo keeps, its training converged,
vLLM's CUDA build serves it at the tau the offline reference loop gives, the gate's own rules
refuse the faults that cost more than max_regression and pass those that cost less, and the
sandbox's playbook probes with the prompts the drafter was held out on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab import prompts as pm
from orchestrator.rules import dflash, plan, probe

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "tests" / "data" / "gpu" / "real-pair"
DRAFTER = REPO / "lab" / "drafters" / "smollm2-135m-dflash"
MARGIN = 0.05  # the served tau against the reference loop's (tests/integration/test_real_pair.py)
MAX_REGRESSION = 0.1  # the playbook's (the default)


def load(name: str) -> Any:
    return json.loads((GPU / name).read_text())


def test_the_drafter_kept_is_the_one_trained_and_served() -> None:
    want = (GPU / "drafter.sha256").read_text().split()[0]
    assert hashlib.sha256((DRAFTER / "model.safetensors").read_bytes()).hexdigest() == want
    recipe = load("training.json")["recipe"]
    config = json.loads((DRAFTER / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": recipe["mask_token_id"], "target_layer_ids": recipe["taps"]}
    assert config["block_size"] == recipe["block_size"] and config["num_hidden_layers"] == recipe["layers"]
    # it lints clean against the real target's config, as the sandbox's deploy lints it
    target = json.loads((GPU / "target-config.json").read_text())
    errors = [p for p in dflash.lint(config, target, num_speculative_tokens=7) if p.severity == "error"]
    assert errors == []


def test_training_converged_in_minutes_on_the_target_s_own_answers() -> None:
    record = load("training.json")
    curve = record["curve"]
    assert record["recipe"]["steps_done"] == record["recipe"]["steps"]
    assert curve[-1]["loss"] < curve[0]["loss"] / 20
    assert curve[-1]["accepted_per_block"] > 2 * max(c["accepted_per_block"] for c in curve[:3]) + 1
    assert record["seconds"]["total"] < 600 and record["gpu"] == "NVIDIA H200"
    # held out: no training prompt shares a task, topic or number range with the probe's prompts
    trained = {p["text"] for p in pm.training(record["recipe"]["seed"])}
    held = pm.held_out()
    assert len(trained) == record["recipe"]["prompts"] and not trained & {p["text"] for p in held}
    assert not any(t in p["text"] for t in pm.CODE_TASKS[-pm.HELD_CODE :] for p in pm.training())
    assert load("reference.json")["prompts"] == [p["text"] for p in held]


def test_vllm_s_cuda_build_serves_the_pair_at_the_reference_tau() -> None:
    """The offline loop (lab/dflash_model.py, bf16 on the H200) and vLLM 0.26.0 behind the whole
    chain agree: a drafter vLLM read differently (taps, mask, layers, attention) would not."""
    reference = load("faults-reference.json")["good"]["all"]
    gates = load("ready-deploy.json")["hosts"][0]["gates"]
    served = gates["acceptance"]
    assert gates["ready"]["ok"] and served["ok"] and "V2 model runner" in gates["engine"]["detail"]
    assert abs(served["mean_acceptance_length"] - reference["tau"]) <= MARGIN * reference["tau"]
    # the same prompts: the reference's drafts, as the served counters count them, differ by the
    # few steps a near tie in bf16 changes
    assert abs(served["drafts"] - reference["drafts"]) <= MARGIN * reference["drafts"]
    # each later probe of the same server gives the same counts: greedy and batch-invariant here
    spread = load("probes-spread.json")
    taus = [r["tau"] for mode in ("sequential", "concurrent") for r in spread[mode]]
    assert len(taus) == 40 and max(taus) - min(taus) < 1e-9
    assert spread["verify_probe_taus"] == [served["mean_acceptance_length"]] * 3


def served_like(reference_tau: float, good_reference: float, good_served: float) -> float:
    """A fault's tau as the server would give it: the good pair's served tau, scaled by the cost the
    reference loop measured for the fault."""
    return good_served * reference_tau / good_reference


@pytest.mark.parametrize(
    ("fault", "verdict"),
    [
        ("stale-mask", "refused"),  # another token for the mask: nothing accepted
        ("other-target", "refused"),  # the taps in another order: fc reads the wrong layers
        ("k-larger", "lint"),  # K = 15 from a block of 8
        ("stale-layers", "passes"),  # the stale 64-layer spread, mapped: -2.3%
        ("layer-shift", "passes"),  # one tap off by one: -1.3%
        ("sliding", "passes"),  # every layer sliding (causal, 64 tokens): -2.5%
        ("stale-bos", "passes"),  # vLLM's DFlash path never reads bos_token_id: -0%
    ],
)
def test_the_gate_refuses_every_fault_that_costs_more_than_max_regression(fault: str, verdict: str) -> None:
    """Each fault's cost is the reference loop's on the H200 (the same prompts, K = 7 unless said);
    the verdict is the gate's own rules on it: lint first, then the thresholds of the shipped
    playbook, then the history of the good release (the same weights, prompts and K)."""
    faults = load("faults-reference.json")
    good_served = load("ready-deploy.json")["hosts"][0]["gates"]["acceptance"]
    good_ref = faults["good"]["all"]["tau"]
    book = yaml.safe_load((REPO / "playbooks" / "smollm2-dflash.yaml").read_text())
    gate = book["gates"]["acceptance"]
    config = json.loads((DRAFTER / "config.json").read_text())
    k = faults[fault]["k"]
    errors = [p.rule for p in dflash.lint(config, num_speculative_tokens=k) if p.severity == "error"]
    if verdict == "lint":
        assert errors == ["speculative_tokens"]
        return
    assert errors == []
    tau = served_like(faults[fault]["all"]["tau"], good_ref, good_served["mean_acceptance_length"])
    drafts = faults[fault]["all"]["drafts"]
    accepted = round((tau - 1) * drafts)
    a = probe.Acceptance(drafts, drafts * k, accepted, accepted / (drafts * k), tau, tau, [])
    ok, _, _ = probe.judge(a, gate["min_mean_acceptance_length"], None, gate["min_drafts"])
    now = {
        "mean_acceptance_length": tau,
        "history": good_served["history"],
        "num_speculative_tokens": k,
        "prompts_sha256": good_served["prompts_sha256"],
    }
    last_ready = {"release_id": "good", "gates": {"acceptance": good_served}}
    held, said = plan.regression(MAX_REGRESSION, now, last_ready)
    cost = 1 - tau / good_served["mean_acceptance_length"]
    assert (ok and held) == (verdict == "passes"), (fault, cost, said)
    assert held == (cost <= MAX_REGRESSION), (fault, cost, said)


def test_the_sandbox_playbook_probes_with_the_held_out_prompts() -> None:
    book = yaml.safe_load((REPO / "playbooks" / "smollm2-dflash.yaml").read_text())
    assert book["gates"]["acceptance"]["prompts"] == [pm.chat(p["text"]) for p in pm.held_out()]
    assert (
        book["drafter"]["reference"]["dflash_config"]
        == json.loads((DRAFTER / "config.json").read_text())["dflash_config"]
    )
    # the GPU run probed with the same prompts and budget: its history is this playbook's
    gpu = load("ready-deploy.json")["hosts"][0]["gates"]["acceptance"]
    body = {"prompts": book["gates"]["acceptance"]["prompts"], "max_tokens": book["gates"]["acceptance"]["max_tokens"]}
    assert gpu["prompts_sha256"] == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
