"""A DFlash drafter's layout as vLLM reads it, in any of the layouts it takes (z-lab's, speculators'), and
the facts lint and the build table share: its target, layer kinds, mask token and what vLLM predicts."""

from __future__ import annotations

from dataclasses import dataclass
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
# every wheel 0.26.0-0.34.0 (None: already in 0.26.0, the oldest read, so refused on no version;
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
    "DFlash2RicursiveDraftModel": "0.34.0",
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
    layer_types: tuple[str, ...] = ()  # text_config's layer_types (or layers_block_type)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Target:
        """The dimensions of a target's config.json, from text_config where the model wraps a
        language model."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        assert isinstance(text, dict)
        archs = config.get("architectures")
        archs = archs if isinstance(archs, list) else ()  # anything else names no architecture
        return cls(
            as_int(text.get("num_hidden_layers")),
            as_int(text.get("hidden_size")),
            as_int(text.get("vocab_size")),
            tuple(a for a in archs if isinstance(a, str)),
            as_int(text.get("max_position_embeddings")),
            tuple(t for t in kinds if isinstance(t, str))
            if isinstance(kinds := text.get("layer_types", text.get("layers_block_type")), list)
            else (),
        )

    @property
    def multimodal_wrapper(self) -> bool:
        """Whether the target is a *ForConditionalGeneration wrapper (the Qwen3.5/3.6 family)."""
        return any(a.endswith("ForConditionalGeneration") for a in self.architectures)

    @property
    def hybrid(self) -> bool:
        """Whether some of the target's layers are not attention (linear attention, Mamba): what
        vLLM calls a hybrid model (0.34.0 config/model.py is_hybrid reads the same layer_types)."""
        return any(t not in ("attention", "full_attention", "sliding_attention") for t in self.layer_types)


def as_int(value: Any) -> int | None:
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
    if not isinstance(kind, str) or kind not in SPECULATORS:
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
    if isinstance(aux, list) and all(as_int(i) is not None for i in aux):
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
    return mask if as_int(mask) is not None and mask >= 0 else None


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
