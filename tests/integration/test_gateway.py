"""Rollouts behind a real gateway: HAProxy (Debian's package) and vllm-router (PyPI) in front of
three servers, a load generator sending requests through the gateway the whole time.

A rolling deploy of a new release loses no request with the gateway in the playbook, and loses
some without it (both numbers are asserted, so the test fails if draining stops working); a
host refused after it was drained stays out of rotation and the rollout stops; a gateway that
cannot be reached or refuses stops the deploy before any server is touched; verify finds a
READY host left out of rotation. See ``gateway_parts`` for the parts and why the servers are
the stand-in here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.results import Gate, RunReport
from tests.integration.gateway_parts import HOSTS, Fleet, Haproxy, Load, Router, free_port, make_fleet, wait_for

pytestmark = [
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is installed by scripts/bootstrap"),
    pytest.mark.usefixtures("gateways"),
]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    yield from make_fleet(tmp_path)


@pytest.fixture
def haproxy(tmp_path: Path, fleet: Fleet) -> Iterator[Haproxy]:
    proxy = Haproxy(tmp_path, free_port(), fleet.port).start()
    yield proxy
    proxy.stop()


def haproxy_gateway(proxy: Haproxy) -> dict[str, object]:
    return {
        "kind": "haproxy",
        "runs_on": "gw",
        "url": f"http://127.0.0.1:{proxy.port}",
        "socket": str(proxy.socket),
        "backend": "vllm",
    }


def by_name(report: RunReport) -> dict[str, object]:
    return {h.name: h for h in report.hosts}


def failures(report: RunReport) -> dict[str, str]:
    return {h.name: f"{h.failed_gate}: {h.gates[h.failed_gate].detail}" for h in report.hosts if h.failed_gate}


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


def test_a_gateway_with_no_rollout_block_keeps_a_host_serving_while_the_others_drain(
    fleet: Fleet, haproxy: Haproxy
) -> None:
    """No rollout block: every host is worked on at once. Behind a gateway that drained them all at
    once, and nothing served (116 of 440 requests lost through the real router): unset,
    rollout.min_in_rotation is one, so a host waits for another to come back before its drain, and
    no request is lost."""
    gateway = haproxy_gateway(haproxy)
    first = fleet.deploy(fleet.playbook(gateway, rollout={}))
    assert first.ok, failures(first)
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    load = Load(haproxy.port).start()
    second = fleet.deploy(fleet.playbook(gateway, "release 2\n", rollout={}))
    load.stop()
    assert second.ok and all(h.changed for h in second.hosts), failures(second)
    assert load.lost == [] and load.sent > 30, (load.sent, load.lost[:5])


def test_min_in_rotation_is_never_broken(fleet: Fleet, haproxy: Haproxy) -> None:
    """With every host needed in rotation, no host can be drained: the rollout says so at once
    (no wait can keep such a floor: it waited the whole start budget, 16 minutes by default) and
    stops, and every server keeps serving its release."""
    gateway = haproxy_gateway(haproxy)
    assert fleet.deploy(fleet.playbook(gateway)).ok
    pids = {name: fleet.pid(name) for name in HOSTS}
    playbook = fleet.playbook(gateway, "release 2\n", rollout={"batch_size": 1, "min_in_rotation": 3})
    report = fleet.deploy(playbook)
    g1 = by_name(report)["g1"]
    assert g1.failed_gate == "gateway" and g1.gates["gateway"].reason == "min_in_rotation", failures(report)
    assert "rollout.min_in_rotation 3 can never be kept while this host is out: the gateway knows 3 servers" in (
        g1.gates["gateway"].detail
    )
    assert g1.duration_s < playbook.serving.startup_timeout
    assert by_name(report)["g2"].failed_gate == "rollout"
    assert {name: fleet.pid(name) for name in HOSTS} == pids
    assert haproxy.status() == {name: "UP" for name in HOSTS}


def test_the_command_hook_and_the_endpoints_file(tmp_path: Path, fleet: Fleet, haproxy: Haproxy) -> None:
    """The two adapters for anything else: a hook given the host's JSON on stdin (here one that
    drives HAProxy's socket, as a site's own script would), and an endpoints file on the gateway's
    host written with the atomic protocol (a router that watches it sees every change whole)."""
    hook = tmp_path / "lb-hook"
    hook.write_text(f"""#!{sys.executable}
