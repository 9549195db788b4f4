"""Bad input of every kind stops before any host is touched: exit 2 (or, for a drafter config's
content, the lint gate), one line naming the file, the line and the key, and no traceback.

The inventory's one container is a local one whose deploy root is under the test's directory:
had anything reached it, that directory would exist.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from orchestrator.cli import main as cli
from orchestrator.config.playbook import load_playbook

DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 8,
    "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]},
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "vocab_size": 64,
    "num_target_layers": 2,
    "layer_types": ["full_attention"],
}
TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "vocab_size": 64,
}
PLAYBOOK = """\
name: hostile
targets: [me]
deploy_root: /unused
files:
  - {src: a.txt, dest: a.txt}
drafter: {config: drafter.json, target_config: target.json}
serving: {num_speculative_tokens: 7}
"""


def setup(tmp_path: Path, playbook: str = PLAYBOOK, inventory: str | None = None) -> list[str]:
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "drafter.json").write_text(json.dumps(DRAFTER))
    (tmp_path / "target.json").write_text(json.dumps(TARGET))
    (tmp_path / "pb.yaml").write_text(playbook)
    root = tmp_path / "root"
    (tmp_path / "inv.yaml").write_text(
        inventory or f"hosts:\n  box:\n    containers:\n      me: {{connection: local, deploy_root: {root}}}\n"
    )
    return [str(tmp_path / "pb.yaml"), "-i", str(tmp_path / "inv.yaml"), "--state-dir", str(tmp_path / "state")]


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    try:
        got = cli.main(argv)
    except SystemExit as exc:  # argparse's own refusals exit 2 from the parser
        got = exc.code  # type: ignore[assignment]
    assert got == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not (tmp_path / "root").exists()  # no host was touched
    return err


BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else 'lol'}]\n"
    for prev, name in zip(["", "a", "b", "c", "d", "e", "f", "g", "h"], "abcdefghi", strict=True)
)
PLAYBOOK_CASES = {
    "NaN threshold (would pass tau 1.00)": (
        PLAYBOOK + "gates: {acceptance: {min_mean_acceptance_length: .nan}}\n",
        "pb.yaml:8 gates.acceptance.min_mean_acceptance_length: expected a finite number, got nan",
    ),
    "infinite start budget": (
        PLAYBOOK.replace("{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, startup_timeout: .inf}"),
        "serving.startup_timeout: expected a finite number, got inf",
    ),
    "an alias bomb": (PLAYBOOK + BOMB, "YAML aliases are not supported"),
    "a self-referencing alias": (PLAYBOOK + "x: &x [*x]\n", "x[0]: YAML aliases are not supported"),
    "a merge key": (
        PLAYBOOK.replace(
            "serving: {num_speculative_tokens: 7}", "base: &b {num_speculative_tokens: 7}\nserving: {<<: *b}"
        ),
        "YAML aliases are not supported",
    ),
    "nested a hundred thousand deep": (PLAYBOOK + "x: " + "[" * 100_000, "invalid YAML"),
    "dest '.'": (PLAYBOOK.replace("dest: a.txt", "dest: ."), "pb.yaml:5 files[0].dest: '.' must be a relative path"),
    "a NUL in dest": (PLAYBOOK.replace("dest: a.txt", 'dest: "a\\0b"'), "files[0].dest: 'a\\x00b' holds a NUL byte"),
    "a file where a directory must be": (
        PLAYBOOK.replace("  - {src: a.txt, dest: a.txt}\n", "  - {src: a.txt, dest: a}\n  - {src: a.txt, dest: a/b}\n"),
        "pb.yaml:6 files[1].dest: 'a/b' needs 'a' to be a directory",
    ),
    "the drafter's directory taken by a file": (
        PLAYBOOK.replace("dest: a.txt", "dest: drafter"),
        "'drafter/config.json' needs 'drafter' to be a directory",
    ),
    "a server with no python": (
        PLAYBOOK.replace("{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, target: /models/t}"),
        "serving.target: a server needs serving.python too",
    ),
    "a key twice": (PLAYBOOK + "name: again\n", "pb.yaml:8 name: duplicate key (first at line 1)"),
    "a start budget of 1e300 seconds": (
        PLAYBOOK.replace("{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, startup_timeout: 1.0e+300}"),
        "serving.startup_timeout: at most 604800 seconds (a week), got 1e+300",
    ),
    "an NCCL time limit of 1e300 seconds": (
        PLAYBOOK + "gates: {nccl: {timeout_s: 1.0e+300}}\n",
        "pb.yaml:8 gates.nccl.timeout_s: at most 604800 seconds (a week)",
    ),
}
# Tool-owned: what the gates prove is what serves. Every spelling vLLM's parser takes for a flag the
# tool gives (the last of two wins), set in extra_args, is refused naming the element and the key
# that sets it; so is the environment that picks the GPUs.
TOOL_ARGS = {
    "a second drafter (the last --speculative-config wins)": (
        '[--speculative-config, \'{"method": "dflash", "model": "/models/other"}\']',
        "serving.extra_args[0]: '--speculative-config' sets vLLM's --speculative-config, which the tool gives "
        "from the release's drafter",
    ),
    "the drafter by underscores": ("['--speculative_config={}']", "serving.extra_args[0]: '--speculative_config={}'"),
    "the drafter by its short alias": ("[-sc, '{}']", "'-sc' sets vLLM's --speculative-config"),
    "the drafter's path as a JSON key": ("[--speculative-config.model, /other]", "sets vLLM's --speculative-config"),
    "the drafter by an abbreviation": ("[--speculative, '{}']", "'--speculative' sets vLLM's --speculative-config"),
    "another target": ("[--model, /models/other]", "'--model' sets vLLM's --model, which the tool gives from models"),
    "another port": ("[--enforce-eager, --port=9000]", "serving.extra_args[1]: '--port=9000' sets vLLM's --port"),
    "another served name": ("[--served-model-name, x]", "which the tool gives from serving.model_name"),
    "tensor parallel by its alias": ("[-tp, '8']", "'-tp' sets vLLM's --tensor-parallel-size"),
    "tensor parallel glued to its alias": ("[-tp8]", "'-tp8' sets vLLM's --tensor-parallel-size"),
    "pipeline parallel": ("[--pipeline-parallel-size, '2']", "sets vLLM's --pipeline-parallel-size"),
    "data parallel (a second engine the probe does not see)": ("[-dp, '2']", "sets vLLM's --data-parallel-size"),
    "a file of arguments": ("[--config, /etc/vllm.yaml]", "'--config' sets vLLM's --config"),
    "the host it listens on": ("[--host, 0.0.0.0]", "sets vLLM's --host, which the tool gives from serving.host"),
}
for name, (args, expected) in TOOL_ARGS.items():
    PLAYBOOK_CASES[f"extra_args: {name}"] = (
        PLAYBOOK.replace("{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, extra_args: " + args + "}"),
        f"pb.yaml:7 {expected}" if expected.startswith("serving.") else expected,
    )
PLAYBOOK_CASES["serving.env: other GPUs than the inventory's"] = (
    PLAYBOOK.replace("{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, env: {CUDA_VISIBLE_DEVICES: '0'}}"),
    "pb.yaml:7 serving.env.CUDA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES is the tool's to set, from the inventory's gpus",
)
PLAYBOOK_CASES["serving.env: CUDA's own GPU order"] = (
    PLAYBOOK.replace(
        "{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, env: {CUDA_DEVICE_ORDER: FASTEST_FIRST}}"
    ),
    "serving.env.CUDA_DEVICE_ORDER: CUDA_DEVICE_ORDER is the tool's to set",
)
# vLLM's control routes on the port users reach: every value vLLM reads as on (or cannot read,
# and fails its start on) is refused; what it reads as off is taken.
for name, value, expected in (
    ("VLLM_SERVER_DEV_MODE", "'1'", "VLLM_SERVER_DEV_MODE=1 opens vLLM's development routes: /collective_rpc"),
    ("VLLM_SERVER_DEV_MODE", "'2'", "VLLM_SERVER_DEV_MODE=2 opens"),
    ("VLLM_SERVER_DEV_MODE", "'yes'", "VLLM_SERVER_DEV_MODE=yes opens"),
    (
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "' True'",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING= True opens /v1/load_lora_adapter",
    ),
):
    PLAYBOOK_CASES[f"serving.env: {name}={value}"] = (
        PLAYBOOK.replace(
            "{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, env: {" + name + ": " + value + "}}"
        ),
        f"pb.yaml:7 serving.env.{name}: {expected}",
    )
# Thresholds that cannot fail: tau = 1 + accepted/drafts is never below 1, a rate never below 0.
for key, value, expected in (
    ("acceptance: {min_mean_acceptance_length: 1}", "acceptance.min_mean_acceptance_length", "must be above 1, got 1"),
    ("acceptance: {min_mean_acceptance_length: 0.5}", "acceptance.min_mean_acceptance_length", "must be above 1"),
    ("live: {min_mean_acceptance_length: 1.0}", "live.min_mean_acceptance_length", "must be above 1, got 1.0"),
    ("acceptance: {min_acceptance_rate: 0}", "acceptance.min_acceptance_rate", "must be above 0, got 0"),
    ("live: {min_acceptance_rate: 0.0}", "live.min_acceptance_rate", "must be above 0"),
    ("nccl: {min_busbw_gbps: 0}", "nccl.min_busbw_gbps", "must be above 0, got 0: 0 GB/s cannot fail"),
    (
        "acceptance: {max_regression: 1}",
        "acceptance.max_regression",
        "a fraction from 0 up to (not including) 1, got 1",
    ),
    ("acceptance: {max_regression: -0.1}", "acceptance.max_regression", "a fraction from 0 up to (not including) 1"),
    ("acceptance: {max_regression: 1.5}", "acceptance.max_regression", "a fraction from 0 up to"),
    ("acceptance: {prefix_cache: always}", "acceptance.prefix_cache", "expected one of warn, strict, off"),
):
    PLAYBOOK_CASES[f"a threshold that cannot fail: {key}"] = (
        PLAYBOOK + "gates: {" + key + "}\n",
        f"pb.yaml:8 gates.{value}: {expected}",
    )


# Past Python's own limit (a str of more than 4,300 digits is refused by int(), as a traceback),
# and what YAML's constructors cannot make.
BIG = "1" + "0" * 5000
PLAYBOOK_CASES["an integer past 4,300 digits"] = (
    PLAYBOOK + f"keep_releases: {BIG}\n",
    "pb.yaml:8 keep_releases: an integer of 5001 digits is past any value this tool takes",
)
PLAYBOOK_CASES["a key past 4,300 digits"] = (PLAYBOOK + f"? {BIG}\n: 1\n", "pb.yaml:8: an integer of 5001 digits")
PLAYBOOK_CASES["a date that does not exist"] = (
    PLAYBOOK + "keep_releases: 2024-02-30\n",
    "pb.yaml:8 keep_releases: cannot read '2024-02-30': day is out of range for month",
)
PLAYBOOK_CASES["a hex integer past any value"] = (
    PLAYBOOK + "keep_releases: 0x" + "f" * 200 + "\n",
    "an integer of 202",
)


@pytest.mark.parametrize("case", list(PLAYBOOK_CASES))
def test_a_hostile_playbook_is_refused_before_any_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, expected = PLAYBOOK_CASES[case]
    err = refused(tmp_path, capsys, ["deploy", *setup(tmp_path, text)])
    assert expected in err and len(err.strip().splitlines()) == 1, err


def test_vllm_s_control_routes_switched_off_are_taken(tmp_path: Path) -> None:
    """What vLLM reads as off (envs.py: int() for the development routes, "1"/"true" for LoRA
    updating) loads, and reaches the server as written."""
    off = "{VLLM_SERVER_DEV_MODE: '0', VLLM_ALLOW_RUNTIME_LORA_UPDATING: 'false'}"
    text = PLAYBOOK.replace("{num_speculative_tokens: 7}", "{num_speculative_tokens: 7, env: " + off + "}")
    playbook = load_playbook(setup(tmp_path, text)[0])
    assert playbook.serving.env == {"VLLM_SERVER_DEV_MODE": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}


ARGUMENT_CASES = {
    "--lock-timeout nan": (["--lock-timeout", "nan"], "argument --lock-timeout: expected a finite number of seconds"),
    "--lock-timeout inf": (["--lock-timeout", "inf"], "expected a finite number of seconds, got 'inf'"),
    "--lock-timeout -1": (["--lock-timeout", "-1"], "must not be negative"),
    "--forks 0": (["--forks", "0"], "argument -f/--forks: must be at least 1"),
    "--release-id ../x": (["--release-id", "../x"], "'../x': a release id is 1 to 128 of letters"),
    "--release-id .hidden": (["--release-id", ".hidden"], "not starting with '.'"),
    "--release-id empty": (["--release-id", ""], "a release id is 1 to 128"),
    "--release-id too long": (["--release-id", "r" * 129], "a release id is 1 to 128"),
    "--lock-timeout 1e300": (["--lock-timeout", "1e300"], "at most 604800 seconds (a week), got '1e300'"),
    "--forks 10^20": (["--forks", "1" + "0" * 20], "argument -f/--forks: must be at most 1000000"),
}


@pytest.mark.parametrize("case", list(ARGUMENT_CASES))
def test_hostile_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    extra, expected = ARGUMENT_CASES[case]
    err = refused(tmp_path, capsys, ["deploy", *setup(tmp_path), *extra])
    assert expected in err


@pytest.mark.parametrize("case", list(ARGUMENT_CASES))
def test_with_json_an_argument_refused_is_a_json_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """A program reading ``--json`` reads every error as JSON, argparse's own too."""
    extra, expected = ARGUMENT_CASES[case]
    err = refused(tmp_path, capsys, ["deploy", "--json", *setup(tmp_path), *extra])
    (line,) = err.strip().splitlines()
    assert expected in json.loads(line)["message"]


