"""The weights gate proves the drafter's config describes its weights.

The safetensors headers on the host: layers, `fc` width, attention shapes, vocabulary.

The weights gate, pure: does a drafter's config describe the weights it is served with?

A config copied from another drafter (or left stale in a model directory) loads, starts and
serves; vLLM then either fails on a shape at load time or, where shapes happen to agree, runs a
drafter whose tokens are never accepted. The safetensors headers (tensor names, dtypes and
shapes, read on the host without the tensors) say what the weights are; this checks the config's
numbers against them, naming each field that disagrees.

Tensor names are those of DFlash drafters as vLLM's ``qwen3_dflash`` loader reads them
(``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``, ...; a leading
``model.`` is tolerated).
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.results import Problem
from orchestrator.rules.dflash import Target

_LAYER = re.compile(r"^layers\.(\d+)\.")


def tensors(headers: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """Every tensor's shape, over all the safetensors files (the ``model.`` prefix dropped)."""
    out: dict[str, list[int]] = {}
    for header in headers.values():
        for name, info in header.items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                out[name.removeprefix("model.")] = shape
    return out


def check(drafter: dict[str, Any], headers: dict[str, dict[str, Any]], target: Target | None) -> list[Problem]:
    """What in the drafter config the weights contradict (empty: they agree on every number)."""
    found = tensors(headers)
    if not found:
        return [Problem("weights", "error", "the drafter directory holds no safetensors tensors")]
    problems: list[Problem] = []
    add = problems.append

    layers = {int(m.group(1)) for name in found if (m := _LAYER.match(name))}
    want_layers = drafter.get("num_hidden_layers")
    if isinstance(want_layers, int) and len(layers) != want_layers:
        add(Problem("num_hidden_layers", "error", f"the weights hold {len(layers)} layers", want_layers, len(layers)))

    hidden = drafter.get("hidden_size")
    heads, kv_heads = (
        drafter.get("num_attention_heads"),
        drafter.get("num_key_value_heads", drafter.get("num_attention_heads")),
    )
    head_dim = drafter.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    )
    config = drafter.get("dflash_config")
    ids = (config if isinstance(config, dict) else {}).get("target_layer_ids") or drafter.get(
        "aux_hidden_state_layer_ids"
    )

    fc = found.get("fc.weight")
    if fc is not None and len(fc) == 2 and isinstance(hidden, int):
        if fc[0] != hidden:
            add(Problem("hidden_size", "error", f"fc.weight has {fc[0]} outputs", hidden, fc[0]))
        elif isinstance(ids, list) and fc[1] != hidden * len(ids):
            taps = fc[1] / hidden
            add(
                Problem(
                    "dflash_config.target_layer_ids",
                    "error",
                    f"fc.weight takes {fc[1]} inputs = hidden_size {hidden} x {taps:g} tapped layers, "
                    f"but the config taps {len(ids)} ({ids})",
                    f"{taps:g} layers",
                    len(ids),
                )
            )

    if isinstance(hidden, int) and isinstance(heads, int) and isinstance(head_dim, int):
        for layer in sorted(layers)[:1]:  # every layer is built alike: the first one says it
            prefix = f"layers.{layer}.self_attn."
            for proj, rows, field in (
                ("q_proj", heads * head_dim, "num_attention_heads"),
                ("k_proj", (kv_heads or heads) * head_dim, "num_key_value_heads"),
                ("v_proj", (kv_heads or heads) * head_dim, "num_key_value_heads"),
            ):
                shape = found.get(f"{prefix}{proj}.weight")
                if shape is not None and shape != [rows, hidden]:
                    add(
                        Problem(
                            field,
                            "error",
                            f"{prefix}{proj}.weight is {shape}, the config makes it "
                            f"[{rows}, {hidden}] (heads x head_dim {head_dim}, hidden_size)",
                            [rows, hidden],
                            shape,
                        )
                    )
            norm = found.get(f"{prefix}q_norm.weight")
            if norm is not None and norm != [head_dim]:
                add(Problem("head_dim", "error", f"{prefix}q_norm.weight is {norm}", [head_dim], norm))

    vocab = drafter.get("vocab_size")
    for name in ("lm_head.weight", "embed_tokens.weight"):
        shape = found.get(name)
        if shape is not None and isinstance(vocab, int) and shape[0] != vocab:
            add(Problem("vocab_size", "error", f"{name} has {shape[0]} rows", vocab, shape[0]))
    if target is not None and target.vocab_size is not None and isinstance(vocab, int) and vocab != target.vocab_size:
        add(
            Problem(
                "vocab_size",
                "error",
                "must equal the target's (the drafter uses its embedding and head)",
                target.vocab_size,
                vocab,
            )
        )
    return problems
