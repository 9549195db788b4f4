"""What a restart reuses and what it goes back to, through the real agent and the ``local``
connector (the stand-in serving side, as test_runs.py): vLLM's pass on a command kept on the host
(the engine check is most of a warm restart's own time), and the commands a host recorded so that a
failed start goes back to the command its READY record was proven with. Both are files of the
deploy root that a command is taken from or run: each is used only as the agent wrote it.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.unit.localbox import Box, alive, deploy, host, verify


def test_a_restart_of_a_command_vllm_passed_is_not_asked_again(box: Box) -> None:
    """vLLM's pass on a command is kept on the host, signed with the controller's key: a restart
    of that very command from a new release (files only) is not asked again while the models'
    configs (by content), the interpreter, its import path and vLLM's files are as they were; a
    drafter config that changed is asked about, and a kept line edited or planted without the key
    is never taken for vLLM's word (the engine check is most of a warm restart's own time)."""
    first = deploy(box, box.playbook())
    engine = host(first, "solo").gates["engine"]
    assert first.ok and engine.data["cached"] is False
    cache = box.root("solo") / ".engine-cache"
    assert len(cache.read_text().splitlines()) == 1
    kept = "(its verdict on this command kept on the host: nothing it depends on changed)"

    (box.dir / "notes.txt").write_text("a new release\n")
    files_only = deploy(box, box.playbook())
    engine = host(files_only, "solo").gates["engine"]
    assert files_only.ok and files_only.release_id != first.release_id
    assert engine.data["cached"] is True and engine.detail.endswith(kept), engine.detail
    assert engine.detail.startswith("vLLM 0.33.0 accepts the command: target Qwen3ForCausalLM")

    other = {"initializer_range": 0.03}
    changed = deploy(box, box.playbook(drafter=other))
    engine = host(changed, "solo").gates["engine"]
    assert changed.ok and engine.data["cached"] is False and kept not in engine.detail

    # The newest line edited (vLLM's version), its signature left as it was: not vLLM's word.
    lines = cache.read_text().splitlines()
    mac, body = lines[0].split(" ", 1)
    entry = json.loads(body)
    entry["verdict"]["version"] = "9.9.9"
    cache.write_text("\n".join([f"{mac} {json.dumps(entry, sort_keys=True)}", *lines[1:]]) + "\n")
    (box.dir / "notes.txt").write_text("a third release\n")
    edited = deploy(box, box.playbook(drafter=other))
    engine = host(edited, "solo").gates["engine"]
    assert edited.ok and engine.data["cached"] is False and "9.9.9" not in engine.detail


@pytest.mark.parametrize(
    "damage", ["readable by others", "another user's", "a link to ours", "a FIFO", "not JSON", "not our command"]
)
def test_a_recorded_command_not_kept_as_ours_is_never_run(box: Box, damage: str) -> None:
    """The command a host recorded is run when going back, so only a regular file of our own that
    no one else may read or write, holding the very command (its digest) the READY record's server
    ran, is used: else the playbook's command is the only one (here it fails: stopped)."""
    first = deploy(box, box.playbook())
    assert first.ok
    run_dir = box.root("solo") / "run"
    store = run_dir / "dflash-serve.commands"
    entries = json.loads(store.read_text())
    if damage == "readable by others":
        store.chmod(0o644)
    elif damage == "a link to ours":
        copy = box.dir / "commands-copy"
        copy.write_text(store.read_text())
        copy.chmod(0o600)
        store.unlink()
        store.symlink_to(copy)
    elif damage == "another user's":
        os.chown(store, 65534, 65534)
    elif damage == "a FIFO":
        store.unlink()
        os.mkfifo(store, 0o600)
    elif damage == "not JSON":
        store.write_text("[{")
    else:  # planted: another argv under the record's digest
        entries[0]["argv"] = [*entries[0]["argv"], "--planted"]
        store.write_text(json.dumps(entries))
        store.chmod(0o600)
    run = deploy(box, box.playbook("broken", env={"STANDIN_FAIL_START": "1"}))
    solo = host(run, "solo")
    assert not run.ok and "no other server command is recorded" in solo.diagnosis[-1], (solo.diagnosis, solo.gates)
    assert not alive(box.pid("solo"))
    assert "--planted" not in (box.root("solo") / "logs" / "dflash-serve.log").read_text()


