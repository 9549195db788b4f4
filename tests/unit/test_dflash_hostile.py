"""Lint over hostile drafter and target configs: every key of a published drafter (z-lab's and a
speculators-format one, as three config classes read them), of its dflash_config and of the
target, set in turn to a value of every wrong kind (a list, a map, text, null, a bool, NaN,
infinity, a number past any model's, a negative one, a fraction): lint answers with problems, never
an exception, within a bounded memory. It once raised on a list for a key it looked up in a table
(model_type, speculators_model_type), on text where it formatted a number (a laguna rope_theta),
on a number where it iterated a list (the target's architectures), and built 10**30 layers
(24 GB, the machine's whole memory) for a num_hidden_layers of 10**30."""

from __future__ import annotations

import copy
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.rules import dflash

DATA = Path(__file__).resolve().parents[1] / "data" / "real-drafters"
REPO = Path(__file__).resolve().parents[2]
WRONG = (["x"], {"a": 1}, "abc", None, True, float("nan"), float("inf"), 10**30, -1, 0.5)
EXTRA_KEYS = (
    "model_type", "rope_theta", "rope_parameters", "no_rope_layers", "vocab_size", "architectures",
    "mask_token_id", "layer_types", "sliding_window", "max_position_embeddings", "rope_scaling",
    "speculators_model_type", "eagle_config", "is_causal", "block_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers",
)  # fmt: skip
MEMORY = 1 << 30  # the whole walk's address space, so that a blow-up fails here, not the machine


def walk() -> tuple[int, list[str]]:
    """How many lint calls were made, and every hostile case that raised, as ``case: error``; run
    in a process of bounded memory."""
    good = json.loads((DATA / "qwen36-27b-dflash" / "drafter.json").read_text())
    speculator = json.loads((DATA / "qwen3-8b-speculator-dflash" / "drafter.json").read_text())
    target = json.loads((DATA / "qwen36-27b-dflash" / "target.json").read_text())
    raised: list[str] = []
    calls = [0]

    def lint(label: str, drafter: dict[str, object], tgt: dict[str, object]) -> None:
        for version in ("0.34.0", "0.26.0+cpu", None):
            calls[0] += 1
            try:
                dflash.lint(drafter, tgt, vllm_version=version, num_speculative_tokens=7)
            except Exception as exc:  # the finding: any exception at all
                raised.append(f"{label} ({version}): {type(exc).__name__}: {exc}"[:300])

    for base in (good, speculator):
        for kind in ("qwen3", "laguna", "muse_glimmer_assistant"):
            for key in sorted({*base, *EXTRA_KEYS}):
                for value in WRONG:
                    drafter = copy.deepcopy(base)
                    drafter["model_type"] = kind
                    drafter[key] = value
                    lint(f"{kind} {key}={value!r:.20}", drafter, target)
    for key in good["dflash_config"]:
        for value in WRONG:
            drafter = copy.deepcopy(good)
            drafter["dflash_config"][key] = value
            lint(f"dflash_config.{key}={value!r:.20}", drafter, target)
    for key in sorted({*target, "num_hidden_layers", "vocab_size", "hidden_size", "architectures"}):
        for value in WRONG:
            tgt = copy.deepcopy(target)
            tgt[key] = value
            lint(f"target {key}={value!r:.20}", good, tgt)
    return calls[0], raised


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


@pytest.mark.usefixtures("programs")
def test_lint_answers_every_hostile_config_with_problems_never_an_exception() -> None:
    code = "import json; from tests.unit.test_dflash_hostile import walk; print(json.dumps(walk()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=_limit
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls, raised = json.loads(proc.stdout)
    assert raised == [], "\n".join(raised[:20])
    assert calls > 3000, calls  # the walk itself: every key, value, class and version


def test_a_layer_count_past_any_model_s_is_an_error_and_builds_nothing() -> None:
    drafter = json.loads((DATA / "qwen36-27b-dflash" / "drafter.json").read_text())
    drafter["num_hidden_layers"] = 10**30
    found = {p.field: p for p in dflash.lint(drafter, None, vllm_version="0.26.0") if p.severity == "error"}
    assert found["num_hidden_layers"].message.startswith("more layers than any model has")
    assert len(dflash.causal_layers(drafter)) == 4096
