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
"""

from __future__ import annotations

import json
import sys
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


def target(out: Path) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=VOCAB["[PAD]"],
        torch_dtype="float32",
    )
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
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    n = len(target_layer_ids)
    w: dict[str, torch.Tensor] = {
        "fc.weight": torch.eye(HIDDEN).repeat(1, n) / n,
        "hidden_norm.weight": torch.ones(HIDDEN),
        "norm.weight": torch.ones(HIDDEN),
    }
    for i in range(len(layer_types)):  # layers after the first write nothing: the residual passes on
        w |= {
            f"layers.{i}.input_layernorm.weight": torch.ones(HIDDEN),
            f"layers.{i}.post_attention_layernorm.weight": torch.ones(HIDDEN),
            f"layers.{i}.self_attn.q_proj.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN),
            f"layers.{i}.self_attn.k_proj.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN),
            f"layers.{i}.self_attn.v_proj.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN),
            f"layers.{i}.self_attn.o_proj.weight": torch.zeros(HIDDEN, HEADS * HEAD_DIM),
            f"layers.{i}.self_attn.q_norm.weight": torch.ones(HEAD_DIM),
            f"layers.{i}.self_attn.k_norm.weight": torch.ones(HEAD_DIM),
            f"layers.{i}.mlp.gate_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
            f"layers.{i}.mlp.up_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
            f"layers.{i}.mlp.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE),
        }
    w["layers.0.self_attn.v_proj.weight"][0, 2] = 1.0  # value: dim 2 of the tapped context
    w["layers.0.self_attn.o_proj.weight"][0, 0] = DRAFT_GAIN  # written into dim 0 (token C)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": BLOCK_SIZE,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB_SIZE,
        "num_target_layers": num_target_layers,
        "layer_types": list(layer_types),
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": EOS,
        "torch_dtype": "float32",
    }
    if "sliding_attention" in layer_types:
        # Every context position holds what the drafter copies, so a short window costs nothing.
        config |= {"sliding_window": SLIDING_WINDOW, "use_sliding_window": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = target(out / "target")
    layers = config.num_hidden_layers
    drafter(out / "drafter-good", MASK, [1], layers)
    drafter(out / "drafter-wrong-mask", WRONG_MASK, [1], layers)
    drafter(out / "drafter-wrong-layer", MASK, [0], layers)
    drafter(out / "drafter-mixed", MASK, [1], layers, ("sliding_attention", "full_attention"))
    for path in out.rglob("*"):  # unprivileged containers read these as nobody
        path.chmod(0o755 if path.is_dir() else 0o644)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
