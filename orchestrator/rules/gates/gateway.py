"""The gateway gate proves each host left the gateway's rotation before its server stopped, and is
served through the gateway again before it is READY (only with a `gateway:` block).

Drained first (no new requests; those in flight finish, within `gateway.drain_timeout`), then
stopped, started and proven; put back in rotation and read back from the gateway's own state; a
request through the gateway must reach it. Never fewer than `rollout.min_in_rotation` hosts serve:
a host whose drain would break that floor waits, or the rollout stops. `verify` says whether each
host is in rotation and whether that agrees with its being READY. The adapters, one per gateway
kind, are in `orchestrator/gateways/`; the acting is `orchestrator/engine/gateway.py`.
"""

from __future__ import annotations

from orchestrator.results import Gate

# Reasons its failures carry (engine/gateway.py acts on the gateway; these are what it found).
MIN_IN_ROTATION = "min_in_rotation"  # taking this host out would leave fewer serving than rollout.min_in_rotation
UNREACHABLE = "unreachable"  # the gateway did not answer, or refused the change
NOT_SERVED = "not_served"  # back in rotation, but the gateway did not serve the host's answers
# verify's findings: the host's place in the rotation against its being READY
IN_ROTATION_NOT_READY = "in_rotation_not_ready"  # users' requests reach a host that is not proven
OUT_OF_ROTATION = "out_of_rotation"  # READY, but taken out and never put back: capacity lost


def read_rotation(in_rotation: bool, status: str, in_flight: int | None, ready: bool) -> Gate:
    """verify: the host as the gateway sees it (in rotation or not, in the gateway's own word)
    against what the other gates found (READY or not)."""
    data = {"in_rotation": in_rotation, "status": status, "in_flight": in_flight}
    if in_rotation and not ready:
        return Gate(
            False,
            f"in the gateway's rotation ({status}) but not READY: users' requests reach it",
            data,
            IN_ROTATION_NOT_READY,
        )
    if not in_rotation and ready:
        return Gate(
            False,
            f"READY but out of the gateway's rotation ({status}): taken out and never put back",
            data,
            OUT_OF_ROTATION,
        )
    if in_rotation:
        return Gate(True, f"in the gateway's rotation ({status})", data)
    return Gate(True, f"out of the gateway's rotation ({status}), as a host that is not READY should be", data)


def unreachable(why: str) -> Gate:
    """The gateway did not answer, or its answer does not read: nothing can be said of the host."""
    return Gate(False, f"the gateway: {why}", reason=UNREACHABLE)
