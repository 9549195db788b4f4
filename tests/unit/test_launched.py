"""The server reads its drafter through ``<root>/launched``, the release it was started from: one
path for every release, so that vLLM's compile cache key (which hashes the path) stays the same
(real vLLM's keys: tests/integration/test_engine_gate.py). Whole runs on this machine with the
stand-in vLLM (see its docstring); the link is what the real agent makes of each step."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.unit.localbox import Box, deploy, host, rollback, verify


def launched(box: Box) -> str:
    return os.readlink(box.root("solo") / "launched")


def drafter_arg(box: Box) -> str:
    argv = json.loads((box.root("solo") / "run" / "dflash-serve.json").read_text())["argv"]
    return str(json.loads(argv[argv.index("--speculative-config") + 1])["model"])


def test_only_a_launch_moves_the_link_the_server_reads_its_drafter_through(box: Box) -> None:
    first = deploy(box, box.playbook())
    assert first.ok, host(first, "solo").gates
    a = first.release_id
    path = drafter_arg(box)
    assert path == f"{box.root('solo')}/launched/drafter" and launched(box) == f"releases/{a}"

    # vLLM refuses a new release's command: the check read the new drafter through the link, and
    # left it where the serving release had it.
    (box.dir / "notes.txt").write_text("a new release\n")
    refused = deploy(box, box.playbook("refused", env={"STANDIN_ENGINE_REFUSE": "no"}))
    assert not refused.ok and host(refused, "solo").failed_gate == "engine"
    assert launched(box) == f"releases/{a}"

    # Another drafter: a new release, started through the same path.
    other = deploy(box, box.playbook("other", drafter={"rope_theta": 10000.0}))
    assert other.ok, host(other, "solo").gates
    b = other.release_id
    assert b != a and launched(box) == f"releases/{b}" and drafter_arg(box) == path
    served = json.loads((box.root("solo") / "launched" / "drafter" / "config.json").read_text())
    assert served["rope_theta"] == 10000.0  # what the server reads is the release it was started from

    back = rollback(box, box.playbook("other"))
    assert back.ok and launched(box) == f"releases/{a}"

    # The link moved by hand behind a running server: verify says the server's drafter is another
    # release's than READY names (a restart would read it).
    os.symlink(f"releases/{b}", box.root("solo") / ".moved")
    os.replace(box.root("solo") / ".moved", box.root("solo") / "launched")
    (box.dir / "notes.txt").write_text("release notes\n")
    checked = verify(box, box.playbook())
    gate = host(checked, "solo").gates["ready"]
    assert not checked.ok and not gate.ok
    assert gate.detail == (
        f"the server reads its drafter from release {b} (the launched link), READY names {a}: deploy again"
    )


def test_a_launch_from_a_release_that_is_not_there_removes_the_link(box: Box, tmp_path: Path) -> None:
    """Never a server started from another release's drafter: the link goes, vLLM finds none."""
    from remote_agent.releases import _point_launched

    root = tmp_path / "root"
    (root / "releases" / "R1").mkdir(parents=True)
    assert _point_launched(str(root), "R1") is None and os.readlink(root / "launched") == "releases/R1"
    assert _point_launched(str(root), "R2") == "R1" and not os.path.lexists(root / "launched")
