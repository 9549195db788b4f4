"""Whole runs through the library's entry point and a fake connector: no host, no agent process.

``FakeConnector`` stands where SSH would (as httpx's ``MockTransport`` does): each batch is decoded
exactly as the host's agent would read it and answered by the test, so the controller's side of
every step (the batches it sends, how it reads the answers, the gates it decides) is the real
code. This is where failure paths the real agent cannot be made to take on cue are tested: an
answer of the wrong shape in the middle of a launch, a connection that drops between two execs.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

import remote_agent
from orchestrator import Deployment, Observer, RunOptions, load_inventory, load_playbook
from orchestrator.config.inventory import Target
from orchestrator.connectors.fake import FakeConnector, answer
from orchestrator.engine.observer import Step
from orchestrator.engine.runner import Stop
from orchestrator.errors import ConnectionLost, InputError
from orchestrator.results import HostReport

OPTIONS = RunOptions(forks=2, lock_timeout=1.0)
ROOT = "/srv/dflash"


def write(tmp_path: Path, serving: dict[str, Any] | None = None) -> tuple[Path, Path]:
    (tmp_path / "notes.txt").write_text("release notes\n")
    book: dict[str, Any] = {
        "name": "fake",
        "targets": ["all"],
        "deploy_root": ROOT,
        "files": [{"src": "notes.txt", "dest": "notes.txt"}],
    }
    if serving is not None:
        book["serving"] = serving
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(yaml.safe_dump(book))
    containers = {name: {"address": f"192.0.2.{i + 1}"} for i, name in enumerate(("a", "b"))}
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu": {"containers": containers}}}))
    return playbook, inventory


def files_of(op: dict[str, Any], release: str) -> list[dict[str, Any]]:
    """What a release's files read back as, where the agent puts them."""
    return [
        {"path": f["path"], "remote_path": f"{ROOT}/releases/{release}/{f['path']}", "sha256": f["sha256"]}
        for f in op["files"]
    ]


def scrape(drafts: int, accepted: int) -> str:
    """vLLM's spec-decode counters as /metrics shows them (K = 7: 7 draft tokens a draft)."""
    lines = [
        f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {drafts * 7}',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {accepted}',
    ]
    return "\n".join(lines) + "\n"


class Host:
    """A well-behaved host, op by op; a test changes one answer to play a misbehaving one."""

    def __init__(self) -> None:
        self.staged: dict[str, list[dict[str, Any]]] = {}  # target -> the staged release's files

    def __call__(self, target: Target, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.answer(target, op) for op in ops]

    def answer(self, target: Target, op: dict[str, Any]) -> dict[str, Any]:
        name = op["op"]
        if name == "lock":
            return answer(op, {"waited_s": 0.0})
        if name == "release_apply":
            files = files_of(op, op["release_id"])
            self.staged[target.name] = files
            return answer(
                op,
                {
                    "release_id": op["release_id"],
                    "previous": None,
                    "changed": True,
                    "switched": op["switch"],
                    "files": [dict(f, changed=True) for f in files],
                },
            )
        if name == "release_switch":
            return answer(op, {"release_id": op["release_id"], "previous": None, "files": self.staged[target.name]})
        if name == "engine_check":
            return answer(op, {"version": "0.33.0", "target": ["Qwen3ForCausalLM"], "seconds": 0.5})
        if name == "launch":
            return answer(op, {"pid": 4242, "kept": False})
        if name == "wait_health":
            return answer(op, {"pid": 4242, "waited_s": 1.5})
        if name == "probe":
            return answer(op, {"before": scrape(0, 0), "after": scrape(40, 280), "seconds": 0.5})
        if name == "stop":
            return answer(op, {"stopped": None, "gone": True})
        if name == "serving_status":
            return answer(op, {"server": None, "health": None, "ready": None})
        if name == "serving_runs":
            return answer(op, {"runs": False})
        raise AssertionError(f"the test's host does not know {name}")


class Seen(Observer):
    def __init__(self) -> None:
        self.started: list[str] = []
        self.done: list[str] = []
        self.steps: list[Step] = []

    def host_started(self, report: HostReport) -> None:
        self.started.append(report.name)

    def host_done(self, report: HostReport) -> None:
        self.done.append(report.name)

    def step(self, step: Step) -> None:
        self.steps.append(step)


def test_a_files_only_deploy_is_one_batch_a_host_carrying_no_serving_code(tmp_path: Path) -> None:
    playbook, inventory = write(tmp_path)
    fake, seen = FakeConnector(Host()), Seen()
    deployment = Deployment(load_playbook(playbook), load_inventory(inventory), OPTIONS, seen, fake)
    run = deployment.deploy()
    assert run.ok and [h.name for h in run.hosts] == ["a", "b"], [h.gates for h in run.hosts]
    assert sorted(seen.started) == sorted(seen.done) == ["a", "b"]
    for h in run.hosts:
        assert h.gates["files"].ok and h.gates["files"].detail.endswith(f"release {run.release_id} is current")
        assert h.ssh["execs"] == 1
    assert [b.names for b in fake.batches] == [["lock", "release_apply"]] * 2
    # Only the modules those ops need travel: no server, GPU or model code.
    source = fake.batches[0].source
    assert b"def op_release_apply" in source and b"def op_launch" not in source and b"def op_gpus" not in source
    assert len(zlib.compress(source)) < FILES_ONLY_BUDGET < len(zlib.compress(remote_agent.source()))


