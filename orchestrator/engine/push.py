"""Pushing model files (a model's ``push:`` directory) from the controller to where the server reads them.

Once per GPU host when the model's path is a disk of the playbook that the host mounts into its
containers (then written at the disk's source on the host, over SSH to the host), else once per
container. Each file's digest is asked first: a file already there is not sent. Otherwise its bytes
stream in chunks over the run's connection, after what a cut upload left when that prefix hashes
the same as the local file's (a resumed upload sends only the rest); the host checks the whole
file, renames it into place and reads it back. Memory stays flat whatever the size.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from orchestrator.agent import protocol
from orchestrator.config.inventory import Container, Target
from orchestrator.config.modelfiles import CHUNK, LocalFile, local_files, sha256_of
from orchestrator.config.playbook import Model
from orchestrator.engine.runner import Node, Run
from orchestrator.errors import ArtifactError
from orchestrator.results import GATE_MODELS, Gate, HostReport

PROGRESS_EVERY_S = 5.0
STEP_EVERY_S = 0.5  # the live display's step line (the log line above is every 5 s)


@dataclass(frozen=True)
class Destination:
    """Where a model directory goes: the GPU host (shared by its containers through a disk) or the
    container itself."""

    target: Target  # the GPU host, or the container itself
    path: str  # the model directory there
    label: str  # for progress: "gpu-a:/srv/models/X"


def destination(run: Run, node: Node, model: Model) -> Destination:
    """Where a model's files go for this node: its GPU host's disk source, when a disk of the
    playbook mounts the model path into an LXD container of that host, else the node itself."""
    container = node.target.container
    host = run.inventory.hosts[container.host]
    if container.lxd is not None and host.address is not None:
        disks = [d for d in run.playbook.disks if model.path == d.path or model.path.startswith(d.path + "/")]
        if disks:
            disk = max(disks, key=lambda d: len(d.path))
            path = disk.source + model.path[len(disk.path) :]
            gpu_host = Target(Container(host.name, host.name, host.address, host.ssh), None)
            return Destination(gpu_host, path, f"{host.name}:{path}")
    return Destination(node.target, model.path, f"{node.name}:{model.path}")


@dataclass(frozen=True)
class Pushed:
    """What one push did: files sent, kept and resumed, bytes and seconds."""

    destination: str
    by: str  # the node whose run pushed it (the others sharing the destination waited for it)
    files: int
    sent: int  # bytes sent this time
    kept: int  # files already there
    resumed: int  # files continued after a cut upload
    seconds: float
    digests: dict[str, str]  # every file pushed, relative path -> sha256: what the model must hold

    def describe(self) -> str:
        if self.sent == 0 and self.resumed == 0:
            return f"pushed to {self.destination}: all {self.files} files already there"
        rate = self.sent / self.seconds / 1e6 if self.seconds else 0.0
        resumed = f", {self.resumed} resumed" if self.resumed else ""
        return (
            f"pushed to {self.destination}: {self.files - self.kept} of {self.files} files, "
            f"{self.sent / 1e6:.1f} MB in {self.seconds:.1f} s ({rate:.0f} MB/s){resumed}"
        )


def push(run: Run, node: Node, model: Model) -> Pushed:
    """Push a model for this node, once per destination: the nodes that share it wait for the
    first one's push and share its outcome (or its failure)."""
    assert model.push is not None
    where = destination(run, node, model)
    key = ("push", where.target.name, where.path)
    with run.once_lock:
        entry = run.once.get(key)
        first = entry is None
        if first:
            entry = run.once[key] = {"done": threading.Event()}
    assert entry is not None
    if first:
        try:
            entry["result"] = send(run, where, local_files(model.push), node.name, model.replace)
        except BaseException as exc:
            entry["error"] = exc
        finally:
            entry["done"].set()
    entry["done"].wait()
    if "error" in entry:
        raise entry["error"]
    return entry["result"]  # type: ignore[no-any-return]