@pytest.mark.parametrize("damage", ["a FIFO", "a link", "oversized"])
def test_a_kept_verdict_file_not_ours_is_neither_read_through_nor_written_through(box: Box, damage: str) -> None:
    """What stands where the kept verdicts go is never opened so as to block (a FIFO), read or
    written through (a link: the file it names stays as it was), or read at all past its bound:
    vLLM is asked, the restart goes on, and the agent's own file takes its place."""
    first = deploy(box, box.playbook())
    assert first.ok
    cache = box.root("solo") / ".engine-cache"
    ours = cache.read_bytes()
    cache.unlink()
    outside = box.dir / "elsewhere"
    if damage == "a FIFO":
        os.mkfifo(cache)
    elif damage == "a link":
        outside.write_bytes(ours)  # what the agent wrote, signed: still not read through a link
        cache.symlink_to(outside)
    else:
        cache.write_bytes(ours * (1 + (1 << 20) // len(ours)))
    (box.dir / "notes.txt").write_text("a new release\n")
    run = deploy(box, box.playbook())
    engine = host(run, "solo").gates["engine"]
    assert run.ok and engine.data["cached"] is False, engine.detail
    assert cache.is_file() and not cache.is_symlink() and len(cache.read_text().splitlines()) == 1
    if damage == "a link":
        assert outside.read_bytes() == ours


@pytest.mark.parametrize("change", ["the target's config edited in place", "vLLM upgraded in place"])
def test_a_kept_verdict_is_asked_again_when_what_it_depends_on_changed(
    box: Box, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The same command and drafter, but the target's config.json rewritten where it stands (a new
    model put in place), or vLLM's package directory replaced (an upgrade): vLLM is asked again."""
    package = box.dir / "vllm-package"
    package.mkdir()
    monkeypatch.setenv("STANDIN_VLLM_PACKAGE", str(package))  # the agent's environment, not the command's
    first = deploy(box, box.playbook())
    assert first.ok and host(first, "solo").gates["engine"].data["cached"] is False
    (box.dir / "notes.txt").write_text("a new release\n")
    same = deploy(box, box.playbook())
    assert same.ok and host(same, "solo").gates["engine"].data["cached"] is True
    if change == "vLLM upgraded in place":
        package.rename(box.dir / "vllm-package-old")
        package.mkdir()
    else:
        config = box.dir / "target" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "initializer_range": 0.03}))
    (box.dir / "notes.txt").write_text("a third release\n")
    run = deploy(box, box.playbook())
    engine = host(run, "solo").gates["engine"]
    assert run.ok and engine.data["cached"] is False, engine.detail


def test_a_start_whose_command_cannot_be_recorded_still_serves(box: Box) -> None:
    """A directory where the recorded commands go: the server started, and is proven READY; only
    a later going back lacks the record (the playbook's command is used then)."""
    store = box.root("solo") / "run" / "dflash-serve.commands"
    store.mkdir(parents=True)
    (store / "kept").write_text("an operator's file\n")
    run = deploy(box, box.playbook())
    assert run.ok, host(run, "solo").gates
    assert store.is_dir() and (store / "kept").read_text() == "an operator's file\n"


def test_verify_engine_asks_vllm_itself_not_the_kept_pass(box: Box) -> None:
    """``verify --engine`` is the operator asking the installed vLLM now: the kept pass does not
    answer it (a deploy's restart may use it)."""
    playbook = box.playbook()
    assert deploy(box, playbook).ok
    assert (box.root("solo") / ".engine-cache").is_file()
    asked = host(verify(box, playbook, engine=True), "solo").gates["engine"]
    assert asked.ok and asked.data["cached"] is False and "kept on the host" not in asked.detail