# Half of what every batch carried when the agent was one file sent whole (25.8 KB compressed).
FILES_ONLY_BUDGET = 12_900


def test_every_key_is_sent_and_the_agents_checks_would_pass(tmp_path: Path) -> None:
    """What the fake received is what the host's dispatcher checks against each op's spec."""
    playbook, inventory = write(tmp_path)
    fake = FakeConnector(Host())
    Deployment(load_playbook(playbook), load_inventory(inventory), OPTIONS, connector=fake).deploy()
    namespace: dict[str, Any] = {"__name__": "dflash-agent"}
    exec(compile(fake.batches[0].source, "dflash-agent", "exec"), namespace)
    for op in fake.batches[0].ops:
        _, spec = namespace["OPS"][op["op"]]
        namespace["check"](op["op"], dict(spec, op=str), op)  # raises bad_request on a missing key


SERVING = {"python": "/opt/vllm/bin/python", "target": "/models/t", "model_name": "tiny", "port": 8000}


def test_a_malformed_answer_during_the_launch_fails_health_and_stops_what_may_run(tmp_path: Path) -> None:
    playbook, inventory = write(tmp_path, SERVING)

    class Garbled(Host):
        def answer(self, target: Target, op: dict[str, Any]) -> dict[str, Any]:
            if op["op"] == "wait_health":
                return answer(op, {"pid": "4242", "waited_s": 1.5})
            return super().answer(target, op)

    fake = FakeConnector(Garbled())
    deployment = Deployment(load_playbook(playbook), load_inventory(inventory), OPTIONS, connector=fake, limit=["a"])
    run = deployment.deploy()
    [host] = run.hosts
    assert not run.ok and host.failed_gate == "health"
    assert host.gates["health"].detail.startswith("wait_health answered badly: 'pid' is str, expected int")
    names = [b.names for b in fake.batches]
    assert names[0] == ["lock", "release_apply", "serving_runs"]
    assert names[1][:4] == ["lock", "engine_check", "release_switch", "launch"] and "wait_health" in names[1]
    # The host cannot be trusted to have left nothing running: everything of it is stopped.
    assert names[2] == ["lock", "stop", "stop"]
    assert any("no previous release to go back to: stopped" in line for line in host.diagnosis)


