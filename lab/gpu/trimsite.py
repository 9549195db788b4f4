"""Remove from an installed site what the trim list names; print what went, with its size, as JSON.

    python3 trimsite.py SITE TRIM_LIST

Each line of the list is a glob relative to SITE ("#" starts a comment). A line that matches nothing
is an error: the list was written for another vLLM, and what it meant to remove is still there.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def main(site: Path, trim: Path) -> int:
    removed: list[dict[str, object]] = []
    for line in trim.read_text().splitlines():
        pattern = line.split("#", 1)[0].strip()
        if not pattern:
            continue
        found = sorted(site.glob(pattern))
        if not found:
            print(f"trimsite: {trim}: {pattern!r} matches nothing in {site}", file=sys.stderr)
            return 1
        for path in found:
            removed.append({"path": str(path.relative_to(site)), "bytes": size(path)})
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    print(json.dumps(removed, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
