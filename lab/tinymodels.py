"""Tiny models for the sandbox, made with hand-set weights so that acceptance depends on the drafter
config alone. Run by the *serving* Python (torch, transformers, tokenizers, safetensors):

    <vllm-venv>/bin/python tinymodels.py OUT_DIR

Writes OUT_DIR/target (a 2-layer Qwen3 with its tokenizer) and drafters that all load and serve:
OUT_DIR/drafter-good (DFlash, mask token and tapped layer right: ~100% acceptance),
OUT_DIR/drafter-wrong-mask and OUT_DIR/drafter-wrong-layer (look fine, ~0% acceptance), and
OUT_DIR/drafter-mixed: the good drafter in the layout of Qwen3.6-27B-DFlash's, a sliding-window
layer and a full one (the second passes its input on), which only vLLM's V2 model runner serves.

The construction: every ordinary token embeds to the unit vector e0, the mask token to e1 and a
second ("wrong") mask token to 100*e3. In the target, attention writes nothing, layer 0 is the
identity and layer 1's MLP adds e2 when its input holds e0; the LM head reads e0 as token C, e1 as
D and e3 as D2, so the target's greedy output is always C. The one-layer drafter attends uniformly
(zero queries) and copies dim 2 of the tapped context into dim 0 with a gain: only the output of
target layer 1 holds e2, so only `target_layer_ids: [1]` with the right mask token drafts C.

``--shape qwen3-8b`` makes the same construction at Qwen3-8B's geometry (36 layers of 4096, 32
query and 8 KV heads of 128, an MLP of 12288, 151,936 rows of vocabulary: 8.2 billion parameters in
bf16, 16.4 GB) with a drafter of Qwen3-8B-DFlash-b16's (5 layers, block 16, taps 1, 9, 17, 25, 33):
tau is still K + 1 by construction, and a decode step costs what an 8B target's does, where the
tiny pair's is mostly the host's Python. Only the good drafter is written; the weights are zeros
but for the few the construction sets, written shard by shard. ``--layers N`` keeps that width at
fewer target layers (taps 1 .. N-1, two drafter layers): a rehearsal on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

HIDDEN = 64
HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 128
WORDS = [
    "def",
    "return",
    "print",
    "if",
    "else",
    "for",
    "while",
    "in",
    "range",
    "import",
    "the",
    "a",
    "is",
    "what",
    "how",
    "many",
    "plus",
    "minus",
    "times",
    "equals",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "hello",
    "thanks",
    "please",
    "write",
    "code",
    "story",
    "about",
    "cat",
    "dog",
    "sun",
    "moon",
    "list",
    "sort",
    "sum",
    "add",
    "number",
    "question",
    "answer",
    "tell",
    "me",
    "you",
    "are",
]
SPECIAL = ["[UNK]", "[PAD]", "C", "D", "D2", "<mask>", "<mask-wrong>", "<eos>"]
VOCAB = {token: i for i, token in enumerate(SPECIAL + WORDS)}
VOCAB_SIZE = 64
C, D, D2, MASK, WRONG_MASK, EOS = (VOCAB[t] for t in ("C", "D", "D2", "<mask>", "<mask-wrong>", "<eos>"))
BLOCK_SIZE = 8  # K = 7 speculative tokens: short blocks keep the CPU sandbox quick
DRAFT_GAIN = 10.0
SLIDING_WINDOW = 16  # drafter-mixed's sliding layer


@dataclass(frozen=True)
class Shape:
    """A pair's geometry: the target's and its drafter's (which shares the target's width)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab_size: int
    block_size: int
    drafter_layers: int
    taps: tuple[int, ...]
    dtype: torch.dtype


TINY = Shape(HIDDEN, HEADS, HEADS, HEAD_DIM, INTERMEDIATE, 2, VOCAB_SIZE, BLOCK_SIZE, 1, (1,), torch.float32)
SHAPES = {
    # Qwen3-8B's config.json; Qwen3-8B-DFlash-b16's depth, block and taps (DFlash's default spacing
    # round(1 + i * (36 - 4) / 4) over 36 layers).
    "qwen3-8b": Shape(4096, 32, 8, 128, 12288, 36, 151936, 16, 5, (1, 9, 17, 25, 33), torch.bfloat16),
}
SHARD_LAYERS = 6  # target layers a shard (about 2.2 GB at 8B's width)


