"""Drafter rules: lint against target and reference, the vLLM build table, loader drops."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator import dflash
from orchestrator.configs import read_mapping

REPO = Path(__file__).resolve().parents[2]
FILES = REPO / "playbooks" / "files"
GOOD = json.loads((FILES / "qwen36-27b-dflash" / "config.json").read_text())
TARGET = json.loads((FILES / "qwen36-27b" / "config.json").read_text())
REFERENCE = read_mapping(FILES / "qwen36-27b-dflash" / "reference.yaml")
STALE = json.loads((REPO / "tests" / "data" / "stale-drafter-config.json").read_text())
Q8_DRAFTER = json.loads((FILES / "qwen3-8b-dflash" / "config.json").read_text())
Q8_TARGET = json.loads((FILES / "qwen3-8b" / "config.json").read_text())


def errors(problems: list[dflash.Problem]) -> dict[str, dflash.Problem]:
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
        ({"architectures": ["Qwen3ForCausalLM"]}, "architectures", "only this architecture"),
        ({"model_type": "llama"}, "model_type", "Qwen3Config"),
        ({"dflash_config__mask_token_id": dflash}, "dflash_config.mask_token_id", "vLLM refuses to start"),
        ({"dflash_config__mask_token_id": 248320}, "dflash_config.mask_token_id", "outside the target vocabulary"),
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
        ({"num_target_layers": 48}, "num_target_layers", "must equal the target's"),
        ({"hidden_size": 4096}, "hidden_size", "must equal the target's"),
        ({"vocab_size": 151936}, "vocab_size", "must equal the target's"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types", "one entry per drafter layer"),
        ({"sliding_window": None}, "sliding_window", "positive window"),
        ({"use_sliding_window": dflash}, "use_sliding_window", "drops sliding_window to None"),
        ({"use_sliding_window": False}, "use_sliding_window", "drops sliding_window to None"),
    ],
)
def test_each_rule(changes: dict[str, Any], field: str, fragment: str) -> None:
    found = errors(dflash.lint(edited(**changes), TARGET))
    assert field in found and fragment in found[field].message, found


def test_swa_window_size_is_an_alternative_to_use_sliding_window() -> None:
    config = edited(use_sliding_window=dflash)
    config["dflash_config"]["swa_window_size"] = 2048
    assert "use_sliding_window" not in errors(dflash.lint(config, TARGET))


def test_num_speculative_tokens_against_block_size() -> None:
    assert errors(dflash.lint(GOOD, TARGET, num_speculative_tokens=16))["num_speculative_tokens"].expected == 15
    warn = [p for p in dflash.lint(GOOD, TARGET, num_speculative_tokens=7) if p.severity == "warning"]
    assert [p.field for p in warn] == ["num_speculative_tokens"]


def test_default_layer_spacing() -> None:
    assert dflash.default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash.default_layer_ids(64, 5) == [1, 16, 31, 46, 61]


MIXED = GOOD  # 4 sliding + 1 full
SLIDING_ONLY = edited(layer_types=["sliding_attention"] * 5)
FULL_ONLY = Q8_DRAFTER


@pytest.mark.parametrize(
    ("version", "drafter", "target", "env", "codes"),
    [
        ("0.19.1", FULL_ONLY, Q8_TARGET, {}, ["no_dflash"]),
        ("0.20.0", FULL_ONLY, Q8_TARGET, {}, ["layer_offset"]),
        ("0.21.0", FULL_ONLY, Q8_TARGET, {}, ["layer_offset"]),
        ("0.22.0", FULL_ONLY, Q8_TARGET, {}, []),
        ("0.24.0", SLIDING_ONLY, Q8_TARGET, {}, ["swa_as_full"]),
        ("0.25.1", SLIDING_ONLY, Q8_TARGET, {}, []),
        ("0.25.0", MIXED, Q8_TARGET, {}, ["mixed_swa_raises"]),
        ("0.26.0", MIXED, Q8_TARGET, {}, ["mixed_needs_v2"]),
        ("0.26.0", MIXED, Q8_TARGET, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, []),
        ("0.32.0+cpu", MIXED, Q8_TARGET, {}, ["mixed_needs_v2"]),
        ("0.33.0", MIXED, Q8_TARGET, {}, []),
        ("0.25.2", FULL_ONLY, TARGET, {}, ["zero_lm_head"]),
        ("0.26.0", FULL_ONLY, TARGET, {}, []),
        ("0.21.0", MIXED, TARGET, {}, ["layer_offset", "swa_as_full", "zero_lm_head"]),
    ],
)
def test_build_table_rows(
    version: str, drafter: dict[str, Any], target: dict[str, Any], env: dict[str, str], codes: list[str]
) -> None:
    found = dflash.check_build(version, drafter, dflash.Target.from_config(target), env)
    assert [p.message.split("]")[0].lstrip("[") for p in found] == codes
    assert all(p.severity == "error" and p.fix for p in found)


def test_every_build_row_names_its_source() -> None:
    assert all(bug.sources for bug in dflash.BUILD_TABLE)


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


def test_lint_command_exit_codes_and_json(tmp_path: Path) -> None:
    target = FILES / "qwen36-27b" / "config.json"
    ok = lint_cli(FILES / "qwen36-27b-dflash" / "config.json", "--target", target, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"ok": True, "problems": []}
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
