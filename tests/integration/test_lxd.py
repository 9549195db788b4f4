"""Real LXD containers through pylxd: the containers gate in deploy and verify, GPU devices LXD
cannot satisfy on this GPU-less machine, read-only model disks, and HTTPS with pinned certificates."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.config.inventory import LxdEndpoint
from orchestrator.lxd.host import LxdHost
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
    # A stop needs only the container running: it stops the server whatever disks the container
    # lacks (a stop of another playbook's server failed on the disks it never reads, and the
    # demos could not run one after the other).
    code, report, _ = run("stop", SANDBOX_PLAYBOOK, "-i", inventory(lxd_sandbox, tmp_path), tmp_path=tmp_path)
    gate = host(report, name)["gates"]["containers"]
    assert code == 0 and gate["ok"] and "devices.dfo-disk-models is missing" in gate["detail"], gate
    assert "a stop needs only the container running" in gate["detail"]
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


@pytest.mark.usefixtures("vllm_cpu")
def test_a_systemd_unit_the_tool_did_not_write_is_never_replaced_or_run(
    lxd_sandbox: LxdSandbox, tmp_path: Path
) -> None:
    """The unit the agent writes for a deploy root has a fixed name. An operator's file of that name
    was overwritten, and a drop-in made for it (here one that hands the server another GPU) ran
    another command than the one the gates proved. Both refused at the engine gate, before
    anything serving is switched or stopped, naming the file; the files left byte-identical."""
    name = lxd_sandbox.nodes()[0].name
    demo = REPO / "playbooks" / "sandbox.yaml"
    root = yaml.safe_load(demo.read_text())["deploy_root"]
    unit = f"dflash-serve-{hashlib.sha256(root.encode()).hexdigest()[:8]}.service"
    before = in_container(lxd_sandbox, name, "readlink", f"{root}/current").stdout
    planted = {
        f"/etc/systemd/system/{unit}": (
            "[Service]\nExecStart=/usr/local/bin/their-server\n",
            "exists and was not written by dflash-orchestrator (left as it is)",
        ),
        "/etc/systemd/system/dflash-.service.d/gpu.conf": (
            "[Service]\nEnvironment=CUDA_VISIBLE_DEVICES=0\n",
            "changes the unit the tool writes (gpu.conf): the server would not run the command the gates proved",
        ),
    }
    for path, (text, said) in planted.items():
        made = in_container(
            lxd_sandbox, name, "sh", "-c", 'mkdir -p "$(dirname "$1")" && printf %s "$2" > "$1"', "-", path, text
        )
        assert made.returncode == 0, made.stderr
        try:
            code, report, _ = run(
                "deploy", demo, "-i", inventory(lxd_sandbox, tmp_path), "--limit", name, tmp_path=tmp_path
            )
            engine = host(report, name)["gates"]["engine"]
            named = path.rsplit("/", 1)[0] if path.endswith(".conf") else path  # a drop-in: its directory
            assert code == 1 and not engine["ok"] and named in engine["detail"], engine
            assert said in engine["detail"], engine
            assert "health" not in host(report, name)["gates"], report  # nothing launched
            assert in_container(lxd_sandbox, name, "cat", path).stdout == text  # left as it was
            assert in_container(lxd_sandbox, name, "readlink", f"{root}/current").stdout == before
        finally:
            in_container(lxd_sandbox, name, "rm", "-f", path)


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


class Watch:
    """``orchestrate watch --json`` running as a user runs it, its rounds read as they come."""

    def __init__(self, *args: str | Path, tmp_path: Path) -> None:
        env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(tmp_path / "state"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "watch", *map(str, args), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.rounds: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.rounds.put(json.loads(line))

    def until(self, what: str, check: Any, within: float = 600) -> dict[str, Any]:
        """The first round from now on whose only host passes ``check``."""
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no round showed {what} within {within:.0f} s; last: {self.seen[-1:]}"
            try:
                rnd = self.rounds.get(timeout=min(left, 5))
            except queue.Empty:
                assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
                continue
            self.seen.append(rnd)
            (h,) = rnd["hosts"]
            if check(h):
                return h

    def end(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def traffic(box: LxdSandbox, name: str, requests: int = 6, max_tokens: int = 64) -> None:
    """A bounded load loop of completions from inside the container (the server listens on its
    loopback). Greedy: the tiny models are made for greedy decoding (sampled at vLLM's default
    temperature 1.0, even the good drafter's tokens are accepted about 10% of the time)."""
    script = (
        "import json, urllib.request\n"
        f"for i in range({requests}):\n"
        f"    body = json.dumps({{'model': 'tiny', 'prompt': 'def f%d():' % i, 'max_tokens': {max_tokens},"
        " 'temperature': 0}).encode()\n"
        "    req = urllib.request.Request('http://127.0.0.1:8000/v1/completions', body,"
        " {'Content-Type': 'application/json'})\n"
        "    assert urllib.request.urlopen(req, timeout=120).status == 200\n"
    )
    sent = in_container(box, name, "python3", "-c", script)
    assert sent.returncode == 0, sent.stderr


def scrape(port: int) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels.get("dflash_orchestrator_host_state", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.usefixtures("vllm_cpu")
@pytest.mark.timeout(1500)  # two real starts in a container and watch's windows: 290-530 s seen, beside other tiers
def test_real_vllm_in_a_container_is_ready_and_watch_sees_the_founding_incident(
    lxd_sandbox: LxdSandbox, tmp_path: Path
) -> None:
    """playbooks/sandbox.yaml end to end in one LXD container (the venv and models mounted
    read-only), READY with its measured tau and verified, the server a systemd unit the agent wrote.

    Then watch: READY with a live tau near K + 1 from production traffic; one-token traffic (no
    draft follows its prefill) said as a window that can never be judged (DEGRADED), READY again
    once drafts flow; then, out of band, the stale drafter config lands (DRIFT, the changed field
    named), the server is restarted by hand with it (a restart, not negative acceptance) and
    traffic shows tau near 1 (DEGRADED, --on-change told); then the server killed (DOWN), and
    `stop` leaves no process of the unit. Prometheus metrics scraped at READY and at DEGRADED."""
    name = lxd_sandbox.nodes()[0].name
    demo = REPO / "playbooks" / "sandbox.yaml"
    inv = inventory(lxd_sandbox, tmp_path)
    code, report, err = run("deploy", demo, "-i", inv, "--limit", name, tmp_path=tmp_path)
    changes = tmp_path / "changes.jsonl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    watch = None
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
            "engine",  # vLLM's own configuration of the exact command, in the container
            "health",
            "acceptance",
            "ready",
        ]
        assert gates["acceptance"]["mean_acceptance_length"] > 7  # K = 7: every drafted token accepted
        # The demo is what a user sees first: its good drafter draws no warning, and the mask token
        # is named as the target's tokenizer has it (a reserved special token).
        assert "dflash_config.mask_token_id 5 is '<mask>', a special token" in gates["models"]["detail"], gates
        assert not [g for g, v in gates.items() if v.get("warnings")], gates
        # the container's name resolves (the image maps it): the start waited on no lookup
        assert "name_lookup" not in gates["health"], gates["health"]
        code, report, err = run("verify", demo, "-i", inv, "--limit", name, tmp_path=tmp_path)
        assert code == 0, host(report, name)["gates"]
        # systemd is the container's init: the server runs as a unit written by the agent.
        record = json.loads(in_container(lxd_sandbox, name, "cat", "/srv/dflash/run/dflash-serve.json").stdout)
        assert record["unit"].startswith("dflash-serve-")
        active = in_container(lxd_sandbox, name, "systemctl", "is-active", record["unit"])
        assert active.stdout.strip() == "active"

        watch = Watch(
            demo,
            *("-i", inv, "--limit", name, "--interval", "2", "--metrics-port", str(port)),
            *("--on-change", f"cat >> {changes}"),
            tmp_path=tmp_path,
        )
        watch.until("READY", lambda h: h["state"] == "READY")
        traffic(lxd_sandbox, name)
        live = watch.until("a judged window", lambda h: h["live"] is not None)
        assert live["state"] == "READY" and live["live"]["mean_acceptance_length"] > 7, live  # K = 7
        metrics = scrape(port)
        assert metrics[("dflash_orchestrator_host_state", "READY")] == 1
        assert metrics[("dflash_orchestrator_mean_acceptance_length_tokens", "")] > 7

        # Traffic that speculation does not run for (one token each: the prefill makes it, no
        # draft follows) can never fill a window: said, and not READY, until drafts flow again.
        # First a round in which no draft moved: the last drafts of the traffic above and all of
        # this (it takes under a round) would otherwise land in one round, which then has drafts.
        seen: dict[str, Any] = {}

        def still(h: dict[str, Any]) -> bool:
            before, seen["drafts"] = seen.get("drafts"), h["window_drafts"]
            return before == h["window_drafts"]

        watch.until("a round in which no draft moved", still, within=60)
        traffic(lxd_sandbox, name, requests=60, max_tokens=1)  # 20 without a draft say it
        blind = watch.until("a window that cannot be judged", lambda h: h["state"] != "READY", within=120)
        assert blind["state"] == "DEGRADED", blind
        assert any("since the last draft: speculative decoding is not running" in r for r in blind["reasons"]), blind
        traffic(lxd_sandbox, name)
        again = watch.until("READY on a judged window", lambda h: h["state"] == "READY" and h["live"], within=120)
        assert again["live"]["mean_acceptance_length"] > 7, again

        stale = "/opt/dflash-orchestrator/tiny-models/drafter-wrong-mask/config.json"
        copied = in_container(lxd_sandbox, name, "cp", stale, "/srv/dflash/current/drafter/config.json")
        assert copied.returncode == 0, copied.stderr
        drift = watch.until("DRIFT", lambda h: h["state"] == "DRIFT")
        assert "drafter/config.json: dflash_config.mask_token_id 5 -> 6" in drift["reasons"], drift

        restart = in_container(lxd_sandbox, name, "systemctl", "restart", record["unit"])
        assert restart.returncode == 0, restart.stderr
        # A round already under way when systemctl returned still saw the old server healthy: the
        # restart is said by the first round that sees the new pid, and health is read from then on.
        restarted = watch.until("the restart said", lambda h: h["restarted"], within=120)
        assert restarted["restarted"].startswith("the server restarted (pid "), restarted
        back = watch.until("the restarted server healthy", lambda h: h["gates"].get("health", {}).get("ok"))
        assert back["state"] == "DRIFT" and not back["gates"]["ready"]["ok"], back  # not the server proven
        traffic(lxd_sandbox, name)
        degraded = watch.until("DEGRADED", lambda h: h["state"] == "DEGRADED")
        assert degraded["live"]["mean_acceptance_length"] < 1.5, degraded
        metrics = scrape(port)
        assert metrics[("dflash_orchestrator_host_state", "DEGRADED")] == 1
        assert metrics[("dflash_orchestrator_mean_acceptance_length_tokens", "")] < 1.5
        assert metrics[("dflash_orchestrator_files_in_drift", "")] == 1

        killed = in_container(lxd_sandbox, name, "systemctl", "kill", "--signal=KILL", record["unit"])
        assert killed.returncode == 0, killed.stderr
        down = watch.until("DOWN", lambda h: h["state"] == "DOWN", within=120)
        # A killed vLLM takes a moment to exit (its memory torn down): a round in that moment
        # rightly says "pid N alive, but /health does not answer"; it is DOWN all the same, and
        # once the process is gone the reason is that it is not running.
        first = len(watch.seen)
        gone = watch.until("the server gone", lambda h: h["reasons"][0] == "the server is not running", within=60)
        assert down["reasons"][0] == "the server is not running" or down["reasons"][0].endswith(
            "alive, but /health does not answer"
        ), down
        assert gone["state"] == "DOWN", gone
        assert all(h["state"] == "DOWN" for r in watch.seen[first - 1 :] for h in r["hosts"]), watch.seen[first - 1 :]
        # --on-change runs once the round is printed: wait for the DOWN it is given.
        deadline = time.monotonic() + 60
        while not (told := [json.loads(line) for line in changes.read_text().splitlines()]) or told[-1]["to"] != "DOWN":
            assert time.monotonic() < deadline, told
            time.sleep(0.2)
        assert [(c["from"], c["to"]) for c in told][:3] == [
            ("READY", "DEGRADED"),
            ("DEGRADED", "READY"),
            ("READY", "DRIFT"),
        ]
        assert ("DRIFT", "DEGRADED") in [(c["from"], c["to"]) for c in told]
        assert told[-1]["to"] == "DOWN" and told[-1]["evidence"]["host"] == name
    finally:
        if watch is not None:
            assert watch.end() in (0, 1)
        code, report, err = run("stop", demo, "-i", inv, "--limit", name, tmp_path=tmp_path)
    assert code == 0 and host(report, name)["gates"]["stopped"]["ok"], err
    gone = in_container(lxd_sandbox, name, "systemctl", "is-active", record["unit"])
    assert gone.stdout.strip() in ("inactive", "failed")
    leftover = in_container(lxd_sandbox, name, "pgrep", "-f", "vllm[.]entrypoints")
    assert leftover.returncode == 1, leftover  # every engine worker of the unit is gone (1: none matched)
