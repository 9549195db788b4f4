"""The health gate proves the tensor-parallel workers are up.

The server launched as a systemd unit written by the agent where systemd is the container's init,
else as a process of its own session (pidfile with start time, log file), `current` switched first,
the drafter read through `launched` (moved by the launch alone); `/health` 200 and `/v1/models`
lists the model within `serving.startup_timeout`; a dead process fails at once with the last 30
lines of its log; the start's ledger (phases from vLLM's own lines, compile hit or miss, KV cache)
is the gate's `startup`, a KV cache smaller than the same release's last start a warning, and so
a start that waited on a lookup of the host's own name (Gloo's, on every start of vLLM). `verify`
holds a server vLLM says is asleep (`/is_sleeping`, its sleep mode's route) as not healthy: it
answers `/health` 200 while every request waits in its queue. With `serving.standby`, the standby
is proven too: asleep (vLLM says so), its release still on the host; a standby awake is a server
outside rotation holding the GPU's memory, and fails the gate.
"""

from __future__ import annotations

from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    GATE_HEALTH,
    GATE_READY,
    Gate,
    HostReport,
)
from orchestrator.rules import startup
from orchestrator.rules.gates.ready import ready_gate

# A reason code of the gate (``GATES``): the server answers /health but vLLM sleeps.
ASLEEP = "asleep"
# The standby (``serving.standby``) is awake: outside rotation, holding the GPU's memory.
STANDBY_AWAKE = "standby_awake"


def health_op(playbook: Playbook, root: str, name: str, host: str = protocol.LOOPBACK) -> protocol.Op[protocol.Healthy]:
    """The wait for the server's health, within the playbook's start budget."""
    s = playbook.serving
    return protocol.wait_health(root, name, s.port, s.model_name, s.startup_timeout, host=host)


def read_health(
    healthy: protocol.Healthy, kept: bool, report: HostReport, last_ready: dict[str, Any] | None = None
) -> None:
    """The health gate from the health wait's answer (the pid that answered, how long it took) and,
    for a server this run started, its startup ledger; a KV cache smaller than the same release's
    last start (``last_ready``: the READY record the host held before) is said with both numbers."""
    if kept:
        detail = f"healthy after {healthy.waited_s} s, pid {healthy.pid} (already running)"
        data_kept: dict[str, Any] = {"seconds": healthy.waited_s}
        last = last_start(last_ready, report.release_id)
        if last is not None and isinstance(last_ready, dict) and last_ready.get("pid") == healthy.pid:
            # The same process: its start is still the one that serves (the READY record keeps it
            # for the next start to compare with); history counts it once.
            data_kept["startup"] = {**last, "carried": True}
        report.gates[GATE_HEALTH] = Gate(True, detail, data_kept)
        return
    data: dict[str, Any] = {"seconds": healthy.waited_s}
    detail = f"healthy after {healthy.waited_s} s, pid {healthy.pid}"
    if healthy.startup is not None:
        ledger = startup.ledger(healthy.startup)
        data["startup"] = ledger.to_json()
        detail = f"healthy {ledger.total_s:.1f} s after the launch, pid {healthy.pid}: {ledger.line()}"
        if warning := startup.smaller_kv(ledger, last_start(last_ready, report.release_id)):
            data["kv_smaller"] = warning
            detail += f"; warning: {warning}"
        if warning := startup.name_lookup(healthy.startup):
            data["name_lookup"] = warning
            detail += f"; warning: {warning}"
    report.gates[GATE_HEALTH] = Gate(True, detail, data)


def last_start(last_ready: dict[str, Any] | None, release_id: str | None) -> dict[str, Any] | None:
    """The ledger of the start the host's last READY record names, when it was this release's."""
    if not isinstance(last_ready, dict) or release_id is None or last_ready.get("release_id") != release_id:
        return None
    gates = last_ready.get("gates")
    health = gates.get(GATE_HEALTH) if isinstance(gates, dict) else None
    ledger = health.get("startup") if isinstance(health, dict) else None
    return ledger if isinstance(ledger, dict) else None


def read_serving_status(status: protocol.Status, report: HostReport, role: str | None = None) -> None:
    """verify: the process we started is alive (and, on a head, healthy), and the READY record is
    this release's. ``role``: a rank that serves no HTTP (its health is its process being alive)."""
    server = status.server
    if role is not None:
        report.gates[GATE_HEALTH] = rank_alive(server, role)
    elif server is None or not server.alive:
        report.gates[GATE_HEALTH] = Gate(False, "the server is not running")
    elif status.health != 200:
        said = f"answers {status.health}" if status.health is not None else "does not answer"
        report.gates[GATE_HEALTH] = Gate(False, f"pid {server.pid} alive, but /health {said}")
    elif status.sleeping:
        # vLLM's sleep mode, asked for by whoever reached its dev routes: healthy, serving nothing
        report.gates[GATE_HEALTH] = Gate(
            False,
            f"pid {server.pid} alive and /health 200, but vLLM is asleep (POST /sleep): every request "
            "waits in its queue until POST /wake_up",
            reason=ASLEEP,
        )
    else:
        report.gates[GATE_HEALTH] = Gate(True, f"pid {server.pid} alive, /health 200")
    report.gates[GATE_READY] = ready_gate(status, report)


def read_standby(status: protocol.Status, report: HostReport) -> None:
    """verify, a playbook with a standby: the standby as the host has it (its release, port and
    process, and the memory its READY record counted when that process was put to sleep). None
    is kept: no standby yet (a first deploy), or it went back into service. Awake, it fails the
    health gate: a server outside rotation that holds the GPU's memory."""
    standby = status.server
    if standby is None or not standby.alive:
        report.standby = None
        return
    found: dict[str, Any] = {
        "release_id": standby.release_id,
        "pid": standby.pid,
        "port": standby.port,
        "asleep": status.sleeping,
    }
    counted = (status.ready or {}).get("standby")
    if isinstance(counted, dict) and counted.get("pid") == standby.pid:
        for key in ("host_mib", "gpu_mib", "sleep_s"):
            if isinstance(counted.get(key), (int, float)) and not isinstance(counted.get(key), bool):
                found[key] = counted[key]
    report.standby = found
    if not status.sleeping and report.gates.get(GATE_HEALTH, Gate(True, "")).ok:
        said = "does not answer /health" if status.health is None else "is awake (vLLM does not say it sleeps)"
        report.gates[GATE_HEALTH] = Gate(
            False,
            f"the standby (release {standby.release_id}, pid {standby.pid}, port {standby.port}) {said}: a server "
            "outside rotation that holds the GPU's memory; a deploy puts the next standby to sleep and stops it",
            reason=STANDBY_AWAKE,
        )


def rank_alive(server: protocol.Process | None, role: str) -> Gate:
    """A rank other than the head serves no HTTP: its health is its process being alive."""
    if server is not None and server.alive:
        return Gate(True, f"{role} pid {server.pid} alive")
    return Gate(False, f"{role} is not running")
