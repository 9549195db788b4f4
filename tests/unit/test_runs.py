"""Whole runs through the real engine and the real agent, on this machine: the ``local`` connector.

No root, no SSH, no network beyond loopback: every "container" is a ``connection: local`` entry of
the inventory with its own deploy root under the test's directory, and the agent runs as a local
subprocess exactly as it runs over SSH. The serving side is ``standin_vllm.py`` (see its
docstring: real vLLM is what tests/integration runs; here only the speed differs). Deploys,
verifies, rollbacks and stops of single hosts and of a two-node group, with their failure paths.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

import orchestrator
from orchestrator.agent import protocol
from orchestrator.agent.client import AgentClient
from orchestrator.cli import main as cli
from orchestrator.config.playbook import load_playbook
from orchestrator.connectors.local import LocalConnector
from orchestrator.deployment import Deployment
from orchestrator.errors import AgentError
from tests.unit.localbox import (
    GOOD_MASK,
    OPTIONS,
    Box,
    K,
    alive,
    deploy,
    ended,
    files_only_book,
    free_port,
    host,
    immutable,
    rollback,
    stop,
    verify,
)


def test_one_host_ready_refused_rolled_back_rolled_back_again_and_stopped(box: Box) -> None:
    good_pb = box.playbook()
    first = deploy(box, good_pb)
    solo = host(first, "solo")
    assert first.ok, solo.gates
    assert solo.gates["acceptance"].data["mean_acceptance_length"] == K + 1
    assert list(solo.gates) == [
        "lint",
        "connect",
        "files",
        "loader",
        "build",
        "engine",
        "health",
        "acceptance",
        "ready",
    ]
    # stage (the checks started), launch beside the checks, switch+proof, READY record
    assert solo.ssh == {"connects": 0, "execs": 4, "retries": 0}
    good, server = first.release_id, box.pid("solo")
    assert box.current("solo") == f"releases/{good}" and alive(server)
    assert verify(box, good_pb, probe=True).ok

    # The incident: a drafter config the server accepts, healthy, with ~0% of drafts accepted.
    bad = deploy(box, box.playbook("bad", mask=6))
    solo = host(bad, "solo")
    assert not bad.ok and not solo.gates["acceptance"].ok
    assert solo.gates["acceptance"].data["mean_acceptance_length"] == 1.0
    assert any("mask_token_id (6)" in d for d in solo.diagnosis)
    back = f"rolled back: release {good} is current again, healthy and READY"
    assert any(d.startswith(back) for d in solo.diagnosis), solo.diagnosis
    assert box.current("solo") == f"releases/{good}" and not alive(server)
    assert verify(box, good_pb).ok

    # `rollback` goes to the previous release (the bad one): refused, and the good one back again.
    refused = rollback(box, good_pb)
    solo = host(refused, "solo")
    assert not refused.ok and solo.release_id == bad.release_id and not solo.gates["acceptance"].ok
    assert any(d.startswith(back) for d in solo.diagnosis) and box.current("solo") == f"releases/{good}"
    assert verify(box, good_pb).ok

    stopped = stop(box, good_pb)
    assert stopped.ok and host(stopped, "solo").gates["stopped"].detail.startswith("stopped pid")
    assert not alive(box.pid("solo"))
    after = verify(box, good_pb)
    assert not after.ok and host(after, "solo").gates["health"].detail == "the server is not running"


def test_lint_errors_stop_the_deploy_before_anything_is_touched(box: Box) -> None:
    playbook = box.playbook(mask=65)  # past the target vocabulary (64): an error
    run = deploy(box, playbook)
    assert not run.ok and host(run, "solo").gates["lint"].detail.startswith("not attempted")
    assert not box.root("solo").exists()


def test_a_release_that_cannot_be_staged_leaves_current_and_no_staging(box: Box) -> None:
    first = deploy(box, box.playbook())
    assert first.ok
    (box.dir / "notes.txt").write_text("other notes\n")
    changed = box.playbook("changed")
    # A retried batch may find its release id taken; with other content it must refuse.
    run = deploy(box, changed, release_id=first.release_id)
    detail = host(run, "solo").gates["files"].detail
    assert not run.ok and f"release {first.release_id} exists with other content" in detail
    assert box.current("solo") == f"releases/{first.release_id}"
    assert not [p for p in (box.root("solo") / "releases").iterdir() if p.name.startswith(".")]
    assert alive(box.pid("solo"))  # the server that ran was not touched


def test_a_locked_deploy_root_waits_then_fails_naming_the_holder(box: Box) -> None:
    playbook = box.playbook()
    box.root("solo").mkdir(parents=True)
    with open(box.root("solo") / ".lock", "w") as held:
        held.write('{"owner": "alice@other-controller"}')
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        run = deploy(box, playbook, lock_timeout=0.3)
    detail = host(run, "solo").gates["files"].detail
    assert not run.ok and "locked by another run" in detail and "alice@other-controller" in detail
    assert not (box.root("solo") / "current").exists()


def liar(box: Box, edit: str) -> str:
    """A host that runs the real agent and then lies in its answer (``edit`` rewrites the JSON)."""
    script = box.dir / "liar.py"
    script.write_text(
        "import json, subprocess, sys\n"
        "real = subprocess.run([sys.executable, *sys.argv[1:]], input=sys.stdin.buffer.read(), capture_output=True)\n"
        "answer = json.loads(real.stdout)\n"
        f"{edit}\n"
        "sys.stdout.write(json.dumps(answer))\n"
    )
    wrapper = box.dir / "bin" / "lying-python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def with_python(box: Box, name: str, python: str) -> None:
    data = yaml.safe_load(box.inventory_path.read_text())
    data["hosts"]["this-box"]["containers"][name]["python"] = python
    box.inventory_path.write_text(yaml.safe_dump(data))


def test_a_host_whose_read_back_disagrees_with_our_copy_is_not_ready(box: Box) -> None:
    """The controller checks every digest against its own copy, not only the agent's word."""
    edit = "answer['results'][1]['result']['files'][0]['sha256'] = '0' * 64"
    with_python(box, "solo", liar(box, edit))
    run = deploy(box, box.playbook())
    detail = host(run, "solo").gates["files"].detail
    assert not run.ok and detail.startswith("read-back differs") and "0" * 64 in detail
    assert "health" not in host(run, "solo").gates  # nothing was launched


def test_a_host_answering_in_the_wrong_shape_fails_its_gate_clearly(box: Box) -> None:
    edit = "answer['results'][0]['result'] = {'waited_s': 'soon'}"
    with_python(box, "solo", liar(box, edit))
    run = deploy(box, box.playbook())
    detail = host(run, "solo").gates["files"].detail
    assert not run.ok and detail == "lock answered badly: 'waited_s' is str, expected float (exit 0)"


