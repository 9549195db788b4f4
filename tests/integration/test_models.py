"""Model directories on real hosts: the drafter overlay on real vLLM (the founding incident), pins
and drift, the target's config where the server reads it, the weights gate, and pushing large
artifacts over real SSH (resumed after a cut; the controller's memory flat)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from orchestrator.sandbox.lxdhosts import LxdSandbox
from orchestrator.sandbox.processes import descendants, run_measured
from tests.integration.conftest import REPO, Sandbox, inventory, run
from tests.integration.test_faults import wait_for
from tests.integration.test_serving import MODELS, VLLM, K, stop_server

STALE_MASK = 6


def drafter_with_a_stale_config(sandbox: Sandbox, host: str, name: str = "drafter") -> str:
    """The good drafter's weights in a model directory of the host (its own /srv) whose own
    config.json is stale: the wrong mask token, as on the day of the incident."""
    where = sandbox.srv(host) / "models" / name
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS / "drafter-good" / "model.safetensors", where / "model.safetensors")
    config = json.loads((MODELS / "drafter-good" / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = STALE_MASK
    (where / "config.json").write_text(json.dumps(config))
    return f"/srv/models/{name}"


def book(tmp_path: Path, root: str, drafter_dir: str, name: str = "pb", **changes: Any) -> Path:
    """A playbook serving the tiny target with the drafter's weights from ``drafter_dir`` and the
    right config from the playbook (``serving`` and ``top`` changes merged in)."""
    data: dict[str, Any] = {
        "name": name,
        "targets": ["all"],
        "deploy_root": root,
        "models": {"target": {"path": str(MODELS / "target")}, "drafter": {"path": drafter_dir}},
        "drafter": {
            "config": str(MODELS / "drafter-good" / "config.json"),
            "target_config": str(MODELS / "target" / "config.json"),
        },
        "serving": {
            "python": str(VLLM / "bin" / "python"),
            "model_name": "tiny",
            "num_speculative_tokens": K,
            "port": 8000,
            "extra_args": ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager"],
            "env": {"LD_PRELOAD": str(VLLM / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "1"},
            "startup_timeout": 600,
        },
        "gates": {"acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 20, "max_tokens": 64}},
    }
    for key, value in changes.items():
        if key == "serving":
            data["serving"].update(value)
        elif value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(data))
    return path


def test_the_incident_the_overlay_serves_the_right_config_over_a_stale_model_directory(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    """The release's drafter is an overlay: the config the release proved, and links to the model
    directory's weights, never the directory's own (stale) config; vLLM pointed at the model
    directory itself is refused before any host. (Real vLLM serving through such an overlay, READY
    with tau near K+1: the demo in an LXD container, tests/integration/test_lxd.py, whose drafter
    is a model directory too.)"""
    host = sandbox.names[1]
    drafter = drafter_with_a_stale_config(sandbox, host)
    try:
        good = cli(
            "deploy", files_only(tmp_path, root_name, drafter), "-i", sandbox.inventory, "--json", "--limit", host,
            timeout=900,
        )  # fmt: skip
        report = good.host(host)
        assert good.code == 0, (good.stderr[-2000:], report["gates"])
        assert report["gates"]["models"]["ok"] and report["gates"]["weights"]["ok"], report["gates"]
        overlay = sandbox.srv(host) / Path(root_name).name / "releases" / good.json["release_id"] / "drafter"
        assert json.loads((overlay / "config.json").read_text())["dflash_config"]["mask_token_id"] == 5
        assert os.readlink(overlay / "model.safetensors") == f"{drafter}/model.safetensors"

        # vLLM pointed at the model directory itself (its own, stale config) instead of the
        # release's overlay: refused before any host, since it would serve what was not proven.
        direct = {"method": "dflash", "model": drafter, "num_speculative_tokens": K}
        serving = {"speculative": False}
        extra = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager"]
        serving["extra_args"] = [*extra, "--speculative-config", json.dumps(direct)]  # type: ignore[assignment]
        stale = book(tmp_path, root_name, drafter, "direct", serving=serving)
        refused = cli("deploy", stale, "-i", sandbox.inventory, "--json", "--limit", host, timeout=900)
        assert refused.code == 2 and "serving.extra_args[7]: '--speculative-config' sets vLLM's" in refused.stderr
    finally:
        stop_server(sandbox, host, root_name)


def files_only(tmp_path: Path, root: str, drafter_dir: str, name: str = "files", **changes: Any) -> Path:
    path = book(tmp_path, root, drafter_dir, name, **changes)
    data = json.loads(path.read_text())
    data["serving"] = {"num_speculative_tokens": K}  # no server: the files, models and weights gates
    path.write_text(json.dumps(data))
    return path


def test_a_flipped_byte_in_a_weight_file_fails_verify_and_deploy_naming_it(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    host = sandbox.names[2]
    drafter = drafter_with_a_stale_config(sandbox, host, "flip")
    pb = files_only(tmp_path, root_name, drafter)
    first = cli("deploy", pb, "-i", sandbox.inventory, "--json", "--limit", host)
    assert first.code == 0, first.host(host)["gates"]
    assert [m["verified"] for m in first.host(host)["models"]] == ["hashed", "hashed"]
    again = cli("verify", pb, "-i", sandbox.inventory, "--json", "--limit", host)
    assert again.code == 0 and [m["verified"] for m in again.host(host)["models"]] == ["cached", "release"]

    weights = sandbox.srv(host) / "models" / "flip" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    checked = cli("verify", pb, "-i", sandbox.inventory, "--json", "--limit", host)
    gate = checked.host(host)["gates"]["models"]
    assert checked.code == 1 and f"{drafter}/model.safetensors (served as drafter/model.safetensors)" in gate["detail"]
    deployed = cli("deploy", pb, "-i", sandbox.inventory, "--json", "--limit", host)
    gate = deployed.host(host)["gates"]["models"]
    assert deployed.code == 1 and f"drafter {drafter}: model.safetensors has sha256" in gate["detail"]


def test_the_target_config_on_the_host_and_the_weights_are_checked_before_any_server(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    host = sandbox.names[3]
    drafter = drafter_with_a_stale_config(sandbox, host, "checks")
    target = sandbox.srv(host) / "models" / "target"
    shutil.copytree(MODELS / "target", target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (target / "config.json").write_text(json.dumps(config))
    models = {"target": {"path": "/srv/models/target"}, "drafter": {"path": drafter}}
    run = cli(
        "deploy",
        files_only(tmp_path, root_name, drafter, models=models),
        "-i",
        sandbox.inventory,
        "--json",
        "--limit",
        host,
    )
    detail = run.host(host)["gates"]["models"]["detail"]
    assert run.code == 1 and "differs from drafter.target_config in num_hidden_layers (2 here, 3 on the host)" in detail

    wrong = json.loads((MODELS / "drafter-good" / "config.json").read_text())
    wrong["num_hidden_layers"] = 2
    wrong["layer_types"] = ["full_attention"] * 2
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    pb = files_only(tmp_path, root_name, drafter, "wrong", drafter={"config": str(tmp_path / "wrong.json")})
    run = cli("deploy", pb, "-i", sandbox.inventory, "--json", "--limit", host)
    gate = run.host(host)["gates"]["weights"]
    assert run.code == 1 and gate == {"ok": False, "detail": "num_hidden_layers: the weights hold 1 layers"}

    # A copy cut short: its header is whole and agrees with the config, and vLLM refuses the file.
    weights = sandbox.srv(host) / "models" / "checks" / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 1)
    run = cli(
        "deploy", files_only(tmp_path, root_name, drafter, "cut"), "-i", sandbox.inventory, "--json", "--limit", host
    )
    said = " ".join(g["detail"] for g in run.host(host)["gates"].values())
    assert run.code == 1 and f"ends at byte {size} and the file at {size - 1} (truncated)" in said, said
    assert f"{drafter}/model.safetensors" in said


def pushing(tmp_path: Path, root: str, local: Path, dest: str, name: str = "push") -> Path:
    path = book(tmp_path, root, dest, name)
    data = json.loads(path.read_text())
    data["serving"] = {"num_speculative_tokens": K}  # no server: the files, models and weights gates
    data["models"] = {"drafter": {"path": dest, "push": str(local)}}
    data["drafter"].pop("target_config")
    path.write_text(json.dumps(data))
    return path


def artifact(tmp_path: Path, size: int) -> Path:
    """A drafter directory to push: the tiny drafter's files and a large file of random bytes."""
    local = tmp_path / "artifact"
    local.mkdir()
    shutil.copy(MODELS / "drafter-good" / "model.safetensors", local / "model.safetensors")
    with (local / "big.bin").open("wb") as f:
        for _ in range(size >> 24):
            f.write(os.urandom(1 << 24))
    return local


