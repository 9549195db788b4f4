"""The playbook: what to deploy, where, and what must hold before a host is READY.

name: qwen36-dflash
targets: [all]                      # containers, groups or GPU hosts of the inventory
deploy_root: /srv/dflash            # releases/, current and previous live here
keep_releases: 5
files:                              # local source (relative to this file) -> path in the release
  - {src: files/tokenizer_config.json, dest: target/tokenizer_config.json, mode: "0644"}
drafter:
  config: files/drafter/config.json # pushed as drafter/config.json in the release
  reference: files/reference.json   # pinned known-good values, or an inline mapping
models:                             # where the weights live, as the server sees them
  target: {path: /models/Qwen3.6-27B, manifest: files/target.sha256}
  drafter: {path: /models/Qwen3.6-27B-DFlash, push: /data/Qwen3.6-27B-DFlash}
serving: {...}
gates: {...}
rollout: {...}
"""

from __future__ import annotations

import hashlib
import math
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.config.gateway import Gateway, parse_gateway
from orchestrator.config.readers import parse_json, read_json, read_mapping
from orchestrator.config.yamlsource import Field, load_file, read_text
from orchestrator.errors import InputError

DRAFTER_DIR = "drafter"
DRAFTER_CONFIG = "config.json"
DRAFTER_CONFIG_DEST = f"{DRAFTER_DIR}/{DRAFTER_CONFIG}"
# Files larger than this are sent inline with the request; models belong on mounted volumes.
MAX_FILE_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 60.0  # serving.drain_timeout behind a gateway, unless set
KEEP_RELEASES = 5  # releases kept on a host (the current one and its predecessors) unless set


@dataclass(frozen=True)
class FileSpec:
    """One file of a release, read once on the controller."""

    src: Path
    dest: str
    mode: str
    content: bytes = field(repr=False)
    secret: bool = False  # never shown (dry-run diffs): sizes and digests only

    @property
    def sha256(self) -> str:
        """The file's digest, as the host must hold it."""
        return hashlib.sha256(self.content).hexdigest()

    @property
    def private(self) -> bool:
        """Its content is not for every eye: marked secret, or not world-readable where it lands."""
        return self.secret or not int(self.mode, 8) & 0o004


@dataclass(frozen=True)
class Disk:
    """A directory of the GPU host mounted into each container (models, usually read-only)."""

    source: str
    path: str
    readonly: bool = True


@dataclass(frozen=True)
class Drafter:
    """The drafter config a release serves: its values (the bytes pushed), the target's config it is
    judged against and the pinned reference."""

    config: FileSpec
    values: dict[str, Any]  # the config's JSON, parsed once: what lint and the loader gate compare
    reference: dict[str, Any] | None = None  # pinned known-good values (file or inline)
    target: dict[str, Any] | None = None  # a local copy of the target model's config.json


@dataclass(frozen=True)
class Model:
    """A model directory on the hosts: where the server reads it, and what pins its files."""

    role: str  # "target" or "drafter"
    path: str  # absolute, as the server sees it (in LXD, usually a disk from the GPU host)
    manifest: dict[str, str] | None = None  # relative path -> sha256, from a local sha256sum file
    push: Path | None = None  # a local directory uploaded to ``path`` from the controller
    replace: bool = False  # the push may replace files it did not put there (an operator's own)


@dataclass(frozen=True)
class Models:
    """Where the target's and the drafter's weights are on the hosts, with their pins and pushes."""

    target: Model | None = None
    drafter: Model | None = None

    @property
    def all(self) -> tuple[Model, ...]:
        """The models the playbook names (target, drafter)."""
        return tuple(m for m in (self.target, self.drafter) if m is not None)


EXECUTORS = ("mp", "ray")


@dataclass(frozen=True)
class MultiNode:
    """One vLLM deployment over several containers: rank 0 (the head) is the first node."""

    nodes: tuple[str, ...]  # container names, in rank order, or one group name
    executor: str = "mp"  # vLLM's multiprocessing multi-node mode, or a Ray cluster
    master_port: int = 29500
    master_addr: str | None = None  # the head's address on the nodes' network (default: its address)
    interface: str = "eth0"  # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on every node
    ray_port: int = 6379
    file: str | None = field(default=None, compare=False)  # where it was written, for errors
    line: int | None = field(default=None, compare=False)

    def error(self, message: str) -> InputError:
        return InputError(message, file=self.file, line=self.line, key="serving.multi_node")


@dataclass(frozen=True)
class Standby:
    """``serving.standby``: the READY release kept asleep (vLLM's sleep mode, level 1: its weights
    in host memory, the GPU's freed) when the next one starts, to go back to in seconds. The
    sleeping server keeps its port, so releases alternate between ``serving.port`` and ``port``:
    only a gateway can follow. Sleep needs vLLM's dev routes (``VLLM_SERVER_DEV_MODE=1``), which
    also serve ``/collective_rpc`` with no API key: ``dev_routes: gateway-only`` says that only the
    gateway reaches these ports."""

    port: int
    dev_routes: str = "gateway-only"