def test_a_server_that_does_not_start_is_stopped_and_what_was_ready_started_again(box: Box) -> None:
    """A start that fails goes back to the release that was current *and* to the server command its
    READY record was proven with, as the host recorded that launch: the playbook's command (a flag,
    a variable) is the one that failed. A deploy that changed only the command and failed once left
    nothing serving ("already current ... stopped"), and a new release with a broken command took
    its failing command back to the old release."""
    good_pb = box.playbook()
    first = deploy(box, good_pb)
    assert first.ok
    proven = box.pid("solo")
    store = box.root("solo") / "run" / "dflash-serve.commands"
    assert store.stat().st_mode & 0o777 == 0o600  # the environment may hold secrets
    (box.dir / "notes.txt").write_text("a new release\n")
    broken = box.playbook("broken", env={"STANDIN_FAIL_START": "1", "STANDIN_GOOD_MASK": str(GOOD_MASK)})
    run = deploy(box, broken)
    solo = host(run, "solo")
    assert not run.ok and not solo.gates["health"].ok
    assert (
        "the server process exited" in solo.gates["health"].detail
        and "stand-in told to fail" in solo.gates["health"].detail
    )
    back = (
        f"rolled back: release {first.release_id} is current again with the server command it was READY with, "
        "healthy and READY"
    )
    assert any(d.startswith(back) for d in solo.diagnosis), solo.diagnosis
    assert box.current("solo") == f"releases/{first.release_id}"
    assert box.pid("solo") != proven and alive(box.pid("solo")) and not alive(proven)
    assert verify(box, good_pb, probe=True).ok  # the very command the good playbook gives

    # The command alone changed (the files of the current release): the same, by the command.
    (box.dir / "notes.txt").write_text("release notes\n")
    run = deploy(box, box.playbook("broken-again", env={"STANDIN_FAIL_START": "1"}))
    solo = host(run, "solo")
    assert not run.ok and "stand-in told to fail" in solo.gates["health"].detail
    assert solo.diagnosis[-1].startswith(back), solo.diagnosis
    checked = verify(box, good_pb)
    assert alive(box.pid("solo")) and checked.ok, host(checked, "solo").gates

    # The command changed its port too: the command READY was proven with is started and proven
    # where it listened (it was looked for on the new port, not found, and nothing served).
    moved = box.playbook("broken-moved", port=free_port(), env={"STANDIN_FAIL_START": "1"})
    run = deploy(box, moved)
    solo = host(run, "solo")
    assert not run.ok and "stand-in told to fail" in solo.gates["health"].detail
    assert solo.diagnosis[-1].startswith(back), solo.diagnosis
    checked = verify(box, good_pb)
    assert alive(box.pid("solo")) and checked.ok, host(checked, "solo").gates

    # No other command recorded (the host lost it): nothing to go back to, said, and stopped.
    store.unlink()
    run = deploy(box, box.playbook("broken-again", env={"STANDIN_FAIL_START": "1"}))
    assert not run.ok and host(run, "solo").diagnosis[-1].startswith(
        f"release {first.release_id} was already current and does not pass with this playbook's serving settings, "
        "and no other server command is recorded as READY with it: stopped"
    )
    assert not alive(box.pid("solo"))


def test_a_kept_server_that_fails_its_proof_is_started_afresh_from_its_release(box: Box) -> None:
    """Nothing changed, so the running server is kept and proven again in place; it fails (it
    re-read a drafter config that was wrong for a moment, as the founding incident's server read a
    stale one). Its release's files are right, so its own command is started afresh from them and
    proven: it was stopped, and nothing served."""
    book = box.playbook()
    first = deploy(box, book)
    assert first.ok
    pid = box.pid("solo")
    config = box.root("solo") / "releases" / str(first.release_id) / "drafter" / "config.json"
    good = config.read_bytes()
    config.write_text(json.dumps({**json.loads(good), "dflash_config": {"mask_token_id": 0, "target_layer_ids": [1]}}))
    os.kill(pid, signal.SIGHUP)  # the server reads its drafter config again: now no draft is accepted

    def reloaded() -> bool:  # its counters start again at a reload
        with urllib.request.urlopen(f"http://127.0.0.1:{box.port}/metrics", timeout=5) as answer:
            return "vllm:spec_decode_num_drafts_total{" in (text := answer.read().decode()) and (
                re.search(r"vllm:spec_decode_num_drafts_total\{[^}]*\} 0\.0", text) is not None
            )

    deadline = time.monotonic() + 30
    while not reloaded():
        assert time.monotonic() < deadline, "the server did not re-read its drafter config"
        time.sleep(0.05)
    config.write_bytes(good)  # the file is right again: nothing for a deploy to change
    run = deploy(box, book)
    solo = host(run, "solo")
    assert not run.ok and not solo.gates["acceptance"].ok, solo.gates  # the kept server, proven in place
    assert solo.diagnosis[-1].startswith(
        f"rolled back: release {first.release_id} is current again, its server (kept in place, failed its proof) "
        "started afresh from it, healthy and READY"
    ), solo.diagnosis
    assert box.pid("solo") != pid and alive(box.pid("solo")) and not alive(pid)
    assert verify(box, book, probe=True).ok


def test_the_engine_gate_refuses_a_command_before_anything_serving_is_touched(box: Box) -> None:
    """vLLM's own verdict on the new command comes before the switch and the stop: a refusal
    fails the engine gate in vLLM's words, and the release that served still serves, by the same
    process, READY as it was. A redeploy that changes nothing does not ask again."""
    first = deploy(box, box.playbook())
    solo = host(first, "solo")
    assert first.ok and solo.gates["engine"].detail == (
        "vLLM 0.33.0 accepts the command: target Qwen3ForCausalLM, drafter DFlashDraftModel, V1 model runner"
    )
    server = box.pid("solo")
    again = deploy(box, box.playbook())
    assert again.ok and host(again, "solo").gates["engine"].detail == "not asked: the server already runs this command"
    ready = (box.root("solo") / "ready.json").read_bytes()
    (box.dir / "notes.txt").write_text("a new release\n")
    words = "Total number of attention heads (3) must be divisible by tensor parallel size (2)."
    refused = deploy(box, box.playbook("refused", env={"STANDIN_ENGINE_REFUSE": words}))
    solo = host(refused, "solo")
    assert not refused.ok and solo.failed_gate == "engine"
    assert solo.gates["engine"].detail == f"vLLM 0.33.0 refuses the command: ValueError: {words}"
    assert "health" not in solo.gates and not solo.diagnosis  # nothing launched, nothing to roll back
    assert box.current("solo") == f"releases/{first.release_id}" and box.pid("solo") == server and alive(server)
    assert (box.root("solo") / "ready.json").read_bytes() == ready
    (box.dir / "notes.txt").write_text("release notes\n")  # the files of the release that serves
    assert verify(box, box.playbook()).ok


