"""The gpus gate proves the GPUs the server will get are there, free and usable.

In the container, before anything is staged: `nvidia-smi`'s CSV (count, PCI address, memory, driver,
compute processes) against the inventory, tensor x pipeline parallel and `--gpu-memory-utilization`;
the serving torch's CUDA against the driver; with 2+ GPUs an NCCL all-reduce over them (see GPUs).

The GPU gate, pure: what ``nvidia-smi`` says of a container's GPUs, judged before a server loads.

The ways a GPU deploy dies after minutes of model loading, each visible in seconds beforehand: the
container sees other GPUs than the inventory gives it (or fewer than tensor x pipeline parallel
needs there), a GPU pinned by PCI address is not the one seen, another process holds memory that
``--gpu-memory-utilization`` counts on, the driver is older than the serving torch's CUDA needs.
Memory held by the server we started ourselves does not count: the launch stops it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.inventory import Container
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    GATE_GPUS,
    Gate,
    HostReport,
)
from orchestrator.rules import serving

# The oldest driver each CUDA major version of a serving torch runs on, by minor version
# compatibility: NVIDIA's "CUDA Compatibility" guide (docs.nvidia.com/deploy/cuda-compatibility,
# table 1: 13.x >= 580, 12.x >= 525, 11.x >= 450) and the CUDA Toolkit release notes' driver table
# for the exact Linux builds (11.x >= 450.80.02, 12.0 GA 525.60.13, 13.0 GA 580.65.06). Below it,
# torch.cuda.is_available() is False and vLLM fails at its first CUDA call.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization when not given


class FactsError(ValueError):
    """nvidia-smi's output is not what the query asked for."""


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi's CSV describes it."""

    index: int
    uuid: str
    name: str
    pci: str
    total_mib: int
    used_mib: int
    free_mib: int
    driver: str
    compute_mode: str

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "pci": self.pci,
            "memory_total_mib": self.total_mib,
            "memory_used_mib": self.used_mib,
            "memory_free_mib": self.free_mib,
            "driver": self.driver,
            "compute_mode": self.compute_mode,
        }


@dataclass(frozen=True)
class App:
    """One compute process on a GPU, as nvidia-smi's CSV describes it."""

    pid: int
    gpu_uuid: str
    used_mib: int
    name: str