@pytest.mark.parametrize(
    "argv",
    [
        ["history", "--json", "--bogus"],
        ["inventory", "validate", "--json", "--nope"],
        ["deploy", "--json"],
        ["lint", "drafter.json", "--json"],
        ["report", "--json", "--limit", "x"],
        ["watch", "--json"],
    ],
)
def test_with_json_every_commands_usage_errors_are_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    err = refused(tmp_path, capsys, argv)
    (line,) = err.strip().splitlines()
    assert json.loads(line)["message"].startswith("orchestrate")
    assert ": error: " in json.loads(line)["message"]


def test_rollback_to_a_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(tmp_path, capsys, ["rollback", *setup(tmp_path), "--to", "../../etc"])
    assert "argument --to: '../../etc': a release id" in err


DRAFTER_CASES = {
    "a key twice (a stale dflash_config first)": (
        '{"dflash_config": {"mask_token_id": 6}, "dflash_config": {"mask_token_id": 5}}',
        "drafter.json: invalid JSON: the key 'dflash_config' appears twice in one object",
    ),
    "NaN": ('{"hidden_size": NaN}', "drafter.json: invalid JSON: NaN is not a JSON number"),
    "Infinity": ('{"hidden_size": Infinity}', "drafter.json: invalid JSON: Infinity is not a JSON number"),
    "nested a hundred thousand deep": ("[" * 100_000 + "]" * 100_000, "drafter.json: invalid JSON: nested too deeply"),
    "not an object": ("[1, 2]", "drafter.json:1: expected a JSON object"),
    "an integer past 4,300 digits": (
        '{"hidden_size": ' + BIG + "}",
        "drafter.json: invalid JSON: an integer of 5001 digits is past any value a config holds",
    ),
    "a negative one": ('{"hidden_size": -' + BIG + "}", "an integer of 5001 digits"),
}