def tokenizer(out: Path) -> None:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # The mask tokens are special added tokens, as a real target's reserved ids are: never in a
    # sequence the target reads or writes. As ordinary vocabulary, the models gate would rightly
    # warn that the good drafter's mask is a token of normal text.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="<eos>",
        additional_special_tokens=["<mask>", "<mask-wrong>"],
        model_max_length=512,
    )
    fast.save_pretrained(out)


def embeddings() -> torch.Tensor:
    emb = torch.zeros(VOCAB_SIZE, HIDDEN)
    emb[:, 0] = 1.0
    emb[MASK] = 0.0
    emb[MASK, 1] = 1.0
    emb[WRONG_MASK] = 0.0
    emb[WRONG_MASK, 3] = 100.0
    return emb


def qwen3_config(shape: Shape, **extra: object) -> Qwen3Config:
    """The target's config at ``shape``: every ordinary token to token C, EOS and PAD the tokenizer's."""
    return Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=VOCAB["[PAD]"],
        torch_dtype=str(shape.dtype).removeprefix("torch."),
        **extra,
    )


def target(out: Path) -> Qwen3Config:
    config = qwen3_config(TINY)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(embeddings())
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
        mlp = model.model.layers[1].mlp
        # RMSNorm turns e0 into sqrt(H)*e0 = 8*e0; silu(1) * 1 is then written to dim 2.
        mlp.gate_proj.weight[0, 0] = 1.0 / 8
        mlp.up_proj.weight[0, 0] = 1.0 / 8
        mlp.down_proj.weight[2, 0] = 1.0 / float(torch.nn.functional.silu(torch.tensor(1.0)))
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[C, 0] = 1.0
        model.lm_head.weight[D, 1] = 1.0
        model.lm_head.weight[D2, 3] = 1.0
    model.save_pretrained(out, safe_serialization=True)
    tokenizer(out)
    return config


