"""A hostile or damaged deploy root, through whole local runs and the real agent: nothing outside
what the tool made is followed, written or removed; what is its own is repaired by a deploy; verify
says exactly what differs from the release (extra files, links, modes)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.config.playbook import Playbook, load_playbook
from tests.unit.localbox import Box, alive, deploy, host, stop, verify


def files_book(box: Box, mode: str = "0644", notes: bool = True) -> Playbook:
    (box.dir / "a.txt").write_text("a\n")
    (box.dir / "b.txt").write_text("b\n")
    files = [{"src": "a.txt", "dest": "a.txt", "mode": mode}]
    if notes:
        files.append({"src": "b.txt", "dest": "sub/b.txt"})
    book = {"name": "files", "targets": ["solo"], "deploy_root": "/unused", "files": files}
    (box.dir / "files.yaml").write_text(yaml.safe_dump(book))
    return load_playbook(box.dir / "files.yaml")


def outside(box: Box, name: str = "precious") -> Path:
    path = box.dir / "elsewhere" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("not the tool's\n")
    return path


def test_links_in_place_of_the_tools_own_files_are_replaced_not_followed(box: Box) -> None:
    root = box.root("solo")
    root.mkdir(parents=True)
    victim = outside(box)
    (root / ".lock").symlink_to(victim)
    run = deploy(box, box.playbook())  # with a server: run/, logs/ and ready.json too
    assert run.ok, host(run, "solo").gates
    assert victim.read_text() == "not the tool's\n" and sorted(os.listdir(victim.parent)) == ["precious"]
    assert not (root / ".lock").is_symlink()

    assert stop(box, box.playbook()).ok  # its record is about to be damaged: end it as ours first
    for name in ("ready.json", "logs/dflash-serve.log"):
        target = root / name
        target.unlink()
        target.symlink_to(outside(box, name.replace("/", "-")))
    (box.dir / "notes.txt").write_text("a new release\n")
    again = deploy(box, box.playbook())
    assert again.ok, host(again, "solo").gates
    for name in ("ready.json", "logs-dflash-serve.log"):
        assert (victim.parent / name).read_text() == "not the tool's\n", name
    assert sorted(os.listdir(victim.parent)) == ["logs-dflash-serve.log", "precious", "ready.json"]
    assert not (root / "ready.json").is_symlink()


@pytest.mark.parametrize("name", ["releases", "run", "logs"])
def test_a_link_in_place_of_the_tools_own_directory_is_refused_and_kept(box: Box, name: str) -> None:
    """A link where the tool keeps its releases, its servers' records or their logs was made by
    someone else (an operator's tmpfs for run/, say): it is neither followed nor replaced (replacing
    run/ lost the records of what ran there), and the run says which and why."""
    root = box.root("solo")
    first = deploy(box, box.playbook())
    assert first.ok, host(first, "solo").gates
    assert stop(box, box.playbook()).ok
    kept = box.dir / "elsewhere" / name
    kept.parent.mkdir(exist_ok=True)
    os.rename(root / name, kept)
    (root / name).symlink_to(kept)
    before = sorted(str(p.relative_to(kept)) for p in kept.rglob("*"))
    (box.dir / "notes.txt").write_text("a new release\n")
    again = deploy(box, box.playbook())
    assert not again.ok
    detail = " ".join(g.detail for g in host(again, "solo").gates.values() if not g.ok)
    assert f"{root / name} is a symbolic link, not made by this tool (left alone, not followed)" in detail
    assert (root / name).is_symlink() and os.readlink(root / name) == str(kept)
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*")) == before  # nothing written through it


def test_a_damaged_current_is_repaired_when_it_is_ours_and_refused_when_it_is_not(box: Box) -> None:
    playbook = files_book(box)
    first = deploy(box, playbook)
    assert first.ok
    root = box.root("solo")
    release = root / "releases" / str(first.release_id)
    for damage in (str(release), str(outside(box).parent)):  # absolute to the right release; out of the root
        (root / "current").unlink()
        (root / "current").symlink_to(damage)
        checked = host(verify(box, playbook), "solo")
        assert not checked.ready and "not at a release under releases/" in checked.gates["files"].detail
        repaired = deploy(box, playbook)
        assert repaired.ok, host(repaired, "solo").gates
        assert os.readlink(root / "current").startswith("releases/")
        assert verify(box, playbook).ok
    (root / "current").unlink()
    (root / "current").mkdir()  # not a link: not ours to remove
    (root / "current" / "kept.txt").write_text("someone's\n")
    refused = host(deploy(box, playbook), "solo")
    assert (
        not refused.ready
        and "current exists and is not a symlink (not ours: left alone)" in refused.gates["files"].detail
    )
    assert (root / "current" / "kept.txt").read_text() == "someone's\n"


def test_a_release_file_replaced_by_a_link_is_drift_and_repaired(box: Box) -> None:
    playbook = files_book(box)
    first = deploy(box, playbook)
    root = box.root("solo")
    served = root / "releases" / str(first.release_id) / "a.txt"
    copy = root / "copy-of-a.txt"
    copy.write_text("a\n")  # identical bytes elsewhere in the root
    served.unlink()
    served.symlink_to(copy)
    checked = host(verify(box, playbook), "solo")
    assert not checked.ready and f"(a link to {copy}, not the release's own file)" in checked.gates["files"].detail
    served.unlink()
    served.symlink_to(outside(box))  # out of the root
    assert "not the release's own file" in host(verify(box, playbook), "solo").gates["files"].detail
    repaired = deploy(box, playbook)
    assert repaired.ok and repaired.release_id != first.release_id
    assert verify(box, playbook).ok and outside(box).read_text() == "not the tool's\n"


def test_the_served_tree_is_exactly_the_release(box: Box) -> None:
    """A planted file, a file the playbook dropped, and a mode changed by hand are drift; a mode
    changed in the playbook is a new release."""
    playbook = files_book(box)
    first = deploy(box, playbook)
    release = box.root("solo") / "releases" / str(first.release_id)
    (release / "sub" / "generation_config.json").write_text("{}")
    planted = host(verify(box, playbook), "solo").gates["files"].detail
    assert f"sub/generation_config.json is served but not part of release {first.release_id}" in planted
    (release / "sub" / "generation_config.json").unlink()

    os.chmod(release / "a.txt", 0o666)
    chmodded = host(verify(box, playbook), "solo").gates["files"].detail
    assert f"{release / 'a.txt'} has mode 0666, the playbook says 0644" in chmodded
    repaired = deploy(box, playbook)
    assert repaired.ok and repaired.release_id != first.release_id and verify(box, playbook).ok

    private = files_book(box, mode="0600")
    tighter = deploy(box, private)
    assert tighter.ok and tighter.release_id != repaired.release_id
    assert oct((box.root("solo") / "current" / "a.txt").stat().st_mode & 0o777) == "0o600"

    dropped = files_book(box, mode="0600", notes=False)
    assert (
        "sub/b.txt is served but no longer in the playbook" in host(verify(box, dropped), "solo").gates["files"].detail
    )


def plant(path: Path, kind: str) -> None:
    """A FIFO (an open or read of it waits for ever) or a link to an endless device, in place of
    a file."""
    if path.is_symlink() or path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", ["a.txt", ".manifest.sha256"])
def test_a_fifo_or_device_in_the_release_is_drift_not_a_hang(box: Box, name: str, kind: str) -> None:
    playbook = files_book(box)
    first = deploy(box, playbook)
    release = box.root("solo") / "releases" / str(first.release_id)
    plant(release / name, kind)
    checked = host(verify(box, playbook), "solo")
    said = checked.gates["files"].detail
    assert not checked.ready
    if name == "a.txt":
        assert said.startswith(f"drift: {release if kind == 'fifo' else box.root('solo') / 'current'}/a.txt")
    else:
        assert said == f"drift: release {first.release_id} has no readable manifest (.manifest.sha256)"
    repaired = deploy(box, playbook)
    assert repaired.ok and repaired.release_id != first.release_id, host(repaired, "solo").gates
    assert verify(box, playbook).ok


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", [".lock", "ready.json", "run/dflash-serve.json", "logs/dflash-serve.log", ".digests"])
def test_a_fifo_or_device_in_place_of_the_tools_own_file_is_replaced(box: Box, name: str, kind: str) -> None:
    playbook = box.playbook()
    first = deploy(box, playbook)
    assert first.ok
    root, server = box.root("solo"), box.pid("solo")
    plant(root / name, kind)
    (box.dir / "notes.txt").write_text("a new release: the server is started again\n")
    if name.startswith("run/"):
        # The record of the running server is gone: it cannot be stopped as ours, and whatever
        # answers on the port is not a server this root started. No READY on its word.
        orphaned = host(deploy(box, box.playbook("again")), "solo")
        try:
            assert not orphaned.ready and not orphaned.gates["health"].ok
            assert f"port {box.port} already answers" in orphaned.gates["health"].detail
        finally:
            os.kill(server, signal.SIGTERM)
        wait_gone(server)
    again = deploy(box, box.playbook("again"))
    assert again.ok, host(again, "solo").gates
    assert verify(box, box.playbook("again")).ok
    if name != ".digests":  # the cache is only written when it has something to keep
        assert (root / name).is_file() and not (root / name).is_symlink()


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.02)