def send(run: Run, where: Destination, files: list[LocalFile], by: str, replace: bool = False) -> Pushed:
    """Push ``files`` (``rel`` under ``where.path``) to one destination: what is there already is
    kept, a cut upload resumed."""
    started = time.monotonic()
    # The model directory keeps its own digest cache (hidden: never served, never linked), so a
    # GPU host needs no deploy root, and a no-change push is a stat per file.
    root = where.path
    status = protocol.upload_status(root, [(f"{where.path}/{f.rel}", f.size, f.sha256) for f in files], replace)
    states = run.client.batch(where.target, [status])[status]
    sent = kept = resumed = 0
    todo: list[Upload] = []
    for f, state in zip(files, states, strict=True):
        if state.present:
            kept += 1
            continue
        offset = 0
        if state.partial and state.partial_sha256 == sha256_of(f.path, state.partial):
            offset, resumed = state.partial, resumed + 1
        todo.append((f, protocol.upload(root, state.path, f.size, f.sha256, offset), offset))
    for batch in _batches(todo):
        # Small files travel together, one exec for many (300 one-line files took 300 execs);
        # each upload reads its own bytes from the stream in turn.
        stream = itertools.chain.from_iterable(
            _chunks(f, off, _progress(run, where, f, off, by)) for f, _, off in batch
        )
        answers = run.client.batch(where.target, [op for _, op, _ in batch], stream=stream)
        sent += sum(answers[op].written for _, op, _ in batch)
    digests = {f.rel: f.sha256 for f in files}
    return Pushed(where.label, by, len(files), sent, kept, resumed, time.monotonic() - started, digests)


# Uploads sent in one exec: up to this many files, or this many bytes together; a larger file alone.
BATCH_FILES = 256
BATCH_BYTES = 64 << 20


Upload = tuple[LocalFile, "protocol.Op[protocol.Uploaded]", int]  # the file, its op, where it resumes


def _batches(todo: list[Upload]) -> Iterator[list[Upload]]:
    batch: list[Upload] = []
    size = 0
    for item in todo:
        left = item[0].size - item[2]
        if batch and (len(batch) >= BATCH_FILES or size + left > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += left
    if batch:
        yield batch


def _progress(run: Run, where: Destination, f: LocalFile, offset: int, by: str) -> Callable[[int], None]:
    started = last = shown = time.monotonic()

    def report(done: int) -> None:
        nonlocal last, shown
        now = time.monotonic()
        if now - shown >= STEP_EVERY_S:
            shown = now
            run.step(by, f"pushing to {where.label}", f"{f.rel} {done / 1e9:.2f} of {f.size / 1e9:.2f} GB")
        if now - last >= PROGRESS_EVERY_S:
            last = now
            rate = (done - offset) / (now - started) / 1e6
            run.say(f"push {where.label}: {f.rel} {done / 1e9:.2f} of {f.size / 1e9:.2f} GB, {rate:.0f} MB/s")

    return report


def _chunks(f: LocalFile, offset: int, report: Callable[[int], None]) -> Iterator[bytes]:
    """The file's bytes from ``offset``, a chunk at a time (read as they are sent)."""
    done = offset
    try:
        with f.path.open("rb") as stream:
            stream.seek(offset)
            while done < f.size:
                block = stream.read(min(CHUNK, f.size - done))
                if not block:
                    raise ArtifactError(f"{f.path} ended at {done} bytes, it had {f.size} when hashed")
                done += len(block)
                report(done)
                yield block
    except OSError as exc:
        raise ArtifactError(f"cannot read {f.path}: {exc.strerror or exc}") from exc


def note(pushed: dict[str, Pushed], report: HostReport) -> None:
    """What the push sent, in the models gate (when it passed) and each model's JSON."""
    for entry in report.models:
        done = pushed.get(entry["name"])
        if done is not None:
            entry["pushed"] = {
                "destination": done.destination,
                "by": done.by,
                "files": done.files - done.kept,
                "bytes_sent": done.sent,
                "resumed": done.resumed,
                "seconds": round(done.seconds, 2),
            }
    gate = report.gates.get(GATE_MODELS)
    if gate is not None and gate.ok and pushed:
        report.gates[GATE_MODELS] = Gate(True, gate.detail + "; " + "; ".join(p.describe() for p in pushed.values()))
