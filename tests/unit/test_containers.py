"""The LXD shape of a container (GPUs, disks, config) and drift from it: pure, no LXD."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config.inventory import load_inventory
from orchestrator.config.playbook import Disk
from orchestrator.errors import InputError
from orchestrator.lxd.containers import diff, spec_for

INV = """\
hosts:
  gpu-a:
    address: 192.0.2.10
    lxd: {endpoint: https://192.0.2.10:8443, client_cert: c.crt, client_key: c.key, server_cert: s.crt}
    containers:
      serve-0:
        jump: true
        gpus: [2, 3]
        lxd:
          image: debian-cuda
          profiles: [default, gpu]
          config: {limits.memory: 64GiB}
          nvidia_runtime: true
      serve-1:
        address: 10.0.0.3
        gpus: [0]
        lxd: {gpu_pci: ["0000:41:00.0"]}
"""


def load(tmp_path: Path, text: str = INV):  # type: ignore[no-untyped-def]
    (tmp_path / "inv.yaml").write_text(text)
    return load_inventory(tmp_path / "inv.yaml")


def test_spec_has_gpus_disks_and_config(tmp_path: Path) -> None:
    inv = load(tmp_path)
    host = inv.hosts["gpu-a"]
    assert (
        host.lxd is not None
        and host.lxd.url == "https://192.0.2.10:8443"
        and host.lxd.server_cert == tmp_path / "s.crt"
    )
    s0, s1 = host.containers
    assert s0.address is None  # discovered through LXD at run time
    spec = spec_for(s0, (Disk("/srv/models/qwen", "/models/Qwen3.6-27B"),))
    assert spec.image == "debian-cuda" and spec.profiles == ("default", "gpu")
    assert spec.devices == {
        "dfo-gpu2": {"type": "gpu", "gputype": "physical", "id": "2"},
        "dfo-gpu3": {"type": "gpu", "gputype": "physical", "id": "3"},
        "dfo-disk-models-qwen3-6-27b": {
            "type": "disk",
            "source": "/srv/models/qwen",
            "path": "/models/Qwen3.6-27B",
            "readonly": "true",
        },
    }
    assert spec.config == {"limits.memory": "64GiB", "nvidia.runtime": "true"}
    assert spec_for(s1).devices == {"dfo-gpu0": {"type": "gpu", "gputype": "physical", "pci": "0000:41:00.0"}}


def test_drift_names_each_missing_or_changed_key_and_ignores_user_devices(tmp_path: Path) -> None:
    spec = spec_for(load(tmp_path).hosts["gpu-a"].containers[0])
    devices = {"dfo-gpu2": {"type": "gpu", "gputype": "physical", "id": "2"}, "my-own": {"type": "nic"}}
    config = {"limits.memory": "32GiB", "nvidia.runtime": "true", "user.note": "x"}
    drift = diff(spec, devices, config)
    assert [d.describe() for d in drift] == [
        "devices.dfo-gpu3 is missing (expected {gputype=physical, id=3, type=gpu})",
        "config.limits.memory is '32GiB', expected '64GiB'",
    ]
    assert diff(spec, {**devices, "dfo-gpu3": spec.devices["dfo-gpu3"]}, {**config, "limits.memory": "64GiB"}) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("endpoint: https://192.0.2.10:8443, ", "endpoint: http://192.0.2.10:8443, ", "lxd.endpoint: expected 'local'"),
        (", server_cert: s.crt}", "}", "missing required key 'server_cert'"),
        (
            'lxd: {gpu_pci: ["0000:41:00.0"]}',
            'lxd: {gpu_pci: ["a", "b"]}',
            "gpu_pci: expected one PCI address per GPU (1)",
        ),
        (
            "          nvidia_runtime: true\n",
            "          nvidia_runtime: yes-please\n",
            "nvidia_runtime: expected true or false",
        ),
    ],
)
def test_bad_lxd_blocks(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in INV
    with pytest.raises(InputError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load(tmp_path, INV.replace(old, new))


def test_container_without_lxd_host_needs_an_address(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="missing required key 'address'"):
        load(tmp_path, "hosts:\n  h:\n    containers:\n      c: {gpus: [0]}\n")
    with pytest.raises(InputError, match="has no lxd: block"):
        load(tmp_path, "hosts:\n  h:\n    containers:\n      c: {address: 10.0.0.1, lxd: {image: x}}\n")