def test_a_connection_lost_between_two_execs_fails_connect_and_nothing_after_it(tmp_path: Path) -> None:
    playbook, inventory = write(tmp_path, SERVING)
    calls = {"n": 0}
    good = Host()

    def dropping(target: Target, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionLost(target.name, "Connection reset by peer (after 3 retries)")
        return good(target, ops)

    fake = FakeConnector(dropping)
    run = Deployment(load_playbook(playbook), load_inventory(inventory), OPTIONS, connector=fake, limit=["a"]).deploy()
    [host] = run.hosts
    assert not run.ok and host.gates["connect"] == host.gates[host.failed_gate or ""]
    assert host.gates["connect"].detail == "Connection reset by peer (after 3 retries)"
    assert host.gates["files"].ok and "staged" in host.gates["files"].detail  # staged, never switched
    assert "health" not in host.gates and len(fake.batches) == 2


def test_targets_are_chosen_by_the_library(tmp_path: Path) -> None:
    playbook, inventory = write(tmp_path)
    book, inv = load_playbook(playbook), load_inventory(inventory)
    assert [t.name for t in Deployment(book, inv, limit=["b"]).targets] == ["b"]
    assert [t.name for t in Deployment(book, inv, limit=["gpu"]).targets] == ["a", "b"]  # a GPU host: its containers
    with pytest.raises(InputError, match="'nowhere' is not a container, group or GPU host"):
        Deployment(book, inv, limit=["nowhere"])
    only_a = replace(book, targets=["a"])
    with pytest.raises(InputError, match="no targets: the playbook's targets and --limit select no container"):
        Deployment(only_a, inv, limit=["b"])


class Said(Seen):
    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def say(self, message: str) -> None:
        self.said.append(message)


def test_a_bake_the_limit_leaves_nothing_to_guard_is_said_not_skipped_in_silence(tmp_path: Path) -> None:
    """``rollout.bake_s`` guards the hosts after the canary; a ``--limit`` to the canary alone leaves
    none, so no bake runs: the run says so (it was skipped unsaid, as if the canary had baked)."""
    playbook, inventory = write(tmp_path)
    book = load_playbook(playbook)
    book = replace(book, rollout=replace(book.rollout, canary=1, bake_s=30.0))
    fake, seen = FakeConnector(Host()), Said()
    run = Deployment(book, load_inventory(inventory), OPTIONS, seen, fake, limit=["a"]).deploy()
    assert run.ok and [h.name for h in run.hosts] == ["a"], [h.gates for h in run.hosts]
    assert "no bake: every host of this run (1) is in the canary batch (rollout.canary 1)" in "\n".join(seen.said)
    assert "bake" not in run.hosts[0].gates


def test_hosts_an_interrupt_kept_from_starting_are_named_interrupted_not_over_the_failure_budget(
    tmp_path: Path,
) -> None:
    """One host at a time with ``max_failures: 0``: a first Ctrl-C lands while the first host is in
    flight. It finishes READY; the next is not started, and neither is the third, for the same
    reason: the interrupt (the second was counted as a failure, and the third was named "not
    attempted: over max_failures", as if a host had failed)."""
    playbook, inventory = write(tmp_path)
    containers = {name: {"address": f"192.0.2.{i + 1}"} for i, name in enumerate(("a", "b", "c"))}
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu": {"containers": containers}}}))
    book = load_playbook(playbook)
    book = replace(book, rollout=replace(book.rollout, batch_size=1, max_failures=0))
    options = replace(OPTIONS, forks=1, interrupt=Stop())
    host = Host()

    def interrupting(target: Target, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        options.interrupt.set()  # a Ctrl-C while the first host is in flight
        return host(target, ops)

    run = Deployment(book, load_inventory(inventory), options, Seen(), FakeConnector(interrupting)).deploy()
    assert run.interrupted and [h.name for h in run.hosts] == ["a", "b", "c"]
    a, b, c = run.hosts
    assert a.ready, a.gates
    for h in (b, c):
        assert (
            h.failed_gate == "interrupted" and h.gates["interrupted"].detail == "not started: the run was interrupted"
        )
        assert "rollout" not in h.gates


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"forks": 0}, "forks: expected a whole number from 1 to 1000000, got 0"),
        ({"forks": 10**20}, "forks: expected a whole number from 1"),
        ({"forks": True}, "forks: expected a whole number"),
        ({"forks": 2.5}, "forks: expected a whole number"),
        ({"lock_timeout": float("nan")}, "lock_timeout: expected seconds from 0 to 604800, got nan"),
        ({"lock_timeout": -1}, "lock_timeout: expected seconds"),
        ({"lock_timeout": 1e300}, "lock_timeout: expected seconds"),
        ({"lock_timeout": "60"}, "lock_timeout: expected seconds"),
        ({"release_id": "../../etc"}, "release_id: '../../etc': a release id is 1 to 128"),
        ({"release_id": ".hidden"}, "not starting with '.'"),
        ({"release_id": ""}, "release_id: '': a release id"),
        ({"skip_containers": "no"}, "skip_containers: expected true or false"),
        ({"state_dir": "/tmp/x"}, "state_dir: expected a Path"),
    ],
)
def test_run_options_from_python_are_checked_as_the_cli_checks_them(options: dict[str, Any], said: str) -> None:
    """The library does everything the CLI does, its checks included: forks=0 waited for ever, a
    release id is a directory on every host, a NaN lock timeout never timed out."""
    with pytest.raises(InputError) as refused:
        RunOptions(**options)
    assert str(refused.value).startswith("RunOptions: ") and said in str(refused.value)
    assert refused.value.exit_code == 2


def test_retry_policy_and_rollback_targets_are_checked_by_the_library(tmp_path: Path) -> None:
    from orchestrator.connectors.base import RetryPolicy

    for policy, said in [
        (RetryPolicy(attempts=0), "retry.attempts: expected a whole number from 1 to 100, got 0"),
        (RetryPolicy(initial_wait=float("inf")), "retry.initial_wait: expected seconds"),
        (RetryPolicy(max_wait=-1.0), "retry.max_wait: expected seconds"),
    ]:
        with pytest.raises(InputError, match=said):
            RunOptions(retry=policy)
    playbook, inventory = write(tmp_path)
    fake = FakeConnector(Host())
    deployment = Deployment(load_playbook(playbook), load_inventory(inventory), OPTIONS, connector=fake)
    for to in ("../x", "a/b", ".x", ""):
        with pytest.raises(InputError, match=r"rollback to: .* a release id is 1 to 128"):
            deployment.rollback(to=to)
    assert not fake.batches  # refused before any host


def test_watchers_of_one_playbook_name_but_other_hosts_are_another_watch_group(tmp_path: Path) -> None:
    """By name alone, a second playbook of that name (another team's, other hosts) joined the
    first's watch group, and as its follower never recorded or paged anything. The default group
    is the name and a digest of the hosts: the same hosts from any copy of the file share it."""
    playbook, inventory = write(tmp_path)
    book, inv = load_playbook(playbook), load_inventory(inventory)
    a, b, both = Deployment(book, inv, limit=["a"]), Deployment(book, inv, limit=["b"]), Deployment(book, inv)
    assert a.watch_group.startswith(f"{book.name}@") and len({a.watch_group, b.watch_group, both.watch_group}) == 3
    copy = tmp_path / "copy"
    copy.mkdir()
    again = Deployment(load_playbook(write(copy)[0]), load_inventory(write(copy)[1]), limit=["a"])
    assert again.watch_group == a.watch_group
