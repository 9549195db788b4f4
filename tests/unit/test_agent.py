"""The remote agent, run for real as a subprocess the way SSH runs it (bootstrap + stdin).

No SSH here: these exercise the write protocol, release switching and refusals on the local
filesystem. The same agent over real SSH is covered by the integration tests.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import remote_agent
from orchestrator.agent import BOOTSTRAP, b64, decode_response, encode_request


def run(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-c", BOOTSTRAP], input=encode_request(ops), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    decode_response("local", proc.returncode, proc.stdout, proc.stderr)  # the controller can read it
    return json.loads(proc.stdout)["results"]  # type: ignore[no-any-return]


def files(**contents: bytes) -> list[dict[str, Any]]:
    return [
        {"path": p.replace("__", "/"), "sha256": hashlib.sha256(c).hexdigest(), "mode": "0644", "content_b64": b64(c)}
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


def test_put_is_atomic_idempotent_and_reports_digests(tmp_path: Path) -> None:
    data = b'{"mask_token_id": 248070}\n'
    op = {
        "op": "put",
        "root": str(tmp_path),
        "path": "cfg/config.json",
        "sha256": hashlib.sha256(data).hexdigest(),
        "content_b64": b64(data),
        "mode": "0600",
    }
    first = run([op])[0]["result"]
    assert first["changed"] is True and first["before"] is None
    assert (tmp_path / "cfg/config.json").read_bytes() == data
    assert first["mode"] == "0600" and first["size"] == len(data)
    second = run([op])[0]["result"]
    assert second["changed"] is False and second["inode"] == first["inode"]
    assert sorted(os.listdir(tmp_path / "cfg")) == ["config.json"]  # no temp files left


def test_stat_and_sha256(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    res = run(
        [
            {"op": "stat", "root": str(tmp_path), "paths": ["a", "b"], "sha256": True},
            {"op": "sha256", "root": str(tmp_path), "paths": ["a", "b"]},
        ]
    )
    st, digests = res[0]["result"]["files"], res[1]["result"]["files"]
    assert st[0]["exists"] and st[0]["size"] == 3 and st[0]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    assert st[1] == {"path": str(tmp_path / "b"), "exists": False}
    assert [d["sha256"] for d in digests] == [hashlib.sha256(b"abc").hexdigest(), None]


def test_put_refuses_content_that_does_not_match_its_digest(tmp_path: Path) -> None:
    op = {"op": "put", "root": str(tmp_path), "path": "x", "sha256": "0" * 64, "content_b64": b64(b"abc")}
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
        "content_b64": b64(b"x"),
    }
    err = run([op])[0]["error"]
    assert err["code"] == "outside_root" and err["op"] == "put"
    assert not (tmp_path / "escape").exists()


def test_symlink_escaping_the_root_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "releases").symlink_to(outside)
    res = apply(root, "r1", a=b"x")
    assert res["error"]["code"] == "symlink_escape" and "outside the deploy root" in res["error"]["message"]
    assert list(outside.iterdir()) == []


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
    res = run([{"op": "read", "root": str(tmp_path), "path": "missing"}, {"op": "facts"}])
    err = res[0]["error"]
    assert err["code"] == "io" and err["errno"] == 2 and err["path"].endswith("missing")
    assert res[1]["skipped"]
    assert run([{"op": "no_such_op"}])[0]["error"]["code"] == "unknown_op"


def test_facts(tmp_path: Path) -> None:
    facts = run([{"op": "facts", "root": str(tmp_path / "not-yet")}])[0]["result"]
    assert facts["python"].count(".") == 2 and facts["uid"] == os.getuid()
    assert facts["disk"]["path"] == str(tmp_path) and facts["gpus"] == []


def test_bad_request_is_answered_not_crashed() -> None:
    source = encode_request([]).split(b"\n", 1)
    bad = source[0] + b"\n" + source[1][: int(source[0])] + b"not json"
    proc = subprocess.run([sys.executable, "-c", BOOTSTRAP], input=bad, capture_output=True, timeout=60)
    assert proc.returncode == 0 and "bad request" in json.loads(proc.stdout)["error"]
