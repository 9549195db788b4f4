"""The sandbox's container image: Debian bookworm built locally with debootstrap, cached by recipe.

No image server is reachable here, so the image is made from Debian packages: systemd as init,
sshd, python3 (for the agent) and libnuma1 (vLLM's CPU extension needs it). Its recipe (packages,
files, metadata) is hashed; a build is reused from the cache for as long as the recipe is the same.

Traps handled (each one breaks the containers silently otherwise):
- udev must be installed and not masked, or systemd-networkd waits forever and eth0 gets no DHCP;
- /etc/machine-id must be empty, or every container gets the same DHCP lease;
- SSH host keys are removed and made at first boot (ed25519 only: RSA takes seconds and leaves
  the container "degraded" meanwhile); slow first-boot units (e2scrub, binfmt) are masked;
- the client key arrives through an LXD template from ``user.ssh_authorized_keys``: no cloud-init;
- the hostname must resolve from /etc/hosts (an LXD template, as published images have it) and
  /etc/resolv.conf name no resolver: a lookup that times out costs vLLM's start 2 minutes in Gloo.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.errors import SandboxError

CACHE = Path(os.environ.get("ORCHESTRATE_CACHE_DIR", "/var/cache/dflash-orchestrator"))
SUITE = "bookworm"
PACKAGES = (
    "systemd-sysv",
    "udev",
    "openssh-server",
    "python3",
    "iproute2",
    "netbase",
    "ca-certificates",
    "procps",
    "libnuma1",
)
MASKED_UNITS = (
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "man-db.timer",
)

FILES: dict[str, str] = {
    # No resolver: the containers reach nothing beyond the bridge, so a lookup fails at once rather
    # than after a timeout on the nameserver debootstrap copied from this machine.
    "etc/resolv.conf": "",
    "etc/systemd/network/10-eth0.network": "[Match]\nName=eth0\n\n[Network]\nDHCP=ipv4\n",
    "etc/systemd/system/dfo-ssh-hostkey.service": (
        "[Unit]\nDescription=Make the SSH host key at first boot\nBefore=ssh.service\n"
        "ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key\n\n"
        '[Service]\nType=oneshot\nExecStart=/usr/bin/ssh-keygen -q -t ed25519 -N "" -f /etc/ssh/ssh_host_ed25519_key\n\n'
        "[Install]\nWantedBy=multi-user.target\n"
    ),
    "etc/ssh/sshd_config.d/10-dfo.conf": (
        "HostKey /etc/ssh/ssh_host_ed25519_key\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUseDNS no\n"
    ),
}
SYMLINKS: dict[str, str] = {
    "etc/systemd/system/multi-user.target.wants/systemd-networkd.service": "/lib/systemd/system/systemd-networkd.service",
    "etc/systemd/system/multi-user.target.wants/dfo-ssh-hostkey.service": "/etc/systemd/system/dfo-ssh-hostkey.service",
    "etc/systemd/system/multi-user.target.wants/ssh.service": "/lib/systemd/system/ssh.service",
    **{f"etc/systemd/system/{unit}": "/dev/null" for unit in MASKED_UNITS},
}
TEMPLATES: dict[str, tuple[str, str]] = {
    # path in the container: (template file, template text)
    "/root/.ssh/authorized_keys": ("authorized_keys.tpl", '{{ config_get("user.ssh_authorized_keys", "") }}\n'),
    "/etc/hostname": ("hostname.tpl", "{{ container.name }}\n"),
    # The container's own name resolves without DNS, as LXD's published images template it: Gloo
    # (vLLM's CPU process group) looks the hostname up, and with no answer it waited 120 s a start
    # ("Unable to resolve hostname to a (local) address"), vLLM's config another 10 s a lookup.
    "/etc/hosts": (
        "hosts.tpl",
        "127.0.0.1\tlocalhost\n127.0.1.1\t{{ container.name }}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    ),
}

Say = Callable[[str], None]


def recipe() -> str:
    """Everything that decides the image's content; its hash names the cache entry."""
    return json.dumps(
        {
            "suite": SUITE,
            "packages": PACKAGES,
            "files": FILES,
            "symlinks": SYMLINKS,
            "templates": TEMPLATES,
            "version": 1,
        },
        sort_keys=True,
    )


