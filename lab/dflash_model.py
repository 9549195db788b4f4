"""A DFlash drafter in plain torch, computing what vLLM's ``qwen3_dflash.py`` computes, and the
reference speculative decoding loop that measures its acceptance without vLLM.

What vLLM does (0.26 CUDA and 0.32 CPU builds, ``model_executor/models/qwen3_dflash.py`` and
``v1/spec_decode/dflash.py``), and so what this module does:

- the target's hidden states are tapped after the layers in ``dflash_config.target_layer_ids``
  (vLLM collects layer ``i + 1``'s input, the residual stream after layer ``i``: transformers'
  ``hidden_states[i + 1]``), concatenated and put through ``fc``;
- that context is normed by ``hidden_norm`` and projected to each drafter layer's keys (then
  ``k_norm`` and RoPE at the context's own positions) and values, with no ``input_layernorm``;
- the query block is the bonus token the target just chose and K mask tokens, at the positions
  after the context; each drafter layer is a Qwen3 decoder layer whose attention sees the whole
  context and the block (non-causal for a full-attention layer, causal for a sliding one);
- the drafter's final ``norm``, then the *target's* LM head (vLLM shares the target's embedding and
  head with a drafter whose checkpoint has none); the K mask positions' argmaxes are the drafts.

The reference loop verifies drafts with the target's greedy choice, as vLLM does at temperature 0,
and counts tau as vLLM's metrics give it: 1 + accepted tokens / drafts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    taps: tuple[int, ...]
    mask_token_id: int
    block_size: int
    rope_theta: float
    eps: float
    vocab: int
    num_target_layers: int
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    def config(self) -> dict[str, Any]:
        """The drafter's config.json, as vLLM reads it."""
        types = list(self.layer_types) or ["full_attention"] * self.layers
        config: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.taps)},
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "vocab_size": self.vocab,
            "num_target_layers": self.num_target_layers,
            "layer_types": types,
            "max_position_embeddings": 8192,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
        if "sliding_attention" in types:
            config |= {"sliding_window": self.sliding_window, "use_sliding_window": True}
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DrafterShape:
        dflash = config["dflash_config"]
        types = tuple(config.get("layer_types") or ())
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            layers=config["num_hidden_layers"],
            taps=tuple(dflash["target_layer_ids"]),
            mask_token_id=dflash["mask_token_id"],
            block_size=config["block_size"],
            rope_theta=float(config.get("rope_theta") or 1_000_000),
            eps=config.get("rms_norm_eps", 1e-6),
            vocab=config["vocab_size"],
            num_target_layers=config["num_target_layers"],
            layer_types=types,
            sliding_window=window,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight.float()).to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (vLLM's ``is_neox_style`` default): x [..., T, heads, dim]."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv  # [..., T, dim/2]
    cos, sin = freqs.cos()[..., None, :], freqs.sin()[..., None, :]
    x1, x2 = x.float()[..., : dim // 2], x.float()[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = Norm(s.head_dim, s.eps)
        self.k_norm = Norm(s.head_dim, s.eps)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        k = self.k_norm(self.k_proj(x).unflatten(-1, (s.kv_heads, s.head_dim)))
        v = self.v_proj(x).unflatten(-1, (s.kv_heads, s.head_dim))
        return rope(k, positions, s.rope_theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, Q, H]; context keys/values [B, C, kv, d]; allowed [B, Q, C + Q] (True: attend)."""
        s = self.s
        q = rope(self.q_norm(self.q_proj(x).unflatten(-1, (s.heads, s.head_dim))), positions, s.rope_theta)
        k, v = self.keys(x, positions)
        k = torch.cat([context[0], k], dim=1)
        v = torch.cat([context[1], v], dim=1)
        group = s.heads // s.kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, d]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class Layer(nn.Module):
    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(s.hidden, s.intermediate, bias=False),
                "up_proj": nn.Linear(s.hidden, s.intermediate, bias=False),
                "down_proj": nn.Linear(s.intermediate, s.hidden, bias=False),
            }
        )
        self.input_layernorm = Norm(s.hidden, s.eps)
        self.post_attention_layernorm = Norm(s.hidden, s.eps)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, context, allowed)
        x = self.post_attention_layernorm(h)
        return h + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](x)) * self.mlp["up_proj"](x))


class Drafter(nn.Module):
    """The drafter's own weights; the target's embedding and head are passed in, never trained."""

    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.s = s
        self.fc = nn.Linear(s.hidden * len(s.taps), s.hidden, bias=False)
        self.hidden_norm = Norm(s.hidden, s.eps)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = Norm(s.hidden, s.eps)

    def causal(self, i: int) -> bool:
        """vLLM: a sliding layer is causal, a full one is not (``_dflash_layer_causal``)."""
        return bool(self.s.layer_types) and self.s.layer_types[i] == "sliding_attention"

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [B, C, taps*H] -> each layer's context keys and values."""
        c = self.hidden_norm(self.fc(features))
        return [layer.self_attn.keys(c, positions) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        allowed: torch.Tensor,
        causal_allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = block_embeds
        for i, layer in enumerate(self.layers):
            mask = causal_allowed if (self.causal(i) and causal_allowed is not None) else allowed
            h = layer(h, block_positions, context[i], mask)
        return self.norm(h)

    def state_for_vllm(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in self.state_dict().items()}


def save(drafter: Drafter, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(drafter.state_for_vllm(), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(drafter.s.config(), indent=2) + "\n")


def load(path: Path, config: dict[str, Any] | None = None) -> Drafter:
    """The drafter at ``path``; ``config`` (the one a server would read) replaces its config.json."""
    from safetensors.torch import load_file

    shape = DrafterShape.from_config(config or json.loads((path / "config.json").read_text()))
    drafter = Drafter(shape)
    weights = load_file(str(path / "model.safetensors"))
    fc = weights["fc.weight"]
    if fc.shape[1] != drafter.fc.weight.shape[1]:
        raise ValueError(f"fc takes {fc.shape[1]} features, the config's taps give {drafter.fc.weight.shape[1]}")
    drafter.load_state_dict(weights, strict=False)
    return drafter


# --- the target ----------------------------------------------------------------------------------


def tapped(hidden_states: tuple[torch.Tensor, ...], taps: tuple[int, ...]) -> torch.Tensor:
    """vLLM's aux hidden states for ``target_layer_ids``: the residual stream after layer i, in
    layer order whatever the config's order (vLLM keeps ``tuple(sorted(set(layers)))``:
    model_executor/models/interfaces.py, ``_set_aux_hidden_state_layers``)."""
    return torch.cat([hidden_states[i + 1] for i in sorted(set(taps))], dim=-1)


def block_mask(context: int, block: int, causal: bool, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[1, block, context + block]: every query sees the whole context and its block; a causal
    (sliding) layer's query sees only keys at its position or before, and within ``window``."""
    keys = torch.arange(context + block, device=device)
    queries = torch.arange(context, context + block, device=device)[:, None]
    if not causal:
        return torch.ones(1, block, context + block, dtype=torch.bool, device=device)
    allowed = keys[None] <= queries
    if window is not None:
        allowed &= keys[None] > queries - window
    return allowed[None]


@torch.no_grad()
def speculative_greedy(
    target: Any,
    drafter: Drafter,
    prompt: list[int],
    max_tokens: int,
    k: int,
) -> dict[str, Any]:
    """Greedy decoding of ``max_tokens`` tokens with the drafter proposing ``k`` a step and the target
    verifying, as vLLM does at temperature 0. The target is run over the whole sequence each step
    (no cache): slow, and plainly right."""
    device = next(target.parameters()).device
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    s = drafter.s
    ids = torch.tensor([prompt], device=device)
    out = target(ids, output_hidden_states=True)
    feats = tapped(out.hidden_states, s.taps)
    seq = [*prompt, int(out.logits[0, -1].argmax())]
    generated, drafts, accepted, per_step = 1, 0, 0, []
    while generated < max_tokens:
        a = len(seq) - 1  # the bonus token's position; the context is every position before it
        ctx_pos = torch.arange(a, device=device)[None]
        context = drafter.context(feats[:, :a].to(drafter.fc.weight.dtype), ctx_pos)
        block = torch.tensor([[seq[-1]] + [s.mask_token_id] * k], device=device)
        pos = torch.arange(a, a + k + 1, device=device)[None]
        h = drafter(
            F.embedding(block, embed).to(drafter.fc.weight.dtype),
            pos,
            context,
            block_mask(a, k + 1, False, device),
            block_mask(a, k + 1, True, device, s.sliding_window),
        )
        guess = (h[0, 1:].to(head.dtype) @ head.T).argmax(-1).tolist()
        out = target(torch.tensor([seq + guess], device=device), output_hidden_states=True)
        choice = out.logits[0, a:].argmax(-1).tolist()  # the target's token after each position from a
        n = 0
        while n < k and guess[n] == choice[n]:
            n += 1
        drafts += 1
        accepted += n
        per_step.append(n)
        new = [*guess[:n], choice[n]]
        seq += new
        generated += len(new)
        feats = tapped(out.hidden_states, s.taps)[:, : len(seq) - 1]
    return {
        "drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted": accepted,
        "tau": 1 + accepted / drafts if drafts else None,
        "per_step": per_step,
        "tokens": seq[len(prompt) :][:max_tokens],
    }


def tau_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled tau over prompts (as vLLM's counters pool them) and the per-prompt spread."""
    drafts = sum(r["drafts"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    taus = [r["tau"] for r in results if r["tau"] is not None]
    mean = sum(taus) / len(taus)
    sd = math.sqrt(sum((t - mean) ** 2 for t in taus) / (len(taus) - 1)) if len(taus) > 1 else 0.0
    return {
        "tau": round(1 + accepted / drafts, 4),
        "drafts": drafts,
        "accepted": accepted,
        "per_prompt": [round(t, 3) for t in taus],
        "per_prompt_sd": round(sd, 3),
    }
