"""The speed-up gate's arithmetic: tokens per second per arm and concurrency, the ratio with its
bound from the repeats, the verdict per concurrency, and low acceptance told apart from a drafter
that is accepted but does not pay at the load."""

from __future__ import annotations

import pytest

from orchestrator.rules import speedup as su


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
    once = su.level(arm(8, 100), arm(8, 120))
    assert once.low == once.speedup == pytest.approx(1.2)  # one run an arm: no bound, said


def test_a_level_below_min_fails_with_both_numbers_and_the_accepted_drafter_is_told_apart() -> None:
    """Published: 2.7x at one request, 1.0x at eight on one box. Acceptance fine there: speculation
    does not pay at that load, a finding about the load, not the drafter's config."""
    levels = [su.level(arm(1, 100, 100), arm(1, 270, 270)), su.level(arm(8, 600, 600), arm(8, 600, 600))]
    v = su.judge(levels, 1.1, tau=6.3, min_tau=3.0, k=15)
    assert not v.ok and v.reason == su.NO_SPEEDUP
    assert "speed-up below 1.1 at concurrency 8 with acceptance fine (tau 6.30 of K = 15 drafted)" in v.detail
    assert "at 1: 2.70x (270 against 100 tokens/s, 95% >= 2.70, n = 2+2)" in v.detail
    assert "at 8: 1.00x (600 against 600 tokens/s" in v.detail
    low = su.judge(levels, 1.1, tau=1.03, min_tau=1.5, k=7)
    assert not low.ok and low.reason == su.LOW_ACCEPTANCE and "acceptance is low (tau 1.03 < 1.5)" in low.detail
    assert su.judge(levels[:1], 1.1).ok
    assert su.judge([], 1.1).reason == su.UNMEASURED


def test_an_unsteady_level_is_said() -> None:
    v = su.judge([su.level(arm(4, 100, 140, 60), arm(4, 300, 310, 290))], 1.1)
    assert v.ok and "at 4 the repeats spread 40% (over 5%): the bound is widened by it" in v.detail


def test_percentiles_of_time_to_first_token_and_decode_speed() -> None:
    reqs = tuple(su.Request(11, 1.0 + i, first_token_s=0.1 * (i + 1)) for i in range(10))
    a = su.Arm(1, (su.Run(1, 10.0, reqs),))
    assert a.percentile(0.5) == pytest.approx(0.5) and a.percentile(0.99) == pytest.approx(1.0)
    assert a.percentile(0.5, "decode") is not None
    assert su.Arm(1, (su.Run(1, 1.0, (su.Request(5, 1.0),)),)).percentile(0.5) is None