import json, socket, sys
request = json.load(sys.stdin)
name, action = request["host"]["name"], request["action"]
def ask(line):
    s = socket.socket(socket.AF_UNIX); s.connect({str(haproxy.socket)!r}); s.sendall(line.encode() + b"\\n")
    out = b"".join(iter(lambda: s.recv(65536), b"")); s.close(); return out.decode()
if action != "status":
    said = ask("set server vllm/%s state %s" % (name, "ready" if action == "in" else "drain")).strip()
    if said:
        sys.exit(said)
head, *rows = ask("show stat").lstrip("# ").splitlines()
row = next(dict(zip(head.split(","), r.split(","))) for r in rows if r.startswith("vllm,%s," % name))
print("asked", action, "of", name)
print(json.dumps({{"in_rotation": row["status"].startswith("UP"), "in_flight": int(row["scur"])}}))
""")
    hook.chmod(0o755)
    gateway = {"kind": "command", "runs_on": "gw", "url": f"http://127.0.0.1:{haproxy.port}", "command": [str(hook)]}
    assert fleet.deploy(fleet.playbook(gateway)).ok
    load = Load(haproxy.port).start()
    report = fleet.deploy(fleet.playbook(gateway, "release 2\n"))
    load.stop()
    assert report.ok, failures(report)
    assert load.lost == [], load.lost[:5]
    assert all(h.gates["gateway"].data["in_flight_left"] == 0 for h in report.hosts)
    # Every host at once with a floor of two: the hook answers only for the host it is asked
    # about, so the others serving went uncounted (a floor of one or more could never be met, or,
    # unset, every host was drained at once); the run's other servers are asked too.
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    load = Load(haproxy.port).start()
    floored = fleet.deploy(fleet.playbook(gateway, "release 3\n", rollout={"min_in_rotation": 2}))
    load.stop()
    assert floored.ok, failures(floored)
    assert load.lost == [], load.lost[:5]

    endpoints = tmp_path / "gw" / "endpoints.json"
    endpoints.parent.mkdir()
    gateway = {
        "kind": "endpoints-file",
        "runs_on": "gw",
        "url": f"http://127.0.0.1:{haproxy.port}",
        "path": str(endpoints),
    }
    report = fleet.deploy(fleet.playbook(gateway, "release 3\n"))
    assert report.ok, failures(report)
    listed = json.loads(endpoints.read_text())["endpoints"]
    assert listed == [{"name": n, "url": f"http://{a}:{fleet.port}"} for n, a in sorted(HOSTS.items())]
    stopped = fleet.stop(fleet.playbook(gateway, "release 3\n"))
    assert stopped.ok
    assert json.loads(endpoints.read_text()) == {"endpoints": []}


# A canary batch of one, then one host at a time, each canary baked 8 s on live traffic.
BAKED = {
    "rollout": {"canary": 1, "batch_size": 1, "bake_s": 8},
    "gates": {
        "acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32},
        "live": {"min_mean_acceptance_length": 2.0, "min_drafts": 20},
    },
}


def test_a_canary_that_degrades_while_it_bakes_is_rolled_back_and_the_rollout_stops(
    fleet: Fleet, haproxy: Haproxy
) -> None:
    """The canary passes every gate, then its acceptance on live traffic falls (its drafter config
    changed under it and the server re-read it, as the founding incident's stale file would): the
    bake sees it, the canary goes back to the release before, and no other host is touched."""
    gateway = haproxy_gateway(haproxy)
    top = BAKED
    # No traffic while it bakes: the bake judged nothing, and used to pass. The rollout stops
    # there, and the canary, seen doing nothing wrong, is kept.
    unjudged = fleet.deploy(fleet.playbook(gateway, **top))
    g1 = by_name(unjudged)["g1"]
    assert g1.failed_gate == "bake" and g1.gates["bake"].reason == "unjudged", failures(unjudged)
    assert "judged nothing: 0 drafts on live traffic, gates.live.min_drafts 20 needed" in g1.gates["bake"].detail
    assert os.readlink(fleet.root("g1") / "current").endswith(g1.release_id or "?")
    for name in ("g2", "g3"):
        assert "the canary g1 could not be judged while it baked" in by_name(unjudged)[name].gates["rollout"].detail
        assert not (fleet.root(name) / "current").exists()
    load = Load(haproxy.port).start()
    first = fleet.deploy(fleet.playbook(gateway, **top))
    load.stop()
    assert first.ok, failures(first)
    old = first.hosts[0].release_id
    pids = {name: fleet.pid(name) for name in ("g2", "g3")}

    def ready_release() -> str | None:
        record = json.loads((fleet.root("g1") / "ready.json").read_text())
        return record["release_id"] if record["release_id"] != old else None

    def break_the_canary() -> None:
        new = wait_for("the canary READY on the new release", ready_release, timeout=60)
        config = fleet.root("g1") / "releases" / new / "drafter" / "config.json"
        drafter = json.loads(config.read_text())
        drafter["dflash_config"]["mask_token_id"] = 0
        config.write_text(json.dumps(drafter))
        os.kill(fleet.pid("g1"), signal.SIGHUP)  # the server reads its drafter config again

    load = Load(haproxy.port).start()
    saboteur = threading.Thread(target=break_the_canary)
    saboteur.start()
    report = fleet.deploy(fleet.playbook(gateway, "release 2\n", **top))
    saboteur.join(60)
    load.stop()
    hosts = by_name(report)
    g1 = hosts["g1"]
    assert (
        g1.failed_gate == "bake" and "live acceptance fell: mean acceptance length 1.00" in g1.gates["bake"].detail
    ), failures(report)
    assert f"rolled back: release {old} is current again" in " ".join(g1.diagnosis), g1.diagnosis
    assert os.readlink(fleet.root("g1") / "current").endswith(old or "?")
    for name in ("g2", "g3"):
        assert hosts[name].failed_gate == "rollout" and "the canary g1 degraded" in hosts[name].gates["rollout"].detail
    assert {name: fleet.pid(name) for name in ("g2", "g3")} == pids
    assert haproxy.status() == {name: "UP" for name in HOSTS}
    assert load.lost == [], load.lost[:5]


def test_a_canary_whose_server_restarts_while_it_bakes_is_rolled_back(fleet: Fleet, haproxy: Haproxy) -> None:
    """A server that restarts under the canary (a crash its supervisor hid) while it bakes: its
    counters start again. The bake used to measure from the restart on and pass; a restart is
    itself what the bake is there to catch."""
    gateway = haproxy_gateway(haproxy)
    top = BAKED
    first = fleet.deploy(fleet.playbook(gateway))
    assert first.ok, failures(first)
    old = first.hosts[0].release_id
    from orchestrator.config.inventory import load_inventory
    from orchestrator.deployment import Deployment
    from orchestrator.engine.observer import Observer, Step
    from tests.integration.gateway_parts import OPTIONS

    class RestartOnceBaking(Observer):
        """Restarts the canary's server at the bake's first reading (its counters' base is taken)."""

        done = False

        def step(self, step: Step) -> None:
            if step.what == "baking" and not self.done:
                self.done = True
                os.kill(fleet.pid("g1"), signal.SIGHUP)  # the stand-in's restart: counters from zero

    load = Load(haproxy.port).start()
    book = fleet.playbook(gateway, "release 2\n", **top)
    report = Deployment(book, load_inventory(fleet.inventory), OPTIONS, RestartOnceBaking()).deploy()
    load.stop()
    g1 = by_name(report)["g1"]
    assert g1.failed_gate == "bake" and "its server restarted once while it baked" in g1.gates["bake"].detail, failures(
        report
    )
    assert os.readlink(fleet.root("g1") / "current").endswith(old or "?")
    assert "the canary g1 degraded" in by_name(report)["g2"].gates["rollout"].detail


class MeetingSocket:
    """HAProxy's admin socket behind a proxy that holds a `show stat` read while every server is
    UP until a second such read arrives (or 2 s pass): two controllers that decide at once are
    made to read the rotation at once, every time, instead of by chance."""

    def __init__(self, real: Path, path: Path) -> None:
        import socket

        self.real, self.path = real, path
        self.cond = threading.Condition()
        self.waiting = 0
        self.met = 0
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(16)
        self.stopped = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _meet(self) -> None:
        with self.cond:
            if self.waiting:
                self.waiting -= 1
                self.met += 1
                self.cond.notify_all()
                return
            self.waiting += 1
            generation = self.met
            if not self.cond.wait_for(lambda: self.met != generation, 2.0):
                self.waiting -= 1

    def _ask(self, line: bytes) -> bytes:
        import socket

        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.real))
            s.sendall(line)
            return b"".join(iter(lambda: s.recv(65536), b""))

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: object) -> None:
        import socket

        assert isinstance(conn, socket.socket)
        with conn:
            line = b""
            while not line.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                line += chunk
            if line.startswith(b"show stat"):
                answer = self._ask(line)
                statuses = [r.split(b",")[17] for r in answer.splitlines() if r.startswith(b"vllm,g")]
                if statuses and all(st == b"UP" for st in statuses):
                    self._meet()
                    answer = self._ask(line)
            else:
                answer = self._ask(line)
            conn.sendall(answer)

    def close(self) -> None:
        self.stopped = True
        self.server.close()


