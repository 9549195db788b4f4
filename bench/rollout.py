"""A rolling deploy of 3 hosts under constant load, through a real gateway: requests sent and lost,
the rollout's wall time, each host's drain and admission, with and without the gateway in the
playbook, and what min_in_rotation held.

    .venv/bin/python bench/rollout.py [--gateway haproxy|vllm-router] [--clients 6] [--reps 3]

The hosts are three ``connection: local`` containers on 127.0.0.11-13 serving the stand-in of
``tests/unit/standin_vllm.py`` (each request 8 tokens at 0.05 s), the gateway HAProxy (Debian's
package) or vllm-router (PyPI) started here; see ``tests/integration/gateway_parts.py``. Each
rollout replaces servers started without vLLM's drain (``--shutdown-timeout`` 0: a stop cuts what
they hold), so the difference is the gateway's drain alone (vllm-router routes only to the workers
a deploy added, so it is measured with the gateway only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.gateway_parts import HOSTS, Haproxy, Load, Router, free_port, make_fleet, wait_for


def one(gateway_kind: str, clients: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        fleet_iter = make_fleet(base)
        fleet = next(fleet_iter)
        proxy = Haproxy(base, free_port(), fleet.port).start()
        router = Router(base, free_port()).start() if gateway_kind == "vllm-router" else None
        try:
            if router is None:
                gateway: dict[str, Any] = {
                    "kind": "haproxy",
                    "runs_on": "gw",
                    "url": f"http://127.0.0.1:{proxy.port}",
                    "socket": str(proxy.socket),
                    "backend": "vllm",
                }
                front = proxy.port
            else:
                gateway = {"kind": "vllm-router", "runs_on": "gw", "url": f"http://127.0.0.1:{router.port}"}
                front = router.port
            out: dict[str, Any] = {}
            rollout = {"batch_size": 1, "min_in_rotation": 2}
            # vllm-router routes only to workers a deploy added: it is measured with the gateway only.
            labels = (("with", gateway),) if router else (("without", None), ("with", gateway))
            for label, spec in labels:
                first = fleet.deploy(fleet.playbook(spec if router else None, f"{label} 1\n", rollout=rollout))
                assert first.ok, [(h.name, h.failed_gate) for h in first.hosts]
                if router is None:
                    wait_for("HAProxy's checks", lambda: proxy.status() == {n: "UP" for n in HOSTS})
                load = Load(front, clients=clients).start()
                started = time.monotonic()
                report = fleet.deploy(fleet.playbook(spec, f"{label} 2\n", rollout=rollout))
                wall = time.monotonic() - started
                load.stop()
                assert report.ok, [(h.name, h.failed_gate) for h in report.hosts]
                gates = [h.gates.get("gateway") for h in report.hosts]
                out[label] = {
                    "sent": load.sent,
                    "lost": len(load.lost),
                    "wall_s": wall,
                    "drain_s": [g.data.get("drain_s") for g in gates if g is not None],
                    "admit_s": [g.data.get("admit_s") for g in gates if g is not None],
                }
            return out
        finally:
            if router is not None:
                router.stop()
            proxy.stop()
            for _ in fleet_iter:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", choices=["haproxy", "vllm-router"], default="haproxy")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs = [one(args.gateway, args.clients) for _ in range(args.reps)]
    print(f"gateway {args.gateway}, {args.clients} clients, 3 hosts one at a time, min_in_rotation 2, {args.reps} reps")
    print("| playbook | sent | lost | rollout wall s (median) | drain s per host | admit s per host |")
    print("| --- | --: | --: | --: | --- | --- |")
    for label in ("without", "with"):
        rows = [r[label] for r in runs if label in r]
        if not rows:
            continue
        drains = [d for r in rows for d in r["drain_s"] if d is not None]
        admits = [a for r in rows for a in r["admit_s"] if a is not None]
        print(
            f"| {label} the gateway | {sum(r['sent'] for r in rows)} | {sum(r['lost'] for r in rows)} | "
            f"{statistics.median(r['wall_s'] for r in rows):.1f} | "
            f"{f'{min(drains):.2f}-{max(drains):.2f}' if drains else '-'} | "
            f"{f'{min(admits):.2f}-{max(admits):.2f}' if admits else '-'} |"
        )


if __name__ == "__main__":
    main()
