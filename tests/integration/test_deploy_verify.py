"""deploy and verify against real sshd hosts: the happy path, the founding incident, no-op runs."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tests.integration.conftest import GOOD_DRAFTER, STALE_DRAFTER, Sandbox, write_playbook

ENV = b"VLLM_ENGINE_READY_TIMEOUT_S=900\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_deploy_then_verify_clean(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    pb = write_playbook(tmp_path, root_name, {"serving.env": ENV})
    deployed = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert deployed.code == 0, deployed.stderr
    hosts = deployed.json["hosts"]
    assert [h["name"] for h in hosts] == sandbox.names
    release = deployed.json["release_id"]
    for h in hosts:
        assert h["ready"] and h["gates"]["files"]["ok"] and h["release_id"] == release
        assert h["ssh"]["connects"] == 1 and h["ssh"]["execs"] <= 2, h  # a changing deploy: at most two execs
        by_path = {f["path"]: f for f in h["files"]}
        cfg = by_path["drafter/config.json"]
        assert cfg["remote_path"] == f"{root_name}/releases/{release}/drafter/config.json"
        assert cfg["sha256"] == sha(GOOD_DRAFTER.read_bytes()) and cfg["changed"]
        # What landed on that host's disk, read from this machine: the very bytes we meant.
        on_disk = sandbox.srv(h["name"]) / Path(cfg["remote_path"]).relative_to("/srv")
        assert on_disk.read_bytes() == GOOD_DRAFTER.read_bytes()
        current = sandbox.srv(h["name"]) / Path(root_name).name / "current"
        assert os.readlink(current) == f"releases/{release}"
    # each host's progress on stderr, as JSON lines with --json: its steps, then its end
    events = [json.loads(line) for line in deployed.stderr.splitlines()]
    done = sorted(e["host"] for e in events if e.get("step") == "done" and e["ready"])
    assert done == sorted(sandbox.names), deployed.stderr
    assert {e["host"] for e in events if e.get("step") == "staging the release"} == set(sandbox.names)

    verified = cli("verify", pb, "-i", sandbox.inventory, "--json")
    assert verified.code == 0, verified.stderr
    assert all(h["in_sync"] and not any(f["drift"] for f in h["files"]) for h in verified.json["hosts"])
    # one connection and one exec per host for a no-change verify
    assert all(h["ssh"] == {"connects": 1, "execs": 1, "retries": 0} for h in verified.json["hosts"])

    table = cli("verify", pb, "-i", sandbox.inventory)
    assert table.code == 0 and f"verify: {len(sandbox.names)}/{len(sandbox.names)} hosts IN SYNC" in table.stdout


def test_the_incident_stale_drafter_config_is_drift_and_the_next_deploy_repairs_it(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    pb = write_playbook(tmp_path, root_name, {"serving.env": ENV})
    first = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert first.code == 0, first.stderr
    victim = sandbox.names[2]
    remote = first.host(victim)["files"][0]["remote_path"]
    assert remote.endswith("drafter/config.json")
    # The stale file of the incident sits where the server reads; the server would look healthy.
    (sandbox.srv(victim) / Path(remote).relative_to("/srv")).write_bytes(STALE_DRAFTER.read_bytes())

    verified = cli("verify", pb, "-i", sandbox.inventory, "--json")
    assert verified.code == 1
    bad = verified.host(victim)
    assert not bad["in_sync"]
    gate = bad["gates"]["files"]
    assert not gate["ok"] and gate["detail"].startswith("drift:")
    assert sha(STALE_DRAFTER.read_bytes()) in gate["detail"] and sha(GOOD_DRAFTER.read_bytes()) in gate["detail"]
    drifted = [f for f in bad["files"] if f["drift"]]
    assert [(f["remote_path"], f["sha256"], f["expected_sha256"]) for f in drifted] == [
        (remote, sha(STALE_DRAFTER.read_bytes()), sha(GOOD_DRAFTER.read_bytes()))
    ]
    others = [h for h in verified.json["hosts"] if h["name"] != victim]
    assert all(h["in_sync"] for h in others)

    repaired = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert repaired.code == 0, repaired.stderr
    fixed = repaired.host(victim)
    assert fixed["changed"] and fixed["release_id"] == repaired.json["release_id"]
    assert fixed["previous_release_id"] == first.json["release_id"]
    assert [f["changed"] for f in fixed["files"]] == [True, False]  # only the drafter config differed
    assert all(not h["changed"] for h in repaired.json["hosts"] if h["name"] != victim)
    assert cli("verify", pb, "-i", sandbox.inventory).code == 0


def test_second_deploy_with_no_change_writes_nothing_and_says_so(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    pb = write_playbook(tmp_path, root_name, {"serving.env": ENV})
    first = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert first.code == 0
    host = sandbox.names[0]
    base = sandbox.srv(host) / Path(root_name).name
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in base.rglob("*") if p.is_file() and p.name != ".lock"}

    second = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert second.code == 0
    for h in second.json["hosts"]:
        assert not h["changed"] and h["release_id"] == first.json["release_id"]
        assert not any(f["changed"] for f in h["files"])
        assert h["gates"]["files"]["detail"].startswith("no change")
        assert h["ssh"]["execs"] == 1  # a deploy costs one exec per host
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in base.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    assert sorted(os.listdir(base / "releases")) == [first.json["release_id"]]


def test_dry_run_shows_diffs_and_writes_nothing(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    pb = write_playbook(tmp_path / "a", root_name, {"serving.env": b"A=1\nB=2\n"})
    assert cli("deploy", pb, "-i", sandbox.inventory).code == 0
    pb2 = write_playbook(tmp_path / "b", root_name, {"serving.env": b"A=1\nB=3\n"})
    dry = cli("deploy", pb2, "-i", sandbox.inventory, "--dry-run")
    assert dry.code == 0, dry.stderr
    assert dry.stdout.count("-B=2\n+B=3\n") == len(sandbox.names)
    assert "dry run: 1 of 2 files would change" in dry.stdout
    # nothing was written: verify against the first playbook is still clean
    assert cli("verify", pb, "-i", sandbox.inventory).code == 0


def test_rollback_and_pruning(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    ids = []
    for n in range(4):
        pb = write_playbook(
            tmp_path / str(n), root_name, {"serving.env": f"N={n}\n".encode()}, extra="keep_releases: 2\n"
        )
        run = cli("deploy", pb, "-i", sandbox.inventory, "--json", "--limit", sandbox.names[0])
        assert run.code == 0, run.stderr
        assert [h["name"] for h in run.json["hosts"]] == [sandbox.names[0]]
        ids.append(run.json["release_id"])
    releases = sandbox.srv(sandbox.names[0]) / Path(root_name).name / "releases"
    assert sorted(os.listdir(releases)) == sorted(ids[2:])

    back = cli("rollback", pb, "-i", sandbox.inventory, "--json", "--limit", sandbox.names[0])
    assert back.code == 0, back.stderr
    assert back.json["hosts"][0]["release_id"] == ids[2]
    previous_pb = tmp_path / "2" / "pb.yaml"
    assert cli("verify", previous_pb, "-i", sandbox.inventory, "--limit", sandbox.names[0]).code == 0
    assert cli("verify", pb, "-i", sandbox.inventory, "--limit", sandbox.names[0]).code == 1
    to = cli("rollback", pb, "-i", sandbox.inventory, "--json", "--limit", sandbox.names[0], "--to", ids[0])
    assert to.code == 1 and "release " + ids[0] + " does not exist" in to.json["hosts"][0]["gates"]["files"]["detail"]


def test_history_records_runs(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    pb = write_playbook(tmp_path, root_name)
    cli("deploy", pb, "-i", sandbox.inventory)
    cli("verify", pb, "-i", sandbox.inventory)
    hist = cli("history", "--json")
    assert hist.code == 0
    runs = hist.json["runs"]
    assert [r["kind"] for r in runs] == ["verify", "deploy"]
    assert runs[1]["ok"] and runs[1]["hosts_ready"] == len(sandbox.names)
    assert {h["name"] for h in runs[1]["hosts"]} == set(sandbox.names)
    text = cli("history", "--host", sandbox.names[0])
    assert text.code == 0 and "deploy" in text.stdout and "verify" in text.stdout