def _rows(text: str, width: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != width:
            raise FactsError(f"unexpected nvidia-smi line {line!r}")
        rows.append(cells)
    return rows


def _mib(text: str, what: str) -> int:
    """A memory figure (``nounits``: whole MiB). nvidia-smi says what it cannot read in brackets
    ("[N/A]": a process it cannot see, "[Insufficient Permissions]"): counted as none. Anything
    else that is not a whole number is not nvidia-smi's (``inf`` crashed the controller's ``int``)."""
    if text.startswith("[") and text.endswith("]"):
        return 0
    if not text.isascii() or not text.isdigit():
        raise FactsError(f"unexpected {what} {text!r}")
    return int(text)


def parse_gpus(text: str) -> list[Gpu]:
    """``--query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free,driver_version,
    compute_mode --format=csv,noheader,nounits``."""
    out = []
    for cells in _rows(text, 9):
        try:
            index = int(cells[0])
        except ValueError as exc:
            raise FactsError(f"unexpected GPU index {cells[0]!r}") from exc
        out.append(
            Gpu(
                index,
                cells[1],
                cells[2],
                cells[3],
                _mib(cells[4], "memory.total"),
                _mib(cells[5], "memory.used"),
                _mib(cells[6], "memory.free"),
                cells[7],
                cells[8],
            )
        )
    return out


def parse_apps(text: str) -> list[App]:
    """``--query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv,noheader,nounits``."""
    out = []
    for cells in _rows(text, 4):
        if cells[0].isdigit():
            out.append(App(int(cells[0]), cells[1], _mib(cells[2], "used_memory"), cells[3]))
    return out


def pci_key(address: str) -> str:
    """PCI addresses as nvidia-smi (00000000:17:00.0) and LXD or lspci (0000:17:00.0, 17:00.0)
    write them, to one form: bus:device.function, lower case."""
    parts = address.strip().lower().split(":")
    return ":".join(parts[-2:]) if len(parts) >= 2 else address.strip().lower()


def memory_utilization(playbook: Playbook) -> float:
    """The share of GPU memory vLLM will ask for: --gpu-memory-utilization from serving.extra_args,
    else vLLM's default 0.9."""
    args = list(playbook.serving.extra_args)
    for i, arg in enumerate(args):
        value = None
        if arg == "--gpu-memory-utilization" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--gpu-memory-utilization="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return float(value)
            except ValueError:
                break
    return DEFAULT_MEMORY_UTILIZATION


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def ranks_here(playbook: Playbook, container: Container, nodes: int) -> int:
    """GPUs one node's server uses: tensor x pipeline parallel over the group's nodes."""
    s = playbook.serving
    if s.tensor_parallel_size is None:
        return len(container.gpus)
    return s.tensor_parallel_size * s.pipeline_parallel_size // max(1, nodes)


def judge(
    playbook: Playbook,
    container: Container,
    gpus: list[Gpu],
    apps: list[App],
    ours: set[int],
    torch_cuda: str | None,
    nodes: int = 1,
) -> list[str]:
    """Why this container's GPUs cannot carry the server (empty: they can)."""
    problems: list[str] = []
    want = list(container.gpus)
    seen = {g.index: g for g in gpus}
    if container.lxd is not None and len(gpus) != len(want):
        problems.append(f"the container sees {len(gpus)} GPUs, the inventory gives it {len(want)}")
    missing = [i for i in want if i not in seen]
    if container.lxd is None and missing:
        problems.append(f"GPU {', '.join(map(str, missing))} of the inventory is not seen (seen: {sorted(seen)})")
    needed = ranks_here(playbook, container, nodes)
    if needed != len(want):
        problems.append(
            f"tensor x pipeline parallel needs {needed} GPUs on this node, the inventory gives it {len(want)}"
        )
    used = [seen[i] for i in want if i in seen] if container.lxd is None else gpus
    pins = container.lxd.gpu_pci if container.lxd is not None else ()
    for pin, gpu in zip(pins, sorted(used, key=lambda g: g.index), strict=False):
        if pci_key(pin) != pci_key(gpu.pci):
            problems.append(f"GPU {gpu.index} is at PCI {gpu.pci}, the inventory pins {pin}")
    by_uuid = {g.uuid: g for g in used}
    ours_mib = {g.uuid: 0 for g in used}
    for app in apps:
        held = by_uuid.get(app.gpu_uuid)
        if held is None:
            continue
        if app.pid in ours:
            ours_mib[held.uuid] += app.used_mib
        else:
            problems.append(
                f"GPU {held.index} is used by another process: pid {app.pid} ({app.name or '?'}) holds {app.used_mib} MiB"
            )
    share = memory_utilization(playbook)
    for gpu in used if playbook.serving.target is not None else ():  # files only: nothing loads
        free = gpu.free_mib + ours_mib[gpu.uuid]  # our own server is stopped before the launch
        need = int(gpu.total_mib * share)
        if free < need:
            problems.append(
                f"GPU {gpu.index} has {free} MiB free of {gpu.total_mib}; --gpu-memory-utilization {share:g} asks {need}"
            )
    if torch_cuda == "":
        problems.append(f"the serving python {playbook.serving.python} has no torch")
    elif torch_cuda == "None":
        problems.append("the serving torch is a CPU build (torch.version.cuda is None): it cannot use these GPUs")
    elif torch_cuda and torch_cuda != "unknown":
        major = _version(torch_cuda)[:1]
        floor = MIN_DRIVER.get(major[0]) if major else None
        drivers = {g.driver for g in used}
        for driver in sorted(drivers):
            if floor is not None and _version(driver) < _version(floor):
                problems.append(
                    f"driver {driver} is older than the serving torch's CUDA {torch_cuda} needs (>= {floor})"
                )
    return problems


def describe(gpus: list[Gpu], torch_cuda: str | None) -> str:
    """The gpus gate's one line: how many GPUs of which kind, the driver, torch's CUDA and each
    GPU's free memory."""
    if not gpus:
        return "no GPU"
    names = sorted({g.name for g in gpus})
    free = ", ".join(f"{g.index}: {g.free_mib} MiB free" for g in gpus)
    cuda = f", torch CUDA {torch_cuda}" if torch_cuda not in (None, "", "None") else ""
    return f"{len(gpus)} x {', '.join(names)} (driver {gpus[0].driver}{cuda}; {free})"


class GpuChecks:
    """The gpus gate's questions for one node the inventory gives GPUs (none where it gives none:
    a CPU deployment): nvidia-smi's view, and with more than one GPU and a serving Python, the
    NCCL preflight. A files-only playbook is checked too: its files are for a server on them."""

    def __init__(self, playbook: Playbook, root: str, container: Container, nodes: int = 1) -> None:
        self.playbook, self.container, self.nodes = playbook, container, nodes
        self.facts: protocol.Op[protocol.GpuFacts] | None = None
        self.nccl: protocol.Op[protocol.AllReduce] | None = None
        s = playbook.serving
        if not container.gpus:
            self.ops: list[protocol.Op[Any]] = []
            return
        # Findings both: nvidia-smi's facts are reported even when the preflight after them fails.
        self.facts = protocol.gpus(root, s.python, serving.environment(playbook, container)).finding()
        count = ranks_here(playbook, container, nodes)
        if count > 1 and s.python is not None:
            # The server's own GPU environment: what the preflight proves is what the server gets.
            env = {**serving.gpu_env(container), **s.env}
            self.nccl = protocol.nccl(root, s.python, count, env, playbook.gates.nccl.timeout_s).finding()
        self.ops = [op for op in (self.facts, self.nccl) if op is not None]

    def read(self, answers: protocol.Answers, report: HostReport) -> None:
        """The gate from what came back: nvidia-smi's facts, and the preflight's answer or failure."""
        if self.facts is None:
            return
        failed = answers.failure(self.facts)
        if failed is not None:
            report.gates[GATE_GPUS] = Gate(False, failed.describe())
            return
        if self.facts not in answers:
            return
        nccl_failed = answers.failure(self.nccl)
        nccl = Gate(False, nccl_failed.describe()) if nccl_failed is not None else None
        read_gpus(self.playbook, self.container, answers[self.facts], answers.get(self.nccl), report, self.nodes, nccl)


def read_gpus(
    playbook: Playbook,
    container: Container,
    facts: protocol.GpuFacts,
    all_reduce: protocol.AllReduce | None,
    report: HostReport,
    nodes: int = 1,
    nccl_failed: Gate | None = None,
) -> None:
    """The gpus gate from nvidia-smi's answers and the NCCL preflight's (or its failure)."""
    if facts.missing:
        report.gates[GATE_GPUS] = Gate(
            False, f"no nvidia-smi in the container, but the inventory gives it GPUs {list(container.gpus)}"
        )
        return
    try:
        seen, apps = parse_gpus(facts.gpus), parse_apps(facts.apps)
    except FactsError as exc:
        report.gates[GATE_GPUS] = Gate(False, f"nvidia-smi's answer could not be read: {exc}")
        return
    report.gpus = [g.to_json() for g in seen]
    problems = judge(playbook, container, seen, apps, set(facts.ours), facts.torch_cuda, nodes)
    data: dict[str, Any] = {}
    detail = describe(seen, facts.torch_cuda)
    if problems:
        pass  # the preflight's answer says no more: these GPUs are not the server's to begin with
    elif nccl_failed is not None:
        problems.append(nccl_failed.detail)
    elif all_reduce is not None and all_reduce.skipped:
        detail += f"; NCCL preflight skipped: {all_reduce.skipped}"
    elif all_reduce is not None:
        data = {"busbw_gbps": round(all_reduce.busbw_gbps, 1), "nccl": all_reduce.nccl}
        floor = playbook.gates.nccl.min_busbw_gbps
        if not all_reduce.right:
            problems.append(f"the all-reduce over {all_reduce.gpus} GPUs gave a wrong sum")
        elif floor is not None and all_reduce.busbw_gbps < floor:
            problems.append(f"the all-reduce reached {all_reduce.busbw_gbps:.1f} GB/s bus bandwidth, below {floor:g}")
        detail += f"; NCCL {all_reduce.nccl} all-reduce over {all_reduce.gpus} GPUs: {all_reduce.busbw_gbps:.1f} GB/s bus bandwidth"
    report.gates[GATE_GPUS] = Gate(not problems, "; ".join(problems) if problems else detail, data)
