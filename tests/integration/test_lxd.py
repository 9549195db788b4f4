"""Real LXD containers through pylxd: the containers gate in deploy and verify, GPU devices LXD
cannot satisfy on this GPU-less machine, read-only model disks, and HTTPS with pinned certificates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.inventory import LxdEndpoint
from orchestrator.lxd import LxdHost
from orchestrator.sandbox.lxdhosts import LxdSandbox
from orchestrator.sandbox.processes import stop_process
from tests.integration.conftest import REPO, host, in_container, inventory, run

SANDBOX_PLAYBOOK = REPO / "playbooks" / "sandbox-files.yaml"


@pytest.fixture
def lxd() -> LxdHost:
    return LxdHost("sandbox", LxdEndpoint("local"))


def test_deploy_and_verify_the_sandbox_playbook(lxd_sandbox: LxdSandbox, tmp_path: Path) -> None:
    inv = inventory(lxd_sandbox, tmp_path)
    code, report, err = run("deploy", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)
    assert code == 0, err
    for h in report["hosts"]:
        assert h["ready"] and h["gates"]["containers"]["ok"] and h["gates"]["files"]["ok"]
        assert h["container"]["status"] == "running" and h["container"]["address"].startswith("10.231.0.")
    code, report, err = run("verify", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)
    assert code == 0, err
    assert all(h["in_sync"] and h["container"]["drift"] == [] for h in report["hosts"])


def test_model_disk_is_mounted_read_only_inside(lxd_sandbox: LxdSandbox, tmp_path: Path) -> None:
    code, _, err = run("deploy", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path), tmp_path=tmp_path)
    assert code == 0, err
    name = lxd_sandbox.nodes()[0].name
    ssh = ["ssh", "-F", str(lxd_sandbox.ssh_config), name]
    readme = subprocess.run([*ssh, "cat /models/README"], capture_output=True, text=True, timeout=60)
    assert readme.returncode == 0 and "Model weights" in readme.stdout
    write = subprocess.run([*ssh, "touch /models/written-by-container"], capture_output=True, text=True, timeout=60)
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    assert not Path("/var/lib/dflash-orchestrator/models/written-by-container").exists()


def test_stopped_container_is_reported_by_verify_and_started_by_deploy(
    lxd_sandbox: LxdSandbox, lxd: LxdHost, tmp_path: Path
) -> None:
    inv = inventory(lxd_sandbox, tmp_path)
    assert run("deploy", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)[0] == 0
    victim, other = (n.name for n in lxd_sandbox.nodes())
    lxd.stop(victim)
    code, report, _ = run("verify", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)
    assert code == 1
    bad = host(report, victim)
    containers = bad["gates"]["containers"]
    assert not bad["ready"] and not containers["ok"] and containers["detail"] == "container is stopped"
    assert "files" not in bad["gates"]  # nothing to read from a stopped container
    assert host(report, other)["in_sync"]
    assert lxd.status(victim) == "Stopped"  # verify never changes anything

    code, report, err = run("deploy", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)
    assert code == 0, err
    assert host(report, victim)["container"]["actions"] == ["started"]
    assert lxd.status(victim) == "Running"


def test_config_and_device_drift_is_reported_and_repaired(
    lxd_sandbox: LxdSandbox, lxd: LxdHost, tmp_path: Path
) -> None:
    name = lxd_sandbox.nodes()[1].name

    def declare(data: Any) -> None:
        data["hosts"]["sandbox"]["containers"][name]["lxd"]["config"]["limits.processes"] = "5000"

    inv = inventory(lxd_sandbox, tmp_path, declare)
    assert run("deploy", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)[0] == 0
    subprocess.run(["lxc", "config", "set", name, "limits.processes", "4000"], check=True)
    code, report, _ = run("verify", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)
    assert code == 1
    drifted = host(report, name)
    assert drifted["container"]["drift"] == [{"key": "config.limits.processes", "expected": "5000", "actual": "4000"}]
    assert "config.limits.processes is '4000', expected '5000'" in drifted["gates"]["containers"]["detail"]
    code, report, _ = run("deploy", SANDBOX_PLAYBOOK, "-i", inv, tmp_path=tmp_path)
    assert code == 0 and host(report, name)["container"]["actions"] == ["updated config.limits.processes"]
    subprocess.run(["lxc", "config", "unset", name, "limits.processes"], check=True)

    # A model disk removed by hand is drift too, and the next deploy puts it back.
    subprocess.run(["lxc", "config", "device", "remove", name, "dfo-disk-models"], check=True, capture_output=True)
    code, report, _ = run("verify", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path), tmp_path=tmp_path)
    assert code == 1
    assert "devices.dfo-disk-models is missing" in host(report, name)["gates"]["containers"]["detail"]
    code, report, _ = run("deploy", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path), tmp_path=tmp_path)
    assert code == 0 and host(report, name)["container"]["actions"] == ["updated devices.dfo-disk-models"]


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_gpu_device_lxd_cannot_satisfy_fails_that_host_only_and_leaves_it_as_it_was(
    lxd_sandbox: LxdSandbox, lxd: LxdHost, tmp_path: Path, stopped: bool
) -> None:
    """No GPU on this machine: LXD's own error must reach the user, per host, and nothing change."""
    other, victim = (n.name for n in lxd_sandbox.nodes())  # the first host is the playbook's canary
    assert run("deploy", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path), tmp_path=tmp_path)[0] == 0
    if stopped:
        lxd.stop(victim)
    before = json.loads(
        subprocess.run(["lxc", "query", f"/1.0/instances/{victim}"], capture_output=True, text=True, check=True).stdout
    )

    def with_gpu(data: Any) -> None:
        data["hosts"]["sandbox"]["containers"][victim]["gpus"] = [0]

    code, report, _ = run(
        "deploy", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path, with_gpu), tmp_path=tmp_path
    )
    assert code == 1
    gate = host(report, victim)["gates"]["containers"]
    assert not gate["ok"] and "GPU" in gate["detail"], gate
    assert "files" not in host(report, victim)["gates"]
    assert host(report, other)["ready"]
    after = json.loads(
        subprocess.run(["lxc", "query", f"/1.0/instances/{victim}"], capture_output=True, text=True, check=True).stdout
    )
    assert after["devices"] == before["devices"] and "dft-gpu0" not in after["devices"]
    assert after["status"] == before["status"]
    if stopped:
        assert run("deploy", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path), tmp_path=tmp_path)[0] == 0


