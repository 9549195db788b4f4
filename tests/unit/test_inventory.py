"""Inventory loading: typed models, and errors that name file, line and key path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.inventory import load_inventory
from orchestrator.errors import InputError

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
known_hosts: kh
defaults:
  user: deploy
  key: keys/id
  vars: {tier: default, region: none}
groups:
  canary:
    vars: {tier: canary}
hosts:
  gpu-a:
    address: 192.0.2.10
    vars: {region: eu}
    containers:
      serve-0:
        address: 10.10.0.2
        jump: true
        gpus: [0, 1]
        groups: [canary, serve]
        vars: {region: eu-1}
      serve-1:
        address: 10.10.0.3
        port: 2222
        groups: serve
  gpu-b:
    containers:
      serve-2:
        address: 10.10.1.2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(InputError) as info:
        load_inventory(write(tmp_path, text))
    assert info.value.exit_code == 2
    return str(info.value)


def test_loads_hosts_containers_and_settings(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    assert inv.known_hosts == tmp_path / "kh"
    assert [c.name for c in inv.containers] == ["serve-0", "serve-1", "serve-2"]
    s0 = inv.hosts["gpu-a"].containers[0]
    assert s0.gpus == (0, 1) and s0.jump and s0.ssh.user == "deploy"
    assert s0.ssh.key == tmp_path / "keys/id"
    assert inv.hosts["gpu-a"].containers[1].ssh.port == 2222
    assert inv.hosts["gpu-a"].containers[1].groups == ("serve",)


def test_targets_resolve_by_container_group_host_and_all(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    names = lambda pats: [t.name for t in inv.resolve(pats)]  # noqa: E731
    assert names(["all"]) == ["serve-0", "serve-1", "serve-2"]
    assert names(["serve"]) == ["serve-0", "serve-1"]
    assert names(["gpu-b"]) == ["serve-2"]
    assert names(["serve-2", "canary"]) == ["serve-0", "serve-2"]
    jumped = inv.resolve(["serve-0"])[0]
    assert jumped.jump is not None and jumped.jump.address == "192.0.2.10"
    assert inv.resolve(["serve-1"])[0].jump is None
    with pytest.raises(InputError, match="target 'nope' is not a container, group or GPU host"):
        inv.resolve(["nope"])


def test_vars_precedence(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD))
    s0, s1 = inv.hosts["gpu-a"].containers
    assert inv.vars_for(s0) == {"tier": "canary", "region": "eu-1"}
    assert inv.vars_for(s1) == {"tier": "default", "region": "eu"}


def test_error_names_file_line_and_key_path(tmp_path: Path) -> None:
    bad = GOOD.replace("gpus: [0, 1]", "gpus: [0, one]")
    msg = error_of(tmp_path, bad)
    assert msg == f"{tmp_path / 'inv.yaml'}:17 hosts.gpu-a.containers.serve-0.gpus: expected a list of integers"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "        jump: true\n",
            "        jmup: true\n",
            ":16 hosts.gpu-a.containers.serve-0.jmup: unknown key (did you mean 'jump'?)",
        ),
        (
            "        port: 2222\n",
            "        port: 70000\n",
            ":22 hosts.gpu-a.containers.serve-1.port: must be at most 65535",
        ),
        (
            "      serve-2:\n",
            "      serve-1:\n",
            ":26 hosts.gpu-b.containers.serve-1: container name already used on GPU host 'gpu-a'",
        ),
        (
            "        address: 10.10.1.2\n",
            "        gpus: [0]\n",
            ":26 hosts.gpu-b.containers.serve-2: missing required key 'address'",
        ),
        (
            "    address: 192.0.2.10\n",
            "",
            ":15 hosts.gpu-a.containers.serve-0.jump: jumps through GPU host 'gpu-a', which has no address",
        ),
        ("  user: deploy\n", "  user: deploy\n  user: root\n", ":4 defaults.user: duplicate key (first at line 3)"),
        ("        gpus: [0, 1]\n", "        gpus: [0, 0]\n", "gpus: expected a list of distinct GPU indices"),
        (
            "        jump: true\n",
            "        jump: yes please\n",
            "jump: expected true or false, got a string ('yes please')",
        ),
    ],
)
def test_bad_inventories(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in GOOD
    assert expected in error_of(tmp_path, GOOD.replace(old, new, 1))


@pytest.mark.parametrize(
    "address",
    [
        "\uff11\uff10.10.1.2",  # fullwidth digits: the resolver folds them to 10.10.1.2
        "10.10.1.2\u200b",  # a zero-width space: dropped by IDNA
        "10.10.1.2\u00ad",  # a soft hyphen: dropped too
        "\uff47pu-b.example",  # a fullwidth letter
        "10.10.1.2 ",
        "10.10.1.2\t",
        "gpu b",
        "-gpu-b",
        "gpu_b.example",
        "gpu-b..example",
        "a" * 64 + ".example",
    ],
)
def test_an_address_that_is_not_an_ip_or_an_ascii_host_name_is_refused(tmp_path: Path, address: str) -> None:
    """Whatever a resolver would fold into another address is refused where it is written, for
    containers and GPU hosts alike: it would pass the one-place-one-container check and reach
    another container's machine."""
    text = GOOD.replace("        address: 10.10.1.2\n", f"        address: {json.dumps(address)}\n", 1)
    assert f":27 hosts.gpu-b.containers.serve-2.address: {address!r} is not an IP address" in error_of(tmp_path, text)
    text = GOOD.replace("    address: 192.0.2.10\n", f"    address: {json.dumps(address)}\n", 1)
    assert f":11 hosts.gpu-a.address: {address!r} is not an IP address" in error_of(tmp_path, text)