def test_a_refused_command_whose_server_cannot_be_put_back_in_rotation_says_so(box: Box) -> None:
    """A host whose new command vLLM refuses was drained first; its server, never stopped, goes
    back into rotation. Where the gateway will not take it back (here a balancer's own hook that
    refuses ``in``), the host is left out of rotation while healthy: its diagnosis says so, not
    only its gateway gate (the table showed the engine's refusal alone)."""
    state, refuse = box.dir / "lb.json", box.dir / "lb-refuses-in"
    hook = box.dir / "lb-hook"
    hook.write_text(f"""#!{sys.executable}
import json, os, sys
request = json.load(sys.stdin)
state = json.load(open({str(state)!r})) if os.path.exists({str(state)!r}) else {{"in": False}}
if request["action"] == "in" and os.path.exists({str(refuse)!r}):
    sys.exit("the balancer's configuration is read-only")
if request["action"] in ("in", "out"):
    state["in"] = request["action"] == "in"
    json.dump(state, open({str(state)!r}, "w"))
print(json.dumps({{"in_rotation": state["in"], "in_flight": 0}}))
""")
    hook.chmod(0o755)
    gateway = {"kind": "command", "runs_on": "solo", "url": f"http://127.0.0.1:{box.port}", "command": [str(hook)]}
    first = deploy(box, box.playbook(top={"gateway": gateway}, host="127.0.0.1"))
    assert first.ok, host(first, "solo").gates
    assert json.loads(state.read_text()) == {"in": True}
    server = box.pid("solo")
    (box.dir / "notes.txt").write_text("a new release\n")
    refuse.write_text("")
    words = "Total number of attention heads (3) must be divisible by tensor parallel size (2)."
    book = box.playbook("refused", env={"STANDIN_ENGINE_REFUSE": words}, top={"gateway": gateway}, host="127.0.0.1")
    refused = deploy(box, book)
    solo = host(refused, "solo")
    assert not refused.ok and not solo.gates["engine"].ok
    assert box.pid("solo") == server and alive(server)  # what served still runs
    assert json.loads(state.read_text()) == {"in": False}  # out of rotation
    assert "the balancer's configuration is read-only" in solo.gates["gateway"].detail
    said = " ".join(solo.diagnosis)
    assert "still serves, but the gateway would not take it back: out of rotation" in said, solo.diagnosis
    assert "read-only" in said


def test_a_refused_first_release_leaves_nothing_running(box: Box) -> None:
    run = deploy(box, box.playbook(mask=6))
    solo = host(run, "solo")
    assert not run.ok and not solo.gates["acceptance"].ok
    assert "no previous release to go back to: stopped (no vLLM or Ray process left)" in solo.diagnosis
    assert not alive(box.pid("solo"))


def test_on_a_host_where_nothing_serves_the_server_starts_beside_the_checks_and_stops_if_they_refuse(
    box: Box,
) -> None:
    """Nothing serves yet: the server is launched while the loader and engine checks finish (their
    time hidden behind its start), and ``current`` moves only once they pass. When vLLM refuses,
    the server started beside them is stopped and nothing was made current: as it was before."""
    words = "Total number of attention heads (3) must be divisible by tensor parallel size (2)."
    refused = deploy(box, box.playbook("refused", env={"STANDIN_ENGINE_REFUSE": words}))
    solo = host(refused, "solo")
    assert not refused.ok and solo.failed_gate == "engine", solo.gates
    assert solo.gates["engine"].detail == f"vLLM 0.33.0 refuses the command: ValueError: {words}"
    assert solo.gates["loader"].ok  # the same process answered the loader check too
    assert (
        "nothing was serving: the server started beside the checks was stopped, and current was not switched"
        in solo.diagnosis
    )
    started = box.pid("solo")  # the record of the server launched beside the checks
    assert not alive(started)
    assert not (box.root("solo") / "current").exists() and not (box.root("solo") / "ready.json").exists()
    assert not list((box.root("solo") / "run").glob("checks-*"))

    accepted = deploy(box, box.playbook())
    assert accepted.ok, host(accepted, "solo").gates
    assert box.current("solo") == f"releases/{accepted.release_id}" and alive(box.pid("solo"))


def test_the_loader_and_build_checks_run_in_the_server_s_environment(box: Box) -> None:
    """serving.env reaches the serving-Python checks as it reaches the server (a PYTHONPATH there
    would put another transformers or vLLM first): deploy's background checks and verify's alike.
    The stand-in answers with the versions its environment names."""
    env = {
        "STANDIN_GOOD_MASK": str(GOOD_MASK),
        "STANDIN_TRANSFORMERS": "4.99-from-serving-env",
        "STANDIN_VLLM": "0.32.0",
    }
    playbook = box.playbook(env=env)
    for run in (deploy(box, playbook), verify(box, playbook)):
        solo = host(run, "solo")
        assert run.ok, solo.gates
        assert "transformers 4.99-from-serving-env loads" in solo.gates["loader"].detail
        assert solo.gates["build"].detail.startswith("vllm 0.32.0")


def test_verify_reuses_the_loader_view_a_deploy_kept(box: Box) -> None:
    """A deploy's background checks keep the loader's view under the server's environment, and
    verify asks under the same one: it reuses the view, starting no serving Python for it."""
    playbook = box.playbook(env={"STANDIN_GOOD_MASK": str(GOOD_MASK), "STANDIN_LOADER_WHERE": "1"})
    deployed = deploy(box, playbook)
    assert deployed.ok, host(deployed, "solo").gates
    assert "kept on the host" not in host(deployed, "solo").gates["loader"].detail  # loaded, then kept
    checked = host(verify(box, playbook), "solo")
    assert checked.gates["loader"].detail.endswith("(the view kept on the host: nothing it depends on changed)")
    # A new command by a vLLM variable alone (the AOT guard): vLLM is asked, transformers' view reused.
    env = {"STANDIN_GOOD_MASK": str(GOOD_MASK), "STANDIN_LOADER_WHERE": "1", "VLLM_FORCE_AOT_LOAD": "0"}
    guarded = host(deploy(box, box.playbook(env=env)), "solo")
    assert guarded.gates["loader"].detail.endswith("(the view kept on the host: nothing it depends on changed)")
    assert guarded.gates["engine"].data["cached"] is False
    # Any other variable may change what transformers imports: loaded again.
    env["HF_HUB_CACHE"] = str(box.dir / "hub")
    other = host(deploy(box, box.playbook(env=env)), "solo")
    assert "kept on the host" not in other.gates["loader"].detail


def test_verify_catches_a_changed_file_and_a_restarted_server(box: Box) -> None:
    playbook = box.playbook()
    first = deploy(box, playbook)
    assert first.ok
    served = box.root("solo") / "releases" / str(first.release_id) / "drafter" / "config.json"
    kept = served.read_bytes()
    served.write_bytes(kept.replace(b'"mask_token_id": 5', b'"mask_token_id": 6'))
    drifted = host(verify(box, playbook), "solo")
    assert not drifted.gates["files"].ok and drifted.gates["files"].detail.startswith("drift:")
    assert str(served) in drifted.gates["files"].detail
    # Repaired by the next deploy, which stages a new release and starts the server on it.
    repaired = deploy(box, playbook)
    assert repaired.ok and repaired.release_id != first.release_id
    # A server restarted behind our back is healthy, but no longer the one proven READY.
    record = json.loads((box.root("solo") / "ready.json").read_text())
    record["pid"] += 1
    (box.root("solo") / "ready.json").write_text(json.dumps(record))
    restarted = host(verify(box, playbook), "solo")
    assert not restarted.gates["ready"].ok and "restarted since READY" in restarted.gates["ready"].detail


