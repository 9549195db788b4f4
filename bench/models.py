"""Model artifacts at scale: pushing a large file against scp, and verify with the digest cache.

On its own ssh sandbox (prefix ``dfm``, 10.82.0.0/16), as root:

    python bench/models.py --push-gib 2 --push-hosts 4 --verify-gib 4 --verify-hosts 8

1. Push: ``orchestrate deploy`` of a playbook whose drafter model is ``push:`` a directory holding
   one file of --push-gib GiB, to --push-hosts hosts at once, against ``scp`` of the same file to
   the same hosts at once (the same key, the same sshd); MB/s of payload each, and the
   controller's peak memory during the push.
2. Verify: --verify-hosts hosts each serving a model directory of --verify-gib GiB (one shared
   directory on this machine: every host hashes it into its own cache), a no-change
   ``orchestrate verify`` against the same verify of a playbook with no models; then
   ``verify --rehash`` (every file hashed again), in seconds per GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.sandbox.processes import run_measured
from orchestrator.sandbox.sshhosts import SshSandbox

REPO = Path(__file__).resolve().parents[1]
TINY = Path("/opt/dflash-orchestrator/tiny-models/drafter-good")  # made by scripts/vllm-venv
DRAFTER = TINY / "config.json"
WORK = Path("/var/lib/dflash-orchestrator/bench-models")


def orchestrate(*args: str | Path, state: Path) -> tuple[float, int, dict[str, object]]:
    """(wall seconds, peak RSS KiB of this child, its JSON report)."""
    env = dict(os.environ, ORCHESTRATE_STATE_DIR=str(state))
    started = time.monotonic()
    proc, peak = run_measured([sys.executable, "-m", "orchestrator", *map(str, args), "--json"], env)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"orchestrate {args[0]} failed: {proc.stderr.decode()[-2000:]}")
    return wall, peak, json.loads(proc.stdout)


def big_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for _ in range(size >> 24):
            f.write(os.urandom(1 << 24))


def playbook(path: Path, models: dict[str, object] | None) -> Path:
    book: dict[str, object] = {
        "name": "bench-models",
        "targets": ["all"],
        "deploy_root": "/srv/bench-models",
        "drafter": {"config": str(DRAFTER)},
        "serving": {"num_speculative_tokens": 7},  # the tiny drafter's block of 8
    }
    if models:
        book["models"] = models
    path.write_text(json.dumps(book))
    return path


def push(box: SshSandbox, names: list[str], gib: float) -> None:
    size = int(gib * (1 << 30))
    local = WORK / "push"
    big_file(local / "big.bin", size)
    shutil.copy(TINY / "model.safetensors", local / "model.safetensors")  # the weights gate reads it
    for name in names:  # each run starts from hosts without the file
        shutil.rmtree(Path(box.dir / "hosts" / name / "srv" / "models"), ignore_errors=True)
    pb = playbook(WORK / "push.json", {"drafter": {"path": "/srv/models/pushed", "push": str(local)}})
    limits = [a for n in names for a in ("--limit", n)]
    wall, peak, report = orchestrate("deploy", pb, "-i", box.inventory, *limits, state=WORK / "state")
    seconds = max(h["models"][0]["pushed"]["seconds"] for h in report["hosts"])  # type: ignore[index]
    ours = size * len(names) / seconds / 1e6

    started = time.monotonic()
    copies = [
        subprocess.Popen(
            ["scp", "-q", "-F", str(box.ssh_config), str(local / "big.bin"), f"{n}:/srv/scp-big.bin"],
            stdout=subprocess.DEVNULL,
        )
        for n in names
    ]
    if any(c.wait() != 0 for c in copies):
        raise SystemExit("scp failed")
    scp_seconds = time.monotonic() - started
    theirs = size * len(names) / scp_seconds / 1e6
    print(
        f"push {gib:g} GiB to {len(names)} hosts: orchestrate {seconds:.1f} s ({ours:.0f} MB/s, deploy "
        f"{wall:.1f} s in all), scp {scp_seconds:.1f} s ({theirs:.0f} MB/s): {ours / theirs:.2f}x scp; "
        f"controller peak RSS {peak / 1024:.0f} MiB"
    )


def verify(box: SshSandbox, names: list[str], gib: float) -> None:
    size = int(gib * (1 << 30))
    shared = WORK / "shared-model"
    for i in range(4):  # four shards, like a real checkpoint
        big_file(shared / f"model-{i:05d}-of-00004.safetensors", size // 4)
    shutil.copy(TINY.parent / "target" / "config.json", shared / "config.json")  # read where the server reads it
    with_models = playbook(WORK / "with.json", {"target": {"path": str(shared)}})
    without = playbook(WORK / "without.json", None)
    limits = [a for n in names for a in ("--limit", n)]
    for pb in (with_models, without):
        orchestrate("deploy", pb, "-i", box.inventory, *limits, state=WORK / "state")
    orchestrate("deploy", with_models, "-i", box.inventory, *limits, state=WORK / "state")
    times: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(3):
        times["with"].append(orchestrate("verify", with_models, "-i", box.inventory, *limits, state=WORK / "state")[0])
        times["without"].append(orchestrate("verify", without, "-i", box.inventory, *limits, state=WORK / "state")[0])
    w, wo = sorted(times["with"])[1], sorted(times["without"])[1]
    rehash, _, _ = orchestrate("verify", with_models, "--rehash", "-i", box.inventory, *limits, state=WORK / "state")
    total_gb = size * len(names) / 1e9
    print(
        f"verify {len(names)} hosts x {gib:g} GiB of model files, no change (median of 3): {w:.2f} s against "
        f"{wo:.2f} s without models ({w / wo:.2f}x); --rehash {rehash:.1f} s for {total_gb:.1f} GB "
        f"({rehash / total_gb:.2f} s per GB on this machine's 2 cores)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--push-gib", type=float, default=2.0)
    parser.add_argument("--push-hosts", type=int, default=4)
    parser.add_argument("--verify-gib", type=float, default=4.0)
    parser.add_argument("--verify-hosts", type=int, default=8)
    args = parser.parse_args()
    box = SshSandbox(Path("/var/lib/dflash-orchestrator/bench-models-sandbox"), prefix="dfm", subnet="10.82")
    box.down()
    box.up(max(args.push_hosts, args.verify_hosts))
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        names = [h.name for h in box.hosts()]
        push(box, names[: args.push_hosts], args.push_gib)
        verify(box, names[: args.verify_hosts], args.verify_gib)
    finally:
        box.down()


if __name__ == "__main__":
    main()
