"""The ready gate proves the evidence is recorded on the host.

`ready.json` (release, gate numbers, digests, server pid) written with the atomic protocol.
"""

from __future__ import annotations

from typing import Any

from orchestrator.agent import protocol
from orchestrator.results import (
    GATE_SPEEDUP,
    Gate,
    HostReport,
)


def ready_gate(status: protocol.Status, report: HostReport) -> Gate:
    ready, server = status.ready, status.server
    if ready is None:
        return Gate(False, "no READY record (ready.json)")
    if ready.get("release_id") != report.release_id:
        return Gate(False, f"READY record is for release {ready.get('release_id')}, current is {report.release_id}")
    files = ready.get("files")
    recorded = (
        {f.get("path"): f.get("sha256") for f in files if isinstance(f, dict)} if isinstance(files, list) else None
    )
    if recorded != {f.dest: f.sha256 for f in report.files}:
        return Gate(False, "READY record's digests differ from the files served")
    if server and ready.get("pid") != server.pid:
        return Gate(
            False, f"the server was restarted since READY (pid {ready.get('pid')} -> {server.pid}): probe again"
        )
    if server and server.alive and status.launched_elsewhere is not None:
        # a restart in place (systemd's, the host's) would read a drafter from outside any release
        return Gate(
            False,
            f"the launched link points at {status.launched_elsewhere!r}, not at a release under releases/: "
            f"the server's drafter is read from outside release {report.release_id}; deploy again",
        )
    if server and server.alive and status.launched is not None and status.launched != report.release_id:
        # A server started by hand, or a launch that did not finish: it reads another drafter.
        return Gate(
            False,
            f"the server reads its drafter from release {status.launched} (the launched link), "
            f"READY names {report.release_id}: deploy again",
        )
    return Gate(True, f"READY record matches release {report.release_id} and its digests", recorded_speedup(ready))


def recorded_speedup(ready: dict[str, Any]) -> dict[str, Any]:
    """The speed-up per concurrency the READY record keeps (watch exports it), if it has one."""
    gates = ready.get("gates")
    fast = gates.get(GATE_SPEEDUP) if isinstance(gates, dict) else None
    levels = fast.get("levels") if isinstance(fast, dict) else None
    if not isinstance(levels, list):
        return {}
    kept = [
        {"concurrency": lv["concurrency"], "speedup": lv["speedup"]}
        for lv in levels
        if isinstance(lv, dict)
        and isinstance(lv.get("concurrency"), int)
        and isinstance(lv.get("speedup"), (int, float))
        and not isinstance(lv.get("speedup"), bool)
    ]
    return {"speedup": kept} if kept else {}
