"""Train a DFlash drafter for a target on the target's own generations, and measure it offline.

    python lab/train_drafter.py train TARGET OUT [--steps N] [--minutes M] [--seed S] [--device cuda]
    python lab/train_drafter.py reference TARGET DRAFTER [--config FILE] [--k 7] [--max-tokens 128]

``train`` writes OUT/drafter (config.json + model.safetensors, bf16, as vLLM serves it),
OUT/training.json (the recipe, the seed, the data, the times, the loss curve) and OUT/reference.json
(tau of the reference loop on the held-out prompts). ``reference`` prints the same measurement for
any drafter (``--config``: the config a server would read instead of the drafter's own, the way a
stale file is served).

The recipe (DFlash, arXiv 2602.06036, as its published drafters and vLLM's code use it):

1. data: every training prompt of lab/prompts.py, chat-templated; the target answers each greedily
   (the probe's decoding) and once sampled at temperature 0.8, a fixed number of tokens with no
   stop at end-of-turn (the probe sets ``ignore_eos``);
2. features: the target's residual stream after each tapped layer, for every position, computed
   once;
3. each step: sequences, and in each, random anchors in the answer; a block is the anchor's token
   and K mask tokens at the positions after it, seeing the context before the anchor; the loss is
   cross entropy at the K mask positions against the target's own next tokens, weighted
   exp(-(k-1)/gamma) as in the paper (the first drafts decide most of the acceptance);
4. the target's embedding and head are shared and frozen (vLLM shares them at serve time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from lab import dflash_model as dm
from lab import prompts as pm

TAPS = (1, 8, 15, 22, 28)  # spread over the 30 layers, none the last (its output is normed)
BLOCK = 8  # K = 7
MASK_TOKEN = "<empty_output>"  # a reserved token chat text never holds
GAMMA = 4.0  # the paper's loss decay for blocks of 8


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_target(path: Path, device: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:  # transformers 5.17 writes SmolLM2's tokenizer without one
        tok.pad_token = tok.eos_token
    return model, tok


@torch.no_grad()
def generate(
    target: Any, tok: Any, texts: list[str], new_tokens: int, sample: bool, batch: int, seed: int
) -> list[list[int]]:
    """Each prompt's ids followed by ``new_tokens`` of the target's answer (no stop at end-of-turn)."""
    device = next(target.parameters()).device
    target.generation_config.eos_token_id = None  # as ignore_eos: answer the full length
    tok.padding_side = "left"
    out: list[list[int]] = []
    torch.manual_seed(seed)
    for i in range(0, len(texts), batch):
        enc = tok(texts[i : i + batch], return_tensors="pt", padding=True).to(device)
        ids = target.generate(
            **enc,
            max_new_tokens=new_tokens,
            do_sample=sample,
            temperature=0.8 if sample else None,
            top_p=None,
            top_k=None,
            pad_token_id=tok.pad_token_id,
        )
        for row, mask in zip(ids.tolist(), enc["attention_mask"].tolist(), strict=False):
            pad = len(mask) - sum(mask)
            out.append(row[pad:])
        log(f"generated {len(out)}/{len(texts)} ({'sampled' if sample else 'greedy'})")
    return out


@torch.no_grad()
def features(target: Any, seqs: list[list[int]], taps: tuple[int, ...], batch: int, pad: int) -> torch.Tensor:
    """[N, T, taps*H] in bf16: the tapped residual stream for every sequence (right-padded)."""
    device = next(target.parameters()).device
    length = max(len(s) for s in seqs)
    chunks = []
    for i in range(0, len(seqs), batch):
        rows = [s + [pad] * (length - len(s)) for s in seqs[i : i + batch]]
        out = target(torch.tensor(rows, device=device), output_hidden_states=True)
        chunks.append(dm.tapped(out.hidden_states, taps).to(torch.bfloat16))
    return torch.cat(chunks)


def batch_masks(
    anchors: torch.Tensor, length: int, block: int, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [B, A] -> allowed [B, A*block, length + A*block] for the non-causal layers and the
    causal one: a block's queries see context positions before their anchor and their own block."""
    b, a = anchors.shape
    device = anchors.device
    ctx = torch.arange(length, device=device)[None, None, :] < anchors[:, :, None]  # [B, A, T]
    ctx &= torch.arange(length, device=device)[None, None, :] < lengths[:, None, None]
    ctx = ctx.repeat_interleave(block, dim=1)  # [B, A*block, T]
    owner = torch.arange(a * block, device=device) // block
    same = owner[:, None] == owner[None, :]
    within = torch.arange(a * block, device=device) % block
    causal = same & (within[None, :] <= within[:, None])
    full = torch.cat([ctx, same[None].expand(b, -1, -1)], dim=-1)
    causal_full = torch.cat([ctx, causal[None].expand(b, -1, -1)], dim=-1)
    return full, causal_full


