"""Playbook loading: files read once, destinations confined to the release, sections validated."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from orchestrator.config.playbook import load_playbook
from orchestrator.errors import InputError

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
        (
            "rollout:",
            "  speedup: {concurrency: [1, 0]}\nrollout:",
            "gates.speedup.concurrency: distinct request counts from 1 to 4096, or 'observed' (the fleet's load as watch recorded it), got [1, 0]",
        ),
        ("rollout:", "  speedup: {concurrency: [8, 8]}\nrollout:", "distinct request counts"),
        ("rollout:", "  speedup: {concurrency: 8}\nrollout:", "speedup.concurrency: expected a list of integers"),
        ("rollout:", "  speedup: {min: 0}\nrollout:", "gates.speedup.min: must be above 0, got 0"),
        ("rollout:", "  speedup: {repeats: 0}\nrollout:", "gates.speedup.repeats"),
        # Inputs that can mean nothing: one pair has no bound (a level only ever inconclusive,
        # which on_inconclusive: pass passed at a lower bound of 0.00), one token drafts nothing
        # (every host "speculative decoding is not running"), an empty prompt, a floor of hosts
        # in rotation with no gateway to have a rotation.
        (
            "rollout:",
            "  speedup: {repeats: 1, max_pairs: 1, on_inconclusive: pass}\nrollout:",
            "gates.speedup.repeats: at least 2 (one pair has no spread, so no bound either way), got 1",
        ),
        (
            "min_drafts: 10}",
            "min_drafts: 10, max_tokens: 1}",
            "gates.acceptance.max_tokens: at least 2, got 1: the first token comes from the prefill",
        ),
        ("rollout:", "  speedup: {max_tokens: 1}\nrollout:", "gates.speedup.max_tokens: at least 2, got 1"),
        (
            "min_drafts: 10}",
            'min_drafts: 10, prompts: [Hello, ""]}',
            "pb.yaml:15 gates.acceptance.prompts[1]: expected a non-empty string, got an empty one",
        ),
        ("rollout:", '  speedup: {prompts: ""}\nrollout:', "gates.speedup.prompts: expected a non-empty string"),
        ("rollout:", "  speedup: {prompts: [Hi, 3]}\nrollout:", "gates.speedup.prompts[1]: expected a string, got"),
        # addresses as the inventory's are held to: the resolver folds fullwidth digits and drops
        # invisible characters, so each would reach another machine than the one written
        (
            "  port: 8100",
            '  port: 8100\n  host: "\uff11\uff10.0.0.1"',
            "serving.host: '\uff11\uff10.0.0.1' is not an IP address",
        ),
        ("  port: 8100", '  port: 8100\n  host: "10.0.0.1\u200b"', "serving.host: '10.0.0.1\\u200b' is not an IP"),
        (
            "max_failures: 1}",
            "max_failures: 1, min_in_rotation: 1}",
            "rollout.min_in_rotation: counts the hosts a gateway sends requests to, and this playbook has no gateway",
        ),
        ("rollout:", "  speedup: {mni: 1.2}\nrollout:", "gates.speedup.mni: unknown key (did you mean 'min'?)"),
        (
            "rollout:",
            "  speedup: {repeats: 5, max_pairs: 4}\nrollout:",
            "gates.speedup.max_pairs: at least repeats (5)",
        ),
        ("rollout:", "  speedup: {max_pairs: 0}\nrollout:", "gates.speedup.max_pairs: at least repeats (3)"),
        (
            "rollout:",
            "  speedup: {on_inconclusive: ignore}\nrollout:",
            "gates.speedup.on_inconclusive: expected one of refuse, pass, got a string ('ignore')",
        ),
        ("rollout:", "  speedup: {arms: side}\nrollout:", "gates.speedup.arms: expected one of auto, beside, before"),
        (
            "rollout:",
            "  speedup: {arms: true}\nrollout:",
            "gates.speedup.arms: expected one of auto, beside, before, got a boolean",
        ),
        (
            "rollout:",
            "  speedup: {baseline_port: 8100}\nrollout:",
            "gates.speedup.baseline_port: the serving port (8100)",
        ),
        (
            "rollout:",
            "  speedup: {baseline_port: 70000}\nrollout:",
            "gates.speedup.baseline_port: must be at most 65535",
        ),
        ("rollout:", "  speedup: {baseline_memory: 1.5}\nrollout:", "gates.speedup.baseline_memory: a share of a GPU"),
        (
            "rollout:",
            "  speedup: {baseline_memory: .nan}\nrollout:",
            "gates.speedup.baseline_memory: expected a finite",
        ),
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


MODELS = (
    GOOD.replace("  port: 8100\n", "  port: 8100\n  python: /opt/vllm/bin/python\n")
    + "models:\n  target: {path: /models/T, manifest: t.sha256}\n  drafter: {path: /models/D, push: local-d}\n"
)


def test_models_pin_by_manifest_and_default_the_served_target(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    (tmp_path / "t.sha256").write_text(f"{digest}  model.safetensors\n{digest} *tokenizer.json\n")
    (tmp_path / "local-d").mkdir()
    pb = load_playbook(setup(tmp_path, MODELS))
    assert pb.serving.target == "/models/T"  # serving.target defaults to the target model's path
    assert pb.models.target is not None and pb.models.target.manifest == {
        "model.safetensors": digest,
        "tokenizer.json": digest,
    }
    assert pb.models.drafter is not None and pb.models.drafter.push == tmp_path / "local-d"


def test_a_manifest_as_sha256sum_and_editors_write_it_is_read(tmp_path: Path) -> None:
    """`find . -type f -exec sha256sum {} +` names files ./x; a Windows editor adds a byte-order
    mark and CRLF line ends. All are the same manifest (they were refused, naming the wrong cause)."""
    digest = hashlib.sha256(b"x").hexdigest()
    text = f"\ufeff{digest}  ./model.safetensors\r\n{digest} *./sub/tokenizer.json\r\n"
    (tmp_path / "t.sha256").write_bytes(text.encode("utf-8"))
    (tmp_path / "local-d").mkdir()
    pb = load_playbook(setup(tmp_path, MODELS))
    assert pb.models.target is not None
    assert pb.models.target.manifest == {"model.safetensors": digest, "sub/tokenizer.json": digest}
    (tmp_path / "t.sha256").write_text(f"\\{digest}  a\\nb\n")  # sha256sum's escape of a name with a newline
    with pytest.raises(InputError, match=r"t.sha256:1: an escaped name"):
        load_playbook(setup(tmp_path, MODELS))


@pytest.mark.parametrize(
    ("manifest", "change", "expected"),
    [
        ("zz  a\n", None, "t.sha256:1: expected '<sha256>  <path>' (sha256sum's format)"),
        (f"{'a' * 64}  ../etc/passwd\n", None, "'../etc/passwd' must be a relative path inside the model directory"),
        (f"{'a' * 64}  a\n{'b' * 64}  a\n", None, "t.sha256:2: a is listed twice"),
        ("", None, "t.sha256 lists no files"),
        (f"{'a' * 64}  a\n", ("path: /models/T,", "path: models/T,"), "models.target.path: expected an absolute"),
        (f"{'a' * 64}  a\n", ("push: local-d", "push: nowhere"), "models.drafter.push: local directory"),
        (f"{'a' * 64}  a\n", ("path: /models/D,", "path: /models/T,"), "cannot share a model directory"),
        (
            f"{'a' * 64}  a\n",
            ("push: local-d", "push: local-d, replace: 'true'"),
            "models.drafter.replace: expected true",
        ),
        (
            f"{'a' * 64}  a\n",
            ("manifest: t.sha256}", "manifest: t.sha256, replace: true}"),
            "models.target.replace: replace: says what a push may replace; this model has no push:",
        ),
    ],
)
def test_bad_models_name_file_line_and_key(
    tmp_path: Path, manifest: str, change: tuple[str, str] | None, expected: str
) -> None:
    (tmp_path / "t.sha256").write_text(manifest)
    (tmp_path / "local-d").mkdir()
    text = MODELS.replace(*change) if change else MODELS
    with pytest.raises(InputError) as info:
        load_playbook(setup(tmp_path, text))
    assert expected in str(info.value) and str(tmp_path / "pb.yaml") in str(info.value)
    assert info.value.exit_code == 2


def test_a_drafter_model_needs_the_config_its_release_serves(tmp_path: Path) -> None:
    text = "name: d\ntargets: [all]\ndeploy_root: /srv/d\nfiles: [{src: a.env, dest: a.env}]\n"
    text += "models:\n  drafter: {path: /models/D}\n"
    with pytest.raises(InputError, match=r"models\.drafter: a drafter model needs drafter\.config"):
        load_playbook(setup(tmp_path, text))


def test_a_server_target_without_its_python_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"serving\.target: a server needs serving\.python too"):
        load_playbook(setup(tmp_path, GOOD.replace("  port: 8100\n", "  port: 8100\n  target: /models/T\n")))


def test_models_without_a_server_serve_nothing(tmp_path: Path) -> None:
    (tmp_path / "local-d").mkdir()
    text = GOOD.replace("serving:\n  port: 8100\n  extra_args: [--enforce-eager]\n", "")
    pb = load_playbook(setup(tmp_path, text + "models:\n  target: {path: /models/T}\n"))
    assert pb.serving.target is None  # files and models only: nothing is launched


def test_the_live_gate_defaults_to_the_acceptance_gate_and_can_be_set_apart(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text("{}")
    base = "name: x\ntargets: [a]\ndeploy_root: /srv/x\nfiles: [{src: c.json, dest: c.json}]\n"
    path = tmp_path / "p.yaml"
    path.write_text(base + "gates: {acceptance: {min_mean_acceptance_length: 5, min_drafts: 20}}\n")
    gates = load_playbook(path).gates
    assert (gates.live.min_mean_acceptance_length, gates.live.min_drafts) == (5.0, 20)
    path.write_text(
        base
        + "gates:\n  acceptance: {min_drafts: 20}\n  live: {min_mean_acceptance_length: 2.5, min_acceptance_rate: 0.3}\n"
    )
    gates = load_playbook(path).gates
    assert (gates.live.min_mean_acceptance_length, gates.live.min_acceptance_rate, gates.live.min_drafts) == (
        2.5,
        0.3,
        20,
    )
    path.write_text(base + "gates:\n  live: {min_acceptance_rate: 1.5}\n")
    with pytest.raises(InputError, match=r"p.yaml:6 gates.live.min_acceptance_rate: a rate between 0 and 1"):
        load_playbook(path)


def test_the_speedup_gate_is_off_unless_asked_for_and_sorted_when_it_is(tmp_path: Path) -> None:
    assert load_playbook(setup(tmp_path, GOOD)).gates.speedup is None
    text = GOOD.replace("rollout:", "  speedup: {concurrency: [16, 1, 4], min: 1.2}\nrollout:", 1)
    text = text.replace("gates:\n  acceptance:", "gates:\n  acceptance:", 1)
    pb = load_playbook(setup(tmp_path, text.replace("\ngates:\n  speedup", "\n  speedup", 1)))
    gate = pb.gates.speedup
    assert gate is not None and gate.concurrency == (1, 4, 16) and gate.min == 1.2 and gate.repeats == 3


@pytest.mark.parametrize(
    ("args", "levels", "expected"),
    [
        ("[--max-num-seqs, '4']", "[1, 8]", "pb.yaml:16 gates.speedup.concurrency: [8] requests at once is above"),
        ("['--max-num-seqs=4']", "[1, 8, 16]", "[8, 16] requests at once is above serving.extra_args --max-num-seqs 4"),
        ("[--max_num_seqs, '2', --max-num-seqs, '8']", "[1, 16]", "[16] requests at once is above"),  # the last wins
        ("[--max-num-seqs, '8']", "[1, 8]", None),
        ("[--enforce-eager]", "[1, 4096]", None),  # vLLM's own default: nothing to hold it to
    ],
)
def test_a_speedup_level_above_max_num_seqs_is_refused_naming_both(
    tmp_path: Path, args: str, levels: str, expected: str | None
) -> None:
    """vLLM runs at most --max-num-seqs requests at once: a level above it would queue the rest and
    measure less than it names."""
    text = GOOD.replace("extra_args: [--enforce-eager]", f"extra_args: {args}").replace(
        "rollout:", f"  speedup: {{concurrency: {levels}}}\nrollout:", 1
    )
    path = setup(tmp_path, text)
    if expected is None:
        assert load_playbook(path).gates.speedup is not None
        return
    with pytest.raises(InputError) as info:
        load_playbook(path)
    assert expected in str(info.value)


GATEWAY = "gateway: {kind: haproxy, runs_on: gw, url: 'http://10.0.0.9:30000', socket: /run/h.sock, backend: vllm}\n"
ROUTER = "gateway: {kind: vllm-router, runs_on: gw, url: 'http://10.0.0.9:30000'}\n"
SERVED = "  port: 8100\n  target: /models/t\n  python: /usr/bin/python3\n"
SPEEDUP = "gates:\n  speedup: {}\n"


def test_a_standby_is_off_unless_asked_for_and_then_alternates_between_two_ports(tmp_path: Path) -> None:
    assert load_playbook(setup(tmp_path, GOOD)).serving.standby is None
    text = GOOD.replace("  port: 8100\n", SERVED + "  standby: {port: 8102, dev_routes: gateway-only}\n") + GATEWAY
    standby = load_playbook(setup(tmp_path, text)).serving.standby
    assert standby is not None and (standby.port, standby.dev_routes) == (8102, "gateway-only")


@pytest.mark.parametrize(
    ("standby", "extra", "expected"),
    [
        ("{port: 8102, dev_routes: gateway-only}", "", "a standby needs a gateway (gateway:)"),
        ("{port: 8100, dev_routes: gateway-only}", GATEWAY, "must differ from serving.port (8100)"),
        ("{port: 8102}", GATEWAY, "serving.standby: missing required key 'dev_routes'"),
        ("{port: 8102, dev_routes: anywhere}", GATEWAY, "/collective_rpc, which calls any method of every worker"),
        ("{port: 70000, dev_routes: gateway-only}", GATEWAY, "serving.standby.port: must be at most 65535"),
        (
            "{port: 8102, dev_routes: gateway-only, level: 2}",
            GATEWAY,
            "serving.standby.level: unknown key; allowed: dev_routes, port",
        ),
        (
            "{port: 8101, dev_routes: gateway-only}",
            SPEEDUP + GATEWAY,
            "a standby and the speed-up gate do not go together yet",
        ),
        ("{port: 8102, dev_routes: gateway-only}", ROUTER, "a vllm-router gateway knows a server by its URL"),
    ],
)
def test_a_standby_that_cannot_hold_is_refused_at_load_naming_its_key(
    tmp_path: Path, standby: str, extra: str, expected: str
) -> None:
    text = GOOD.replace("  port: 8100\n", f"{SERVED}  standby: {standby}\n") + extra.replace(SPEEDUP, "")
    if SPEEDUP in extra:
        text = text.replace("gates:\n", SPEEDUP, 1)
    with pytest.raises(InputError) as info:
        load_playbook(setup(tmp_path, text))
    assert expected in str(info.value), str(info.value)
    assert info.value.exit_code == 2
