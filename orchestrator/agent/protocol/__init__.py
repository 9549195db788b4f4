"""The agent protocol: every operation the controller sends, its request and the reader of its answer.

An ``Op`` is one operation as a value: the request (plain data that marshal carries to the host),
how long it may take beyond a plain round trip, and the function that reads its answer into a
typed value, side by side (as pyinfra keeps a fact's command with its parser). The host is not
trusted: a reader checks every field it uses and a malformed answer is an ``AgentProtocolError``,
never a ``KeyError`` deep in a run. Answers are looked up by op (``answers[op]``), never by position.

Each operation's contract is one row of ``OPS`` at the end, in the agent's order: its name, the
agent module that implements it (what a batch must carry), the gate its failure is reported
under, its words for progress, and its builder. Nothing outside this module is keyed by an op's
name. An op built ``.finding()`` does not stop its batch when it fails: its failure is a finding
(``Answers.failures``), and the ops after it run (verify and watch read every gate at once). An
op may take an earlier answer of its batch by reference (``ref``), resolved on the host.

Adding an op: a builder and a reader here, a function with ``@op(name, **spec)`` in the agent
module that does the work, and a row in ``OPS``. The agent checks every request against the
function's spec (a missing or mistyped key is a ``bad_request`` naming it), so every key is sent
from here: the defaults live on this side only. A unit test holds the two sides equal in names
and order.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from orchestrator.agent.protocol.core import (
    LOOPBACK,
    SPECS,
    AnswerError,
    Answers,
    Locked,
    Op,
    OpSpec,
    ServerCommand,
    Written,
    batch_timeout,
    lock,
    put,
    ref,
)
from orchestrator.agent.protocol.models import (
    MODEL_HASH_TIMEOUT,
    SLOWEST_UPLOAD_BYTES_PER_S,
    ModelFile,
    ModelFiles,
    TokenFacts,
    Uploaded,
    UploadState,
    model_files,
    upload,
    upload_status,
)
from orchestrator.agent.protocol.releases import (
    INSPECT_MAX_BYTES,
    Applied,
    Overlay,
    Releases,
    Served,
    ServedFile,
    Switched,
    release_apply,
    release_inspect,
    release_list,
    release_switch,
    release_verify,
)
from orchestrator.results import (
    GATE_ACCEPTANCE,
    GATE_BUILD,
    GATE_ENGINE,
    GATE_FILES,
    GATE_GATEWAY,
    GATE_GPUS,
    GATE_HEALTH,
    GATE_LOADER,
    GATE_MODELS,
    GATE_RAY,
    GATE_READY,
    GATE_SPEEDUP,
    GATE_STOPPED,
)

if TYPE_CHECKING:  # the modules of serving hosts, loaded when first named (``__getattr__``)
    from orchestrator.agent.protocol.background import (
        ChecksDone,
        ChecksStarted,
        checks_start,
        checks_wait,
    )
    from orchestrator.agent.protocol.checks import (
        NCCL_BYTES,
        NCCL_ITERATIONS,
        SERVING_PYTHON_TIMEOUT,
        AllReduce,
        Build,
        GpuFacts,
        LoaderView,
        gpus,
        loader_view,
        nccl,
        vllm_build,
    )
    from orchestrator.agent.protocol.compile_cache import (
        GIVEN,
        CacheFile,
        Placed,
        compile_cache_files,
        compile_cache_place,
        compile_cache_read,
    )
    from orchestrator.agent.protocol.gateway import (
        Endpoint,
        HttpAnswer,
        gateway_endpoints,
        gateway_http,
        gateway_socket,
    )
    from orchestrator.agent.protocol.serving import (
        ENGINE_CHECK_TIMEOUT,
        Engine,
        Healthy,
        Launched,
        Loaded,
        Output,
        Process,
        Refused,
        Scrapes,
        Sent,
        Startup,
        Status,
        Stopped,
        command,
        engine_check,
        launch,
        load,
        metrics,
        probe,
        serving_runs,
        serving_status,
        stop,
        wait_health,
    )
    from orchestrator.agent.protocol.standby import Sleep, sleep, wake_up

# The modules loaded when first named (what ``TYPE_CHECKING`` imports above): a files-only deploy
# never loads the serving ops (their answer classes cost a controller start milliseconds on 3.11).
_LATER = ("serving", "checks", "background", "compile_cache", "gateway", "standby")

__all__ = [
    "ENGINE_CHECK_TIMEOUT",
    "GIVEN",
    "INSPECT_MAX_BYTES",
    "LOOPBACK",
    "MODEL_HASH_TIMEOUT",
    "NCCL_BYTES",
    "NCCL_ITERATIONS",
    "OPS",
    "SERVING_PYTHON_TIMEOUT",
    "SLOWEST_UPLOAD_BYTES_PER_S",
    "SPECS",
    "AllReduce",
    "AnswerError",
    "Answers",
    "Applied",
    "Build",
    "CacheFile",
    "ChecksDone",
    "ChecksStarted",
    "Endpoint",
    "Engine",
    "GpuFacts",
    "Healthy",
    "HttpAnswer",
    "Launched",
    "Loaded",
    "LoaderView",
    "Locked",
    "ModelFile",
    "ModelFiles",
    "Op",
    "OpSpec",
    "Output",
    "Overlay",
    "Placed",
    "Process",
    "Refused",
    "Releases",
    "Scrapes",
    "Sent",
    "Served",
    "ServedFile",
    "ServerCommand",
    "Sleep",
    "Startup",
    "Status",
    "Stopped",
    "Switched",
    "TokenFacts",
    "UploadState",
    "Uploaded",
    "Written",
    "batch_timeout",
    "checks_start",
    "checks_wait",
    "command",
    "compile_cache_files",
    "compile_cache_place",
    "compile_cache_read",
    "engine_check",
    "gateway_endpoints",
    "gateway_http",
    "gateway_socket",
    "gpus",
    "launch",
    "load",
    "loader_view",
    "lock",
    "metrics",
    "model_files",
    "modules",
    "nccl",
    "probe",
    "put",
    "ref",
    "release_apply",
    "release_inspect",
    "release_list",
    "release_switch",
    "release_verify",
    "serving_runs",
    "serving_status",
    "sleep",
    "stop",
    "upload",
    "upload_status",
    "vllm_build",
    "wait_health",
    "wake_up",
    "words",
]


OPS = (
    OpSpec("put", "core", GATE_READY, "writing"),
    OpSpec("lock", "core", GATE_FILES, "waiting for the deploy root's lock"),
    OpSpec("release_apply", "releases", GATE_FILES, "staging the release"),
    OpSpec("release_verify", "releases", GATE_FILES, "reading the served files back"),
    OpSpec("release_inspect", "releases", GATE_FILES, "reading the served files"),
    OpSpec("release_list", "releases", GATE_FILES, "listing its releases"),
    OpSpec("release_switch", "releases", GATE_FILES, "switching current"),
    OpSpec("model_files", "models", GATE_MODELS, "hashing the model files"),
    OpSpec("upload_status", "models", GATE_MODELS, "checking what is already uploaded"),
    OpSpec("upload", "models", GATE_MODELS, "uploading"),
    OpSpec("compile_cache_files", "compile_cache", GATE_HEALTH, "listing its compile cache"),
    OpSpec("compile_cache_read", "compile_cache", GATE_HEALTH, "reading its compile cache"),
    OpSpec("compile_cache_place", "compile_cache", GATE_HEALTH, "placing the compile cache given"),
    OpSpec("stop", "serving", GATE_STOPPED, "stopping the server"),
    OpSpec("command", "serving", GATE_RAY, "running a command"),
    OpSpec("engine_check", "serving", GATE_ENGINE, "letting vLLM check the command"),
    OpSpec("serving_runs", "serving", GATE_FILES, "reading what the server runs"),
    OpSpec("launch", "serving", GATE_HEALTH, "launching the server"),
    OpSpec("wait_health", "serving", GATE_HEALTH, "waiting for health"),
    OpSpec("serving_status", "serving", GATE_HEALTH, "reading the server's status"),
    OpSpec("probe", "serving", GATE_ACCEPTANCE, "probing acceptance"),
    OpSpec("load", "serving", GATE_SPEEDUP, "sending the speed-up load"),
    OpSpec("metrics", "serving", GATE_ACCEPTANCE, "reading the server's metrics"),
    OpSpec("sleep", "standby", GATE_STOPPED, "putting the server to sleep"),
    OpSpec("wake_up", "standby", GATE_HEALTH, "waking the standby"),
    OpSpec("loader_view", "checks", GATE_LOADER, "loading the drafter config with transformers"),
    OpSpec("vllm_build", "checks", GATE_BUILD, "reading the vLLM build"),
    OpSpec("gpus", "checks", GATE_GPUS, "checking its GPUs"),
    OpSpec("nccl", "checks", GATE_GPUS, "all-reducing over its GPUs (NCCL)"),
    OpSpec("checks_start", "background", GATE_ENGINE, "starting the loader and engine checks"),
    OpSpec("checks_wait", "background", GATE_ENGINE, "waiting for the loader and engine checks"),
    OpSpec("gateway_socket", "gateway", GATE_GATEWAY, "asking the gateway"),
    OpSpec("gateway_http", "gateway", GATE_GATEWAY, "asking the gateway"),
    OpSpec("gateway_endpoints", "gateway", GATE_GATEWAY, "changing the endpoints file"),
)


SPECS.update({spec.name: spec for spec in OPS})


def __getattr__(name: str) -> Any:
    """A name of ``__all__`` from the module of ``_LATER`` that has it, loaded on its first use."""
    if name in __all__:
        for module in _LATER:
            found = importlib.import_module(f"{__name__}.{module}")
            if hasattr(found, name):
                return getattr(found, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def modules(names: Iterable[str]) -> tuple[str, ...]:
    """The agent modules a batch of these ops needs (every module for a name not in the table: the
    agent then says it knows no such op)."""
    found = {SPECS[n].module if n in SPECS else "*" for n in names}
    return ("*",) if "*" in found else tuple(sorted(found))


def words(name: str) -> str:
    """What a host is doing while it runs this op, in the user's words."""
    return SPECS[name].words if name in SPECS else name
