"""Rollouts behind a real gateway: HAProxy (Debian's package) and vllm-router (PyPI) in front of
three servers, a load generator sending requests through the gateway the whole time.

A rolling deploy of a new release loses no request with the gateway in the playbook, and loses
some without it (both numbers are asserted, so the test fails if draining stops working); a
host refused after it was drained stays out of rotation and the rollout stops; a gateway that
cannot be reached or refuses stops the deploy before any server is touched; verify finds a
READY host left out of rotation. See ``gateway_parts`` for the parts and why the servers are
the stand-in here; ``test_gateway_rollout.py`` holds the rollout's own rules (its capacity floor,
canaries that bake, hooks and files, two controllers).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from orchestrator.results import Gate
from tests.integration.gateway_parts import (
    HOSTS,
    Fleet,
    Haproxy,
    Load,
    Router,
    by_name,
    failures,
    free_port,
    haproxy_gateway,
    wait_for,
)

pytestmark = [
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is installed by scripts/bootstrap"),
    pytest.mark.usefixtures("gateways"),
]


def test_a_rolling_deploy_behind_haproxy_loses_no_request_and_without_the_gateway_loses_some(
    fleet: Fleet, haproxy: Haproxy
) -> None:
    """Both rollouts replace servers started with vLLM's default stop (abort what it holds): the one
    with the gateway in the playbook drains each host at HAProxy first and loses nothing."""
    first = fleet.deploy(fleet.playbook(None))  # no gateway, no drain: servers that abort on SIGTERM
    assert first.ok, failures(first)
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})

    load = Load(haproxy.port).start()
    second = fleet.deploy(fleet.playbook(None, "release 2\n"))
    load.stop()
    assert second.ok and all(h.changed for h in second.hosts), failures(second)
    without_gateway = (load.sent, load.lost)
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})

    gateway = haproxy_gateway(haproxy)
    load = Load(haproxy.port).start()
    third = fleet.deploy(fleet.playbook(gateway, "release 3\n"))
    load.stop()
    assert third.ok and all(h.changed for h in third.hosts), failures(third)
    with_gateway = (load.sent, load.lost)
    for host in third.hosts:
        gate = host.gates["gateway"]
        assert gate.data["in_flight_left"] == 0 and gate.data["drain_s"] >= 0, gate
        assert "a request through" in gate.detail, gate
    assert haproxy.status() == {name: "UP" for name in HOSTS}
    print(
        f"\nrequests sent/lost: with the gateway {with_gateway[0]}/{len(with_gateway[1])}, "
        f"without {without_gateway[0]}/{len(without_gateway[1])}"
    )
    assert with_gateway[1] == [], with_gateway[1][:5]
    assert with_gateway[0] > 30
    assert without_gateway[1], "a rollout that drains nothing lost no request: the comparison shows nothing"


def test_a_rolling_deploy_behind_vllm_router_loses_no_request(tmp_path: Path, fleet: Fleet) -> None:
    router = Router(tmp_path, free_port()).start()
    try:
        gateway = {"kind": "vllm-router", "runs_on": "gw", "url": f"http://127.0.0.1:{router.port}"}
        first = fleet.deploy(fleet.playbook(gateway))
        assert first.ok, failures(first)
        urls = {f"http://{address}:{fleet.port}" for address in HOSTS.values()}
        assert set(router.workers() or []) == urls

        load = Load(router.port).start()
        second = fleet.deploy(fleet.playbook(gateway, "release 2\n"))
        load.stop()
        assert second.ok, failures(second)
        print(f"\nvllm-router: requests sent {load.sent}, lost {len(load.lost)}")
        assert load.lost == [] and load.sent > 30, load.lost[:5]
        assert set(router.workers() or []) == urls
        # nothing changed: every server kept, and put back where the router still lists it (its
        # add_worker answers HTTP 400 "already exists": judged by reading the router back)
        again = fleet.deploy(fleet.playbook(gateway, "release 2\n"))
        assert again.ok, failures(again)
        assert set(router.workers() or []) == urls
        # stop takes each host out of the router before its server ends
        stopped = fleet.stop(fleet.playbook(gateway, "release 2\n"))
        assert stopped.ok, failures(stopped)
        assert router.workers() == []
    finally:
        router.stop()


def test_a_deploy_that_changes_only_the_server_s_command_drains_each_host_before_its_restart(
    fleet: Fleet, haproxy: Haproxy
) -> None:
    """A variable of serving.env changed and no file: every server restarts (its command differs),
    so each is taken out of HAProxy's rotation before its stop, as for changed files, and no
    request is lost. A redeploy that changes nothing keeps every server, in rotation."""
    import yaml

    from orchestrator.config.playbook import load_playbook

    gateway = haproxy_gateway(haproxy)
    first = fleet.deploy(fleet.playbook(gateway))
    assert first.ok, failures(first)
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    book = yaml.safe_load(fleet.playbook(gateway).file.read_text())
    book["serving"]["env"]["STANDIN_SETTING"] = "a variable the server reads"
    path = fleet.dir / "command-only.yaml"
    path.write_text(yaml.safe_dump(book))

    load = Load(haproxy.port).start()
    second = fleet.deploy(load_playbook(path))
    load.stop()
    assert second.ok and not any(h.changed for h in second.hosts), failures(second)
    for host in second.hosts:
        gate = host.gates["gateway"]
        assert gate.detail.startswith("drained in") and gate.data["in_flight_left"] == 0, gate
        assert "after the launch" in host.gates["health"].detail, host.gates["health"]  # restarted
    assert load.lost == [] and load.sent > 30, (load.sent, load.lost[:5])
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})

    same = fleet.deploy(load_playbook(path))
    assert same.ok, failures(same)
    assert all("drain_s" not in h.gates.get("gateway", Gate(True, "")).data for h in same.hosts)  # kept, undrained
    assert haproxy.drained() == {name: False for name in HOSTS}


def test_a_host_refused_after_its_drain_stays_out_and_the_rotation_is_the_ready_hosts(
    fleet: Fleet, haproxy: Haproxy
) -> None:
    gateway = haproxy_gateway(haproxy)
    assert fleet.deploy(fleet.playbook(gateway)).ok
    (fleet.root("g2") / "standin-refuse").write_text("")  # g2's vLLM now refuses the drafter
    load = Load(haproxy.port).start()
    report = fleet.deploy(fleet.playbook(gateway, "release 2\n"))
    load.stop()
    hosts = by_name(report)
    assert hosts["g1"].ready
    assert not hosts["g2"].ready and hosts["g2"].failed_gate == "health", failures(report)
    assert "left out of the gateway's rotation" in " ".join(hosts["g2"].diagnosis), hosts["g2"].diagnosis
    assert hosts["g3"].failed_gate == "rollout", failures(report)  # the failure budget (0) stopped it
    # The gateway sends traffic exactly to the READY hosts: g1 (new release) and g3 (untouched).
    assert haproxy.drained() == {"g1": False, "g2": True, "g3": False}
    assert haproxy.status()["g1"] == "UP" and haproxy.status()["g3"] == "UP" and haproxy.status()["g2"] != "UP"
    assert load.lost == [], load.lost[:5]
    # verify says the same: g2 not READY and out (consistent), g1 and g3 READY and in.
    verified = by_name(fleet.verify(fleet.playbook(gateway, "release 2\n")))
    assert verified["g1"].gates["gateway"].ok and verified["g1"].gates["gateway"].data["in_rotation"]
    assert verified["g2"].gates["gateway"].ok and not verified["g2"].gates["gateway"].data["in_rotation"]


def test_a_kept_server_that_fails_its_proof_leaves_rotation_before_it_stops(fleet: Fleet, haproxy: Haproxy) -> None:
    """A redeploy that changes nothing keeps every server in rotation and proves each again; one
    that fails that proof (here a tau floor above what any drafter of K gives) is stopped, as any
    host that fails its proof, but taken out of HAProxy's rotation first: it was stopped in
    rotation, and the users' requests sent to it were lost (17 of 63 through HAProxy, real vLLM).
    The stand-in finishes what is in flight at its stop and HAProxy's checks find it down soon
    after, so here no request was lost either way; what the old code got wrong, and this holds,
    is the rotation: the stopped server was left in it."""
    gateway = haproxy_gateway(haproxy)
    assert fleet.deploy(fleet.playbook(gateway)).ok
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    strict = {"acceptance": {"min_mean_acceptance_length": 9.0, "min_drafts": 10, "max_tokens": 32}}
    load = Load(haproxy.port).start()
    report = fleet.deploy(fleet.playbook(gateway, gates=strict))
    load.stop()
    hosts = by_name(report)
    first = hosts["g1"]
    assert load.lost == [] and load.sent > 10, (load.sent, load.lost[:5])
    assert not first.ready and first.failed_gate == "acceptance", failures(report)
    assert "drain_s" not in first.gates["gateway"].data  # kept in place, not drained for a restart
    assert first.gates["gateway"].detail.startswith("taken out of the gateway's rotation"), first.gates["gateway"]
    assert "left out of the gateway's rotation (taken out before the stop)" in first.diagnosis[-1], first.diagnosis
    assert hosts["g2"].failed_gate == "rollout" and hosts["g3"].failed_gate == "rollout"
    assert haproxy.drained() == {"g1": True, "g2": False, "g3": False}


def test_an_unreachable_or_refusing_gateway_stops_the_deploy_before_any_server_is_touched(
    tmp_path: Path, fleet: Fleet
) -> None:
    proxy = Haproxy(tmp_path, free_port(), fleet.port).start()
    gateway = haproxy_gateway(proxy)
    try:
        assert fleet.deploy(fleet.playbook(gateway)).ok
        pids = {name: fleet.pid(name) for name in HOSTS}

        gone = dict(gateway, socket=str(tmp_path / "no-such.sock"))
        report = fleet.deploy(fleet.playbook(gone, "release 2\n"))
        assert not report.ok
        for host in report.hosts:
            assert list(host.gates) == ["gateway"], host.gates
            assert (
                "no-such.sock" in host.gates["gateway"].detail and "no host was touched" in host.gates["gateway"].detail
            )
        assert {name: fleet.pid(name) for name in HOSTS} == pids
        assert all(
            os.readlink(fleet.root(n) / "current").endswith(h.release_id or "") for n, h in by_name(report).items()
        )
    finally:
        proxy.stop()

    # A socket at user level reads the rotation but refuses every change: the first host's drain
    # fails in HAProxy's words, its server is not stopped, and nothing else is touched.
    refusing = Haproxy(tmp_path, free_port(), fleet.port, level="user").start()
    try:
        wait_for("HAProxy's checks", lambda: set(refusing.status().values()) == {"UP"})
        report = fleet.deploy(fleet.playbook(haproxy_gateway(refusing), "release 3\n"))
        assert not report.ok
        g1 = by_name(report)["g1"]
        assert (
            g1.failed_gate == "gateway"
            and "HAProxy refused `set server vllm/g1 state drain`" in g1.gates["gateway"].detail
        )
        assert "ermission denied" in g1.gates["gateway"].detail, g1.gates["gateway"].detail
        assert {name: fleet.pid(name) for name in HOSTS} == pids
        assert set(refusing.status().values()) == {"UP"}
    finally:
        refusing.stop()


def test_a_server_name_the_gateway_does_not_know_or_shares_stops_the_run_before_any_host_is_touched(
    fleet: Fleet, haproxy: Haproxy
) -> None:
    """HAProxy's servers are its configuration's: a name its backend does not have is a wrong name,
    not a host out of rotation (the host would be restarted undrained while HAProxy sends users to
    it under its own name), and verify would pass it. Two containers mapped to one server, or a
    server named for no container, are bad input. Each stops the run before any host is touched."""
    from orchestrator.errors import InputError

    gateway = haproxy_gateway(haproxy)
    assert fleet.deploy(fleet.playbook(gateway)).ok
    pids = {name: fleet.pid(name) for name in HOSTS}
    renamed = dict(gateway, servers={"g1": "g1-web"})
    for run in (fleet.deploy(fleet.playbook(renamed, "release 2\n")), fleet.verify(fleet.playbook(renamed))):
        assert not run.ok
        for host in run.hosts:
            detail = host.gates["gateway"].detail
            assert "HAProxy's backend 'vllm' has no server 'g1-web' (it has: g1, g2, g3)" in detail, detail
    assert {name: fleet.pid(name) for name in HOSTS} == pids
    for servers, said in (
        ({"g1": "g2"}, "gateway.servers: g1 and g2 are one server to the gateway (g2): one container, one server"),
        ({"nowhere": "g3"}, "gateway.servers.nowhere: 'nowhere' is not a container of"),
    ):
        with pytest.raises(InputError, match=re.escape(said)):  # bad input: the CLI's exit 2
            fleet.deploy(fleet.playbook(dict(gateway, servers=servers), "release 3\n"))
    assert {name: fleet.pid(name) for name in HOSTS} == pids


def test_verify_finds_a_ready_host_left_out_of_rotation(fleet: Fleet, haproxy: Haproxy) -> None:
    gateway = haproxy_gateway(haproxy)
    playbook = fleet.playbook(gateway)
    assert fleet.deploy(playbook).ok
    assert haproxy.command("set server vllm/g3 state maint").strip() == ""
    report = fleet.verify(playbook)
    g3 = by_name(report)["g3"]
    assert not report.ok and g3.failed_gate == "gateway", failures(report)
    assert g3.gates["gateway"].reason == "out_of_rotation" and "MAINT" in g3.gates["gateway"].detail
    assert by_name(report)["g1"].ready
    rounds = fleet.watch_round(playbook)  # watch says it too, as its own state
    assert rounds["g3"].state == "OUT_OF_ROTATION" and rounds["g3"].in_rotation is False, rounds["g3"].reasons
    assert rounds["g1"].state == "READY" and rounds["g1"].in_rotation is True
    # a redeploy with nothing changed puts it back, proven through the gateway
    again = fleet.deploy(playbook)
    assert again.ok, failures(again)
    assert haproxy.status()["g3"] == "UP"


def test_verify_s_speed_up_measured_in_the_gateway_s_rotation_says_so(fleet: Fleet, haproxy: Haproxy) -> None:
    """``verify --speedup`` measures both arms on a server that stays in rotation (verify never
    drains): the users' requests share its host and are in its numbers. The gate says so, and its
    data carries it (it was unsaid)."""
    from orchestrator.config.inventory import load_inventory
    from orchestrator.deployment import Deployment
    from tests.integration.gateway_parts import OPTIONS

    gateway = haproxy_gateway(haproxy)
    speedup = {"concurrency": [1], "max_tokens": 16, "repeats": 2, "max_pairs": 2, "min": 0.05}
    playbook = fleet.playbook(gateway, gates=fleet_gates(speedup))
    assert fleet.deploy(playbook).ok
    checked = Deployment(playbook, load_inventory(fleet.inventory), OPTIONS, limit=["g1"]).verify(speedup=True)
    gate = by_name(checked)["g1"].gates["speedup"]
    assert gate.data.get("in_rotation") is True, gate.detail
    assert "measured with the host in the gateway's rotation: users' requests shared its server" in gate.detail


def fleet_gates(speedup: dict[str, object]) -> dict[str, object]:
    return {
        "acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32},
        "speedup": {**speedup, "on_inconclusive": "pass"},
    }


def test_haproxy_follows_a_server_to_another_port_through_the_agent(fleet: Fleet, haproxy: Haproxy) -> None:
    """The standby's move on a real HAProxy (Debian's 2.6): the backend's server sent to the other
    port of its host by the runtime API through the gateway host's agent, read back from `show
    servers state`; again, it is already there; a port HAProxy would wrap is refused before it is
    sent, and HAProxy keeps the port it had."""
    from orchestrator.agent.client import AgentClient
    from orchestrator.config.inventory import load_inventory
    from orchestrator.connectors.local import LocalConnector
    from orchestrator.errors import GatewayError
    from orchestrator.gateways.base import Server
    from orchestrator.gateways.client import GatewayClient, gateway_target

    playbook = fleet.playbook(haproxy_gateway(haproxy))
    client = GatewayClient(
        playbook, gateway_target(playbook, load_inventory(fleet.inventory)), AgentClient(LocalConnector())
    )
    other = fleet.port + 1 if fleet.port < 65535 else fleet.port - 1

    def port_of(name: str) -> int:
        for line in haproxy.command("show servers state vllm").splitlines()[2:]:
            fields = line.split()
            if len(fields) > 18 and fields[3] == name:
                return int(fields[18])  # srv_port
        raise AssertionError(f"no server {name} in show servers state")

    assert port_of("g1") == fleet.port
    moved = Server("g1", "g1", f"http://{HOSTS['g1']}:{other}")
    client.move(moved)
    assert port_of("g1") == other and port_of("g2") == fleet.port
    client.move(moved)  # already there
    assert port_of("g1") == other
    with pytest.raises(GatewayError, match="a port of 1-65535"):
        client.move(Server("g1", "g1", f"http://{HOSTS['g1']}:99999"))
    assert port_of("g1") == other
