"""The acceptance gate proves live traffic accepts the drafter's tokens, as well as it did.

`/metrics` scraped before and after a probe (greedy, fixed budget, code/math/chat prompts) through
the agent; counter deltas summed over engines: tau (mean acceptance length), rate, per-position
rates, drafts, and tau per prompt (the agent reads the spec-decode counters after each prompt) with
a 95% lower bound over the prompts (each prompt one sample, Student's t: acceptance within a request
is not independent token by token, and a per-token Wilson bound missed the real pair's tau 4 times
in 10; docs/real-pair.md); no spec-decode counters or a counter going down fail. The thresholds
judge tau itself (`gates.acceptance.min_mean_acceptance_length`, 1.5 unless set: docs/real-pair.md
says why) and the bound says how far other prompts may fall. Then held to its history (the drafter's
digest read from the release's links in verify, from its directory in deploy: one history): the
READY record keeps tau, rate, per-position rates, K, the prompts' digest and the history (the target
and the drafter's weights); a release of the same history, K and prompts whose tau falls more than
`gates.acceptance.max_regression` (0.1) below the last READY release's is refused with both numbers
(`acceptance_regressed`); other weights, K or prompts start a new history, said in the gate's
`regression`. A server kept in rotation (nothing changed, or `verify --probe` behind a gateway)
serves users while it is probed, and their drafts are in the counters too: where the server
generated more tokens than the probe's own completions (`vllm:generation_tokens` against their
usage), the gate says how many (`other_traffic_tokens`), the thresholds judge all of that traffic,
and the history, which compares the probe's prompts alone, is not compared (a redeploy that changed
nothing, real vLLM behind HAProxy under load, was refused as a 29% regression: tau 5.67 of all its
traffic against the prompts' 8.00). `verify --probe` holds the probe to the READY record the same
way. A warm pass follows the cold one: half the prompts again, their prefixes now in vLLM's prefix
cache (where DFlash has lost acceptance: vLLM issue 47930, fix PR 54163); its tau, rate, drafts and
`vllm:prefix_cache_hits` are in the gate's `warm`, and a fall beyond `max_regression` below the cold
tau of those same prompts (the agent scrapes once more inside the cold pass, after them: a real
drafter's tau differs by prompt, so the whole cold pass is no yardstick) is a warning (the gate's
failure with `gates.acceptance.prefix_cache: strict`; `off` sends no warm pass); with no cache hits
nothing is compared, said.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    GATE_ACCEPTANCE,
    Gate,
    HostReport,
)
from orchestrator.rules import probe

DEFAULT_PROBE_PROMPTS = (
    # a mix of the kinds of traffic acceptance depends on: code, math, chat
    "def sort the list of numbers and return the sum",
    "what is seven plus five times three",
    "hello please write me a story about a cat and the moon",
)

# Reasons beside the probe's own (rules/probe.py): a fall from the last READY record's tau on the
# same history, and the warm pass (prefixes cached) accepting less than the cold one.
REGRESSED = "acceptance_regressed"
PREFIX_CACHE = "prefix_cache_acceptance"


def probe_timeout(playbook: Playbook) -> float:
    """How long the acceptance probe may take: a minute, plus a second per token it asks for."""
    gate = playbook.gates.acceptance
    return 60.0 + gate.max_tokens * (len(probe_prompts(playbook)) + warm_prompts(playbook))


def probe_prompts(playbook: Playbook) -> tuple[str, ...]:
    """The probe's prompts: the playbook's, or the built-in mix."""
    return playbook.gates.acceptance.prompts or DEFAULT_PROBE_PROMPTS


def warm_prompts(playbook: Playbook) -> int:
    """How many prompts the probe sends again, their prefixes cached: half (rounded up), or none."""
    gate = playbook.gates.acceptance
    return 0 if gate.prefix_cache == "off" else -(-len(probe_prompts(playbook)) // 2)


def probe_op(
    playbook: Playbook, host: str = protocol.LOOPBACK, server: tuple[str, str] | None = None
) -> protocol.Op[protocol.Scrapes]:
    """The acceptance probe: greedy completions of the playbook's prompts (or the built-in mix).
    ``server`` (root, name): sent where that server's record says it listens (a host with a
    standby serves on either of two ports)."""
    s, gate = playbook.serving, playbook.gates.acceptance
    prompts = probe_prompts(playbook)
    timeout = probe_timeout(playbook)
    warm = warm_prompts(playbook)
    return protocol.probe(s.port, s.model_name, prompts, gate.max_tokens, timeout, host=host, warm=warm, server=server)


def read_probe(
    playbook: Playbook, scrapes: protocol.Scrapes, report: HostReport, last_ready: dict[str, Any] | None = None
) -> None:
    """The acceptance gate from the probe's two scrapes, held to the absolute thresholds and to
    ``last_ready`` (the READY record the host held before this run): the same target and drafter
    weights, prompts and K may not have fallen more than ``max_regression`` below its tau."""
    gate = playbook.gates.acceptance
    try:
        # the cold pass is what the thresholds and the history judge
        a = probe.measure(scrapes.before, scrapes.middle or scrapes.after, scrapes.each)
    except probe.ProbeError as exc:
        report.gates[GATE_ACCEPTANCE] = Gate(False, str(exc), reason=exc.reason)
        return
    ok, detail, reason = probe.judge(a, gate.min_mean_acceptance_length, gate.min_acceptance_rate, gate.min_drafts)
    tau = round(a.mean_acceptance_length, 3)
    data: dict[str, Any] = {
        "mean_acceptance_length": tau,
        "mean_acceptance_length_low": round(a.mean_acceptance_length_low, 3),
        "bound": a.bound_over,
        "acceptance_rate": round(a.rate, 4),
        "drafts": a.drafts,
        "per_position": [round(p, 3) for p in a.per_position],
        "per_prompt": [round(t, 3) for t in a.per_prompt],
        "seconds": scrapes.seconds,
        # what makes two probes comparable: the same K, prompts and budget, target and weights
        "num_speculative_tokens": playbook.serving.num_speculative_tokens,
        "prompts_sha256": prompts_digest(playbook),
        "history": history_key(playbook, report),
    }
    others = probe.other_traffic(scrapes.before, scrapes.middle or scrapes.after, scrapes.own_tokens)
    if others:
        # A server kept in rotation: its counters hold the users' requests too, so this tau is of
        # all its traffic. The thresholds judge that (live traffic must be accepted); the probe
        # history compares like with like, the probe's prompts alone, so it is not compared.
        data["other_traffic_tokens"] = others
        detail += f" (with {others} tokens of other traffic served during the probe: the tau is of all of it)"
    if ok and others:
        data["regression"] = (
            f"not compared with the last READY release: {others} tokens of other traffic were served during the "
            "probe, so its tau is not the probe prompts' alone"
        )
    elif ok:
        ok, said = regression(gate.max_regression, data, last_ready)
        data["regression"] = said
        if not ok:
            detail, reason = said, REGRESSED
    if scrapes.middle is not None:
        cold = cold_of_repeated(scrapes, a)
        data["warm"], finding = warm_pass(gate.max_regression, cold, scrapes.middle, scrapes.after)
        if finding is not None and ok and gate.prefix_cache == "strict":
            ok, detail, reason = False, finding, PREFIX_CACHE
        elif finding is not None:
            data["warnings"] = [*data.get("warnings", []), finding]
    report.gates[GATE_ACCEPTANCE] = Gate(ok, detail, data, reason)


def cold_of_repeated(scrapes: protocol.Scrapes, cold: probe.Acceptance) -> probe.Acceptance:
    """Like with like: the cold pass's acceptance over the prompts the warm pass sends again (the
    scrape inside the cold pass, after them); the whole cold pass where there is none to read."""
    if scrapes.first is None:
        return cold
    try:
        return probe.measure(scrapes.before, scrapes.first)
    except probe.ProbeError:
        return cold


PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def warm_pass(
    max_regression: float, cold: probe.Acceptance, middle: str, after: str
) -> tuple[dict[str, Any], str | None]:
    """The warm pass against the cold one: prompts sent again find their prefixes in vLLM's prefix
    cache, where DFlash has lost acceptance (vLLM issue 47930, fix PR 54163) while a cold probe saw
    nothing. Its numbers, and a finding when its tau falls more than ``max_regression`` below."""
    try:
        hits = (probe.total(after, PREFIX_HITS) or 0.0) - (probe.total(middle, PREFIX_HITS) or 0.0)
        queries = (probe.total(after, PREFIX_QUERIES) or 0.0) - (probe.total(middle, PREFIX_QUERIES) or 0.0)
        warm = probe.measure(middle, after)
    except probe.ProbeError as exc:
        return {"error": str(exc)}, f"the warm pass cannot be judged: {exc}"
    data: dict[str, Any] = {
        "mean_acceptance_length": round(warm.mean_acceptance_length, 3),
        "acceptance_rate": round(warm.rate, 4),
        "drafts": warm.drafts,
        "prefix_cache_hits": int(hits),
        "prefix_cache_queries": int(queries),
    }
    if hits <= 0:
        data["compared"] = "no: the warm pass found nothing in the prefix cache (caching off, or prompts under a block)"
        return data, None
    data["compared"] = "yes"
    cold_tau, warm_tau = cold.mean_acceptance_length, warm.mean_acceptance_length
    data["cold_mean_acceptance_length"] = round(cold_tau, 3)  # the same prompts, their prefixes cold
    if warm_tau < cold_tau * (1 - max_regression):
        return data, (
            f"with its prefix cached, tau falls to {warm_tau:.2f} from the cold pass's {cold_tau:.2f} "
            f"({int(hits)} of {int(queries)} prompt tokens from the cache): production traffic that shares "
            "prefixes accepts less than the probe says (vLLM issue 47930)"
        )
    return data, None


def prompts_digest(playbook: Playbook) -> str:
    """The probe's prompts and token budget, as one digest: only probes of the same set compare."""
    gate = playbook.gates.acceptance
    body = {"prompts": list(probe_prompts(playbook)), "max_tokens": gate.max_tokens}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# Files that hold weights (what a drafter is), as against its config and the release's other files.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def history_key(playbook: Playbook, report: HostReport) -> str:
    """The acceptance history a probe belongs to: the target and the drafter's weights (the models'
    digests, and weight files the release pushes). A drafter config, a flag or a vLLM
    upgrade stays in the history, and is what the regression check is for."""
    body = {
        "target": playbook.serving.target,
        # a model is its digest where it has one: the same weights at another path (a copy, a fault
        # drafter beside them) are the same history; the path only where nothing was hashed
        "models": sorted((m.get("name"), m.get("sha256") or m.get("path")) for m in report.models),
        "weights": sorted((f.dest, f.sha256) for f in report.files if f.dest.endswith(WEIGHT_SUFFIXES)),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def regression(max_regression: float, now: dict[str, Any], last_ready: dict[str, Any] | None) -> tuple[bool, str]:
    """``now`` (the acceptance gate's data) against the last READY record's: the same history,
    K and prompts, and tau not more than ``max_regression`` below; else why nothing was compared."""
    gates = (last_ready or {}).get("gates")
    before = gates.get(GATE_ACCEPTANCE) if isinstance(gates, dict) else None
    release = (last_ready or {}).get("release_id")
    then_tau = before.get("mean_acceptance_length") if isinstance(before, dict) else None
    if not (isinstance(then_tau, (int, float)) and not isinstance(then_tau, bool) and 1 <= then_tau < math.inf):
        return True, "no earlier READY record with a probe: this starts the acceptance history"
    assert isinstance(before, dict)
    if before.get("history") != now["history"]:
        return True, f"a new acceptance history: the target or the drafter's weights differ from release {release}'s"
    if before.get("num_speculative_tokens") != now["num_speculative_tokens"]:
        return True, (
            f"a new acceptance history: K is {now['num_speculative_tokens']}, release {release} was probed with "
            f"{before.get('num_speculative_tokens')}"
        )
    if before.get("prompts_sha256") != now["prompts_sha256"]:
        return True, f"a new acceptance history: the probe's prompts differ from release {release}'s"
    then, tau = float(before["mean_acceptance_length"]), float(now["mean_acceptance_length"])
    floor = then * (1 - max_regression)
    if tau < floor:
        return False, (
            f"tau {tau:.2f} fell {1 - tau / then:.0%} below the {then:.2f} of the last READY release {release} "
            f"(the same target and drafter weights, prompts and K; at most {max_regression:.0%}: "
            "gates.acceptance.max_regression)"
        )
    return True, f"tau {tau:.2f} against {then:.2f} of the last READY release {release} (floor {floor:.2f})"
