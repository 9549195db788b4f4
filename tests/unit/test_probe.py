"""Acceptance arithmetic on vLLM's Prometheus text: deltas, engines summed, restarts and absence."""

from __future__ import annotations

import pytest

from orchestrator import probe


def metrics(drafts: float, tokens: float, accepted: float, per_pos: list[float], engines: int = 1) -> str:
    lines = []
    for name, value in (("drafts", drafts), ("draft_tokens", tokens), ("accepted_tokens", accepted)):
        lines.append(f"# TYPE vllm:spec_decode_num_{name} counter")
        for e in range(engines):
            lines.append(f'vllm:spec_decode_num_{name}_total{{engine="{e}",model_name="m"}} {value}')
            lines.append(f'vllm:spec_decode_num_{name}_created{{engine="{e}",model_name="m"}} 1.7e9')
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
    for e in range(engines):
        for p, v in enumerate(per_pos):
            lines.append(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="m",position="{p}"}} {v}'
            )
    return "\n".join(lines) + "\n"


def test_deltas_summed_over_engines() -> None:
    before = metrics(10, 70, 20, [8, 7, 5, 0, 0, 0, 0], engines=2)
    after = metrics(110, 770, 370, [98, 87, 75, 50, 30, 20, 10], engines=2)
    a = probe.measure(before, after)
    assert (a.drafts, a.draft_tokens, a.accepted) == (200, 1400, 700)
    assert a.rate == pytest.approx(0.5)
    assert a.mean_acceptance_length == pytest.approx(1 + 700 / 200)
    assert a.per_position[0] == pytest.approx(180 / 200)
    assert a.mean_acceptance_length_low < a.mean_acceptance_length


def test_no_spec_decode_series_means_not_running() -> None:
    with pytest.raises(probe.ProbeError, match="speculative decoding is not running"):
        probe.measure(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n", metrics(1, 7, 7, [1] * 7)
        )


def test_a_counter_going_down_is_a_restart() -> None:
    with pytest.raises(probe.ProbeError, match="restarted"):
        probe.measure(metrics(100, 700, 300, [50] * 7), metrics(5, 35, 10, [2] * 7))


def test_judge() -> None:
    good = probe.measure(metrics(0, 0, 0, [0] * 7), metrics(50, 350, 350, [50] * 7))
    assert good.mean_acceptance_length == pytest.approx(8.0)
    assert probe.judge(good, 4.0, None, 20)[0]
    assert not probe.judge(good, 4.0, None, 60)[0]  # too few drafts
    bad = probe.measure(metrics(0, 0, 0, [0] * 7), metrics(300, 2100, 0, [0] * 7))
    ok, detail = probe.judge(bad, 4.0, None, 20)
    assert not ok and detail.startswith("mean acceptance length 1.00 < 4.0")
    assert not probe.judge(good, 1.0, 1.01, 1)[0]  # rate gate
