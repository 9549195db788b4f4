"""DFlash drafter rules, pure: lint a drafter config against its target, a pinned reference and a
vLLM version; read the serving loader's view of it. No I/O here.

Every rule states what it protects against. The vLLM table is data (``BUILD_TABLE``) with its
sources; add a row when a new build bug is found.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class Problem:
    field: str
    severity: str  # "error" | "warning"
    message: str
    expected: Any = None
    actual: Any = None
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.fix:
            out.pop("fix")
        return out

    def line(self) -> str:
        values = ""
        if self.expected is not None or self.actual is not None:
            values = f" (expected {self.expected!r}, got {self.actual!r})"
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{self.severity}: {self.field}: {self.message}{values}{fix}"


@dataclass(frozen=True)
class Target:
    """The target model's dimensions, from ``text_config`` when the model is a multimodal wrapper."""

    num_hidden_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    architectures: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Target:
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        assert isinstance(text, dict)
        archs = config.get("architectures") or ()
        return cls(
            _int(text.get("num_hidden_layers")),
            _int(text.get("hidden_size")),
            _int(text.get("vocab_size")),
            tuple(a for a in archs if isinstance(a, str)),
        )

    @property
    def multimodal_wrapper(self) -> bool:
        return any(a.endswith("ForConditionalGeneration") for a in self.architectures)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def default_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """z-lab's default tap spacing: round(1 + i*(N-4)/(n-1))."""
    if count == 1:
        return [1]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def layer_kinds(drafter: dict[str, Any]) -> set[str]:
    types = drafter.get("layer_types")
    return {t for t in types if isinstance(t, str)} if isinstance(types, list) else set()


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


def _integer_problems(drafter: dict[str, Any], dflash: dict[str, Any]) -> list[Problem]:
    out = []
    for scope, names, prefix in ((drafter, INTEGER_FIELDS, ""), (dflash, INTEGER_DFLASH_FIELDS, "dflash_config.")):
        for name in names:
            value = scope.get(name)
            if value is not None and _int(value) is None:
                out.append(
                    Problem(
                        f"{prefix}{name}", "error", "must be an integer (transformers and vLLM read one)", actual=value
                    )
                )
    return out


def lint(
    drafter: dict[str, Any],
    target: dict[str, Any] | None = None,
    reference: dict[str, Any] | None = None,
    vllm_version: str | None = None,
    num_speculative_tokens: int | None = None,
    serving_env: dict[str, str] | None = None,
) -> list[Problem]:
    problems: list[Problem] = []
    add = problems.append
    dflash = drafter.get("dflash_config")
    dflash = dflash if isinstance(dflash, dict) else {}
    tgt = Target.from_config(target) if target is not None else None

    problems.extend(_integer_problems(drafter, dflash))
    archs = drafter.get("architectures")
    if archs != [ARCHITECTURE]:
        add(
            Problem(
                "architectures", "error", "vLLM maps only this architecture to its DFlash model", [ARCHITECTURE], archs
            )
        )
    if drafter.get("model_type") != "qwen3":
        add(
            Problem(
                "model_type",
                "error",
                "transformers must parse the drafter with Qwen3Config",
                "qwen3",
                drafter.get("model_type"),
            )
        )

    mask = dflash.get("mask_token_id")
    if mask is None:
        add(
            Problem(
                "dflash_config.mask_token_id",
                "error",
                "missing: vLLM refuses to start without it",
                fix="set the mask token of the target family (Qwen3: 151669, Qwen3.5/3.6: 248070)",
            )
        )
    elif _int(mask) is None or mask < 0:
        add(Problem("dflash_config.mask_token_id", "error", "must be a non-negative integer", actual=mask))
    elif tgt and tgt.vocab_size is not None and mask >= tgt.vocab_size:
        add(
            Problem(
                "dflash_config.mask_token_id",
                "error",
                f"outside the target vocabulary (size {tgt.vocab_size})",
                f"< {tgt.vocab_size}",
                mask,
            )
        )

    ids = dflash.get("target_layer_ids")
    if ids is None:
        add(Problem("dflash_config.target_layer_ids", "error", "missing: the drafter would tap no target layer"))
    elif not isinstance(ids, list) or not ids or any(_int(i) is None for i in ids):
        add(Problem("dflash_config.target_layer_ids", "error", "must be a non-empty list of integers", actual=ids))
    else:
        if any(b <= a for a, b in itertools.pairwise(ids)):
            add(Problem("dflash_config.target_layer_ids", "error", "must be strictly increasing", actual=ids))
        if tgt and tgt.num_hidden_layers is not None:
            bad = [i for i in ids if not 0 <= i < tgt.num_hidden_layers]
            if bad:
                add(Problem(
                    "dflash_config.target_layer_ids", "error",
                    f"layers {bad} are outside the target's 0..{tgt.num_hidden_layers - 1}: vLLM starts healthy, then the "
                    "first request kills the engine", f"each in [0, {tgt.num_hidden_layers})", ids,
                ))  # fmt: skip

    if tgt is not None:
        dimensions = (
            ("num_target_layers", "num_hidden_layers", tgt.num_hidden_layers),
            ("hidden_size", "hidden_size", tgt.hidden_size),
            ("vocab_size", "vocab_size", tgt.vocab_size),
        )
        unknown = [target_name for _, target_name, want in dimensions if want is None]
        if unknown:
            add(Problem(
                "target", "error",
                f"the target's config.json has no {', '.join(unknown)} (an integer, at the top or under text_config): "
                "the drafter cannot be checked against it",
            ))  # fmt: skip
        for name, _, want in dimensions:
            have = drafter.get(name)
            if want is not None and have != want:
                add(Problem(name, "error", "must equal the target's", want, have))

    layers = drafter.get("num_hidden_layers")
    types = drafter.get("layer_types")
    if isinstance(types, list):
        if _int(layers) is not None and len(types) != layers:
            add(
                Problem(
                    "layer_types",
                    "error",
                    "needs one entry per drafter layer (transformers raises otherwise)",
                    f"{layers} entries",
                    f"{len(types)} entries",
                )
            )
        unknown = sorted({t if isinstance(t, str) else repr(t) for t in types if t not in (SLIDING, FULL)})
        if unknown:
            add(Problem("layer_types", "error", f"unknown layer types {unknown}", [SLIDING, FULL], types))
    if SLIDING in layer_kinds(drafter):
        window = _int(drafter.get("sliding_window"))
        if window is None or window <= 0:
            add(
                Problem(
                    "sliding_window",
                    "error",
                    "sliding layers need a positive window",
                    "> 0",
                    drafter.get("sliding_window"),
                )
            )
        if drafter.get("use_sliding_window") is not True and not dflash.get("swa_window_size"):
            add(Problem(
                "use_sliding_window", "error",
                "transformers' Qwen3Config drops sliding_window to None unless use_sliding_window is true: the "
                "reference model runs full attention and vLLM >= 0.25 raises", True, drafter.get("use_sliding_window"),
                fix="set \"use_sliding_window\": true (or dflash_config.swa_window_size)",
            ))  # fmt: skip

    block = _int(drafter.get("block_size"))
    if num_speculative_tokens is not None and block is not None:
        if num_speculative_tokens > block - 1:
            add(
                Problem(
                    "num_speculative_tokens",
                    "error",
                    f"a block of {block} drafts at most {block - 1} tokens",
                    block - 1,
                    num_speculative_tokens,
                )
            )
        elif num_speculative_tokens < block - 1:
            add(
                Problem(
                    "num_speculative_tokens",
                    "warning",
                    f"the drafter proposes {block - 1} per block; fewer wastes its work",
                    block - 1,
                    num_speculative_tokens,
                )
            )

    if reference:
        for key, want in sorted(_flatten(reference).items()):
            have = _lookup(drafter, key)
            if have != want:
                add(Problem(key, "error", "differs from the pinned reference", want, have))

    if vllm_version is not None:
        problems.extend(check_build(vllm_version, drafter, tgt, serving_env or {}))
    return problems


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


