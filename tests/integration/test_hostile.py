"""Hostile and damaged deploy roots on real sshd hosts: nothing the tool did not make is followed,
written or removed; what is its own is repaired; verify says exactly what differs; read-only runs
write nothing; bad input never reaches a host. (The same classes run fast through the local
connector in tests/unit/test_hostile_root.py and test_hostile_input.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.conftest import Sandbox, write_playbook

HOST = 3  # the sandbox host these tests use (each test has its own deploy root)


def base_of(sandbox: Sandbox, root_name: str) -> Path:
    """The deploy root as seen from this machine."""
    return sandbox.srv(sandbox.names[HOST]) / Path(root_name).name


def outside(sandbox: Sandbox, name: str) -> Path:
    path = sandbox.srv(sandbox.names[HOST]) / "not-the-tools" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("someone else's\n")
    return path


def deploy(cli, pb: Path, sandbox: Sandbox, *extra: str):  # type: ignore[no-untyped-def]
    return cli("deploy", pb, "-i", sandbox.inventory, "--json", "--limit", sandbox.names[HOST], *extra)


def verify(cli, pb: Path, sandbox: Sandbox):  # type: ignore[no-untyped-def]
    return cli("verify", pb, "-i", sandbox.inventory, "--json", "--limit", sandbox.names[HOST])


def files_gate(run) -> str:  # type: ignore[no-untyped-def]
    return str(run.json["hosts"][0]["gates"]["files"]["detail"])


def test_a_lock_link_is_replaced_and_its_target_untouched(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    base = base_of(sandbox, root_name)
    base.mkdir(parents=True)
    victim = outside(sandbox, "passwd-like")
    os.symlink(f"/srv/not-the-tools/{victim.name}", base / ".lock")
    run = deploy(cli, write_playbook(tmp_path, root_name), sandbox)
    assert run.code == 0, files_gate(run)
    assert victim.read_text() == "someone else's\n" and not (base / ".lock").is_symlink()


@pytest.mark.parametrize("damage", ["absolute", "elsewhere"])
def test_a_damaged_current_link_is_reported_then_repaired(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,
    damage: str,  # type: ignore[no-untyped-def]
) -> None:
    pb = write_playbook(tmp_path, root_name)
    first = deploy(cli, pb, sandbox)
    assert first.code == 0
    base = base_of(sandbox, root_name)
    (base / "current").unlink()
    target = f"{root_name}/releases/{first.json['release_id']}" if damage == "absolute" else "/tmp"
    os.symlink(target, base / "current")
    checked = verify(cli, pb, sandbox)
    assert checked.code == 1 and "not at a release under releases/" in files_gate(checked)
    repaired = deploy(cli, pb, sandbox)
    assert repaired.code == 0, files_gate(repaired)
    assert os.readlink(base / "current").startswith("releases/") and verify(cli, pb, sandbox).code == 0


def test_a_release_file_replaced_by_a_link_to_a_copy_is_drift(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    pb = write_playbook(tmp_path, root_name, {"a.txt": b"a\n"})
    first = deploy(cli, pb, sandbox)
    base = base_of(sandbox, root_name)
    served = base / "releases" / first.json["release_id"] / "a.txt"
    (base / "copy.txt").write_bytes(b"a\n")
    served.unlink()
    os.symlink(f"{root_name}/copy.txt", served)
    checked = verify(cli, pb, sandbox)
    assert checked.code == 1 and "not the release's own file" in files_gate(checked)
    assert deploy(cli, pb, sandbox).code == 0 and verify(cli, pb, sandbox).code == 0


def test_pruning_leaves_what_the_tool_did_not_make(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    base = base_of(sandbox, root_name)
    (base / "releases" / "backup-2024").mkdir(parents=True)
    (base / "releases" / "backup-2024" / "weights.bin").write_bytes(b"precious")
    os.utime(base / "releases" / "backup-2024", (0, 0))
    for n in range(4):
        run = deploy(
            cli,
            write_playbook(tmp_path / str(n), root_name, {"n.txt": str(n).encode()}, extra="keep_releases: 2\n"),
            sandbox,
        )
        assert run.code == 0
    assert "backup-2024: not made by this tool, left alone" in files_gate(run)
    assert (base / "releases" / "backup-2024" / "weights.bin").read_bytes() == b"precious"
    assert len([p for p in (base / "releases").iterdir() if p.name != "backup-2024"]) == 2


def test_the_served_tree_is_exactly_the_release(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    pb = write_playbook(tmp_path, root_name, {"a.txt": b"a\n", "b.txt": b"b\n"})
    first = deploy(cli, pb, sandbox)
    release = base_of(sandbox, root_name) / "releases" / first.json["release_id"]
    (release / "drafter" / "generation_config.json").write_text("{}")
    checked = verify(cli, pb, sandbox)
    assert checked.code == 1 and "drafter/generation_config.json is served but not part of release" in files_gate(
        checked
    )
    (release / "drafter" / "generation_config.json").unlink()
    os.chmod(release / "a.txt", 0o666)
    checked = verify(cli, pb, sandbox)
    assert checked.code == 1 and "has mode 0666, the playbook says 0644" in files_gate(checked)
    repaired = deploy(cli, pb, sandbox)
    assert repaired.code == 0 and repaired.json["release_id"] != first.json["release_id"]
    dropped = write_playbook(tmp_path / "dropped", root_name, {"a.txt": b"a\n"})
    assert "b.txt is served but no longer in the playbook" in files_gate(verify(cli, dropped, sandbox))


def test_read_only_runs_create_nothing_on_the_host(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    pb = write_playbook(tmp_path, root_name)
    assert verify(cli, pb, sandbox).code == 1
    assert deploy(cli, pb, sandbox, "--dry-run").code == 0
    assert cli("rollback", pb, "-i", sandbox.inventory, "--limit", sandbox.names[HOST]).code == 1
    assert not base_of(sandbox, root_name).exists()


def test_a_dry_run_never_shows_a_secret(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    extra = ""
    pb = write_playbook(tmp_path, root_name, {"token.env": b"TOKEN=old-s3cr3t\n"}, extra=extra)
    text = pb.read_text().replace("dest: token.env}", 'dest: token.env, mode: "0600"}')
    pb.write_text(text)
    assert deploy(cli, pb, sandbox).code == 0
    src = next(tmp_path.glob("src-*token.env"))
    src.write_bytes(b"TOKEN=new-s3cr3t\n")
    looked = deploy(cli, pb, sandbox, "--dry-run")
    assert looked.code == 0 and "s3cr3t" not in looked.stdout
    assert "not shown (secret or not world-readable)" in json.dumps(looked.json)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("x: &x [*x]\n", "YAML aliases are not supported"),
        ("gates: {acceptance: {min_mean_acceptance_length: .nan}}\n", "expected a finite number"),
        ("files: [{src: pb.yaml, dest: .}]\n", "must be a relative path inside the release"),
    ],
    ids=["alias-bomb", "nan-threshold", "dest-dot"],
)
def test_bad_input_never_reaches_an_ssh_host(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,
    change: str,
    expected: str,  # type: ignore[no-untyped-def]
) -> None:
    pb = write_playbook(tmp_path, root_name)
    pb.write_text(pb.read_text() + change)
    run = cli("deploy", pb, "-i", sandbox.inventory, "--limit", sandbox.names[HOST])
    assert run.code == 2 and expected in run.stderr and "Traceback" not in run.stderr
    assert not base_of(sandbox, root_name).exists()