# What a playbook must say of the dev routes a standby opens (see ``Standby``).
DEV_ROUTES = ("gateway-only",)


@dataclass(frozen=True)
class Serving:
    """How vLLM is started: the serving Python, the target, speculation, parallel sizes, port, extra
    arguments, environment and start budget."""

    python: str | None = None
    target: str | None = None
    model_name: str = "dflash"
    speculative: bool = True
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int = 1
    num_speculative_tokens: int = 15
    # Where vLLM listens: an address, or "address" (the container's own, where a gateway on another
    # machine reaches it). Unset: "address" with a gateway, else 127.0.0.1 (probes go through the
    # agent either way). 0.0.0.0 only when written here.
    host: str | None = None
    port: int = 8000
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 900.0
    multi_node: MultiNode | None = None
    # vLLM's --shutdown-timeout: how long a stopping server finishes the requests it holds (vLLM's
    # own default, 0, aborts them), and how long a drained host's in-flight requests are waited for.
    drain_timeout: float = 0.0
    # vLLM's compile cache: "own", each host compiles its own; "share", the first host of a key to
    # be READY (a rollout's canary) gives the hosts of its key its cache, which the controller
    # takes, signs and keeps (compiled code the other hosts then run: an opt-in).
    compile_cache: str = "own"
    standby: Standby | None = None

    @property
    def stop_timeout(self) -> int:
        """Our wait after SIGTERM (and the unit's TimeoutStopSec) before SIGKILL: longer than vLLM's
        own drain, so that a graceful stop is never cut short by us."""
        return 30 + math.ceil(self.drain_timeout)


@dataclass(frozen=True)
class AcceptanceGate:
    """The acceptance gate's thresholds and the probe's prompts and budget (also watch's, unless
    gates.live sets them apart)."""

    # Without a playbook's own: below every working drafter's tau measured, above total loss. The
    # real pair's bound over its 12 probe prompts is 1.59-1.69 on every build (its tau 2.16-2.31),
    # while a wrong mask or a drafter for another target gives 1.03 (docs/real-pair.md). A drafter
    # whose published tau is 4-6 should set its own (the Qwen playbooks set 3.0-3.5).
    min_mean_acceptance_length: float = 1.5
    min_acceptance_rate: float | None = None
    min_drafts: int = 50
    prompts: tuple[str, ...] = ()
    max_tokens: int = 128
    # A new release of the same target and drafter weights, probed with the same prompts and K,
    # may not fall more than this fraction below the last READY release's tau.
    max_regression: float = 0.1
    # The warm pass (half the prompts again, their prefixes cached): "warn" says a drop of its tau
    # beyond max_regression below the cold pass's, "strict" fails the gate on it, "off" sends none.
    prefix_cache: str = "warn"


@dataclass(frozen=True)
class NcclGate:
    """The NCCL preflight's floor on bus bandwidth and its time limit."""

    min_busbw_gbps: float | None = None  # the preflight's all-reduce must reach this bus bandwidth
    timeout_s: float = 180.0  # longer is a hang (NCCL's init over many GPUs takes tens of seconds)


@dataclass(frozen=True)
class SpeedupGate:
    """Does speculation pay at the fleet's load: the same greedy load, at each ``concurrency``, with
    and without the drafter; the drafter arm's output tokens per second at least ``min`` times the
    baseline's at every level (orchestrator/rules/gates/speedup.py)."""

    concurrency: tuple[int, ...] = (1, 8)
    min: float = 1.1
    max_tokens: int = 256
    repeats: int = 3  # pairs at each concurrency at the least: the spread, and the bound
    prompts: tuple[str, ...] = ()  # the acceptance probe's unless set
    max_pairs: int = 6  # pairs at the most: more only while a level's interval still holds min
    on_inconclusive: str = "refuse"  # or "pass": what READY does with a level that cannot decide
    arms: str = "auto"  # "beside" (both servers at once), "before" (the baseline first), or as fits
    baseline_port: int | None = None  # the baseline beside: the serving port + 1 unless set
    baseline_memory: float | None = None  # its --gpu-memory-utilization: what the target needs unless set
    # ``concurrency: observed``: the levels are the fleet's own load as watch recorded it (the
    # median and 90th percentile of the requests its servers ran), taken when the run starts;
    # ``concurrency`` is then what they came to (empty: none recorded).
    observed: bool = False
    observed_from: str = ""  # where the observed levels came from, in words (set when a run takes them)


@dataclass(frozen=True)
class Gates:
    """Every threshold of the readiness chain that the playbook sets."""

    acceptance: AcceptanceGate = AcceptanceGate()
    nccl: NcclGate = NcclGate()
    # watch's judgement of production traffic: the acceptance gate's thresholds unless set apart
    # (traffic sampled at temperature > 0 accepts fewer drafted tokens than the greedy probe).
    live: AcceptanceGate = AcceptanceGate()
    speedup: SpeedupGate | None = None  # no speed-up gate unless the playbook asks for one


