"""The ``standby`` agent module's ops: the server put to sleep (vLLM's sleep mode) and woken, each
read back from the server.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from orchestrator.agent.protocol.core import LOOPBACK, Op, answer_field

# vLLM's sleep gauge (v1/metrics/loggers.py, vLLM 0.32): one series a state, 1.0 on the one it is in.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
_SLEEP_SERIES = re.compile(r'^vllm:engine_sleep_state\{[^}]*sleep_state="(\w+)"[^}]*\}\s+(\S+)\s*$')


@dataclass(frozen=True)
class Sleep:
    """sleep, wake_up: how long vLLM took to answer, its answer, and what it says it is after, read
    back: ``/is_sleeping`` (None: no answer) and its sleep gauge (``SLEEP_STATES``; None: no
    gauge, or one that names no state)."""

    seconds: float
    answer: str
    is_sleeping: bool | None
    state: str | None
    host_mib: int | None = None  # the server's process group, resident, after the call
    gpu_mib: int | None = None  # its processes' GPU memory (nvidia-smi; None: no nvidia-smi)


def sleep(
    root: str,
    name: str,
    port: int,
    level: int,
    timeout: float,
    host: str = LOOPBACK,
    keep_as: str | None = None,
    need: int | None = None,
) -> Op[Sleep]:
    """Put the server started under ``name`` (listening on ``port``) to sleep: level 1 offloads its
    weights to host memory and frees the GPU's, level 2 discards them. Requests in flight finish
    first. ``keep_as``: once read back asleep, the server is known by that name (the standby; refused
    while a live server of ours has it), and ``name`` is free for the next release. ``need``: the
    bytes of weights level 1 moves to host memory (refused before vLLM is asked where the host has
    not that much available, with a margin)."""
    request = {"op": "sleep", "root": root, "name": name, "host": host, "port": port, "level": level}
    return Op({**request, "timeout": timeout, "keep_as": keep_as, "need": need}, _slept, budget_s=timeout + 20)


def wake_up(
    root: str, name: str, port: int, timeout: float, host: str = LOOPBACK, serve_as: str | None = None
) -> Op[Sleep]:
    """Wake the server started under ``name``: its weights back on the GPU, its KV cache allocated.
    ``serve_as``: once read back awake, it is known by that name (the server again; refused while a
    live server of ours has it) and ``launched`` names its release."""
    request = {"op": "wake_up", "root": root, "name": name, "host": host, "port": port, "timeout": timeout}
    return Op({**request, "serve_as": serve_as}, _slept, budget_s=timeout + 20)


def _slept(v: dict[str, Any]) -> Sleep:
    said = answer_field(v, "is_sleeping", str, optional=True)
    is_sleeping = None
    if said is not None:
        with contextlib.suppress(ValueError):
            found = json.loads(said)
            if isinstance(found, dict) and isinstance(found.get("is_sleeping"), bool):
                is_sleeping = found["is_sleeping"]
    return Sleep(
        answer_field(v, "seconds", float),
        answer_field(v, "answer", str),
        is_sleeping,
        sleep_state(answer_field(v, "gauge", str)),
        answer_field(v, "host_mib", int, optional=True),
        answer_field(v, "gpu_mib", int, optional=True),
    )


def sleep_state(metrics: str) -> str | None:
    """The state vLLM's sleep gauge is at in a ``/metrics`` text: the one series at 1 (None: no
    gauge, or not exactly one state at 1)."""
    on = []
    for line in metrics.splitlines():
        found = _SLEEP_SERIES.match(line.strip())
        if found and found[1] in SLEEP_STATES:
            with contextlib.suppress(ValueError):
                if float(found[2]) == 1.0:
                    on.append(found[1])
    return on[0] if len(on) == 1 else None
