"""The shipped alerting rules in a real Prometheus (Debian's package, tests/prometheus.py) scraping a
real ``orchestrate watch``: a host made DEGRADED (the founding incident: a stale drafter config and
a restart behind our back, then live traffic) fires DflashHostDegraded, read from Prometheus' own
API, and it resolves once the host is fixed; the Grafana dashboard's queries run there."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.prometheus import running_prometheus
from tests.unit.localbox import GOOD_MASK, Box, deploy, free_port
from tests.unit.test_watch import complete, restart_by_hand
from tests.unit.test_watchers import Watch

OPS = Path(__file__).resolve().parents[2] / "ops"
DEADLINE_S = 90


def test_a_degraded_host_fires_the_alert_and_it_resolves_when_fixed(box: Box, tmp_path: Path) -> None:
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    port = free_port()
    watcher = Watch(box, playbook.file, {"ORCHESTRATE_STATE_DIR": str(tmp_path / "state")}, port, tmp_path / "c")
    rules = OPS / "prometheus" / "dflash-orchestrator-rules.yml"
    try:
        watcher.wait_for(r"watch group pb@[0-9a-f]{8}: leading")
        with running_prometheus(tmp_path / "prometheus", [f"127.0.0.1:{port}"], [rules]) as prom:
            deadline = time.monotonic() + DEADLINE_S
            while not prom.query('dflash_orchestrator_watch_leader{group=~"pb@[0-9a-f]{8}"} == 1'):
                assert time.monotonic() < deadline, "Prometheus never scraped the watcher"
                time.sleep(0.2)
            # before the first scrape nobody led: pending, and gone at the next evaluation
            while prom.alerts("DflashNoWatcherLeading"):
                assert time.monotonic() < deadline, prom.alerts("DflashNoWatcherLeading")
                time.sleep(0.2)
            assert prom.alerts("DflashHostDegraded") == []
            served = box.root("solo") / "current" / "drafter" / "config.json"
            good = served.read_text()
            served.write_text(good.replace(f'"mask_token_id": {GOOD_MASK}', '"mask_token_id": 9'))
            restart_by_hand(box)
            firing: list[dict[str, object]] = []
            while not firing:
                assert time.monotonic() < deadline, watcher.seen[-10:]
                complete(box)
                firing = [a for a in prom.alerts("DflashHostDegraded") if a["state"] == "firing"]
            (alert,) = firing
            assert alert["labels"] == {"alertname": "DflashHostDegraded", "host": "solo", "severity": "page"}
            assert float(alert["value"]) >= 3  # rounds, as the rule counts them
            assert "solo is DEGRADED" in alert["annotations"]["summary"]  # type: ignore[index]
            assert [a["labels"]["host"] for a in prom.alerts("DflashLiveAcceptanceBelowGate")] == ["solo"]
            # every query of the dashboard runs in Prometheus, and the host's panels have data
            dashboard = json.loads((OPS / "grafana" / "dflash-orchestrator-watch.json").read_text())
            for panel in dashboard["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"].replace('{host=~"$host"}', "").replace('host=~"$host"', "")
                    result = prom.query(expr)  # a query Prometheus cannot parse fails here
                    if "in_rotation" not in expr:  # served only where the playbook has a gateway
                        assert result, (panel["title"], expr)
            # fixed: the right config back, restarted, traffic accepted again
            served.write_text(good)
            restart_by_hand(box)
            while prom.alerts("DflashHostDegraded") or prom.alerts("DflashLiveAcceptanceBelowGate"):
                assert time.monotonic() < deadline + DEADLINE_S, watcher.seen[-10:]
                complete(box)
            assert prom.query('dflash_orchestrator_host_state{dflash_orchestrator_host_state="READY"} == 1')
    finally:
        watcher.end()