@dataclass(frozen=True)
class Rollout:
    """The rollout policy: canary hosts first, then batches, stopping past a failure budget; with
    a gateway, never fewer than ``min_in_rotation`` hosts serving."""

    canary: int = 0
    batch_size: int | None = None
    max_failures: int = 0
    # None: unset, which behind a gateway keeps one host serving while others drain (the gateway's
    # default: drain every host at once and nothing serves); set 0 to allow it.
    min_in_rotation: int | None = None
    # After the canary: its live acceptance (and its errors at the gateway) watched this long
    # before the next batch; a canary that degrades is rolled back and the rollout stops.
    bake_s: float = 0.0


PREFIX_CACHE = ("warn", "strict", "off")
COMPILE_CACHE = ("own", "share")


@dataclass(frozen=True)
class Playbook:
    """One deployment, typed: what each target host serves (files, drafter, models), how vLLM runs
    it, the gates and the rollout."""

    file: Path
    name: str
    targets: tuple[str, ...]
    deploy_root: str
    keep_releases: int
    files: tuple[FileSpec, ...]
    drafter: Drafter | None
    disks: tuple[Disk, ...]
    serving: Serving
    gates: Gates
    rollout: Rollout
    models: Models = Models()
    gateway: Gateway | None = None

    @property
    def release_files(self) -> tuple[FileSpec, ...]:
        """Everything pushed into a release, the drafter config included, in a stable order."""
        extra = (self.drafter.config,) if self.drafter else ()
        return tuple(sorted(self.files + extra, key=lambda f: f.dest))


def load_playbook(path: Path | str) -> Playbook:
    """The playbook file as a typed Playbook, its local files read once; any bad key is one
    InputError naming file, line and key."""
    path = Path(path)
    doc = load_file(path)
    top = Field(doc).mapping(
        {
            "name",
            "targets",
            "deploy_root",
            "keep_releases",
            "files",
            "drafter",
            "disks",
            "serving",
            "gates",
            "rollout",
            "models",
            "gateway",
        },
        required=frozenset({"name", "deploy_root"}),
    )
    base = path.parent
    deploy_root = top["deploy_root"].directory()
    models = _models(top["models"], base)
    serving = _serving(top["serving"])
    if serving.target is not None and serving.python is None:
        raise top["serving"]["target"].error("a server needs serving.python too (the interpreter that runs vLLM)")
    if serving.target is None and serving.python is not None and models.target is not None:
        serving = replace(serving, target=models.target.path)
    if "targets" in top:
        targets = top["targets"].str_list()
    elif serving.multi_node is not None:
        targets = serving.multi_node.nodes  # a multi-node deployment's targets are its nodes
    else:
        raise top.error("missing required key 'targets'")
    if not targets:
        raise top["targets"].error("expected at least one target")

    files: list[FileSpec] = []
    dests: dict[str, str] = {}
    for item in top["files"].sequence():
        item.mapping({"src", "dest", "mode", "secret", "unsafe_mode"}, required=frozenset({"src", "dest"}))
        spec = replace(_file_spec(item, item["src"].str(), item["dest"].str(), base), secret=item["secret"].bool(False))
        if int(spec.mode, 8) & 0o7002 and not item["unsafe_mode"].bool(False):
            raise item["mode"].error(
                f"mode {spec.mode} is setuid, setgid, sticky or world-writable: refused unless the file says "
                "unsafe_mode: true"
            )
        if spec.dest in dests:
            raise item["dest"].error(f"destination already used by {dests[spec.dest]}")
        dests[spec.dest] = item.key
        files.append(spec)

    drafter = None
    if "drafter" in top:
        d = top["drafter"].mapping({"config", "reference", "target_config"}, required=frozenset({"config"}))
        if DRAFTER_CONFIG_DEST in dests:
            raise d.error(f"{dests[DRAFTER_CONFIG_DEST]} already pushes {DRAFTER_CONFIG_DEST}")
        config = _file_spec(d, d["config"].str(), DRAFTER_CONFIG_DEST, base, src_key="config")
        reference: dict[str, Any] | None = None
        ref = d["reference"]
        if ref.present and isinstance(ref.value, dict):
            reference = dict(ref.value)
        elif ref.present:
            reference = read_mapping(_local(ref, ref.str(), base))
        target = None
        if "target_config" in d:
            target = read_json(_local(d["target_config"], d["target_config"].str(), base))
        # The values judged are parsed from the very bytes pushed: the file is read once, so an
        # editor's save in between cannot make lint pass one config while hosts receive another.
        drafter = Drafter(config, parse_json(config.content, config.src), reference, target)
    every = {spec.dest: item["dest"] for spec, item in zip(files, top["files"].sequence(), strict=True)}
    if drafter is not None:
        every[DRAFTER_CONFIG_DEST] = top["drafter"]["config"]
    for dest, item in every.items():
        parent = posixpath.dirname(dest)
        while parent:
            if parent in every:
                raise item.error(f"'{dest}' needs '{parent}' to be a directory, but the release also has a file there")
            parent = posixpath.dirname(parent)
    if models.drafter is not None and drafter is None:
        raise top["models"]["drafter"].error("a drafter model needs drafter.config: the config its release serves")

    gateway = parse_gateway(top["gateway"], serving.target is not None) if "gateway" in top else None
    if gateway is not None and "drain_timeout" not in top["serving"]:
        # Behind a gateway a restart must not cost requests: drain by default.
        serving = replace(serving, drain_timeout=DRAIN_TIMEOUT_S)
    if serving.standby is not None and gateway is None:
        raise top["serving"]["standby"].error(
            "a standby needs a gateway (gateway:): the sleeping server keeps its port, so releases alternate between "
            "serving.port and standby.port, and only a gateway can send users to whichever serves"
        )
    if serving.standby is not None and gateway is not None and gateway.kind != "haproxy":
        raise top["serving"]["standby"].error(
            f"a standby needs a gateway that can follow a server to another port: HAProxy (set server addr/port); "
            f"a {gateway.kind} gateway knows a server by its URL, which the standby's port changes"
        )
    if serving.multi_node is not None and "rollout" in top:
        raise top["rollout"].error("a multi-node deployment is one group, deployed whole: rollout does not apply")
    if not files and drafter is None:
        raise top.error("the playbook pushes no files: add files: or drafter:")
    gates = _gates(top["gates"])
    _speedup_fits(gates.speedup, serving, top["gates"]["speedup"])
    if serving.standby is not None and gates.speedup is not None:
        # The baseline arm stops what serves, and both arms are measured on serving.port: a host
        # with a standby serves on either of two ports.
        raise top["serving"]["standby"].error(
            "a standby and the speed-up gate do not go together yet: the gate's arms are measured on serving.port, "
            "and a host with a standby serves on either of serving.port and standby.port"
        )
    return Playbook(
        file=path,
        name=top["name"].str(),
        targets=targets,
        deploy_root=deploy_root,
        keep_releases=top["keep_releases"].int(KEEP_RELEASES, minimum=2),
        files=tuple(files),
        drafter=drafter,
        disks=_disks(top["disks"]),
        serving=serving,
        gates=gates,
        rollout=_rollout(top["rollout"], gateway),
        models=models,
        gateway=gateway,
    )