def parse_version(text: str) -> tuple[int, int, int]:
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"not a version: {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


@dataclass(frozen=True)
class BuildBug:
    code: str
    first: str | None  # first affected version (inclusive), None = from the beginning
    fixed: str | None  # first good version, None = not fixed yet
    severity: str
    message: str
    fix: str
    applies: str = "always"  # always | sliding | mixed | mixed_without_v2 | multimodal_target
    sources: tuple[str, ...] = field(default_factory=tuple)


BUILD_TABLE: tuple[BuildBug, ...] = (
    BuildBug(
        "no_dflash",
        None,
        "0.20.0",
        "error",
        "this vLLM has no DFlash support",
        "install vLLM >= 0.26",
        sources=("vLLM wheels 0.19/0.20: no DFlash model before 0.20.0",),
    ),
    BuildBug(
        "layer_offset",
        "0.20.0",
        "0.22.0",
        "error",
        "target_layer_ids are tapped one layer too early (the +1 offset is missing): acceptance collapses",
        "install vLLM >= 0.22 (PR 40727)",
        sources=("vLLM PR 40727",),
    ),
    BuildBug(
        "swa_as_full",
        "0.20.0",
        "0.25.0",
        "error",
        "sliding-window drafter layers silently run as full attention",
        "install vLLM >= 0.26",
        applies="sliding",
        sources=("vLLM wheels 0.20-0.24",),
    ),
    BuildBug(
        "mixed_swa_raises",
        "0.25.0",
        "0.26.0",
        "error",
        "a drafter mixing sliding and full layers raises NotImplementedError",
        "install vLLM >= 0.26",
        applies="mixed",
        sources=("vLLM wheels 0.25.x",),
    ),
    BuildBug(
        "mixed_needs_v2",
        "0.26.0",
        "0.33.0",
        "error",
        "mixed sliding/full drafters need the V2 model runner, which this version does not use by default",
        "set VLLM_USE_V2_MODEL_RUNNER=1 in serving.env (default from 0.33)",
        applies="mixed_without_v2",
        sources=("vLLM 0.26 release notes; default by 0.33",),
    ),
    BuildBug(
        "zero_lm_head",
        None,
        "0.26.0",
        "error",
        "the draft lm_head stays zero-initialised for *ForConditionalGeneration targets: acceptance near 0",
        "install vLLM >= 0.26 (PR 47914)",
        applies="multimodal_target",
        sources=("vLLM PR 47914 (July 2026)",),
    ),
)


def check_build(version: str, drafter: dict[str, Any], target: Target | None, env: dict[str, str]) -> list[Problem]:
    try:
        v = parse_version(version)
    except ValueError:
        return [Problem("vllm", "error", f"cannot read the vLLM version {version!r}")]
    kinds = layer_kinds(drafter)
    facts = {
        "always": True,
        "sliding": SLIDING in kinds,
        "mixed": kinds >= {SLIDING, FULL},
        "mixed_without_v2": kinds >= {SLIDING, FULL} and env.get("VLLM_USE_V2_MODEL_RUNNER") != "1",
        "multimodal_target": bool(target and target.multimodal_wrapper),
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
                    f"[{bug.code}] {bug.message}",
                    f">= {bug.fixed}" if bug.fixed else None,
                    version,
                    bug.fix,
                )
            )
    return out


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