def test_rollback_with_nothing_to_go_back_to_says_so(box: Box) -> None:
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    run = rollback(box, playbook)
    assert not run.ok and host(run, "solo").gates["files"].detail == "there is no previous release to go back to"
    missing = rollback(box, playbook, to="20200101T000000Z-000000")
    assert host(missing, "solo").gates["files"].detail == "release 20200101T000000Z-000000 does not exist here"


def test_a_group_is_ready_and_a_dead_rank_fails_verify_naming_it(box: Box) -> None:
    playbook = box.group()
    run = orchestrator.Deployment(playbook, box.inventory, OPTIONS).deploy()
    assert run.ok, [(h.name, h.gates) for h in run.hosts]  # the library runs it as one group
    head, rank = host(run, "n0"), host(run, "n1")
    assert head.gates["acceptance"].data["mean_acceptance_length"] == K + 1
    assert rank.gates["health"].detail.startswith("headless rank pid")
    assert rank.gates["acceptance"].detail.startswith("through the head n0")
    for name in ("n0", "n1"):
        record = json.loads((box.root(name) / "ready.json").read_text())
        assert record["release_id"] == run.release_id and record["gates"]["group"]["nodes"] == ["n0", "n1"]
    assert verify(box, playbook, probe=True).ok

    rank = box.pid("n1")
    os.kill(rank, signal.SIGKILL)
    assert ended(rank)  # a killed process takes a moment to end on a loaded machine: verify ran before it did
    checked = verify(box, playbook)
    assert not checked.ok
    assert host(checked, "n1").gates["health"].detail == "headless rank is not running"
    assert host(checked, "n0").gates["group"].detail == "group not ready: n1 failed its health gate"


