"""``orchestrate report --html``: the page opened in headless Chromium (Debian's package), from a
state database filled by real runs (a deploy, a verify with its probe, watch rounds through the
founding incident) on this machine's ``connection: local`` containers with the stand-in server."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main as cli
from orchestrator.deployment import Deployment
from orchestrator.store import report as fleetreport
from orchestrator.store.state import StateDB
from tests.unit.localbox import OPTIONS, Box, make_box
from tests.unit.test_watch import complete, restart_by_hand

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Box]:
    yield from make_box(tmp_path, monkeypatch)


Chromium = Callable[..., subprocess.CompletedProcess[bytes]]


@pytest.fixture
def chromium() -> Chromium:
    """Runs Debian's Chromium, headless, with the flags that keep it off the network (this machine's
    is closed)."""
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is not installed: run scripts/bootstrap")
    return run_chromium


def run_chromium(*args: str) -> subprocess.CompletedProcess[bytes]:
    with tempfile.TemporaryDirectory() as profile:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
        flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
        return subprocess.run(
            [str(CHROMIUM), *flags, f"--user-data-dir={profile}", *args], capture_output=True, timeout=120
        )


class Elements(HTMLParser):
    """Every element of a page with its attributes, as the browser's DOM serialised them."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {k: v or "" for k, v in attrs}))

    def having(self, tag: str, cls: str) -> list[dict[str, str]]:
        return [a for t, a in self.found if t == tag and cls in a.get("class", "").split()]


