"""A directory replaced on the host under a bind mount, as under an LXD disk device.

The container keeps the directory it mounted: a model or venv renamed into place on the host
afterwards is not what the server sees. Run for real: a bind mount in a private mount namespace
(root), the agent run the way SSH runs it, inside that namespace.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent import protocol
from orchestrator.agent.client import BOOTSTRAP, encode_request


def agent_in_namespace(tmp_path: Path, setup: str, ops: list[dict[str, object]]) -> list[dict[str, object]]:
    """Run ``setup`` (shell) then the agent with ``ops``, in a mount namespace of their own."""
    request = tmp_path / "request"
    request.write_bytes(encode_request(ops))
    agent = f"{shlex.quote(sys.executable)} -c {shlex.quote(BOOTSTRAP)} < {shlex.quote(str(request))}"
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-ec", f"{setup}\n{agent}"],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)["results"]  # type: ignore[no-any-return]


@pytest.mark.usefixtures("agent")
def test_a_model_directory_replaced_under_its_mount_is_named_with_the_cure(tmp_path: Path) -> None:
    host = tmp_path / "host-models"  # what the GPU host has
    (host / "target").mkdir(parents=True)
    (host / "target" / "config.json").write_text("{}")
    seen = tmp_path / "container-models"  # where the container reads it
    seen.mkdir()
    bind = f"mount --bind {shlex.quote(str(host))} {shlex.quote(str(seen))}"
    # The host's update: the new directory renamed into place, the old one removed.
    swap = f"mkdir -p {host}.new/target && mv {host} {host}.old && mv {host}.new {host} && rm -rf {host}.old"
    op = protocol.model_files(str(tmp_path / "root"), "target", str(seen / "target")).request
    python = protocol.vllm_build(str(seen / "venv" / "bin" / "python")).request

    live = agent_in_namespace(tmp_path, bind, [op])[0]
    assert live["ok"], live

    missing = agent_in_namespace(tmp_path, bind, [{**op, "path": str(seen / "other")}])[0]
    assert not missing["ok"] and missing["error"]["message"] == f"model directory {seen}/other does not exist"

    stale = [agent_in_namespace(tmp_path, f"{bind}\n{swap}", [o])[0] for o in (op, python)]
    assert (host / "target").is_dir()  # the host has it; the mount does not
    message = stale[0]["error"]["message"]
    assert stale[0]["error"]["code"] == "missing_model", stale[0]
    assert message == (
        f"model directory {seen}/target does not exist here: the directory mounted at {seen} was replaced on the "
        "host after the container started (the mount shows it deleted); restart the container to mount the new one"
    )
    assert stale[1]["error"]["code"] == "no_python", stale[1]
    assert stale[1]["error"]["message"].startswith(
        f"serving interpreter {seen}/venv/bin/python does not exist here: the directory mounted at {seen} was replaced"
    )
