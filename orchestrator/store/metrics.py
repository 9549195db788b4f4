"""``watch --metrics-port``: what the last round saw of each host, for Prometheus.

Series are built from the last round at scrape time (a custom collector), so "seconds since the
last good round" is true when it is read, not when the round ended. Names follow Prometheus'
conventions: the ``dflash_orchestrator_`` prefix, base units in the name, ``_ratio`` for a
fraction; the state is a state set, the release an info metric.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric, StateSetMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from orchestrator.results import GATE_READY
from orchestrator.rules.watch import STATES, Round

PREFIX = "dflash_orchestrator_"


class WatchCollector(Collector):
    """watch's Prometheus collector: the last round of every host, as gauges of its state and live
    acceptance."""

    def __init__(self, group: str = "") -> None:
        self._rounds: list[Round] = []
        self._lock = threading.Lock()
        self.group = group
        self._leader: bool | None = None

    def update(self, rounds: list[Round], leader: bool | None = None) -> None:
        """The last round, and whether this watcher leads its group (None: not said)."""
        with self._lock:
            self._rounds = list(rounds)
            self._leader = leader

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            rounds, leader = list(self._rounds), self._leader
        now = time.time()
        state = StateSetMetricFamily(
            f"{PREFIX}host_state", "The host's state in the last watch round.", labels=["host"]
        )
        tau = GaugeMetricFamily(
            f"{PREFIX}mean_acceptance_length_tokens",
            "Mean acceptance length (tokens per draft, the bonus token included) over the last judged window.",
            labels=["host"],
        )
        rate = GaugeMetricFamily(
            f"{PREFIX}acceptance_rate_ratio",
            "Accepted draft tokens over proposed draft tokens in the last judged window.",
            labels=["host"],
        )
        drafts = GaugeMetricFamily(
            f"{PREFIX}window_drafts", "Drafts in the last judged window of production traffic.", labels=["host"]
        )
        open_drafts = GaugeMetricFamily(
            f"{PREFIX}open_window_drafts", "Drafts so far in the window not yet judged.", labels=["host"]
        )
        drift = GaugeMetricFamily(
            f"{PREFIX}files_in_drift", "Files the server reads that differ from the release.", labels=["host"]
        )
        age = GaugeMetricFamily(
            f"{PREFIX}last_good_round_age_seconds",
            "Seconds since a watch round last found the host READY (absent: never).",
            labels=["host"],
        )
        stamp = GaugeMetricFamily(
            f"{PREFIX}last_round_timestamp_seconds", "When the last watch round read the host.", labels=["host"]
        )
        release = InfoMetricFamily(f"{PREFIX}release", "The release current on the host.", labels=["host"])
        rotation = GaugeMetricFamily(
            f"{PREFIX}in_rotation",
            "1 when the playbook's gateway sends the host users' requests, 0 when not (absent: no gateway).",
            labels=["host"],
        )
        state_rounds = GaugeMetricFamily(
            f"{PREFIX}state_rounds",
            "Watch rounds the host has been in its current state, the last one included.",
            labels=["host"],
        )
        live_min = GaugeMetricFamily(
            f"{PREFIX}live_min_mean_acceptance_length_tokens",
            "The live gate: the mean acceptance length a judged window must reach.",
            labels=["host"],
        )
        speedup = GaugeMetricFamily(
            f"{PREFIX}speedup_ratio",
            "The speed-up gate's drafter arm over its baseline (output tokens per second) at this concurrency, "
            "as the host's READY record keeps it (absent: no speed-up measured).",
            labels=["host", "concurrency"],
        )
        leading = GaugeMetricFamily(
            f"{PREFIX}watch_leader",
            "1 when this watcher leads its watch group (records transitions, runs --on-change), 0 when it follows.",
            labels=["group"],
        )
        if leader is not None:
            leading.add_metric([self.group], float(leader))
        for r in rounds:
            state_rounds.add_metric([r.host], r.state_rounds)
            if r.live_min is not None:
                live_min.add_metric([r.host], r.live_min)
            state.add_metric([r.host], {s: s == r.state for s in STATES})
            if r.live is not None:
                tau.add_metric([r.host], r.live.mean_acceptance_length)
                rate.add_metric([r.host], r.live.rate)
                drafts.add_metric([r.host], r.live.drafts)
            if r.window_drafts is not None:
                open_drafts.add_metric([r.host], r.window_drafts)
            drift.add_metric([r.host], r.files_in_drift)
            if r.last_good is not None:
                age.add_metric([r.host], max(0.0, now - r.last_good))
            stamp.add_metric([r.host], r.at)
            release.add_metric([r.host], {"release_id": r.release_id or ""})
            if r.in_rotation is not None:
                rotation.add_metric([r.host], float(r.in_rotation))
            for lv in r.gates.get(GATE_READY, {}).get("speedup", []):
                speedup.add_metric([r.host, str(lv["concurrency"])], float(lv["speedup"]))
        yield from (state, tau, rate, drafts, open_drafts, drift, age, stamp, release, rotation, state_rounds, live_min)
        yield speedup
        if leader is not None:
            yield leading


def serve(collector: WatchCollector, port: int, address: str) -> Any:
    """Serve /metrics on ``address:port`` from a thread; returns the server (``shutdown()``)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
