"""A fleet's history as the state store gives it (``StateDB.history``, ``samples``,
``transitions``), made up at any size for the report's tests and benchmark: each host a deploy,
a few watch samples, and a state that a few hosts lost (DOWN, DEGRADED, DRIFT, out of rotation)."""

from __future__ import annotations

from typing import Any

STATES = ("DOWN", "DEGRADED", "DRIFT", "OUT_OF_ROTATION")


def fleet_history(
    n: int, now: float, samples: int = 6
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, samples, transitions) of ``n`` hosts: host i is in STATES[i % 53] when i % 53 < 4
    (about 8 % of the fleet unwell), READY otherwise; host 5 was never watched."""
    names = [f"gpu-{i // 8:03d}/serve-{i % 8}" for i in range(n)]
    start = now - 6 * 3600
    runs = [
        {
            "id": 1, "kind": "deploy", "playbook": "qwen3-8b-dflash.yaml", "release_id": "r1", "started": start,
            "finished": start + 40, "ok": True, "hosts_total": n, "hosts_ready": n,
            "by": {"user": "alice", "host": "ci-7", "pid": 4242},
            "hosts": [
                {"name": name, "ready": True, "release_id": "r1", "changed": True, "duration_s": 38.0,
                 "gates": {"files": {"ok": True, "detail": "2 files"}, "acceptance": {"ok": True, "detail": "tau 6.5"}}}
                for name in names
            ],
        }
    ]  # fmt: skip
    sample_rows, transitions = [], []
    for i, name in enumerate(names):
        if i == 5:
            continue  # never watched
        bad = STATES[i % 53] if i % 53 < len(STATES) else None
        for k in range(samples):
            tau = 1.05 if bad == "DEGRADED" and k >= samples // 2 else 6.5 - 0.1 * (k % 3)
            sample_rows.append({"at": start + 60 + k * 3000, "host": name, "source": "watch", "release_id": "r1",
                                "mean_acceptance_length": tau, "mean_acceptance_length_low": tau - 0.3,
                                "acceptance_rate": (tau - 1) / 7, "drafts": 400})  # fmt: skip
        transitions.append({"host": name, "at": start + 50, "from": None, "to": "READY", "reasons": []})
        if bad:
            transitions.append({"host": name, "at": now - 3600 + i, "from": "READY", "to": bad, "reasons": [bad]})
    return runs, sample_rows, transitions