@pytest.mark.parametrize("case", list(DRAFTER_CASES))
def test_an_unreadable_drafter_config_is_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, expected = DRAFTER_CASES[case]
    argv = setup(tmp_path)
    (tmp_path / "drafter.json").write_text(text)
    assert expected in refused(tmp_path, capsys, ["deploy", *argv])


LINT_CASES = {
    "block_size as a string": ({"block_size": "16"}, "error: block_size: must be an integer"),
    "a boolean layer count": ({"num_hidden_layers": True}, "error: num_hidden_layers: must be an integer"),
    "a float hidden size": ({"hidden_size": 64.0}, "error: hidden_size: must be an integer"),
    "dflash_config.block_size as a string": (
        {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1], "block_size": "8"}},
        "error: dflash_config.block_size: must be an integer",
    ),
    "a list inside layer_types": (
        {"layer_types": [["full_attention"]]},
        "unknown layer types [\"['full_attention']\"]",
    ),
    "a mask token as a string": (
        {"dflash_config": {"mask_token_id": "5", "target_layer_ids": [1]}},
        "dflash_config.mask_token_id: must be a non-negative integer",
    ),
}


@pytest.mark.parametrize("case", list(LINT_CASES))
def test_drafter_values_of_the_wrong_type_fail_lint_not_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    change, expected = LINT_CASES[case]
    argv = setup(tmp_path)
    (tmp_path / "drafter.json").write_text(json.dumps({**DRAFTER, **change}))
    err = capsys.readouterr().err
    assert cli.main(["lint", str(tmp_path / "drafter.json"), "--target", str(tmp_path / "target.json")]) == 1
    out = capsys.readouterr()
    assert expected in out.out and "Traceback" not in out.err + err
    refused(tmp_path, capsys, ["deploy", *argv], code=1)  # the lint gate: nothing is touched