def test_the_report_renders_each_hosts_tau_over_time_with_its_bad_periods_shaded(
    box: Box, tmp_path: Path, chromium: Chromium
) -> None:
    state = tmp_path / "state"
    playbook = box.playbook()
    common = ["-i", str(box.inventory_path), "--state-dir", str(state)]
    assert cli.main(["deploy", str(playbook.file), *common]) == 0
    assert cli.main(["verify", str(playbook.file), *common, "--probe"]) == 0
    inv = box.inventory
    w = Deployment(playbook, inv, OPTIONS).watcher()
    db = StateDB(state)
    try:
        db.record_watch(*reversed(w.round()))  # READY
        complete(box)
        db.record_watch(*reversed(w.round()))  # READY, a window judged: tau 8
        served = box.root("solo") / "current" / "drafter" / "config.json"
        served.write_text(served.read_text().replace('"mask_token_id": 5', '"mask_token_id": 9'))
        restart_by_hand(box)
        db.record_watch(*reversed(w.round()))  # DRIFT
        complete(box)
        db.record_watch(*reversed(w.round()))  # DEGRADED: tau 1
    finally:
        w.close()
        db.close()
    page = tmp_path / "report.html"
    assert cli.main(["report", "--html", str(page), "--state-dir", str(state)]) == 0

    dumped = chromium("--dump-dom", page.as_uri())
    assert dumped.returncode == 0, dumped.stderr.decode()[-2000:]
    dom = Elements()
    dom.feed(dumped.stdout.decode())
    (section,) = dom.having("section", "host")
    assert section["id"] == "host-solo"
    (svg,) = dom.having("svg", "tau-chart")
    assert svg["data-host"] == "solo"
    sources = sorted(c["data-source"] for c in dom.having("circle", "sample"))
    assert sources == ["deploy", "verify", "watch", "watch"]
    assert dom.having("rect", "period-drift") and dom.having("rect", "period-degraded")
    assert dom.having("polyline", "tau") and dom.having("table", "runs") and dom.having("table", "releases")

    shot = tmp_path / "report.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1000,900", page.as_uri())
    assert taken.returncode == 0 and shot.exists(), taken.stderr.decode()[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1000
    artifacts = os.environ.get("ORCHESTRATE_TEST_ARTIFACTS")
    if artifacts:  # kept where CI or a person can look at it
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        (Path(artifacts) / "report.png").write_bytes(png)

    assert cli.main(["report", "--json", "--state-dir", str(state)]) == 0


def test_nothing_a_host_said_becomes_markup() -> None:
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    run = {
        "id": 1,
        "kind": "deploy",
        "playbook": "p",
        "release_id": hostile,
        "started": 1.0,
        "finished": 2.0,
        "ok": False,
        "hosts_total": 1,
        "hosts_ready": 0,
        "hosts": [
            {
                "name": "gpu-a",
                "ready": False,
                "release_id": hostile,
                "changed": True,
                "gates": {"files": {"ok": False, "detail": hostile}},
                "duration_s": 1.0,
            }
        ],
    }
    sample = {"at": 2.0, "host": "gpu-a", "source": hostile, "release_id": hostile}
    sample |= {"mean_acceptance_length": 1.0, "mean_acceptance_length_low": 1.0, "acceptance_rate": 0.0, "drafts": 9}
    page = fleetreport.render_html(fleetreport.collect([run], [sample], []), 3.0)
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert json.dumps(fleetreport.to_json(fleetreport.collect([run], [sample], []), 3.0))

    # What the store holds is data too: a state no watcher writes (another tool's row, a damaged
    # one) went into the overview's text, class names and its CSS filter as it was; a host named
    # as markup; a speed-up record whose numbers are not numbers.
    hostile_state = 'READY"><style>*{display:none}</style><script>alert(3)</script>'
    transition = {"at": 2.5, "host": "gpu-a", "from": "READY", "to": hostile_state, "reason": hostile}
    other = json.loads(json.dumps(run))
    other["hosts"][0]["name"] = hostile
    other["hosts"][0]["gates"] = {
        "speedup": {"ok": True, "min": hostile, "levels": [{"concurrency": 1, "speedup": "9"}]}
    }
    hosts = fleetreport.collect([run, other], [sample], [transition])
    page = fleetreport.render_html(hosts, 3.0)
    assert "<script" not in page and "<img" not in page
    assert page.count("<style>") == 2  # the page's own, and the overview's filter
    assert '<span class="state state-UNKNOWN">UNKNOWN (READY&quot;&gt;&lt;style&gt;' in page
    assert "9.00x" not in page  # a string is not shown as a figure
    assert json.dumps(fleetreport.to_json(hosts, 3.0))


@pytest.mark.parametrize(
    "damage",
    [
        {"gates": {"health": {"ok": True, "startup": {"phases": {"weights": 2.0}, "total_s": "many"}}}},
        {"gates": {"health": {"ok": True, "startup": {"phases": {"weights": "2"}, "total_s": 3.0, "kv_tokens": "x"}}}},
        {"gates": {"health": {"ok": True, "startup": {"phases": ["weights"], "total_s": 3.0}}}},
        {"gates": {"health": "READY"}},
        {"gates": ["files"]},
        {"gates": {"files": {"ok": "yes", "detail": 7, "data": {"seconds": "3"}}}},
        {"duration_s": "1.5"},
        {"duration_s": None, "ready": "yes"},
        {"release_id": {"a": 1}},
        {"name": 7},
    ],
)
def test_a_stored_record_the_report_cannot_draw_is_drawn_without_it_never_a_traceback(damage: dict[str, Any]) -> None:
    """What the store holds is data: a run's host record with a ledger total, a duration or a gate
    that is not what the tool writes (another tool's row, a damaged one) was a traceback from
    ``report --html`` (a ledger total that is not a number). It is drawn without the figure,
    never as one."""
    good = {"name": "gpu-a", "ready": True, "release_id": "r1", "gates": {"files": {"ok": True, "detail": "ok"}}}
    good["duration_s"] = 1.0
    run = {"id": 1, "kind": "deploy", "playbook": "p", "started": 1.0, "finished": 2.0, "ok": True, "hosts": []}
    run["hosts"] = [good, {**good, "name": "gpu-b", **damage}]
    run["by"] = "someone"  # a run's author that is not the mapping the tool writes
    transitions = [{"at": "noon", "host": "gpu-a", "to": "READY"}, {"at": 2.5, "host": "gpu-a", "to": 3}]
    hosts = fleetreport.collect([run], [], transitions)
    page = fleetreport.render_html(hosts, 3.0)
    assert "gpu-a" in page and "many" not in page and "1.50 s" not in page
    assert json.dumps(fleetreport.to_json(hosts, 3.0))
    shown = {h.name: h for h in hosts}
    if isinstance(damage.get("name"), int):
        assert sorted(shown) == ["gpu-a"]  # not a host's record at all
    else:
        assert shown["gpu-b"].runs[0]["host"]["ready"] is (damage.get("ready", True) is True)


def test_the_report_opens_with_the_fleet_worst_first_at_1024_hosts(tmp_path: Path, chromium: Chromium) -> None:
    """1024 hosts in a browser: the overview counts them by state and lists every host worst first
    (DOWN, DEGRADED, DRIFT, out of rotation, never watched, READY), each row linking to the host's
    section, with a filter by state that needs no script. (How fast it loads is a benchmark:
    bench/report.py.)"""
    from orchestrator.store import report as fleetreport
    from tests.fleet import STATES, fleet_history

    now = time.time()
    hosts = fleetreport.collect(*fleet_history(1024, now))
    page = tmp_path / "fleet.html"
    fleetreport.write_html(page, hosts, now)
    dumped = chromium("--dump-dom", page.as_uri())
    assert dumped.returncode == 0, dumped.stderr.decode()[-2000:]
    dom = Elements()
    dom.feed(dumped.stdout.decode())
    rows = dom.having("tr", "fleet-row")
    assert len(rows) == 1024
    order = [r["data-state"] for r in rows]
    ranks = ["DOWN", "DEGRADED", "DRIFT", "OUT_OF_ROTATION", "NOT_WATCHED", "READY"]
    assert order == sorted(order, key=ranks.index)
    # as fleet_history made them: host i unwell when i % 53 < 4, host 5 never watched
    made = ["NOT_WATCHED" if i == 5 else STATES[i % 53] if i % 53 < len(STATES) else "READY" for i in range(1024)]
    assert {s: order.count(s) for s in ranks} == {s: made.count(s) for s in ranks}
    counts = next(a for t, a in dom.found if t == "p" and a.get("class") == "counts")
    assert counts is not None
    radios = [a["id"] for t, a in dom.found if t == "input" and a.get("type") == "radio"]
    assert radios == ["filter-all", *(f"filter-{s}" for s in ranks)]
    sections = dom.having("section", "host")
    links = [a["href"][1:] for t, a in dom.found if t == "a" and a.get("href", "").startswith("#host-")]
    assert [sec["id"] for sec in sections] == links  # each row links to its section, in the same order
    down = [i for i in range(1024) if made[i] == "DOWN"]
    assert links[0] == f"host-gpu-{down[-1] // 8:03d}/serve-{down[-1] % 8}"  # the latest to go DOWN first
    shot = tmp_path / "fleet.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    assert taken.returncode == 0 and shot.exists(), taken.stderr.decode()[-2000:]
