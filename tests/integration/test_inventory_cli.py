"""An inventory edited with `orchestrate inventory ...` (comments and all) then deploys for real."""

from __future__ import annotations

from pathlib import Path

from tests.integration.conftest import Sandbox, write_playbook


def test_cli_edited_inventory_deploys(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "# lab inventory: written by hand, then edited from the CLI\n"
        f"known_hosts: {sandbox.box.known_hosts}   # from the sandbox\n"
        "defaults:\n"
        f"  key: {sandbox.box.client_key}\n"
        "  python: /usr/bin/python3\n"
        "\n"
        "hosts: {}   # filled in below\n"
    )
    host = sandbox.hosts[3]
    for args in (
        ["add-host", "lab", "--address", "192.0.2.1"],
        ["add-container", "lab", "lab-0", "--address", host.address, "--group", "canary"],
        ["set", "defaults.connect_timeout", "5"],
    ):
        run = cli("inventory", *args, "-i", inv)
        assert run.code == 0, run.stderr
    text = inv.read_text()
    assert text.startswith("# lab inventory: written by hand, then edited from the CLI\n")
    assert "# from the sandbox" in text
    pb = write_playbook(tmp_path, root_name, {"x.env": b"X=1\n"})
    deployed = cli("deploy", pb, "-i", inv, "--json", "--limit", "canary")
    assert deployed.code == 0, deployed.stderr
    assert [h["name"] for h in deployed.json["hosts"]] == ["lab-0"]
    assert (sandbox.srv(host.name) / Path(root_name).name / "current" / "x.env").read_bytes() == b"X=1\n"
