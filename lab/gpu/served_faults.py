"""Each fault of the real pair served by real vLLM, one engine after another in one process: the
tau vLLM's own counters give for the trained drafter and for every fault config
(``lab/train_drafter.py faults``), the held-out prompts one at a time (the counters read after
each: tau per prompt and the gate's bound over prompts) and all at once (batch 12).

    PYTHONPATH=. python3 lab/gpu/served_faults.py MODELS OUT.json [--device cuda|cpu]

MODELS holds ``target/``, ``drafter/`` and the fault drafters. Each engine is vLLM's offline
``LLM`` with the serving flags the playbook gives the server, eager (the faults' taus do not depend
on CUDA graphs, and eager starts in seconds, not minutes: eight engines fit one device call); the
counters are the process's own Prometheus registry, read as /metrics text and measured by the
gate's own arithmetic (``orchestrator.rules.probe``). What the gate says of each is judged from
this record by ``tests/unit/test_real_pair.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lab import prompts as pm  # noqa: E402
from orchestrator.rules import probe  # noqa: E402

K, MAX_TOKENS = 7, 128
# The good config first (the history every fault is held to), then each fault, then K beyond the
# block the drafter was trained with (lint refuses it before any host is touched; served here to
# measure what it would cost).
CASES = (
    "good", "stale-mask", "stale-layers", "stale-bos", "layer-shift", "unsorted-taps", "other-target", "sliding",
    "k-larger",
)  # fmt: skip


def metrics_text() -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def serve(models: Path, case: str, device: str) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams

    drafter = models / ("drafter" if case in ("good", "k-larger") else case)
    k = 2 * K + 1 if case == "k-larger" else K
    kw: dict[str, Any] = {"gpu_memory_utilization": 0.2} if device == "cuda" else {}
    started = time.monotonic()
    llm = LLM(
        model=str(models / "target"),
        speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": k},
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=16,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    record: dict[str, Any] = {"k": k, "start_seconds": round(time.monotonic() - started, 1)}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [pm.chat(p["text"]) for p in pm.held_out()]
    for attempt in range(2):
        before, each = metrics_text(), []
        t0 = time.monotonic()
        for prompt in prompts:
            llm.generate([prompt], params, use_tqdm=False)
            each.append(metrics_text())
        a = probe.measure(before, each[-1], each)
        record[f"one_at_a_time_{attempt}"] = _numbers(a, time.monotonic() - t0)
        before, t0 = metrics_text(), time.monotonic()
        llm.generate(prompts, params, use_tqdm=False)
        record[f"all_at_once_{attempt}"] = _numbers(probe.measure(before, metrics_text()), time.monotonic() - t0)
        if case != "good":
            break  # the good pair twice: the repeat is the spread of one build
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return record


def _numbers(a: probe.Acceptance, seconds: float) -> dict[str, Any]:
    return {
        "tau": round(a.mean_acceptance_length, 4),
        "low": round(a.mean_acceptance_length_low, 4),
        "bound": a.bound_over,
        "drafts": a.drafts,
        "draft_tokens": a.draft_tokens,
        "accepted": a.accepted,
        "per_prompt": [round(t, 3) for t in a.per_prompt],
        "seconds": round(seconds, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", action="append", choices=CASES)
    args = parser.parse_args()
    import torch
    import vllm

    record: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__, "device": args.device}
    if args.device == "cuda":
        record["gpu"] = torch.cuda.get_device_name(0)
    record["cases"] = {}
    for case in args.only or CASES:
        print(f"served_faults: {case}", flush=True)
        try:
            record["cases"][case] = serve(args.models, case, args.device)
        except Exception as exc:  # a config vLLM refuses is a finding: its error is the record
            traceback.print_exc()
            record["cases"][case] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(f"served_faults: {case}: {json.dumps(record['cases'][case])[:400]}", flush=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