def test_two_controllers_behind_one_gateway_keep_its_floor_together(
    tmp_path: Path, fleet: Fleet, haproxy: Haproxy, postgres: object
) -> None:
    """Disjoint targets behind one HAProxy, one shared store, min_in_rotation 2 of 3: each
    controller read the rotation, counted the other's host as serving, and both took one out (one
    server left). They decide under the store's rotation lock, so at most one is out at a time."""
    from orchestrator.config.inventory import load_inventory
    from orchestrator.deployment import Deployment
    from orchestrator.store.state import StateDB
    from tests.integration.gateway_parts import OPTIONS
    from tests.postgres import Postgres

    assert isinstance(postgres, Postgres)
    gateway = haproxy_gateway(haproxy)
    assert fleet.deploy(fleet.playbook(gateway)).ok
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    meeting = MeetingSocket(haproxy.socket, tmp_path / "meeting.sock")
    shared = {**gateway, "socket": str(meeting.path)}
    url = postgres.socket_url(postgres.new_database())
    books = [
        fleet.playbook(shared, "release 2\n", name=name, targets=targets, rollout={"min_in_rotation": 2})
        for name, targets in (("pa", ["g1"]), ("pb2", ["g2", "g3"]))
    ]
    out: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            out.append(sum(st != "UP" for st in haproxy.status().values()))

    reports: dict[str, RunReport] = {}
    stores = [StateDB(tmp_path / "s1", url), StateDB(tmp_path / "s2", url)]

    def run(book: object, store: StateDB) -> None:
        deployment = Deployment(book, load_inventory(fleet.inventory), OPTIONS, store=store)  # type: ignore[arg-type]
        reports[deployment.playbook.name] = deployment.deploy()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        runs = [threading.Thread(target=run, args=pair) for pair in zip(books, stores, strict=True)]
        for t in runs:
            t.start()
        for t in runs:
            t.join(300)
    finally:
        watching.set()
        watcher.join(30)
        meeting.close()
        for store in stores:
            store.close()
    assert all(r.ok for r in reports.values()), {n: failures(r) for n, r in reports.items()}
    assert max(out) == 1, f"{max(out)} servers out of rotation at once (min_in_rotation 2 of 3)"