def _local(f: Field, value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.is_file():
        raise f.error(f"local file {p} does not exist")
    return p


def _file_spec(f: Field, src: str, dest: str, base: Path, src_key: str = "src") -> FileSpec:
    src_field = f[src_key]
    path = _local(src_field, src, base)
    dest_field = f["dest"] if src_key == "src" else f  # the drafter config has a fixed dest
    norm = posixpath.normpath(dest)
    if "\x00" in dest:
        raise dest_field.error(f"{dest!r} holds a NUL byte")
    if dest.startswith("/") or norm != dest or norm.startswith("../") or norm in ("..", "."):
        raise dest_field.error(f"'{dest}' must be a relative path inside the release, with no '..' or '.' parts")
    if dest == ".manifest.sha256":
        raise dest_field.error("'.manifest.sha256' is reserved for the release manifest")
    if "\n" in dest or "\\" in dest:
        raise dest_field.error(f"{dest!r} holds a newline or a backslash; release paths may not")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise src_field.error(f"{path} is {size} bytes; files up to {MAX_FILE_BYTES} bytes are pushed")
    mode_field = f["mode"] if src_key == "src" else None
    mode = "0644"
    if mode_field is not None and mode_field.present:
        raw = mode_field.value
        text = raw if isinstance(raw, str) else None
        if text is None or len(text) not in (3, 4) or any(c not in "01234567" for c in text):
            raise mode_field.error('expected an octal mode as a quoted string, for example "0644"')
        mode = text.rjust(4, "0")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise src_field.error(f"cannot read {path}: {exc.strerror}") from exc
    return FileSpec(src=path, dest=dest, mode=mode, content=content)


def _models(f: Field, base: Path) -> Models:
    f.mapping({"target", "drafter"})
    found: dict[str, Model] = {}
    for role in ("target", "drafter"):
        if role not in f:
            continue
        m = f[role].mapping({"path", "manifest", "push", "replace"}, required=frozenset({"path"}))
        path = m["path"].str()
        if not path.startswith("/") or posixpath.normpath(path) != path or path == "/":
            raise m["path"].error("expected an absolute, normalised directory other than /")
        manifest = None
        if "manifest" in m:
            manifest = _sha256sum_file(m["manifest"], _local(m["manifest"], m["manifest"].str(), base))
            if role == "drafter":
                # The overlay serves the release's config.json, never the model directory's own.
                manifest.pop(DRAFTER_CONFIG, None)
        push = None
        if "push" in m:
            push = Path(m["push"].str()).expanduser()
            push = push if push.is_absolute() else base / push
            if not push.is_dir():
                raise m["push"].error(f"local directory {push} does not exist")
        replace = m["replace"].bool(False)
        if replace and push is None:
            raise m["replace"].error("replace: says what a push may replace; this model has no push:")
        found[role] = Model(role, path, manifest, push, replace)
    if "target" in found and "drafter" in found and found["target"].path == found["drafter"].path:
        raise f["drafter"]["path"].error("the drafter and the target cannot share a model directory")
    return Models(found.get("target"), found.get("drafter"))


def _sha256sum_file(f: Field, path: Path) -> dict[str, str]:
    """A ``sha256sum``-format file: ``<64 hex>  <relative path>`` per line (``*`` binary mark allowed),
    as ``sha256sum`` writes it: names from ``find .`` start ``./``, and an editor may have put a
    byte-order mark first or CRLF line ends."""
    files: dict[str, str] = {}
    for number, line in enumerate(read_text(path).removeprefix("\ufeff").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        if line.startswith("\\"):
            # sha256sum escapes a name holding a backslash or a newline: no model file has one.
            raise f.error(f"{where}: an escaped name (a backslash or a newline in it) is not a model file's")
        digest, sep, name = line[:64], line[64:66], line[66:]  # sep " *": sha256sum's binary mark
        if sep not in ("  ", " *") or len(digest) != 64 or digest.strip("0123456789abcdefABCDEF"):
            raise f.error(f"{where}: expected '<sha256>  <path>' (sha256sum's format)")
        name = name.removeprefix("./")
        norm = posixpath.normpath(name)
        if not name or name.startswith("/") or norm != name or norm.startswith(".."):
            raise f.error(f"{where}: {name!r} must be a relative path inside the model directory")
        if name in files:
            raise f.error(f"{where}: {name} is listed twice")
        files[name] = digest.lower()
    if not files:
        raise f.error(f"{path} lists no files")
    return files


def _disks(f: Field) -> tuple[Disk, ...]:
    disks: list[Disk] = []
    paths: set[str] = set()
    for item in f.sequence():
        item.mapping({"source", "path", "readonly"}, required=frozenset({"source", "path"}))
        source, path = item["source"].str(), item["path"].str()
        for key, value in (("source", source), ("path", path)):
            if not value.startswith("/") or posixpath.normpath(value) != value:
                raise item[key].error("expected an absolute, normalised path")
        if path in paths:
            raise item["path"].error("mounted twice")
        paths.add(path)
        disks.append(Disk(source, path, item["readonly"].bool(True)))
    return tuple(disks)


# The arguments of `vllm serve` that the tool gives from what its gates prove, and where a playbook
# sets each instead. vLLM's parser takes the last of a flag given twice, its short aliases, `_` for
# `-`, `--flag=value`, `--flag.key value` into a JSON argument (vLLM's FlexibleArgumentParser), any
# unambiguous prefix (argparse's allow_abbrev) and a --config file of arguments: in extra_args,
# any of these would serve something other than what was proven (a drafter given twice wins over
# the release's own).
TOOL_FLAGS = {
    "model": "models.target or serving.target",
    "speculative-config": "the release's drafter (drafter:, models.drafter) and serving.num_speculative_tokens",
    "served-model-name": "serving.model_name",
    "host": "serving.host",
    "port": "serving.port",
    "tensor-parallel-size": "serving.tensor_parallel_size or the inventory's gpus",
    "pipeline-parallel-size": "serving.pipeline_parallel_size",
    "data-parallel-size": "one server per container (the probe proves one engine)",
    "distributed-executor-backend": "serving.multi_node.executor",
    "nnodes": "serving.multi_node",
    "node-rank": "serving.multi_node",
    "master-addr": "serving.multi_node.master_addr",
    "master-port": "serving.multi_node.master_port",
    "headless": "serving.multi_node",
    "shutdown-timeout": "serving.drain_timeout (our stop waits longer than it)",
    "config": "serving.extra_args itself (a file of arguments could hold any of these)",
}
_SHORT_FLAGS = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size", "-dp": "data-parallel-size"}
_SHORT_FLAGS["-sc"] = "speculative-config"
# The environment the gates decide on: the GPUs the gpus gate proved free are the inventory's, in
# nvidia-smi's (PCI bus) order.
TOOL_ENV = {
    "CUDA_VISIBLE_DEVICES": "the inventory's gpus",
    "CUDA_DEVICE_ORDER": "the tool (PCI_BUS_ID: CUDA's indices as nvidia-smi and the gpus gate count them)",
}


def tool_flag(arg: str) -> str | None:
    """The flag of TOOL_FLAGS that ``arg`` (one element of an argv) sets as vLLM's parser reads it,
    or None."""
    for short, name in _SHORT_FLAGS.items():
        if arg == short or (arg.startswith(short) and not arg[len(short)].isalpha()):
            return name
    if not arg.startswith("--") or arg == "--":
        return None
    name = arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if name in TOOL_FLAGS:
        return name
    # An abbreviation argparse would expand to one of ours (a prefix no other flag of ours shares
    # is enough to refuse: vLLM would take it for ours, or for nothing).
    found = [flag for flag in TOOL_FLAGS if flag.startswith(name)] if len(name) >= 2 else []
    return found[0] if found else None


def _extra_args(f: Field) -> tuple[str, ...]:
    args: tuple[str, ...] = f.str_list(())
    items = f.sequence() if isinstance(f.value, list) else [f] * len(args)
    for item, arg in zip(items, args, strict=True):
        flag = tool_flag(arg)
        if flag is not None:
            raise item.error(f"{arg!r} sets vLLM's --{flag}, which the tool gives from {TOOL_FLAGS[flag]}")
    return args


# Variables that open vLLM's control routes on the port users reach, the gateway's too (vLLM 0.34.0
# entrypoints/launchers/api_server/routers.py, serve/lora/api_router.py; vLLM logs each as not
# for production): how vLLM reads the value (envs.py), and what a client could then do.
CONTROL_ENV: dict[str, tuple[Callable[[str], bool], str]] = {
    "VLLM_SERVER_DEV_MODE": (
        lambda v: v.strip().lstrip("+-").isdigit() and int(v) == 0,
        "vLLM's development routes: /collective_rpc (any method of every worker), /sleep (the server stops "
        "serving while /health stays 200), /reset_prefix_cache and the weight-update routes",
    ),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": (
        lambda v: v.strip().lower() not in ("1", "true"),
        "/v1/load_lora_adapter: any client loads an adapter, from a path of the host or a repository, into the "
        "served model",
    ),
}


def _serving_env(f: Field) -> dict[str, str]:
    env: dict[str, str] = f.str_map({})
    for name, value in env.items():
        if name in TOOL_ENV:
            raise f[name].error(f"{name} is the tool's to set, from {TOOL_ENV[name]}")
        if name in CONTROL_ENV and not CONTROL_ENV[name][0](value):
            raise f[name].error(
                f"{name}={value} opens {CONTROL_ENV[name][1]}, on the port users reach (through the gateway too); "
                "vLLM itself says it is not for production: leave it out (0 is off)"
            )
    return env


def _serving(f: Field) -> Serving:
    f.mapping(
        {
            "python",
            "target",
            "model_name",
            "speculative",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "num_speculative_tokens",
            "host",
            "port",
            "extra_args",
            "env",
            "startup_timeout",
            "multi_node",
            "drain_timeout",
            "compile_cache",
            "standby",
        }
    )
    multi_node = _multi_node(f["multi_node"]) if "multi_node" in f else None
    port = f["port"].int(Serving.port, minimum=1, maximum=65535)
    standby = _standby(f["standby"], port, multi_node) if "standby" in f else None
    compile_cache = f["compile_cache"].str(Serving.compile_cache)
    if compile_cache not in COMPILE_CACHE:
        raise f["compile_cache"].error(f"expected one of {', '.join(COMPILE_CACHE)}")
    if compile_cache == "share" and multi_node is not None:
        raise f["compile_cache"].error(
            "share gives one host's cache to single-host servers: a multi_node group compiles its own"
        )
    tp = f["tensor_parallel_size"].int(None, minimum=1)
    if multi_node is not None and tp is None:
        raise f.error("a multi_node deployment needs tensor_parallel_size (the total over all nodes)")
    return Serving(
        python=f["python"].str(None),
        target=f["target"].str(None),
        model_name=f["model_name"].str(Serving.model_name),
        speculative=f["speculative"].bool(Serving.speculative),
        tensor_parallel_size=tp,
        pipeline_parallel_size=f["pipeline_parallel_size"].int(Serving.pipeline_parallel_size, minimum=1),
        num_speculative_tokens=f["num_speculative_tokens"].int(Serving.num_speculative_tokens, minimum=1),
        # "address" (the container's own), or an address as the inventory's are held to
        host=f["host"].str(None) if f["host"].present and f["host"].value == "address" else f["host"].address(None),
        port=port,
        extra_args=_extra_args(f["extra_args"]),
        env=_serving_env(f["env"]),
        startup_timeout=f["startup_timeout"].seconds(Serving.startup_timeout, minimum=1),
        multi_node=multi_node,
        drain_timeout=f["drain_timeout"].seconds(Serving.drain_timeout, minimum=0),
        compile_cache=compile_cache,
        standby=standby,
    )


def _standby(f: Field, port: int, multi_node: MultiNode | None) -> Standby:
    f.mapping({"port", "dev_routes"}, required=frozenset({"port", "dev_routes"}))
    if multi_node is not None:
        raise f.error("a multi_node group has no standby: its sleep across nodes is not proven")
    other = f["port"].int(None, minimum=1, maximum=65535)
    assert other is not None
    if other == port:
        raise f["port"].error(
            f"the standby's port must differ from serving.port ({port}): the sleeping server keeps its own"
        )
    routes = f["dev_routes"].str()
    if routes not in DEV_ROUTES:
        raise f["dev_routes"].error(
            "a standby needs vLLM's dev routes (VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, and /collective_rpc, which "
            "calls any method of every worker, with no API key): write gateway-only where only the gateway and this "
            "host reach serving.port and standby.port"
        )
    return Standby(other, routes)


def _multi_node(f: Field) -> MultiNode:
    f.mapping(
        {"nodes", "executor", "master_port", "master_addr", "interface", "ray_port"}, required=frozenset({"nodes"})
    )
    nodes = f["nodes"].str_list()
    if not nodes:
        raise f["nodes"].error("expected the group's containers in rank order, or a group name")
    if len(set(nodes)) != len(nodes):
        raise f["nodes"].error("a container can hold only one rank")
    executor = f["executor"].str(MultiNode.executor)
    if executor not in EXECUTORS:
        raise f["executor"].error(f"expected one of {', '.join(EXECUTORS)}")
    return MultiNode(
        nodes=nodes,
        executor=executor,
        master_port=f["master_port"].int(MultiNode.master_port, minimum=1, maximum=65535),
        master_addr=f["master_addr"].address(None),
        interface=f["interface"].str(MultiNode.interface),
        ray_port=f["ray_port"].int(MultiNode.ray_port, minimum=1, maximum=65535),
        file=f.doc.file,
        line=f.doc.line_of(f.path),
    )


def _above(f: Field, default: float | None, floor: float, why: str) -> float | None:
    """A threshold that can fail: strictly above ``floor``, the least its measure can be."""
    value: float | None = f.number(default)
    if f.present and value is not None and value <= floor:
        raise f.error(f"must be above {floor:g}, got {f.value}: {why}")
    return value


def _tau(f: Field, default: float) -> float:
    """A mean acceptance length threshold: tau = 1 + accepted/drafts is never below 1, so 1 would
    pass the founding incident's 1.00."""
    why = "tau (1 + accepted/drafts) is never below 1, so a drafter that accepts nothing would pass"
    value = _above(f, default, 1.0, why)
    assert value is not None
    return value


def _rate(f: Field, default: float | None) -> float | None:
    rate = _above(f, default, 0.0, "an acceptance rate is never below 0, so it would pass any drafter")
    if rate is not None and rate > 1:
        raise f.error("a rate between 0 and 1")
    return rate


def _speedup(f: Field) -> SpeedupGate | None:
    if not f.present:
        return None
    g = f.mapping(
        {
            "concurrency",
            "min",
            "max_tokens",
            "repeats",
            "prompts",
            "max_pairs",
            "on_inconclusive",
            "arms",
            "baseline_port",
            "baseline_memory",
        }
    )
    observed = g["concurrency"].value == "observed"
    if isinstance(g["concurrency"].value, str) and not observed:
        raise g["concurrency"].error(
            f"a list of request counts, or 'observed' (the fleet's load as watch recorded it), "
            f"got {g['concurrency'].value!r}"
        )
    levels = [] if observed else g["concurrency"].int_list(list(SpeedupGate.concurrency))
    if not observed and (not levels or any(not 1 <= c <= 4096 for c in levels) or len(set(levels)) != len(levels)):
        raise g["concurrency"].error(
            f"distinct request counts from 1 to 4096, or 'observed' (the fleet's load as watch recorded it), "
            f"got {g['concurrency'].value}"
        )
    minimum = _above(g["min"], SpeedupGate.min, 0.0, "a speed-up is never below 0, so it would pass any drafter")
    assert minimum is not None
    # One pair has no interval (its bound is 0, its top infinite): a level that can only ever be
    # inconclusive, which ``on_inconclusive: pass`` would pass with a lower bound of 0.00.
    repeats = g["repeats"].int(SpeedupGate.repeats, maximum=20)
    if repeats < 2:
        raise g["repeats"].error(f"at least 2 (one pair has no spread, so no bound either way), got {repeats}")
    most = g["max_pairs"].int(max(repeats, SpeedupGate.max_pairs), maximum=50)
    if most < repeats:
        raise g["max_pairs"].error(f"at least repeats ({repeats}): the pairs measured at the least")
    memory = g["baseline_memory"].number(None, minimum=0.0)
    if memory is not None and not 0 < memory < 1:
        raise g["baseline_memory"].error(f"a share of a GPU's memory between 0 and 1 (exclusive), got {memory:g}")
    port = g["baseline_port"].int(None, minimum=1, maximum=65535)
    return SpeedupGate(
        concurrency=tuple(sorted(levels)),
        min=minimum,
        max_tokens=_decoded_tokens(g["max_tokens"], SpeedupGate.max_tokens),
        repeats=repeats,
        prompts=tuple(g["prompts"].str_list(())),
        max_pairs=most,
        on_inconclusive=g["on_inconclusive"].choice(("refuse", "pass"), SpeedupGate.on_inconclusive),
        arms=g["arms"].choice(("auto", "beside", "before"), SpeedupGate.arms),
        baseline_port=port,
        baseline_memory=memory,
        observed=observed,
    )


def _decoded_tokens(f: Field, default: int) -> int:
    """A probe's or a load's tokens a request: at least 2, since vLLM's first token comes from the
    prefill and only the tokens after it are drafted (one token: nothing drafted, and every host
    "speculative decoding is not running")."""
    tokens = f.int(default, maximum=4096)
    if tokens < 2:
        raise f.error(
            f"at least 2, got {tokens}: the first token comes from the prefill, so one token a request "
            "drafts nothing and no host could pass"
        )
    return int(tokens)


def max_num_seqs(serving: Serving) -> int | None:
    """The server's ``--max-num-seqs`` as its extra arguments set it (None: vLLM's own default)."""
    seqs = None
    args = list(serving.extra_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--max-num-seqs", "--max_num_seqs"):
            seqs = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return int(seqs) if seqs is not None and seqs.isdigit() else None


def _speedup_fits(gate: SpeedupGate | None, serving: Serving, f: Field) -> None:
    """A speed-up level above the server's ``--max-num-seqs`` would queue in vLLM and measure
    fewer requests at once than it names: refused, naming both."""
    seqs = max_num_seqs(serving)
    if gate is not None and gate.baseline_port == serving.port:
        raise f["baseline_port"].error(
            f"the serving port ({serving.port}): the baseline beside needs a port of its own (or leave it unset: "
            "the serving port + 1)"
        )
    if gate is None or seqs is None:
        return  # vLLM's own default, or a value the engine gate has vLLM's word on
    over = [c for c in gate.concurrency if c > seqs]
    if over:
        raise f["concurrency"].error(
            f"{over} requests at once is above serving.extra_args --max-num-seqs {seqs}: vLLM would run "
            f"{seqs} of them at a time and queue the rest, so the level would measure less than it names "
            "(raise --max-num-seqs or lower the level)"
        )


def _gates(f: Field) -> Gates:
    f.mapping({"acceptance", "nccl", "live", "speedup"})
    nccl = f["nccl"].mapping({"min_busbw_gbps", "timeout_s"})
    a = f["acceptance"].mapping(
        {
            "min_mean_acceptance_length",
            "min_acceptance_rate",
            "min_drafts",
            "prompts",
            "max_tokens",
            "max_regression",
            "prefix_cache",
        }
    )
    regression = a["max_regression"].number(AcceptanceGate.max_regression)
    if not 0 <= regression < 1:
        # tau never falls by its whole value (it is at least 1): 1 or more could never fail
        raise a["max_regression"].error(f"a fraction from 0 up to (not including) 1, got {regression:g}")
    acceptance = AcceptanceGate(
        min_mean_acceptance_length=_tau(a["min_mean_acceptance_length"], AcceptanceGate.min_mean_acceptance_length),
        min_acceptance_rate=_rate(a["min_acceptance_rate"], None),
        min_drafts=a["min_drafts"].int(AcceptanceGate.min_drafts, minimum=1),
        prompts=a["prompts"].str_list(()),
        max_tokens=_decoded_tokens(a["max_tokens"], AcceptanceGate.max_tokens),
        max_regression=regression,
        prefix_cache=a["prefix_cache"].str(AcceptanceGate.prefix_cache),
    )
    if acceptance.prefix_cache not in PREFIX_CACHE:
        raise a["prefix_cache"].error(f"expected one of {', '.join(PREFIX_CACHE)}")
    live = f["live"].mapping({"min_mean_acceptance_length", "min_acceptance_rate", "min_drafts"})
    return Gates(
        acceptance=acceptance,
        live=AcceptanceGate(
            min_mean_acceptance_length=_tau(live["min_mean_acceptance_length"], acceptance.min_mean_acceptance_length),
            min_acceptance_rate=_rate(live["min_acceptance_rate"], acceptance.min_acceptance_rate),
            min_drafts=live["min_drafts"].int(acceptance.min_drafts, minimum=1),
        ),
        speedup=_speedup(f["speedup"]),
        nccl=NcclGate(
            min_busbw_gbps=_above(nccl["min_busbw_gbps"], None, 0.0, "0 GB/s cannot fail: leave it out for no floor"),
            timeout_s=nccl["timeout_s"].seconds(NcclGate.timeout_s, minimum=1),
        ),
    )


def _rollout(f: Field, gateway: Gateway | None) -> Rollout:
    f.mapping({"canary", "batch_size", "max_failures", "min_in_rotation", "bake_s"})
    if "min_in_rotation" in f and gateway is None:
        # without a gateway no host is ever in or out of rotation: a floor that could hold nothing
        raise f["min_in_rotation"].error(
            "counts the hosts a gateway sends requests to, and this playbook has no gateway: block"
        )
    rollout = Rollout(
        canary=f["canary"].int(Rollout.canary, minimum=0),
        batch_size=f["batch_size"].int(None, minimum=1),
        max_failures=f["max_failures"].int(Rollout.max_failures, minimum=0),
        min_in_rotation=f["min_in_rotation"].int(None, minimum=0),
        bake_s=f["bake_s"].seconds(Rollout.bake_s, minimum=0),
    )
    if rollout.bake_s and not rollout.canary:
        raise f["bake_s"].error("a bake watches the canary: set rollout.canary too")
    return rollout