def train(args: argparse.Namespace) -> None:
    started = time.monotonic()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, tok = load_target(Path(args.target), device)
    cfg = target.config
    mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
    shape = dm.DrafterShape(
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        layers=args.layers,
        taps=TAPS,
        mask_token_id=mask_id,
        block_size=BLOCK,
        rope_theta=float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or 100000.0),
        eps=cfg.rms_norm_eps,
        vocab=cfg.vocab_size,
        num_target_layers=cfg.num_hidden_layers,
    )
    train_prompts = pm.training(args.seed, args.math_prompts)[: args.prompts or None]
    texts = [pm.chat(p["text"]) for p in train_prompts]
    t0 = time.monotonic()
    prompt_lens = [len(tok(t).input_ids) for t in texts]
    seqs = generate(target, tok, texts, args.new_tokens, False, args.gen_batch, args.seed)
    seqs += generate(target, tok, texts, args.new_tokens, True, args.gen_batch, args.seed + 1)
    prompt_lens = prompt_lens * 2
    gen_s = time.monotonic() - t0
    t0 = time.monotonic()
    feats = features(target, seqs, TAPS, args.gen_batch, tok.pad_token_id)
    feat_s = time.monotonic() - t0
    length = feats.shape[1]
    tokens = torch.tensor([s + [tok.pad_token_id] * (length - len(s)) for s in seqs], device=device)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    starts = torch.tensor(prompt_lens, device=device)
    log(f"data: {len(seqs)} sequences of up to {length} tokens, features {tuple(feats.shape)} in {feat_s:.1f} s")

    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    drafter = dm.Drafter(shape).to(device)
    for _name, p in drafter.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    k = BLOCK - 1
    weights = torch.tensor([math.exp(-(i) / GAMMA) for i in range(k)], device=device)
    curve: list[dict[str, float]] = []
    t0 = time.monotonic()
    steps = 0
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")
    while steps < args.steps and time.monotonic() - t0 < args.minutes * 60:
        # cosine over the steps or the minutes, whichever runs out first
        progress = min(1.0, max(steps / args.steps, (time.monotonic() - t0) / (args.minutes * 60)))
        lr = args.lr * min(1.0, (steps + 1) / 100) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = torch.randint(len(seqs), (args.batch,), generator=gen).to(device)
        lo, hi = starts[rows], lengths[rows] - BLOCK  # anchor a: labels a+1 .. a+k inside the sequence
        u = torch.rand(args.batch, args.anchors, generator=gen).to(device)
        anchors = (lo[:, None] + (u * (hi - lo + 1)[:, None].float()).long()).clamp(max=(hi)[:, None])
        offs = torch.arange(BLOCK, device=device)
        pos = (anchors[:, :, None] + offs).flatten(1)  # [B, A*BLOCK]
        row_tok = tokens[rows]
        block_ids = torch.full_like(pos, mask_id)
        block_ids[:, ::BLOCK] = torch.gather(row_tok, 1, anchors)
        labels = torch.gather(row_tok, 1, (pos + 1).clamp(max=length - 1)).view(args.batch, args.anchors, BLOCK)[
            :, :, :k
        ]
        full, causal = batch_masks(anchors, length, BLOCK, lengths[rows])
        with amp:
            ctx_pos = torch.arange(length, device=device)[None].expand(args.batch, -1)
            context = drafter.context(feats[rows].to(drafter.fc.weight.dtype), ctx_pos)
            h = drafter(F.embedding(block_ids, embed), pos, context, full, causal)
            h = h.view(args.batch, args.anchors, BLOCK, -1)[:, :, 1:]
            logits = (h @ head.T.to(h.dtype)).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(args.batch, args.anchors, k) * weights).sum() / (weights.sum() * args.batch * args.anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        steps += 1
        if steps % args.log_every == 0 or steps == 1:
            with torch.no_grad():
                hit = (logits.argmax(-1) == labels).float()
                run = hit.cumprod(-1).sum(-1).mean()  # drafts accepted per block if verified now
            curve.append(
                {
                    "step": steps,
                    "loss": round(loss.item(), 4),
                    "accepted_per_block": round(run.item(), 3),
                    "lr": round(lr, 7),
                    "seconds": round(time.monotonic() - t0, 1),
                }
            )
            log(f"step {steps}: loss {loss.item():.4f}, accepted per block {run.item():.2f}")
    train_s = time.monotonic() - t0
    drafter = drafter.float()
    dm.save(drafter, out / "drafter")
    held = pm.held_out()
    served = dm.load(out / "drafter").to(device)  # what vLLM will read: the bf16 file
    ref = reference(target, tok, served, held, k, args.max_tokens)
    (out / "reference.json").write_text(json.dumps(ref, indent=2) + "\n")
    record = {
        "target": str(args.target),
        "recipe": {
            "seed": args.seed,
            "taps": TAPS,
            "block_size": BLOCK,
            "mask_token": MASK_TOKEN,
            "mask_token_id": mask_id,
            "layers": args.layers,
            "steps": args.steps,
            "steps_done": steps,
            "batch": args.batch,
            "anchors_per_sequence": args.anchors,
            "lr": args.lr,
            "schedule": "100 warm-up steps, cosine over the steps or the minutes, whichever ends first",
            "optimizer": "AdamW(0.9, 0.95), no weight decay, clip 1.0",
            "loss_decay_gamma": GAMMA,
            "new_tokens": args.new_tokens,
            "prompts": len(train_prompts),
            "sequences": len(seqs),
            "answers": "one greedy, one sampled at T=0.8 per prompt",
            "device": device,
            "dtype": "bf16 autocast" if device == "cuda" else "float32",
        },
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "seconds": {
            "generate": round(gen_s, 1),
            "features": round(feat_s, 1),
            "train": round(train_s, 1),
            "total": round(time.monotonic() - started, 1),
        },
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "curve": curve,
        "reference_tau": ref["all"]["tau"],
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"trained {steps} steps in {train_s:.0f} s; reference tau on held-out prompts {ref['all']['tau']}")


def reference(
    target: Any, tok: Any, drafter: dm.Drafter, prompts: list[dict[str, str]], k: int, max_tokens: int
) -> dict[str, Any]:
    results = []
    started = time.monotonic()
    for p in prompts:
        r = dm.speculative_greedy(target, drafter, tok(pm.chat(p["text"])).input_ids, max_tokens, k)
        r["kind"] = p["kind"]
        results.append(r)
    by_kind = {kind: dm.tau_of([r for r in results if r["kind"] == kind]) for kind in ("code", "math", "chat")}
    return {
        "k": k,
        "max_tokens": max_tokens,
        "prompts": [p["text"] for p in prompts],
        "all": dm.tau_of(results),
        "by_kind": by_kind,
        "text": [tok.decode(r["tokens"]) for r in results],
        "seconds": round(time.monotonic() - started, 1),
        "device": str(next(target.parameters()).device),
        "dtype": str(next(target.parameters()).dtype),
    }


def reference_cmd(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    target, tok = load_target(Path(args.target), args.device)
    config = json.loads(Path(args.config).read_text()) if args.config else None
    drafter = dm.load(Path(args.drafter), config).to(args.device)
    if args.device == "cuda":
        drafter = drafter.to(torch.bfloat16)
    ref = reference(target, tok, drafter, pm.held_out(args.per_kind), args.k, args.max_tokens)
    print(json.dumps(ref, indent=2))


def faults(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The realistic faults, as the config a server would read instead of the good one. The
    founding incident's stale file (tests/data/stale-drafter-config.json: another model's mask
    token, taps spread over 64 layers, bos) mapped to this model, each field alone; one tap off by
    one; the taps in another order (lint refuses it; vLLM serves them in layer order anyway);
    every layer sliding (causal, a 64-token window). ``other-target`` (weights, not a config) is
    ``other_target``'s."""
    taps = list(config["dflash_config"]["target_layer_ids"])
    n = config["num_target_layers"]
    stale_taps = [
        min(round(i * n / 64), n - 2) for i in (1, 17, 33, 49, 63)
    ]  # its 64-layer spread; n - 2: vLLM taps no output after the last layer
    shifted = list(taps)
    shifted[len(taps) // 2] += 1

    def with_dflash(**kw: Any) -> dict[str, Any]:
        return config | {"dflash_config": config["dflash_config"] | kw}

    return {
        "stale-mask": with_dflash(mask_token_id=0),  # <|endoftext|>: a real token, the wrong one
        "stale-layers": with_dflash(target_layer_ids=stale_taps),
        "stale-bos": config | {"bos_token_id": 0},
        "layer-shift": with_dflash(target_layer_ids=shifted),
        "unsorted-taps": with_dflash(target_layer_ids=list(reversed(taps))),
        "sliding": config
        | {
            "layer_types": ["sliding_attention"] * config["num_hidden_layers"],
            "sliding_window": 64,
            "use_sliding_window": True,
        },
    }


def other_target(good: Path, out: Path) -> None:
    """A drafter trained for another target, as a server meets it: the good config beside weights
    whose ``fc`` reads each tapped layer's features in another layer's slot (its column blocks in
    reverse order: what the same recipe gives on a target whose layers at those depths carry what
    this target's carry elsewhere). A weights fault: a new acceptance history, so only the
    absolute thresholds can refuse it."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(good / "config.json", out / "config.json")
    weights = load_file(str(good / "model.safetensors"))
    fc = weights["fc.weight"]
    hidden = fc.shape[0]
    blocks = list(fc.split(hidden, dim=1))
    weights["fc.weight"] = torch.cat(blocks[::-1], dim=1).contiguous()
    save_file(weights, str(out / "model.safetensors"))


def faults_cmd(args: argparse.Namespace) -> None:
    """Each fault's config beside a link to the good weights; with --reference, its offline tau."""
    good = Path(args.drafter)
    config = json.loads((good / "config.json").read_text())
    out = Path(args.out)
    results: dict[str, Any] = {}
    target = tok = None
    if args.reference:
        target, tok = load_target(Path(args.target), args.device)
    for name, bad in faults(config).items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(bad, indent=2) + "\n")
        link = d / "model.safetensors"
        if not link.exists():
            link.symlink_to((good / "model.safetensors").resolve())
    other_target(good, out / "other-target")
    if args.reference:
        cases = {
            "good": (good, config, BLOCK - 1),
            **{n: (good, c, BLOCK - 1) for n, c in faults(config).items()},
            "other-target": (out / "other-target", config, BLOCK - 1),
            "k-larger": (good, config, 2 * BLOCK - 1),
        }
        for name, (weights, cfg, k) in cases.items():
            drafter = dm.load(weights, cfg).to(args.device)
            if args.device == "cuda":
                drafter = drafter.to(torch.bfloat16)
            results[name] = reference(target, tok, drafter, pm.held_out(), k, args.max_tokens)
            log(f"{name}: reference tau {results[name]['all']['tau']} (K={k})")
        (out / "faults-reference.json").write_text(json.dumps(results, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("train")
    t.add_argument("target")
    t.add_argument("out")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", type=int, default=1)
    t.add_argument("--steps", type=int, default=4000)
    t.add_argument("--minutes", type=float, default=4.5)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--anchors", type=int, default=16)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--prompts", type=int, default=0, help="use only the first N training prompts (0: all)")
    t.add_argument("--math-prompts", type=int, default=1200)
    t.add_argument("--new-tokens", type=int, default=192)
    t.add_argument("--gen-batch", type=int, default=512)
    t.add_argument("--max-tokens", type=int, default=128, help="the reference loop's tokens per held-out prompt")
    t.add_argument("--log-every", type=int, default=50)
    r = sub.add_parser("reference")
    r.add_argument("target")
    r.add_argument("drafter")
    r.add_argument("--config")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--k", type=int, default=BLOCK - 1)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--per-kind", type=int, default=4)
    f = sub.add_parser("faults")
    f.add_argument("drafter")
    f.add_argument("out")
    f.add_argument("--reference", metavar="TARGET", dest="target")
    f.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    f.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.verb == "faults":
        args.reference = args.target is not None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    {"train": train, "reference": reference_cmd, "faults": faults_cmd}[args.verb](args)


if __name__ == "__main__":
    main()