def test_a_2_gib_artifact_reaches_several_hosts_with_the_controllers_memory_flat(
    sandbox: Sandbox, tmp_path: Path, root_name: str
) -> None:
    hosts = sandbox.names[4:7]
    local = artifact(tmp_path, 2 << 30)
    pb = pushing(tmp_path, root_name, local, "/srv/models/pushed")
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    args = [sys.executable, "-m", "orchestrator", "deploy", str(pb), "-i", str(sandbox.inventory), "--json"]
    args += [a for h in hosts for a in ("--limit", h)]
    proc, peak_kib = run_measured(args, env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(proc.stdout)
    for h in report["hosts"]:
        pushed = h["models"][0]["pushed"]
        assert pushed["bytes_sent"] == (2 << 30) + (local / "model.safetensors").stat().st_size
        remote = sandbox.srv(h["name"]) / "models" / "pushed" / "big.bin"
        assert remote.stat().st_size == 2 << 30
    assert (sandbox.srv(hosts[0]) / "models" / "pushed" / "big.bin").read_bytes() == (local / "big.bin").read_bytes()
    # Streamed in chunks: the controller never holds the file (6 GiB went out in all).
    # (about 55 MiB measured; a file held in memory would be 2 GiB)
    assert peak_kib < 256 * 1024, f"controller peak RSS {peak_kib} KiB"
    again, _ = run_measured(args, env)
    assert all(h["models"][0]["pushed"]["bytes_sent"] == 0 for h in json.loads(again.stdout)["hosts"])


def test_a_push_never_replaces_a_file_it_did_not_put_there(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    """A push aimed at a directory that holds another model (a path mistyped, a directory reused)
    used to replace every file that differed. On a real sshd host: refused before any byte goes,
    naming the file, which is left byte-identical; ``replace: true`` takes the directory over."""
    host = sandbox.names[6]
    theirs = sandbox.srv(host) / "models" / "theirs"
    theirs.mkdir(parents=True, exist_ok=True)
    (theirs / "model.safetensors").write_bytes(b"their weights")
    local = tmp_path / "artifact"
    local.mkdir()
    shutil.copy(MODELS / "drafter-good" / "model.safetensors", local / "model.safetensors")
    pb = pushing(tmp_path, root_name, local, "/srv/models/theirs")
    refused = cli("deploy", pb, "-i", sandbox.inventory, "--json", "--limit", host)
    said = " ".join(g["detail"] for g in refused.host(host)["gates"].values())
    assert refused.code == 1 and "/srv/models/theirs/model.safetensors was not put there by a push" in said, said
    assert (theirs / "model.safetensors").read_bytes() == b"their weights"
    data = json.loads(pb.read_text())
    data["models"]["drafter"]["replace"] = True
    pb.write_text(json.dumps(data))
    taken = cli("deploy", pb, "-i", sandbox.inventory, "--json", "--limit", host)
    assert taken.code == 0, taken.stdout[-2000:]
    assert (theirs / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()


def test_a_push_cut_mid_file_resumes_from_what_landed(sandbox: Sandbox, tmp_path: Path, root_name: str) -> None:
    host = sandbox.host(sandbox.names[7])
    size = 256 << 20
    local = artifact(tmp_path, size)
    pb = pushing(tmp_path, root_name, local, "/srv/models/resumed")
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
    args = [sys.executable, "-m", "orchestrator", "deploy", str(pb), "-i", str(sandbox.inventory), "--json"]
    args += ["--limit", host.name]
    partial = sandbox.srv(host.name) / "models" / "resumed"
    # Slow the link so that the upload is still going when it is cut.
    tc = [
        "tc",
        "qdisc",
        "add",
        "dev",
        host.veth,
        "root",
        "tbf",
        "rate",
        "200mbit",
        "burst",
        "64kbit",
        "latency",
        "400ms",
    ]
    subprocess.run(tc, check=True)
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)

        def landed() -> int:
            found = list(partial.glob(".big.bin.partial-*")) if partial.exists() else []
            return found[0].stat().st_size if found and found[0].stat().st_size > 32 << 20 else 0

        wait_for(landed, timeout=120, what="a part of the file on the host")
        session = next(
            pid for pid in descendants(host.pid) if b"dflash-agent" in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
        os.kill(session, signal.SIGKILL)
        _out, err = proc.communicate(timeout=300)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", host.veth, "root"], check=True)
    assert proc.returncode == 1, err.decode()[-2000:]
    kept = next(partial.glob(".big.bin.partial-*")).stat().st_size
    assert 0 < kept < size and not (partial / "big.bin").exists()

    resumed = subprocess.run(args, capture_output=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    pushed = json.loads(resumed.stdout)["hosts"][0]["models"][0]["pushed"]
    rest = (local / "model.safetensors").stat().st_size  # sorted after big.bin: never reached before the cut
    assert pushed["resumed"] == 1 and pushed["bytes_sent"] == size - kept + rest
    assert (partial / "big.bin").read_bytes() == (local / "big.bin").read_bytes()
    assert not list(partial.glob(".big.bin.partial-*"))


def test_two_containers_of_one_gpu_host_get_a_model_pushed_once(lxd_sandbox: LxdSandbox, tmp_path: Path) -> None:
    """The model path is on a disk the GPU host mounts into both containers: one upload, to the
    disk's source on the host, shared by both nodes."""
    local = tmp_path / "artifact"
    local.mkdir()
    shutil.copy(MODELS / "drafter-good" / "model.safetensors", local / "model.safetensors")
    (local / "extra.bin").write_bytes(os.urandom(8 << 20))
    source = Path("/var/lib/dflash-orchestrator/models/t-push-once")
    shutil.rmtree(source, ignore_errors=True)
    data = yaml.safe_load((REPO / "playbooks" / "sandbox.yaml").read_text())
    data["models"] = {"drafter": {"path": "/models/t-push-once", "push": str(local)}}
    data["drafter"].pop("target_config")
    data["serving"] = {"num_speculative_tokens": K}  # no server: the files, models and weights gates
    pb = tmp_path / "push-once.yaml"
    pb.write_text(yaml.safe_dump(data))
    try:
        code, report, err = run("deploy", pb, "-i", inventory(lxd_sandbox, tmp_path), tmp_path=tmp_path)
        assert code == 0, (err[-2000:], report)
        pushes = [h["models"][0]["pushed"] for h in report["hosts"]]
        assert len(pushes) == 2 and pushes[0] == pushes[1]  # one push, reported by both nodes
        assert pushes[0]["destination"] == f"sandbox:{source}" and pushes[0]["bytes_sent"] > 8 << 20
        assert (source / "extra.bin").read_bytes() == (local / "extra.bin").read_bytes()
    finally:
        shutil.rmtree(source, ignore_errors=True)