def test_a_target_config_with_no_dimensions_is_an_error_not_a_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = setup(tmp_path)
    (tmp_path / "target.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    refused(tmp_path, capsys, ["deploy", *argv], code=1)
    assert cli.main(["lint", str(tmp_path / "drafter.json"), "--target", str(tmp_path / "target.json")]) == 1
    assert "the target's config.json has no num_hidden_layers, hidden_size, vocab_size" in capsys.readouterr().out


INVENTORY_CASES = {
    "two containers at one address": (
        "hosts:\n  a:\n    containers:\n      me: {address: 127.0.0.1}\n  b:\n    containers:\n"
        "      other: {address: 127.0.0.1}\n",
        "inv.yaml:7 hosts.b.containers.other: the same address and port as container 'me'",
    ),
    "two local containers on one deploy root": (
        "hosts:\n  a:\n    containers:\n      me: {connection: local}\n      other: {connection: local}\n",
        "hosts.a.containers.other: the same deploy root on this machine as container 'me'",
    ),
    "a group named like a container": (
        "groups: {me: {}}\nhosts:\n  a:\n    containers:\n      me: {connection: local}\n",
        "inv.yaml:1 groups.me: group name 'me' is already a container",
    ),
    "a container's group named like a container": (
        "hosts:\n  a:\n    containers:\n      me: {connection: local, groups: [other]}\n"
        "      other: {connection: local, deploy_root: /x}\n",
        "hosts.a.containers.me.groups: group name 'other' is a container",
    ),
    "a group name with a slash": (
        "hosts:\n  a:\n    containers:\n      me: {connection: local, groups: [a/b]}\n",
        "hosts.a.containers.me.groups: names may hold letters, digits",
    ),
    "an alias bomb": ("x: &x [*x]\nhosts: {}\n", "inv.yaml:1 x[0]: YAML aliases are not supported"),
    # One place spelled twice is still one place (glibc reads 10.66.2 as 10.66.0.2).
    "one address in its short IPv4 form": (
        "hosts:\n  a:\n    containers:\n      me: {address: 10.66.0.2}\n  b:\n    containers:\n"
        "      other: {address: 10.66.2}\n",
        "inv.yaml:7 hosts.b.containers.other: the same address and port as container 'me'",
    ),
    "one address as a number": (
        "hosts:\n  a:\n    containers:\n      me: {address: 10.66.0.2}\n      other: {address: '172097538'}\n",
        "hosts.a.containers.other: the same address and port as container 'me'",
    ),
    "one IPv6 address written twice": (
        "hosts:\n  a:\n    containers:\n      me: {address: 'fd00::2'}\n      other: {address: 'fd00:0:0::2'}\n",
        "hosts.a.containers.other: the same address and port",
    ),
    "one deploy root spelled with a slash": (
        "hosts:\n  a:\n    containers:\n      me: {connection: local, deploy_root: /srv/d}\n"
        "      other: {connection: local, deploy_root: /srv/d/}\n",
        "hosts.a.containers.other: the same deploy root on this machine as container 'me'",
    ),
    "the filesystem's root as a deploy root": (
        "hosts:\n  a:\n    containers:\n      me: {connection: local, deploy_root: /}\n",
        "hosts.a.containers.me.deploy_root: expected an absolute, normalised directory other than /, got '/'",
    ),
    "a deploy root with ..": (
        "hosts:\n  a:\n    containers:\n      me: {connection: local, deploy_root: /srv/../etc}\n",
        "hosts.a.containers.me.deploy_root: expected an absolute, normalised directory",
    ),
    "an SSH time limit of 1e300 seconds": (
        "defaults: {connect_timeout: 1.0e+300}\nhosts:\n  a:\n    containers:\n      me: {connection: local}\n",
        "inv.yaml:1 defaults.connect_timeout: at most 604800 seconds (a week)",
    ),
}


@pytest.mark.parametrize("case", list(INVENTORY_CASES))
def test_a_hostile_inventory_is_refused_before_any_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, expected = INVENTORY_CASES[case]
    err = refused(tmp_path, capsys, ["deploy", *setup(tmp_path, inventory=text)])
    assert expected in err, err


@pytest.mark.parametrize("mode", ["4755", "2755", "1755", "0666", "0777"])
@pytest.mark.usefixtures("programs")
def test_a_dangerous_mode_needs_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
    text = PLAYBOOK.replace("dest: a.txt}", f'dest: a.txt, mode: "{mode}"}}')
    err = refused(tmp_path, capsys, ["deploy", *setup(tmp_path, text)])
    assert f"files[0].mode: mode {mode} is setuid, setgid, sticky or world-writable" in err
    allowed = text.replace(f'mode: "{mode}"', f'mode: "{mode}", unsafe_mode: true')
    assert cli.main(["deploy", *setup(tmp_path, allowed)]) == 0  # said so: deployed (locally)


@pytest.mark.usefixtures("programs")
def test_a_sandbox_command_that_hangs_is_one_clear_error() -> None:
    from orchestrator.errors import SandboxError
    from orchestrator.sandbox.processes import run

    with pytest.raises(SandboxError, match=r"sleep 5 did not finish within 0 s \(is the machine very busy\?\)"):
        run(["sleep", "5"], timeout=0.2)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["history", "--limit", "1" + "0" * 20], "argument --limit: must be at most 1000000"),
        (["watch", "--interval", "1e10"], "argument --interval: at most 604800 seconds (a week)"),
    ],
)
def test_numbers_past_any_sensible_bound_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    """Huge finite numbers once reached an OverflowError (a deadline) or SQLite's integer limit."""
    if argv[0] == "watch":
        argv = ["watch", *setup(tmp_path), *argv[1:]]
    assert expected in refused(tmp_path, capsys, argv)