@pytest.mark.parametrize("address", ["10.10.1.2", "10.66.2", "fd00::2", "fe80::1%eth0", "gpu-b.example.", "GPU-B"])
def test_ip_addresses_and_host_names_are_taken_as_written(tmp_path: Path, address: str) -> None:
    inv = load_inventory(
        write(tmp_path, GOOD.replace("        address: 10.10.1.2\n", f"        address: {json.dumps(address)}\n", 1))
    )
    (target,) = inv.resolve(["serve-2"])
    assert target.container.address == address


def test_invalid_yaml_reports_line(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "hosts:\n  gpu-a: [\n")
    assert msg.startswith(f"{tmp_path / 'inv.yaml'}:3: invalid YAML")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="file not found"):
        load_inventory(tmp_path / "absent.yaml")


def test_shipped_example_inventory_loads() -> None:
    inv = load_inventory(REPO / "inventory" / "example.yaml")
    assert len(inv.containers) == 3
    assert all(t.jump is not None for t in inv.resolve(["serve"]))


def test_a_local_container_needs_no_address_and_may_own_its_deploy_root(tmp_path: Path) -> None:
    inv = load_inventory(
        write(
            tmp_path, "hosts:\n  box:\n    containers:\n      me: {connection: local, deploy_root: /home/me/dflash}\n"
        )
    )
    (target,) = inv.resolve(["me"])
    assert target.container.connection == "local" and target.container.deploy_root == "/home/me/dflash"
    assert target.container.address is None and target.jump is None


@pytest.mark.parametrize(
    ("container", "where", "why"),
    [
        ("{connection: telnet}", "hosts.box.containers.me.connection", "expected 'ssh' or 'local'"),
        ("{connection: local, jump: true}", "hosts.box.containers.me.jump", "is this machine: no jump"),
        (
            "{address: 10.0.0.1, deploy_root: srv/dflash}",
            "hosts.box.containers.me.deploy_root",
            "absolute, normalised directory",
        ),
        ("{connection: ssh}", "hosts.box.containers.me", "missing required key 'address'"),
    ],
)
def test_bad_connections_name_the_key(tmp_path: Path, container: str, where: str, why: str) -> None:
    text = error_of(tmp_path, f"hosts:\n  box:\n    address: 10.0.0.9\n    containers:\n      me: {container}\n")
    assert where in text and why in text and ":5 " in text


def test_a_local_container_cannot_sit_on_an_lxd_managed_host(tmp_path: Path) -> None:
    text = error_of(
        tmp_path, "hosts:\n  box:\n    lxd: {endpoint: local}\n    containers:\n      me: {connection: local}\n"
    )
    assert "hosts.box.containers.me.connection" in text and "LXD containers reached over SSH" in text


def test_every_connection_the_inventory_takes_has_one_connector_and_no_other() -> None:
    """A way of reaching a host is one row of ``config.inventory.CONNECTIONS`` (what the inventory
    takes for it) and one row of ``connectors.CONNECTORS`` (its connector), under one name."""
    from orchestrator.config.inventory import CONNECTIONS
    from orchestrator.connectors import CONNECTORS

    assert list(CONNECTORS) == list(CONNECTIONS)


def test_two_deploy_roots_reached_through_a_linked_directory_are_one_place(tmp_path: Path) -> None:
    """``/srv/b`` a link to ``/srv/a``: ``/srv/b/x`` and ``/srv/a/x`` are one deploy root to the
    agent, so two containers on them would be one host deployed twice and READY twice."""
    (tmp_path / "a" / "x").mkdir(parents=True)
    (tmp_path / "b").symlink_to(tmp_path / "a")
    text = (
        "hosts:\n  box:\n    containers:\n"
        f"      me: {{connection: local, deploy_root: {tmp_path / 'a' / 'x'}}}\n"
        f"      other: {{connection: local, deploy_root: {tmp_path / 'b' / 'x'}}}\n"
    )
    assert "containers.other: the same deploy root on this machine as container 'me'" in error_of(tmp_path, text)
    (tmp_path / "c" / "x").mkdir(parents=True)
    load_inventory(write(tmp_path, text.replace(str(tmp_path / "b" / "x"), str(tmp_path / "c" / "x"))))