def recipe_hash() -> str:
    """The image recipe's digest: the image is rebuilt only when it changes."""
    return hashlib.sha256(recipe().encode()).hexdigest()[:16]


def image_alias() -> str:
    """The LXD alias of the image this recipe builds."""
    return f"dfo-debian-{recipe_hash()}"


def _mirror() -> str:
    """The Debian mirror this machine's apt uses (no other network is reachable)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        match = re.search(r"^URIs:\s*(\S+/debian)\s*$", path.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        match = re.search(r"^deb\s+(\S+/debian)\s+", sources.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
    return "http://deb.debian.org/debian"


def build(say: Say) -> tuple[Path, Path]:
    """Return (metadata tarball, rootfs squashfs), building them unless the cache has this recipe."""
    entry = CACHE / "images" / recipe_hash()
    meta, rootfs_sq = entry / "meta.tar.xz", entry / "rootfs.squashfs"
    if meta.exists() and rootfs_sq.exists():
        return meta, rootfs_sq
    for tool in ("debootstrap", "mksquashfs"):
        if shutil.which(tool) is None:
            raise SandboxError(f"{tool} is missing: apt-get install debootstrap squashfs-tools")
    work = CACHE / "images" / f".build-{recipe_hash()}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    rootfs = work / "rootfs"
    rootfs.mkdir(parents=True)
    started = time.monotonic()
    say(f"image: debootstrap {SUITE} (about 1-2 minutes, cached afterwards)")
    debs = CACHE / "debootstrap"
    debs.mkdir(parents=True, exist_ok=True)
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        f"--cache-dir={debs}",
        SUITE,
        str(rootfs),
        _mirror(),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        shutil.rmtree(work, ignore_errors=True)
        raise SandboxError(f"debootstrap failed:\n{tail}")
    _customise(rootfs)
    say(f"image: rootfs ready in {time.monotonic() - started:.0f} s; packing")
    _pack(work, rootfs)
    entry.mkdir(parents=True, exist_ok=True)
    os.replace(work / "meta.tar.xz", meta)
    os.replace(work / "rootfs.squashfs", rootfs_sq)
    shutil.rmtree(work, ignore_errors=True)
    say(f"image: built in {time.monotonic() - started:.0f} s, cached in {entry}")
    return meta, rootfs_sq


def _customise(rootfs: Path) -> None:
    for rel, text in FILES.items():
        path = rootfs / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for rel, target in SYMLINKS.items():
        link = rootfs / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    for key in (rootfs / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    (rootfs / "etc" / "machine-id").write_text("")
    dbus_id = rootfs / "var" / "lib" / "dbus" / "machine-id"
    if dbus_id.exists() or dbus_id.is_symlink():
        dbus_id.unlink()
    ssh_dir = rootfs / "root" / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    (rootfs / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True, exist_ok=True)


def _pack(work: Path, rootfs: Path) -> None:
    meta_dir = work / "meta"
    (meta_dir / "templates").mkdir(parents=True)
    templates = "".join(
        f"  {path}:\n    when: [create, copy]\n    create_only: false\n    template: {name}\n"
        for path, (name, _) in TEMPLATES.items()
    )
    (meta_dir / "metadata.yaml").write_text(
        f"architecture: x86_64\ncreation_date: {int(time.time())}\n"
        f"properties:\n  description: dflash-orchestrator sandbox (Debian {SUITE}, recipe {recipe_hash()})\n"
        f"  os: debian\n  release: {SUITE}\ntemplates:\n{templates}"
    )
    for _path, (name, text) in TEMPLATES.items():
        (meta_dir / "templates" / name).write_text(text)
    with tarfile.open(work / "meta.tar.xz", "w:xz") as tar:
        tar.add(meta_dir / "metadata.yaml", arcname="metadata.yaml")
        tar.add(meta_dir / "templates", arcname="templates")
    proc = subprocess.run(
        ["mksquashfs", str(rootfs), str(work / "rootfs.squashfs"), "-comp", "gzip", "-noappend", "-quiet"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SandboxError(f"mksquashfs failed: {proc.stderr.strip()[-500:]}")