def drafter(
    out: Path,
    mask_token_id: int,
    target_layer_ids: list[int],
    num_target_layers: int,
    layer_types: tuple[str, ...] = ("full_attention",),
    shape: Shape = TINY,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    n = len(target_layer_ids)
    h, q, kv, mlp, dt = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.intermediate,
        shape.dtype,
    )
    w: dict[str, torch.Tensor] = {
        "fc.weight": (torch.eye(h).repeat(1, n) / n).to(dt),
        "hidden_norm.weight": torch.ones(h, dtype=dt),
        "norm.weight": torch.ones(h, dtype=dt),
    }
    for i in range(len(layer_types)):  # layers after the first write nothing: the residual passes on
        w |= {
            f"layers.{i}.input_layernorm.weight": torch.ones(h, dtype=dt),
            f"layers.{i}.post_attention_layernorm.weight": torch.ones(h, dtype=dt),
            f"layers.{i}.self_attn.q_proj.weight": torch.zeros(q, h, dtype=dt),
            f"layers.{i}.self_attn.k_proj.weight": torch.zeros(kv, h, dtype=dt),
            f"layers.{i}.self_attn.v_proj.weight": torch.zeros(kv, h, dtype=dt),
            f"layers.{i}.self_attn.o_proj.weight": torch.zeros(h, q, dtype=dt),
            f"layers.{i}.self_attn.q_norm.weight": torch.ones(shape.head_dim, dtype=dt),
            f"layers.{i}.self_attn.k_norm.weight": torch.ones(shape.head_dim, dtype=dt),
            f"layers.{i}.mlp.gate_proj.weight": torch.zeros(mlp, h, dtype=dt),
            f"layers.{i}.mlp.up_proj.weight": torch.zeros(mlp, h, dtype=dt),
            f"layers.{i}.mlp.down_proj.weight": torch.zeros(h, mlp, dtype=dt),
        }
    # value: dim 2 of the tapped context (KV head 0), written into dim 0 (token C) by query head 0
    w["layers.0.self_attn.v_proj.weight"][0, 2] = 1.0
    w["layers.0.self_attn.o_proj.weight"][0, 0] = DRAFT_GAIN
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": shape.block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        "hidden_size": h,
        "intermediate_size": mlp,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "num_target_layers": num_target_layers,
        "layer_types": list(layer_types),
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": EOS,
        "torch_dtype": str(dt).removeprefix("torch."),
    }
    if "sliding_attention" in layer_types:
        # Every context position holds what the drafter copies, so a short window costs nothing.
        config |= {"sliding_window": SLIDING_WINDOW, "use_sliding_window": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def shaped_target(out: Path, shape: Shape) -> None:
    """The tiny target's construction at ``shape``'s size, written tensor by tensor (an 8B model
    made through transformers would be initialised at random first, in float32: minutes and 33 GB)."""
    out.mkdir(parents=True, exist_ok=True)
    # architectures as save_pretrained of a model writes it: without it vLLM serves Qwen3Model, for pooling
    qwen3_config(shape, architectures=["Qwen3ForCausalLM"]).save_pretrained(out)
    h, dt = shape.hidden, shape.dtype
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def zeros(*size: int) -> torch.Tensor:
        return torch.zeros(*size, dtype=dt)

    emb = zeros(shape.vocab_size, h)
    emb[:VOCAB_SIZE, :HIDDEN] = embeddings()  # the tiny rows: only dims 0, 1 and 3 are set
    emb[VOCAB_SIZE:, 0] = 1.0  # rows no token names: ordinary tokens all the same
    head = zeros(shape.vocab_size, h)
    head[C, 0], head[D, 1], head[D2, 3] = 1.0, 1.0, 1.0
    count = 1 + math.ceil(shape.layers / SHARD_LAYERS)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    weight_map: dict[str, str] = {}
    total = 0

    def write(tensors: dict[str, torch.Tensor]) -> None:  # one shard at a time: its memory back after
        nonlocal total
        name = names[len(set(weight_map.values()))]
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))

    write({"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(h, dtype=dt), "lm_head.weight": head})
    del emb, head
    shard: dict[str, torch.Tensor] = {}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        shard |= {
            p + "input_layernorm.weight": torch.ones(h, dtype=dt),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dt),
            p + "self_attn.q_proj.weight": zeros(q, h),
            p + "self_attn.k_proj.weight": zeros(kv, h),
            p + "self_attn.v_proj.weight": zeros(kv, h),
            p + "self_attn.o_proj.weight": zeros(h, q),
            p + "self_attn.q_norm.weight": torch.ones(shape.head_dim, dtype=dt),
            p + "self_attn.k_norm.weight": torch.ones(shape.head_dim, dtype=dt),
            p + "mlp.gate_proj.weight": zeros(shape.intermediate, h),
            p + "mlp.up_proj.weight": zeros(shape.intermediate, h),
            p + "mlp.down_proj.weight": zeros(h, shape.intermediate),
        }
        if i == 1:  # as the tiny target's layer 1: RMSNorm makes e0 sqrt(H)*e0; silu(1) * 1 to dim 2
            shard[p + "mlp.gate_proj.weight"][0, 0] = 1.0 / math.sqrt(h)
            shard[p + "mlp.up_proj.weight"][0, 0] = 1.0 / math.sqrt(h)
            shard[p + "mlp.down_proj.weight"][2, 0] = 1.0 / float(torch.nn.functional.silu(torch.tensor(1.0)))
        if (i + 1) % SHARD_LAYERS == 0 or i + 1 == shape.layers:
            write(shard)
            shard = {}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tokenizer(out)


def main(out: Path, shape_name: str = "tiny", layers: int | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if shape_name != "tiny":
        shape = SHAPES[shape_name]
        if layers is not None:  # the width at fewer layers: a rehearsal
            shape = replace(shape, layers=layers, taps=tuple(range(1, min(layers, 6))), drafter_layers=2)
        shaped_target(out / "target", shape)
        kinds = ("full_attention",) * shape.drafter_layers
        drafter(out / "drafter-good", MASK, list(shape.taps), shape.layers, kinds, shape)
        for path in out.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        return
    config = target(out / "target")
    layers = config.num_hidden_layers
    drafter(out / "drafter-good", MASK, [1], layers)
    drafter(out / "drafter-wrong-mask", WRONG_MASK, [1], layers)
    drafter(out / "drafter-wrong-layer", MASK, [0], layers)
    drafter(out / "drafter-mixed", MASK, [1], layers, ("sliding_attention", "full_attention"))
    for path in out.rglob("*"):  # unprivileged containers read these as nobody
        path.chmod(0o755 if path.is_dir() else 0o644)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=("tiny", *SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, help="the shape's width at fewer target layers (a rehearsal)")
    args = parser.parse_args()
    main(args.out, args.shape, args.layers)
