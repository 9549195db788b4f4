"""Playbook loading: files read once, destinations confined to the release, sections validated."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from orchestrator.errors import InputError
from orchestrator.playbook import load_playbook

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
name: demo
targets: [all]
deploy_root: /srv/dflash
files:
  - src: a.env
    dest: serving.env
    mode: "0640"
drafter:
  config: drafter.json
  reference: {dflash_config: {mask_token_id: 248070}}
serving:
  port: 8100
  extra_args: [--enforce-eager]
gates:
  acceptance: {min_mean_acceptance_length: 2.5, min_acceptance_rate: 0.2, min_drafts: 10}
rollout: {canary: 1, batch_size: 2, max_failures: 1}
"""


def setup(tmp_path: Path, text: str) -> Path:
    (tmp_path / "a.env").write_text("A=1\n")
    (tmp_path / "drafter.json").write_text('{"model_type": "qwen3"}\n')
    path = tmp_path / "pb.yaml"
    path.write_text(text)
    return path


def test_loads_everything(tmp_path: Path) -> None:
    pb = load_playbook(setup(tmp_path, GOOD))
    assert [f.dest for f in pb.release_files] == ["drafter/config.json", "serving.env"]
    env = pb.files[0]
    assert env.mode == "0640" and env.content == b"A=1\n"
    assert env.sha256 == hashlib.sha256(b"A=1\n").hexdigest()
    assert pb.drafter is not None and pb.drafter.reference == {"dflash_config": {"mask_token_id": 248070}}
    assert pb.serving.port == 8100 and pb.serving.extra_args == ("--enforce-eager",)
    assert pb.gates.acceptance.min_mean_acceptance_length == 2.5
    assert pb.rollout.canary == 1 and pb.rollout.batch_size == 2
    assert pb.keep_releases == 5


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "    dest: serving.env",
            "    dest: ../etc/passwd",
            "pb.yaml:6 files[0].dest: '../etc/passwd' must be a relative path inside the release",
        ),
        ("    dest: serving.env", "    dest: /etc/passwd", "files[0].dest: '/etc/passwd' must be a relative path"),
        ("    dest: serving.env", "    dest: a/../../x", "must be a relative path inside the release"),
        (
            "    dest: serving.env",
            "    dest: drafter/config.json",
            "drafter: files[0] already pushes drafter/config.json",
        ),
        ("  - src: a.env", "  - src: missing.env", "pb.yaml:5 files[0].src: local file"),
        ('    mode: "0640"', "    mode: 0640", "files[0].mode: expected an octal mode as a quoted string"),
        ("deploy_root: /srv/dflash", "deploy_root: srv", "pb.yaml:3 deploy_root: expected an absolute"),
        ("  port: 8100", "  prot: 8100", "serving.prot: unknown key (did you mean 'port'?)"),
        (
            "min_acceptance_rate: 0.2",
            "min_acceptance_rate: 2",
            "gates.acceptance.min_acceptance_rate: a rate between 0 and 1",
        ),
        ("targets: [all]\n", "", "pb.yaml:1: missing required key 'targets'"),
    ],
)
def test_bad_playbooks(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in GOOD
    with pytest.raises(InputError) as info:
        load_playbook(setup(tmp_path, GOOD.replace(old, new, 1)))
    assert expected in str(info.value)
    assert info.value.exit_code == 2


def test_nothing_to_push_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="pushes no files"):
        load_playbook(setup(tmp_path, "name: x\ntargets: all\ndeploy_root: /srv/x\n"))


@pytest.mark.parametrize(
    "name", ["sandbox.yaml", "sandbox-files.yaml", "qwen36-27b-dflash.yaml", "qwen3-8b-dflash.yaml"]
)
def test_shipped_playbooks_load(name: str) -> None:
    pb = load_playbook(REPO / "playbooks" / name)
    assert pb.drafter is not None
    assert pb.drafter.values["dflash_config"]["mask_token_id"] in (248070, 151669, 5)