def test_https_with_client_certificate_and_pinned_server_certificate(lxd_sandbox: LxdSandbox, tmp_path: Path) -> None:
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
         "-subj", "/CN=orchestrate-test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    wrong = tmp_path / "wrong.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
         "-subj", "/CN=impostor", "-keyout", str(tmp_path / "wrong.key"), "-out", str(wrong)],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(["lxc", "config", "set", "core.https_address", "127.0.0.1:8443"], check=True)
    subprocess.run(
        ["lxc", "config", "trust", "add", str(cert), "--name", "orchestrate-test"], check=True, capture_output=True
    )
    try:
        for server_cert, expect in (("/var/lib/lxd/server.crt", 0), (str(wrong), 1)):

            def https(data: Any, server_cert: str = server_cert) -> None:
                data["hosts"]["sandbox"]["lxd"] = {
                    "endpoint": "https://127.0.0.1:8443",
                    "client_cert": str(cert),
                    "client_key": str(key),
                    "server_cert": server_cert,
                }

            # The machine's CA-bundle variables must not replace the pin.
            os.environ["REQUESTS_CA_BUNDLE"] = str(wrong if expect == 0 else "/var/lib/lxd/server.crt")
            try:
                code, report, err = run(
                    "verify", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path, https), tmp_path=tmp_path
                )
            finally:
                os.environ.pop("REQUESTS_CA_BUNDLE")
            assert code == expect, err
            gate = report["hosts"][0]["gates"]["containers"]
            if expect == 0:
                assert gate["ok"]
            else:
                assert "not the pinned server_cert: refused" in gate["detail"]
    finally:
        fingerprint = subprocess.run(
            ["openssl", "x509", "-in", str(cert), "-noout", "-fingerprint", "-sha256"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        subprocess.run(
            ["lxc", "config", "trust", "remove", fingerprint.split("=")[1].replace(":", "").strip().lower()[:12]],
            check=False,
        )
        subprocess.run(["lxc", "config", "unset", "core.https_address"], check=True)


def test_real_vllm_in_a_container_becomes_ready_with_its_measured_tau(lxd_sandbox: LxdSandbox, tmp_path: Path) -> None:
    """playbooks/sandbox.yaml end to end in one LXD container: the venv and models mounted read-only."""
    if not Path("/opt/dflash-orchestrator/vllm-venv/bin/python").exists():
        pytest.fail("run scripts/vllm-venv first")
    name = lxd_sandbox.nodes()[0].name
    demo = REPO / "playbooks" / "sandbox.yaml"
    code, report, err = run("deploy", demo, "-i", inventory(lxd_sandbox, tmp_path), "--limit", name, tmp_path=tmp_path)
    try:
        assert code == 0, (err, report and host(report, name)["gates"])
        gates = host(report, name)["gates"]
        assert list(gates) == [
            "lint",
            "containers",
            "connect",
            "files",
            "models",  # the demo serves its tiny models from model directories (models:)
            "weights",
            "loader",
            "build",
            "health",
            "acceptance",
            "ready",
        ]
        assert gates["acceptance"]["mean_acceptance_length"] > 7  # K = 7: every drafted token accepted
        code, report, err = run(
            "verify", demo, "-i", inventory(lxd_sandbox, tmp_path), "--limit", name, tmp_path=tmp_path
        )
        assert code == 0, host(report, name)["gates"]
        # systemd is the container's init: the server runs as a unit written by the agent.
        cat = in_container(lxd_sandbox, name, "cat", "/srv/dflash/run/dflash-serve.json")
        assert cat.returncode == 0, cat.stderr
        record = json.loads(cat.stdout)
        assert record["unit"].startswith("dflash-serve-")
        active = in_container(lxd_sandbox, name, "systemctl", "is-active", record["unit"])
        assert active.stdout.strip() == "active"
    finally:
        code, report, err = run(
            "stop", demo, "-i", inventory(lxd_sandbox, tmp_path), "--limit", name, tmp_path=tmp_path
        )
        assert code == 0 and "stopped" in host(report, name)["gates"]["stopped"]["detail"], err
    gone = in_container(lxd_sandbox, name, "systemctl", "is-active", record["unit"])
    assert gone.stdout.strip() in ("inactive", "failed")
    leftover = in_container(lxd_sandbox, name, "pgrep", "-f", "vllm[.]entrypoints")
    assert leftover.returncode == 1, leftover  # every engine worker of the unit is gone (1: none matched)


def test_up_after_the_sandbox_state_was_lost_makes_the_leftover_containers_afresh(lxd_sandbox: LxdSandbox) -> None:
    """A machine whose processes were all killed: `down` found LXD not running, so it removed the
    sandbox's directory (client key, state) and left its containers, which trust a key that is
    gone. The next `up` must not keep them: every node must take the new key."""
    box = lxd_sandbox
    before = {n.name: n.address for n in box.nodes()}
    jump = json.loads(box.state_file.read_text())["jump"]
    stop_process(jump["pid"], jump["pid_start"])
    shutil.rmtree(box.dir)
    said: list[str] = []
    box.up(2, said.append)
    assert sorted(m for m in said if "left by a sandbox" in m) == [
        f"sandbox: removing {name}, left by a sandbox whose state is gone" for name in sorted(before)
    ]
    for name in before:
        answer = in_container(box, name, "cat", "/root/.ssh/authorized_keys")
        assert answer.returncode == 0, answer.stderr
        assert box.client_key.with_suffix(".pub").read_text().split()[1] in answer.stdout
