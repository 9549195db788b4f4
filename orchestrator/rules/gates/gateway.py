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

# Reasons its failures carry (engine/gateway.py acts on the gateway; these are what it found).
MIN_IN_ROTATION = "min_in_rotation"  # taking this host out would leave fewer serving than rollout.min_in_rotation
UNREACHABLE = "unreachable"  # the gateway did not answer, or refused the change
NOT_SERVED = "not_served"  # back in rotation, but the gateway did not serve the host's answers
