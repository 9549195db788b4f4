"""vLLM's compile cache and its AOT guard on a real H200, as the tool reads them.

``tests/data/gpu/aot-guard`` is one run of ``scripts/gpu-serve --only graphs --only force-aot
--only stop`` on the device (one H200, vLLM 0.26.0's CUDA build, the tiny pair in bf16, this
tree): a cold first deploy; the same key again with ``VLLM_FORCE_AOT_LOAD=1`` (a new server
command, so a restart); another key with the guard (``serving.startup_timeout`` 421:
``VLLM_ENGINE_READY_TIMEOUT_S`` is in vLLM's key). These tests hold the ledger, the tool's share,
the guard's verdicts and the diagnosis to that record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.config.playbook import load_playbook
from orchestrator.errors import AgentFailure
from orchestrator.results import HostReport
from orchestrator.rules import diagnosis
from remote_agent import serving

RUN = Path(__file__).resolve().parent.parent / "data" / "gpu" / "aot-guard"


def host(name: str) -> dict[str, Any]:
    (h,) = json.loads((RUN / f"{name}-deploy.json").read_text())["hosts"]
    return h  # type: ignore[no-any-return]


def ledger(name: str) -> dict[str, Any]:
    return host(name)["gates"]["health"]["startup"]  # type: ignore[no-any-return]


def test_a_cold_start_compiles_and_a_restart_of_its_key_loads_it_in_under_half_the_time() -> None:
    cold, warm = ledger("graphs"), ledger("force-hit")
    assert (cold["compile"], cold["artifacts_saved"], cold["artifacts_loaded"]) == ("miss", 2, 0)
    assert (warm["compile"], warm["artifacts_saved"], warm["artifacts_loaded"]) == ("hit", 0, 2)
    assert warm["compile_s"] < cold["compile_s"] / 10  # 1.53 s against 24.0 s
    assert warm["total_s"] <= 0.5 * cold["total_s"]  # 55.3 s against 118.0 s: the goal
    assert warm["cache_dirs"] == cold["cache_dirs"]  # the same key's directories
    for start in (cold, warm):  # the phases add up to launch-to-/health within 5%
        assert abs(sum(start["phases"].values()) - start["total_s"]) <= 0.05 * start["total_s"]
    assert warm["kv_tokens"] >= cold["kv_tokens"]  # no smaller KV cache on the warm start


def test_the_tools_own_share_of_a_cold_first_deploy_is_under_five_percent() -> None:
    cold = host("graphs")["time"]
    assert cold["tool_share"] <= 0.05 and cold["tool_s"] < 2.0, cold  # 1.3 s of 119.6 s
    warm = host("force-hit")["time"]  # a restart of a serving host: its engine check comes first
    assert warm["tool_s"] == round(warm["seconds"] - warm["vllm_start_s"] - warm["probe_s"], 1)


def test_the_guard_refuses_a_start_of_another_key_in_vllms_words_and_the_tool_says_why(tmp_path: Path) -> None:
    miss = host("force-miss")
    assert miss["gates"]["health"]["ok"] is False
    log = (RUN / "dflash-serve.log").read_text()
    assert "FileNotFoundError: [Errno 2] No such file or directory" in log.split("=== ")[-1]
    # the agent's account of the dead server, as it reads that log now: vLLM's root cause first
    path = tmp_path / "dflash-serve.log"
    path.write_text(log)
    said = serving._log_tail(str(path))
    assert said.startswith("(its errors before them:)") and "torch_aot_compile" in said.split("(then:)")[0]
    assert "RuntimeError: Engine core initialization failed" in said.split("(then:)")[1]
    # and the diagnosis names the guard (the recorded run's agent sent only the last 30 lines)
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "pb.yaml").write_text(
        "name: p\ntargets: [me]\ndeploy_root: /unused\nfiles: [{src: a.txt, dest: a.txt}]\n"
        "serving: {python: /usr/bin/python3, target: /m, env: {VLLM_FORCE_AOT_LOAD: '1'}}\n"
    )
    failure = AgentFailure("wait_health", "exited", f"the server process exited; last lines:\n{said}", gate="health")
    causes = diagnosis.diagnose(load_playbook(tmp_path / "pb.yaml"), HostReport("h"), failure=failure)
    recorded = AgentFailure("wait_health", "exited", miss["gates"]["health"]["detail"], gate="health")
    assert not diagnosis.diagnose(load_playbook(tmp_path / "pb.yaml"), HostReport("h"), failure=recorded)[0].startswith(
        "VLLM_FORCE_AOT_LOAD"
    )  # the 30 lines alone never said it
    assert causes[0].startswith("VLLM_FORCE_AOT_LOAD=1 (serving.env) and vLLM's compile cache holds no AOT artifact")
