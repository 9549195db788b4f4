"""The GPU device's side of the wheelhouse: take the parts that arrive one call at a time, then
install the site once every part is there. Standard library only (it runs before vLLM is there).

    python3 lab/gpu/gather.py take WHEELHOUSE [--store /tmp/gpu-wheelhouse]
    python3 lab/gpu/gather.py install WHEELHOUSE [--store ...] [--site /tmp/gpu-site]
    python3 lab/gpu/gather.py split WHEELHOUSE --mib N --out DIR   # here: cut into smaller parts

``take`` copies each part found in WHEELHOUSE (this call's carried folder) to the store, outside the
working tree, where it stays while the machine is warm, once its sha256 is the manifest's; a part
whose digest differs is refused and not kept. ``install`` joins the parts, checks the archive's
digest, unpacks it into the site and says which parts are still missing if any is. Exit 0 when it
did what it says, 1 when a part is missing or wrong, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Any


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def take(house: Path, store: Path, manifest: dict[str, Any]) -> int:
    store.mkdir(parents=True, exist_ok=True)
    failed = 0
    for part in manifest["parts"]:
        here, kept = house / part["name"], store / part["name"]
        if kept.exists() and sha256(kept) == part["sha256"]:
            print(f"gather: {part['name']} already kept")
            continue
        if not here.exists():
            continue
        digest = sha256(here)
        if digest != part["sha256"]:
            print(f"gather: {part['name']} has sha256 {digest}, the manifest says {part['sha256']}: not kept")
            failed = 1
            continue
        shutil.copyfile(here, kept.with_suffix(".tmp"))
        kept.with_suffix(".tmp").replace(kept)
        print(f"gather: {part['name']} kept ({part['bytes']} bytes, sha256 checked)")
    missing = [p["name"] for p in manifest["parts"] if not (store / p["name"]).exists()]
    print(
        f"gather: {len(manifest['parts']) - len(missing)} of {len(manifest['parts'])} parts kept"
        + (f"; missing {missing}" if missing else "")
    )
    return failed


def install(store: Path, site: Path, manifest: dict[str, Any]) -> int:
    missing = [p["name"] for p in manifest["parts"] if not (store / p["name"]).exists()]
    if missing:
        print(f"gather: cannot install, parts missing: {missing}")
        return 1
    stamp = site / ".gathered"
    if stamp.exists() and stamp.read_text().strip() == manifest["archive"]["sha256"]:
        print(f"gather: {site} already holds this wheelhouse")
        return 0
    archive = store / "site.tar.xz"
    with archive.open("wb") as out:
        for part in manifest["parts"]:
            with (store / part["name"]).open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    digest = sha256(archive)
    if digest != manifest["archive"]["sha256"]:
        print(f"gather: the joined archive has sha256 {digest}, the manifest says {manifest['archive']['sha256']}")
        return 1
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(site, filter="data")
    archive.unlink()
    stamp.write_text(manifest["archive"]["sha256"] + "\n")
    print(f"gather: installed {len(manifest['packages'])} packages into {site} ({manifest['site_bytes']} bytes)")
    return 0


def split(house: Path, out: Path, mib: int, manifest: dict[str, Any]) -> int:
    """The same archive in parts of ``mib`` MiB, with its manifest (each call carries the working
    tree too: as the tree grows, the parts must shrink). The archive's digest is checked first."""
    h = hashlib.sha256()
    for part in manifest["parts"]:
        with (house / part["name"]).open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    if h.hexdigest() != manifest["archive"]["sha256"]:
        print(f"gather: the parts in {house} do not join into the manifest's archive")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    parts, size, n = [], mib << 20, 0
    with _joined(house, manifest) as src:
        while chunk := src.read(size):
            name = f"part-{n:02d}"
            (out / name).write_bytes(chunk)
            parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            n += 1
    (out / "MANIFEST.json").write_text(json.dumps(manifest | {"parts": parts}, indent=2) + "\n")
    print(f"gather: {len(parts)} parts of at most {mib} MiB in {out}")
    return 0


class _joined:
    """The parts read one after the other as one file."""

    def __init__(self, house: Path, manifest: dict[str, Any]) -> None:
        self.files = [(house / p["name"]).open("rb") for p in manifest["parts"]]

    def __enter__(self) -> _joined:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.files:
            f.close()

    def read(self, size: int) -> bytes:
        got = b""
        while self.files and len(got) < size:
            chunk = self.files[0].read(size - len(got))
            if chunk:
                got += chunk
            else:
                self.files.pop(0).close()
        return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verb", choices=("take", "install", "split"))
    parser.add_argument("house", type=Path, help="the wheelhouse folder carried by this call (its MANIFEST.json)")
    parser.add_argument("--store", type=Path, default=Path("/tmp/gpu-wheelhouse"))
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpu-site"))
    parser.add_argument("--mib", type=int, default=16, help="split: each part's size")
    parser.add_argument("--out", type=Path, help="split: where the parts go")
    args = parser.parse_args()
    manifest = json.loads((args.house / "MANIFEST.json").read_text())
    if args.verb == "split":
        if args.out is None or args.mib < 1:
            parser.error("split needs --out and --mib >= 1")
        return split(args.house, args.out, args.mib, manifest)
    code = take(args.house, args.store, manifest)
    if args.verb == "install":
        code = code or install(args.store, args.site, manifest)
    return code


if __name__ == "__main__":
    sys.exit(main())
