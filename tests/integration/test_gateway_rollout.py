"""The rollout's own rules behind a real gateway (HAProxy, Debian's package) in front of three
stand-in servers: with no rollout block every host is worked on at once but one keeps serving; the
capacity floor (``min_in_rotation``) is never broken, by one controller or two; a canary that
degrades or restarts while it bakes is rolled back and the rollout stops; the command hook and the
endpoints file gateways. See ``gateway_parts`` for the parts; ``test_gateway.py`` for rollouts
through each gateway kind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.results import RunReport
from tests.integration.gateway_parts import (
    HOSTS,
    Fleet,
    Haproxy,
    Load,
    by_name,
    failures,
    haproxy_gateway,
    wait_for,
)

pytestmark = [
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is installed by scripts/bootstrap"),
    pytest.mark.usefixtures("gateways"),
]


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
    # Every host at once (no rollout block): a drained host drops out of the file, and the last one
    # found itself alone in it and was drained too (24 of 352 requests lost through the real
    # vllm-router, rc 0). The run's other hosts count: the file never empties.
    shortest: list[int] = []
    done = threading.Event()

    def watch_file() -> None:
        while not done.wait(0.01):  # sampled every 10 ms: a drain takes seconds
            shortest.append(len(json.loads(endpoints.read_text())["endpoints"]))  # written whole, renamed

    watcher = threading.Thread(target=watch_file, daemon=True)
    watcher.start()
    try:
        with haproxy.following(endpoints):
            report = fleet.deploy(fleet.playbook(gateway, "release 4\n", rollout={}))
    finally:
        done.set()
        watcher.join(10)
    assert report.ok and all(h.changed for h in report.hosts), failures(report)
    assert shortest and min(shortest) >= 1 and max(shortest) == 3, (min(shortest, default=None), len(shortest))
    stopped = fleet.stop(fleet.playbook(gateway, "release 4\n"))
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


def _two_controllers(
    tmp_path: Path, fleet: Fleet, gateway: dict[str, object], postgres: object, sample: Callable[[], int]
) -> tuple[dict[str, RunReport], list[int]]:
    """Disjoint targets behind one gateway (g1; g2 and g3), min_in_rotation 2 of 3, deployed by two
    controllers at once on one shared store; ``sample`` read every 10 ms meanwhile."""
    from orchestrator.config.inventory import load_inventory
    from orchestrator.deployment import Deployment
    from orchestrator.store.state import StateDB
    from tests.integration.gateway_parts import OPTIONS
    from tests.postgres import Postgres

    assert isinstance(postgres, Postgres)
    url = postgres.socket_url(postgres.new_database())
    books = [
        fleet.playbook(gateway, "release 2\n", name=name, targets=targets, rollout={"min_in_rotation": 2})
        for name, targets in (("pa", ["g1"]), ("pb2", ["g2", "g3"]))
    ]
    samples: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.01):  # a drain takes seconds
            samples.append(sample())

    reports: dict[str, RunReport] = {}
    stores = [StateDB(tmp_path / "s1", url), StateDB(tmp_path / "s2", url)]

    def run(book: object, store: StateDB) -> None:
        deployment = Deployment(book, load_inventory(fleet.inventory), OPTIONS, store=store)  # type: ignore[arg-type]
        reports[deployment.playbook.name] = deployment.deploy()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        runs = [threading.Thread(target=run, args=pair) for pair in zip(books, stores, strict=True)]
        for t in runs:
            t.start()
        for t in runs:
            t.join(300)
    finally:
        done.set()
        watcher.join(30)
        for store in stores:
            store.close()
    return reports, samples


def test_two_controllers_behind_one_gateway_keep_its_floor_together(
    tmp_path: Path, fleet: Fleet, haproxy: Haproxy, postgres: object
) -> None:
    """Disjoint targets behind one HAProxy, one shared store, min_in_rotation 2 of 3: each
    controller read the rotation, counted the other's host as serving, and both took one out (one
    server left). They decide under the store's rotation lock, so at most one is out at a time."""
    gateway = haproxy_gateway(haproxy)
    assert fleet.deploy(fleet.playbook(gateway)).ok
    wait_for("HAProxy's checks", lambda: haproxy.status() == {name: "UP" for name in HOSTS})
    meeting = MeetingSocket(haproxy.socket, tmp_path / "meeting.sock")
    try:
        shared = {**gateway, "socket": str(meeting.path)}
        out_of_rotation = lambda: sum(st != "UP" for st in haproxy.status().values())  # noqa: E731
        reports, out = _two_controllers(tmp_path, fleet, shared, postgres, out_of_rotation)
    finally:
        meeting.close()
    assert all(r.ok for r in reports.values()), {n: failures(r) for n, r in reports.items()}
    assert max(out) == 1, f"{max(out)} servers out of rotation at once (min_in_rotation 2 of 3)"


def test_two_controllers_behind_one_endpoints_file_wait_for_each_other(
    tmp_path: Path, fleet: Fleet, haproxy: Haproxy, postgres: object
) -> None:
    """Disjoint targets behind one endpoints file, min_in_rotation 2 of 3: a host another
    controller drained drops out of the file and out of this run's fleet, so the second
    controller counted one possible server beside its own and failed "can never be kept". A
    gateway whose listing drops the drained waits for capacity instead: both runs READY, and the
    file never lists fewer than two."""
    endpoints = tmp_path / "gw" / "endpoints.json"
    endpoints.parent.mkdir()
    gateway = {"kind": "endpoints-file", "runs_on": "gw", "url": f"http://127.0.0.1:{haproxy.port}"}
    gateway["path"] = str(endpoints)
    assert fleet.deploy(fleet.playbook(gateway)).ok
    listed_now = lambda: len(json.loads(endpoints.read_text())["endpoints"])  # noqa: E731
    with haproxy.following(endpoints):
        reports, listed = _two_controllers(tmp_path, fleet, gateway, postgres, listed_now)
    assert all(r.ok for r in reports.values()), {n: failures(r) for n, r in reports.items()}
    assert listed and min(listed) >= 2, (min(listed, default=None), len(listed))
    assert fleet.stop(fleet.playbook(gateway, "release 2\n")).ok
