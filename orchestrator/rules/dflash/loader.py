"""The serving loader's view: what transformers dropped of the values a drafter config intends."""

from __future__ import annotations

from typing import Any

from orchestrator.results import Problem

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