def test_a_group_whose_second_node_fails_its_files_gate_is_not_launched(box: Box) -> None:
    playbook = box.group()
    first = deploy(box, playbook)
    assert first.ok
    servers = {name: box.pid(name) for name in ("n0", "n1")}
    (box.dir / "notes.txt").write_text("new notes\n")
    with open(box.root("n1") / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        run = deploy(box, box.group(), lock_timeout=0.3)
    assert not run.ok and "locked by another run" in host(run, "n1").gates["files"].detail
    assert host(run, "n0").gates["group"].detail == "not launched: n1 failed its files gate"
    assert "health" not in host(run, "n0").gates
    assert all(alive(pid) for pid in servers.values())  # the group that ran still runs


def test_a_group_refused_by_the_probe_goes_back_to_its_release_on_every_node(box: Box) -> None:
    first = deploy(box, box.group())
    assert first.ok
    run = deploy(box, box.group("bad-group", mask=6))
    head = host(run, "n0")
    assert not run.ok and not head.gates["acceptance"].ok
    assert host(run, "n1").gates["group"].detail == "group not ready: n0 failed its acceptance gate"
    back = f"rolled back: release {first.release_id} is current again on every node, healthy and READY"
    for name in ("n0", "n1"):
        assert any(d.startswith(back) for d in host(run, name).diagnosis), host(run, name).diagnosis
        assert box.current(name) == f"releases/{first.release_id}"
    assert verify(box, box.group()).ok


def test_a_group_rollback_to_a_release_that_fails_its_gate_goes_back_as_one_group(box: Box) -> None:
    """`rollback` of a group to its previous release, whose drafter is refused through the head:
    started on every node, refused, and the release it ran started and proven again on every node."""
    first = deploy(box, box.group())
    bad = deploy(box, box.group("bad-group", mask=6))
    assert first.ok and not bad.ok
    run = rollback(box, box.group())
    head = host(run, "n0")
    assert not run.ok and head.release_id == bad.release_id and not head.gates["acceptance"].ok, head.gates
    back = f"rolled back: release {first.release_id} is current again on every node, healthy and READY"
    for name in ("n0", "n1"):
        assert any(d.startswith(back) for d in host(run, name).diagnosis), host(run, name).diagnosis
        assert box.current(name) == f"releases/{first.release_id}"
    assert verify(box, box.group()).ok


def test_a_group_rollback_needs_the_release_on_every_node(box: Box) -> None:
    """Rollback of a group whose second node fails its files gate: nothing is stopped or switched."""
    first = deploy(box, box.group())
    (box.dir / "notes.txt").write_text("second\n")
    second = deploy(box, box.group())
    assert first.ok and second.ok
    # The second node lost the first release (pruned by hand, say).
    for item in sorted((box.root("n1") / "releases" / str(first.release_id)).rglob("*"), reverse=True):
        item.unlink() if not item.is_dir() or item.is_symlink() else item.rmdir()
    (box.root("n1") / "releases" / str(first.release_id)).rmdir()
    os.unlink(box.root("n1") / "previous")
    running = {name: box.pid(name) for name in ("n0", "n1")}
    run = rollback(box, box.group(), to=first.release_id)
    assert not run.ok
    assert host(run, "n1").gates["files"].detail == f"release {first.release_id} does not exist here"
    assert host(run, "n0").gates["group"].detail == "group not rolled back: n1 failed its files gate"
    assert all(alive(pid) for pid in running.values())
    assert box.current("n0") == box.current("n1") == f"releases/{second.release_id}"
    assert verify(box, box.group()).ok


def test_stop_through_the_cli_ends_every_rank_of_a_group(box: Box, capfd: pytest.CaptureFixture[str]) -> None:
    playbook = box.group()
    assert deploy(box, playbook).ok
    pids = [box.pid("n0"), box.pid("n1")]
    state = box.dir / "state"
    code = cli.main(["stop", str(playbook.file), "-i", str(box.inventory_path), "--json", "--state-dir", str(state)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert code == 0 and all(h["gates"]["stopped"]["ok"] for h in out["hosts"])
    assert not any(alive(pid) for pid in pids)


def test_files_only_one_exec_a_host_then_dry_run_diff_and_rollback(box: Box) -> None:
    """Without a server a deploy is one exec per host (stage and switch together); the dry run
    reads what each host serves and diffs it; rollback only switches."""
    (box.dir / "a.txt").write_text("first\n")
    book = {
        "name": "files",
        "targets": ["solo", "n0"],
        "deploy_root": "/unused",
        "files": [{"src": "a.txt", "dest": "a.txt"}],
    }
    (box.dir / "files.yaml").write_text(yaml.safe_dump(book))
    playbook = load_playbook(box.dir / "files.yaml")
    first = deploy(box, playbook)
    assert first.ok and all(h.ssh == {"connects": 0, "execs": 1, "retries": 0} for h in first.hosts)
    assert (box.root("solo") / "current" / "a.txt").read_text() == "first\n"

    (box.dir / "a.txt").write_text("second\n")
    playbook = load_playbook(box.dir / "files.yaml")
    inv = box.inventory
    looked = Deployment(playbook, inv, OPTIONS).dry_run()
    assert looked.ok and all("-first\n+second\n" in h.diffs[0] for h in looked.hosts)
    assert (box.root("solo") / "current" / "a.txt").read_text() == "first\n"  # nothing written

    second = deploy(box, playbook)
    assert second.ok and (box.root("n0") / "current" / "a.txt").read_text() == "second\n"
    back = rollback(box, playbook)
    assert back.ok and all(h.release_id == first.release_id for h in back.hosts)
    assert (box.root("solo") / "current" / "a.txt").read_text() == "first\n"
    assert not verify(box, playbook).ok  # the playbook says "second"


def test_a_dry_run_never_shows_a_secret_old_or_new(box: Box) -> None:
    """Files not world-readable (on the host or as the playbook writes them), or marked secret,
    are diffed by digest only; a plain file still gets its diff."""
    for name, text in (("token.env", "TOKEN=old-s3cr3t\n"), ("key.pem", "KEY=old-key\n"), ("notes.txt", "old notes\n")):
        (box.dir / name).write_text(text)
    book = {
        "name": "secrets",
        "targets": ["solo"],
        "deploy_root": "/unused",
        "files": [
            {"src": "token.env", "dest": "token.env", "mode": "0600"},
            {"src": "key.pem", "dest": "key.pem", "secret": True},
            {"src": "notes.txt", "dest": "notes.txt"},
        ],
    }
    (box.dir / "secrets.yaml").write_text(yaml.safe_dump(book))
    assert deploy(box, load_playbook(box.dir / "secrets.yaml")).ok
    for name, text in (("token.env", "TOKEN=new-s3cr3t\n"), ("key.pem", "KEY=new-key\n"), ("notes.txt", "new notes\n")):
        (box.dir / name).write_text(text)
    playbook = load_playbook(box.dir / "secrets.yaml")
    inv = box.inventory
    looked = Deployment(playbook, inv, OPTIONS).dry_run()
    shown = json.dumps(looked.to_json())
    assert "s3cr3t" not in shown and "-key" not in shown
    assert "-old notes\\n+new notes" in shown
    assert shown.count("not shown (secret or not world-readable)") == 2


SYS_TGKILL = 234  # x86-64: a signal to one thread of a process


def thread_started(pid: int, tid: int) -> int:
    """A thread's start time, in clock ticks since boot (field 22 of its stat)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


class HeldDeploy:
    """`orchestrate deploy` of three hosts, one at a time, whose first host (n0) waits on a lock
    this test holds: nothing can start or finish before the test lets it."""

    def __init__(self, box: Box, terminal: bool = False) -> None:
        """``terminal``: the run leads a process group of its own, as a shell's foreground job
        does, so that a test can signal the group as a terminal's Ctrl-C does."""
        book = files_only_book(box, "ctrl-c", ["solo", "n0", "n1"])
        box.root("n0").mkdir(parents=True)  # the first host, in inventory order
        self.state = box.dir / "state"
        self.held = open(box.root("n0") / ".lock", "w")  # noqa: SIM115 (held across the test)
        fcntl.flock(self.held, fcntl.LOCK_EX)
        argv = [sys.executable, "-m", "orchestrator", "deploy", str(book), "-i"]
        argv += [str(box.inventory_path), "--forks", "1", "--lock-timeout", "300", "--state-dir", str(self.state)]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=terminal
        )
        self.said = ""
        deadline = time.monotonic() + 60
        while not self.agents():
            assert time.monotonic() < deadline, "the first host's agent never started"
            time.sleep(0.02)
        # The agent has read its whole request once it waits for the lock: the thread that fed it
        # stdin is done, and every thread left lives until the run ends (see ctrl_c).
        self.wait_said("waiting for the deploy root's lock")

    def agents(self) -> list[int]:
        """The run's agents (children of the orchestrate process)."""
        found = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid and b"dflash-agent" in cmdline:
                found.append(int(pid))
        return found

    def ctrl_c(self) -> None:
        """SIGINT to a thread that is not the main one: a terminal's Ctrl-C may land on any thread,
        and Python runs handlers only in the main one (once unheard until the host finished).

        The thread is the oldest but the main one (the run's worker), never the newest: a signal
        sent to a thread that is exiting (the one that fed the agent its request, say) is lost
        with it, and the run then rightly hears nothing."""
        others = [int(t) for t in os.listdir(f"/proc/{self.proc.pid}/task") if int(t) != self.proc.pid]
        assert others, "the run has no thread but the main one"
        worker = min(others, key=lambda tid: (thread_started(self.proc.pid, tid), tid))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(SYS_TGKILL, self.proc.pid, worker, signal.SIGINT) == 0, os.strerror(ctypes.get_errno())

    def wait_said(self, words: str) -> None:
        """Read the run's stderr until it has said ``words``. From the descriptor itself, not the
        text wrapper: a ``readline`` buffers what follows the line, where ``select`` no longer
        sees it, and a line already read in would be waited for in vain."""
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + 30
        while words not in self.said:
            assert time.monotonic() < deadline, f"not said within 30 s: {words!r}; said {self.said!r}"
            if select.select([fd], [], [], 0.2)[0]:
                chunk = os.read(fd, 1 << 16)
                assert chunk, f"the run ended before saying {words!r}: {self.said}"
                self.said += chunk.decode()


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sighup"])
def test_a_first_ctrl_c_finishes_the_host_in_flight_then_reports_and_records(
    box: Box, capfd: pytest.CaptureFixture[str], how: str
) -> None:
    """SIGINT to `orchestrate deploy`, SIGTERM (a service manager's stop, a CI job cancelled), or
    SIGHUP (the terminal or SSH session closed):
    no new host starts, the one in flight finishes, the table and the history row say what
    happened, exit 130. SIGTERM used to end the run at once: no table, no record, a host left
    drained. The host in flight is let go only once the run has said it took the signal:
    however slow the machine, the order is forced, not timed."""
    run = HeldDeploy(box)
    if how == "ctrl-c":
        run.ctrl_c()
        run.wait_said("interrupted: starting no new host")
    elif how == "sigterm":
        os.kill(run.proc.pid, signal.SIGTERM)
        run.wait_said("terminated (SIGTERM): starting no new host")
    else:  # the terminal or SSH session closed: it ended the run at once, unrecorded
        os.kill(run.proc.pid, signal.SIGHUP)
        run.wait_said("hung up (SIGHUP): starting no new host")
    run.held.close()  # the lock is released: the host in flight goes on and finishes
    out, err = run.proc.communicate(timeout=120)
    err = run.said + err
    assert run.proc.returncode == 130, err
    assert "Traceback" not in err
    assert out.count("not started: the run was interrupted") == 2, out
    assert "deploy: 1/3 hosts READY" in out
    assert os.readlink(box.root("n0") / "current").startswith("releases/")
    assert not (box.root("n1") / "current").exists() and not (box.root("solo") / "current").exists()
    capfd.readouterr()
    assert cli.main(["history", "--state-dir", str(run.state), "--json"]) == 0
    (recorded,) = json.loads(capfd.readouterr().out)["runs"]
    assert recorded["kind"] == "deploy" and not recorded["ok"] and recorded["hosts_total"] == 3


def test_a_second_ctrl_c_aborts_at_once_and_the_host_in_flight_stays_consistent(box: Box) -> None:
    """The second Ctrl-C ends the run at once (it used to wait for the host in flight: here, a lock
    held for up to 300 s); that host's agent finishes its atomic steps on its own."""
    run = HeldDeploy(box)
    agents = run.agents()
    run.ctrl_c()
    run.wait_said("interrupted: starting no new host")
    started = time.monotonic()
    run.ctrl_c()
    try:
        _out, err = run.proc.communicate(timeout=30)
    finally:
        run.held.close()
    assert run.proc.returncode == 130 and time.monotonic() - started < 30
    assert "aborted: not waiting for the hosts in flight" in err and "Traceback" not in err
    deadline = time.monotonic() + 60
    while any(alive(a) for a in agents):  # let go of the lock, the agent ends its batch
        assert time.monotonic() < deadline, "the aborted run's agent did not end"
        time.sleep(0.05)
    current = box.root("n0") / "current"
    if current.is_symlink():  # it may have finished its release, never half of one
        assert (current / "a.txt").read_text() == "a\n"
    assert not list(box.root("n0").glob("releases/.staging*"))
    assert not (box.root("n1") / "current").exists() and not (box.root("solo") / "current").exists()


def test_a_run_whose_record_fails_still_says_what_the_hosts_did(box: Box) -> None:
    """The state database takes the run's first write (checked before any host), then stops taking
    writes while the run is held on a lock: the table still reaches stdout, the failure to record
    is said, and the exit code is the run's. Its result used to be lost with the record."""
    run = HeldDeploy(box)
    immutable(run.state, True)
    try:
        run.held.close()  # the host in flight goes on, and every other after it
        out, err = run.proc.communicate(timeout=120)
    finally:
        immutable(run.state, False)
    assert run.proc.returncode == 0, run.said + err
    assert "deploy: 3/3 hosts READY" in out
    assert "error: the run was not recorded: state database" in err and "Traceback" not in err


def test_a_terminals_ctrl_c_reaches_the_controller_never_its_local_agent(box: Box) -> None:
    """Ctrl-C at a terminal signals its whole foreground process group. A local agent used to be
    in it and died mid-batch (current on an unproven release, the old server stopped); it now has
    a session of its own, as a remote agent under sshd does: the run aborts, the agent finishes
    its batch once the lock it waits on is free, and the host holds a whole release."""
    run = HeldDeploy(box, terminal=True)
    agents = run.agents()
    os.killpg(run.proc.pid, signal.SIGINT)
    run.wait_said("interrupted: starting no new host")
    os.killpg(run.proc.pid, signal.SIGINT)
    try:
        run.proc.communicate(timeout=30)
        assert run.proc.returncode == 130
        assert all(alive(a) for a in agents)  # not in the group the terminal signalled
    finally:
        run.held.close()
    deadline = time.monotonic() + 60
    while any(alive(a) for a in agents):
        assert time.monotonic() < deadline, "the agent did not finish its batch"
        time.sleep(0.05)
    assert (box.root("n0") / "current" / "a.txt").read_text() == "a\n"
    assert not list(box.root("n0").glob("releases/.staging*"))


def test_verify_and_the_dry_run_never_write_not_even_the_deploy_root(box: Box) -> None:
    playbook = box.playbook()
    assert not verify(box, playbook).ok
    inv = box.inventory
    looked = Deployment(playbook, inv, OPTIONS).dry_run()
    assert looked.ok and host(looked, "solo").gates["files"].detail == "dry run: 2 of 2 files would change"
    assert not rollback(box, playbook).ok  # nothing to go back to; and nothing made
    (box.dir / "a.txt").write_text("a\n")
    files = {
        "name": "files",
        "targets": ["solo"],
        "deploy_root": "/unused",
        "files": [{"src": "a.txt", "dest": "a.txt"}],
    }
    (box.dir / "files.yaml").write_text(yaml.safe_dump(files))
    refused = rollback(box, load_playbook(box.dir / "files.yaml"))  # files only: the same first look
    assert host(refused, "solo").gates["files"].detail == "there is no previous release to go back to"
    assert not box.root("solo").exists()


def test_a_release_whose_tau_fell_against_the_last_ready_one_is_refused_and_rolled_back(box: Box) -> None:
    """Acceptance held to its history: the same target and drafter weights, prompts and K, with a
    setting of the server that costs acceptance (the stand-in's STANDIN_ACCEPTED, as a flag or a
    vLLM upgrade would) but stays above the absolute threshold, is refused with both numbers."""
    env = {"STANDIN_GOOD_MASK": str(GOOD_MASK)}
    good_pb = box.playbook(env=env)
    first = deploy(box, good_pb)
    solo = host(first, "solo")
    assert first.ok, solo.gates
    data = solo.gates["acceptance"].data
    assert data["regression"] == "no earlier READY record with a probe: this starts the acceptance history"
    assert data["num_speculative_tokens"] == K and len(data["history"]) == len(data["prompts_sha256"]) == 64
    ready = json.loads((box.root("solo") / "ready.json").read_text())
    assert ready["gates"]["acceptance"]["mean_acceptance_length"] == K + 1  # the history lives on the host

    # tau 7 against 8: above the gate's 4.0, but 12% below the last READY release (at most 10%).
    # (Its release notes differ too: a release of its own files, for the rollback below.)
    notes = (box.dir / "notes.txt").read_text()
    (box.dir / "notes.txt").write_text("slower\n")
    slower_pb = box.playbook("slower", env={**env, "STANDIN_ACCEPTED": str(K - 1)})
    slower = deploy(box, slower_pb)
    (box.dir / "notes.txt").write_text(notes)
    solo = host(slower, "solo")
    assert (
        not slower.ok and solo.failed_gate == "acceptance" and solo.gates["acceptance"].reason == "acceptance_regressed"
    )
    assert solo.gates["acceptance"].detail == (
        f"tau 7.00 fell 12% below the 8.00 of the last READY release {first.release_id} (the same target and "
        "drafter weights, prompts and K; at most 10%: gates.acceptance.max_regression)"
    )
    assert box.current("solo") == f"releases/{first.release_id}"  # rolled back to what was READY
    assert json.loads((box.root("solo") / "ready.json").read_text())["release_id"] == first.release_id
    # the time split: the going back's vLLM start and probe are vLLM's time, not the tool's own
    split = solo.time
    assert split is not None and split["rollback_s"] > 0, split
    parts = ("vllm_start_s", "probe_s", "rollback_s", "tool_s")
    assert sum(split[k] for k in parts) == pytest.approx(split["seconds"], abs=0.3), split

    # `rollback` to the slower release (with its command) proves it like a deploy: refused by the
    # same history, and the READY release started and proven again.
    refused = rollback(box, slower_pb, to=str(slower.release_id))
    solo = host(refused, "solo")
    assert not refused.ok and solo.release_id == slower.release_id, solo.gates
    assert solo.gates["health"].ok and solo.gates["acceptance"].reason == "acceptance_regressed", solo.gates
    back = f"rolled back: release {first.release_id} is current again with the server command it was READY with"
    assert any(d.startswith(back) for d in solo.diagnosis), solo.diagnosis
    assert box.current("solo") == f"releases/{first.release_id}" and verify(box, good_pb).ok

    # With a looser tolerance the same release passes, and says what it was compared with.
    loose = box.playbook(
        "loose", env={**env, "STANDIN_ACCEPTED": str(K - 1)}, top={"gates": {"acceptance": {
            "min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32, "max_regression": 0.2}}},
    )  # fmt: skip
    passed = deploy(box, loose)
    assert passed.ok, host(passed, "solo").gates
    assert host(passed, "solo").gates["acceptance"].data["regression"] == (
        f"tau 7.00 against 8.00 of the last READY release {first.release_id} (floor 6.40)"
    )
    # An unchanged redeploy is held to the 7.00 it now has, and passes.
    again = deploy(box, loose)
    assert again.ok and host(again, "solo").gates["acceptance"].data["regression"].startswith("tau 7.00 against 7.00")

    # Another K starts a new history, said; so do other prompts.
    other_k = deploy(box, box.playbook("k5", env=env, num_speculative_tokens=5))
    assert other_k.ok and host(other_k, "solo").gates["acceptance"].data["regression"] == (
        f"a new acceptance history: K is 5, release {host(again, 'solo').release_id} was probed with {K}"
    )


def test_verify_engine_asks_the_installed_vllm_about_the_served_command(box: Box) -> None:
    """verify --engine: the engine gate on the command the current release is served with, as vLLM
    is installed now (an upgrade under a running server refuses it here, not at the next restart)."""
    env = {"STANDIN_GOOD_MASK": str(GOOD_MASK)}
    pb = box.playbook(env=env)
    first = deploy(box, pb)
    assert first.ok
    plain = verify(box, pb)
    assert plain.ok and "engine" not in host(plain, "solo").gates  # not asked unless asked for
    asked = verify(box, pb, engine=True)
    engine = host(asked, "solo").gates["engine"]
    assert asked.ok and engine.detail.startswith("vLLM 0.33.0 accepts the command: target Qwen3ForCausalLM")
    refusing = box.playbook(env={**env, "STANDIN_ENGINE_REFUSE": "Model architectures ['X'] are not supported"})
    refused = verify(box, refusing, engine=True)
    solo = host(refused, "solo")
    assert not refused.ok and not solo.gates["engine"].ok, solo.gates
    assert "are not supported" in solo.gates["engine"].detail
    assert alive(box.pid("solo"))  # verify never stops or starts anything


@pytest.mark.parametrize(
    "record",
    ["[1]", '{"release_id": "R", "gates": {"acceptance": {"mean_acceptance_length": NaN}}}', '{"gates": 3}', "{"],
)
def test_a_ready_record_that_is_not_ours_starts_a_new_history_and_blocks_nothing(box: Box, record: str) -> None:
    """ready.json edited by hand, cut short or planted: the regression check has nothing to hold
    the probe to, says so, and the deploy goes on (and writes a record of its own)."""
    pb = box.playbook()
    assert deploy(box, pb).ok
    (box.root("solo") / "ready.json").write_text(record)
    again = deploy(box, box.playbook("other", drafter={"rms_norm_eps": 1e-5}))
    solo = host(again, "solo")
    assert again.ok, solo.gates
    assert solo.gates["acceptance"].data["regression"] == (
        "no earlier READY record with a probe: this starts the acceptance history"
    )
    assert json.loads((box.root("solo") / "ready.json").read_text())["release_id"] == solo.release_id


def test_a_run_holding_more_than_1024_descriptors_still_waits_on_its_hosts(box: Box) -> None:
    """A controller with a connection per host passes 1024 open descriptors at fleet size, where
    select() refuses any ("filedescriptor out of range in select()": a 1024-host deploy died of
    it). Here 1100 descriptors are taken first, so the run's own pipes lie past 1024."""
    import resource

    from orchestrator.cli import main as cli

    cli.more_files()
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1300:
        pytest.fail("this machine's hard limit on open files is below 1300")
    held = [os.pipe() for _ in range(550)]
    try:
        assert max(fd for pair in held for fd in pair) > 1024
        playbook = box.playbook()
        run = deploy(box, playbook)
        assert run.ok, [h.gates for h in run.hosts]
        watcher = Deployment(playbook, box.inventory, OPTIONS).watcher()  # a session per host, polled
        try:
            (r,), _ = watcher.round()
            assert r.state == "READY", r.reasons
        finally:
            watcher.close()
    finally:
        for r, w in held:
            os.close(r)
            os.close(w)


def test_a_drafter_whose_heads_its_tensor_parallel_size_cannot_split_is_refused_before_any_host(box: Box) -> None:
    """vLLM's DFlash attention asserts the drafter's heads split over the tensor parallel ranks and
    the engine dies at load with a bare AssertionError (qwen3_dflash.py): 3 heads at TP 2 are
    refused by the lint gate with the TP each host would serve at, and nothing is touched."""
    playbook = box.playbook(drafter={"num_attention_heads": 3, "num_key_value_heads": 3}, tensor_parallel_size=2)
    run = deploy(box, playbook)
    assert not run.ok and host(run, "solo").gates["lint"].detail.startswith("not attempted")
    assert {(p.rule, p.field) for p in run.lint or [] if p.severity == "error"} == {
        ("heads_per_rank", "num_attention_heads"),
        ("heads_per_rank", "num_key_value_heads"),
    }
    assert not box.root("solo").exists()


def test_an_editors_save_while_the_playbook_loads_cannot_split_what_lint_judges_from_what_lands(
    box: Box, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drafter config is read once. An editor's atomic save (a new file renamed over the old
    one) lands right after the tool read the bytes it pushes: lint must judge those bytes, so the
    out-of-range mask that was read is refused, though the file now on disk is fine."""
    box.playbook(mask=999)  # the config as read: mask 999 past the target's 64 tokens
    config = box.dir / "pb-drafter.json"
    good = config.read_text().replace('"mask_token_id": 999', f'"mask_token_id": {GOOD_MASK}')
    read_bytes = Path.read_bytes
    saved: list[Path] = []

    def read_then_editor_saves(self: Path) -> bytes:
        content = read_bytes(self)
        if self == config and not saved:
            (box.dir / ".pb-drafter.json.swp").write_text(good)
            os.replace(box.dir / ".pb-drafter.json.swp", config)
            saved.append(self)
        return content

    monkeypatch.setattr(Path, "read_bytes", read_then_editor_saves)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read_then_editor_saves(self).decode())
    playbook = load_playbook(box.dir / "pb.yaml")
    monkeypatch.undo()
    assert saved and json.loads(config.read_text())["dflash_config"]["mask_token_id"] == GOOD_MASK
    assert playbook.drafter is not None and playbook.drafter.values == json.loads(playbook.drafter.config.content)
    run = Deployment(playbook, box.inventory, OPTIONS).deploy()
    assert not run.ok and host(run, "solo").gates["lint"].detail.startswith("not attempted")
    assert {p.field for p in run.lint or [] if p.severity == "error"} == {"dflash_config.mask_token_id"}
    assert not (box.root("solo") / "current").exists()


def test_a_server_killed_during_the_probe_leaves_the_host_not_ready(box: Box) -> None:
    """The server dies with the probe's third prompt in hand (its whole process group, no answer):
    not READY, the acceptance gate failed, no READY record. The controller reads a server that
    vanishes mid-probe as any: a refused connection, whatever the program was."""
    prompts = ["def sort the list of numbers and return the sum"] * 8
    run = deploy(
        box,
        box.playbook(
            env={"STANDIN_GOOD_MASK": str(GOOD_MASK), "STANDIN_DIE_AFTER": "2"},
            top={"gates": {"acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "prompts": prompts}}},
        ),
    )
    solo = host(run, "solo")
    assert not run.ok and not solo.ready, solo.gates
    assert not solo.gates["acceptance"].ok and "ready" not in solo.gates, solo.gates
    assert not (box.root("solo") / "ready.json").exists()


def test_rollback_to_the_first_release_starts_it_proves_it_and_holds_it_to_its_history(box: Box) -> None:
    """A second good release, then `rollback` to the first: switched, a new server started on it,
    proven against its own history, READY."""
    good_pb = box.playbook()
    first = deploy(box, good_pb)
    (box.dir / "notes.txt").write_text("second release\n")
    second = deploy(box, box.playbook("second"))
    assert first.ok and second.ok and second.release_id != first.release_id
    pid = json.loads((box.root("solo") / "ready.json").read_text())["pid"]
    back = rollback(box, good_pb, to=str(first.release_id))
    solo = host(back, "solo")
    assert back.ok, solo.gates
    assert solo.release_id == first.release_id and solo.previous == second.release_id
    acceptance = solo.gates["acceptance"]
    assert acceptance.data["mean_acceptance_length"] == K + 1 and solo.gates["ready"].ok
    assert acceptance.data["regression"].startswith("tau "), acceptance.data  # held to its own history
    ready = json.loads((box.root("solo") / "ready.json").read_text())
    assert ready["release_id"] == first.release_id and ready["pid"] != pid  # a new server, on it
    assert box.current("solo") == f"releases/{first.release_id}" and verify(box, good_pb).ok


@pytest.mark.parametrize("group", [False, True], ids=["one host", "a group"])
def test_rollback_to_the_release_that_runs_keeps_it_and_verify_passes_after(box: Box, group: bool) -> None:
    """`rollback --to` the current release: kept running, proven, READY, and its READY record names
    the files served (it once recorded none, and every verify after it failed: "READY record's
    digests differ from the files served"; seen on the real two-container group)."""
    playbook = box.group if group else box.playbook
    first = deploy(box, playbook())
    (box.dir / "notes.txt").write_text("second\n")
    second = deploy(box, playbook())
    assert first.ok and second.ok and second.release_id != first.release_id
    names = ["n0", "n1"] if group else ["solo"]
    pids = {name: box.pid(name) for name in names}
    run = rollback(box, playbook(), to=str(second.release_id))
    assert run.ok, [h.gates for h in run.hosts]
    for name in names:
        assert host(run, name).release_id == second.release_id and box.pid(name) == pids[name]  # kept
        assert box.current(name) == f"releases/{second.release_id}"
        assert os.readlink(box.root(name) / "previous") == f"releases/{first.release_id}"  # untouched
    after = verify(box, playbook())
    assert after.ok, [{g: v.detail for g, v in h.gates.items()} for h in after.hosts]


def test_a_server_put_to_sleep_behind_our_back_is_not_healthy_and_a_deploy_starts_it_again(box: Box) -> None:
    """vLLM's sleep mode, asked for by anyone who reaches its dev routes (``VLLM_SERVER_DEV_MODE=1``
    set in the container, outside the playbook, which refuses it): the server still answers
    /health 200 while every request waits in its queue. verify names it asleep; a deploy of the
    same release does not keep it in place (its probe would wait in the queue) but starts it again,
    READY."""
    python = box.dir / "bin" / "python"
    python.write_text(f"#!/bin/sh\nVLLM_SERVER_DEV_MODE=1 exec {python.read_text().split('exec ', 1)[1]}")
    book = box.playbook()
    assert deploy(box, book).ok
    pid = box.pid("solo")
    asleep = urllib.request.Request(f"http://127.0.0.1:{box.port}/sleep?level=1", data=b"", method="POST")
    with urllib.request.urlopen(asleep, timeout=10) as answer:
        assert json.loads(answer.read()) == {"status": "sleeping", "level": 1}
    with urllib.request.urlopen(f"http://127.0.0.1:{box.port}/health", timeout=10) as answer:
        assert answer.status == 200  # healthy, and serving nothing

    checked = verify(box, book)
    health = host(checked, "solo").gates["health"]
    assert not checked.ok and not health.ok and health.reason == "asleep", health
    assert f"pid {pid} alive and /health 200, but vLLM is asleep" in health.detail
    probed = host(verify(box, book, probe=True), "solo").gates["acceptance"]
    # said at once, not after the probe's deadline ("no whole answer ... within 220 s")
    assert not probed.ok and "not probed: vLLM is asleep (POST /sleep)" in probed.detail, probed
    load = protocol.load(box.port, "tiny", ["x"], 8, 1, 1, 120.0)  # the speed-up gate's arm, likewise
    with pytest.raises(AgentError) as refused:
        AgentClient(LocalConnector()).batch(box.inventory.resolve(["solo"])[0], [load])
    assert refused.value.failure.code == "asleep" and "not loaded: vLLM is asleep" in refused.value.failure.message

    again = deploy(box, book)
    solo = host(again, "solo")
    assert again.ok, solo.gates
    assert box.pid("solo") != pid and not alive(pid)  # started again, not kept asleep
    assert verify(box, book, probe=True).ok


# What only a host that serves needs: a files-only deploy loads none of it (each frozen dataclass
# costs a start some 0.4 ms on Python 3.11, and a controller start is paid by every command).
SERVING_ONLY = (
    "orchestrator.agent.protocol.serving",
    "orchestrator.agent.protocol.checks",
    "orchestrator.agent.protocol.background",
    "orchestrator.agent.protocol.compile_cache",
    "orchestrator.agent.protocol.gateway",
    "orchestrator.engine.compile_cache",
    "orchestrator.rules.gates.speedup",
    "orchestrator.rules.gates.acceptance",
    "orchestrator.rules.probe",
)


def test_a_files_only_deploy_loads_none_of_the_serving_code(box: Box) -> None:
    book = files_only_book(box, "files", ["solo"])
    program = (
        "import sys\n"
        "from orchestrator.cli.main import main\n"
        f"sys.argv = ['orchestrate', 'deploy', {str(book)!r}, '-i', {str(box.inventory_path)!r}]\n"
        "try:\n    code = main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('LOADED', ' '.join(sorted(m for m in sys.modules if m.startswith('orchestrator'))))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = next(x for x in done.stdout.splitlines() if x.startswith("LOADED ")).split()[1:]
    assert "orchestrator.engine.runs" in loaded  # the deploy ran
    assert [m for m in SERVING_ONLY if m in loaded] == []