def test_a_deploy_root_that_is_one_place_twice_or_overlaps_a_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Decided once the playbook and the inventory meet: a local container with no deploy root of
    its own shares the playbook's with one that names it; a deploy root inside a model directory
    would make each release a file of the model."""
    root = tmp_path / "root"
    argv = setup(
        tmp_path,
        PLAYBOOK.replace("deploy_root: /unused", f"deploy_root: {root}").replace("targets: [me]", "targets: [all]"),
        f"hosts:\n  box:\n    containers:\n      me: {{connection: local}}\n"
        f"      other: {{connection: local, deploy_root: {root}/}}\n",
    )
    err = refused(tmp_path, capsys, ["deploy", *argv])
    assert f"containers me and other are both this machine with deploy root {root}" in err
    models = f"models: {{target: {{path: {tmp_path}}}}}\n"
    argv = setup(tmp_path, PLAYBOOK.replace("deploy_root: /unused", f"deploy_root: {root}") + models)
    err = refused(tmp_path, capsys, ["deploy", *argv])
    assert f"deploy_root: {root} overlaps models.target.path {tmp_path}" in err


def test_an_output_path_that_is_not_a_regular_file_is_written_through_or_refused_never_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """report --html: a device stays a device (written through: /dev/full says it is full), a
    directory or an empty name is refused, a link to a file keeps being a link to the new page.
    The atomic write used to rename a regular file over /dev/full and exit 0."""
    state = ["--state-dir", str(tmp_path / "state")]

    def report(target: str) -> tuple[int, str]:
        try:
            code = cli.main(["report", *state, "--html", target])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code  # type: ignore[assignment]
        return code, capsys.readouterr().err

    code, err = report("/dev/full")
    assert code == 2 and "--html /dev/full: No space left on device" in err
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    assert report("/dev/null")[0] == 0 and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    code, err = report("")
    assert code == 2 and "argument --html: an empty path" in err
    os.mkfifo(tmp_path / "pipe")
    code, err = report(str(tmp_path / "pipe"))  # no reader: said at once, not waited on
    assert code == 2 and "nothing reads the pipe" in err and stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)
    (tmp_path / "dir").mkdir()
    code, err = report(str(tmp_path / "dir"))
    assert code == 2 and "not a regular file" in err and (tmp_path / "dir").is_dir()
    (tmp_path / "page.html").write_text("old page")
    (tmp_path / "page.html").chmod(0o640)
    (tmp_path / "link.html").symlink_to("page.html")
    assert report(str(tmp_path / "link.html"))[0] == 0
    assert (tmp_path / "link.html").is_symlink() and "fleet report" in (tmp_path / "page.html").read_text()
    assert (tmp_path / "page.html").stat().st_mode & 0o777 == 0o640


def test_an_inventory_that_is_not_a_regular_file_is_never_edited(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An edit replaces the inventory by a rename: /dev/null would become a regular file, and
    opening a pipe to read it waits for a writer for ever. Both are refused at once."""
    os.mkfifo(tmp_path / "pipe.yaml")
    for path in ("/dev/null", str(tmp_path / "pipe.yaml")):
        code = cli.main(["inventory", "add-host", "gpu-1", "--address", "10.0.0.9", "-i", path])
        err = capsys.readouterr().err
        assert code == 2 and "not a regular file" in err and "an inventory is edited only when it is one" in err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISFIFO(os.stat(tmp_path / "pipe.yaml").st_mode)


def test_a_state_database_that_cannot_be_written_stops_the_run_before_any_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = setup(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.db").write_bytes(b"not a database, a damaged file" * 100)
    code = cli.main(["deploy", *argv])
    err = capsys.readouterr().err
    assert code == 1 and "state database" in err and "Traceback" not in err
    assert not (tmp_path / "root").exists()  # no host was touched
