"""Rendering: progress and messages for stderr, tables for people, JSON for machines. No decisions here.

Everything the CLI prints is written here (the CLI only chooses what): the run's progress (the
``Observer`` that the CLI hands a run), its result table, the watch's lines and table, the lint
findings, the history and the report's text, the inventory listing and the sandbox's status. What
hosts say reaches the terminal without control codes (``plain``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.engine.observer import Observer, Step
from orchestrator.results import HostReport, Problem, RunReport
from orchestrator.rules import dflash

if TYPE_CHECKING:
    from orchestrator.rules.watch import Round, Transition
    from orchestrator.store.report import HostHistory

# Control characters (ESC and the rest of C0 but tab and newline, DEL, C1) removed from what is
# printed for people: gate details, log lines and diffs come from hosts, and a hostile one must
# not be able to move the cursor, retitle or rewrite the user's terminal. JSON escapes them itself.
_CONTROL = dict.fromkeys([*range(0, 9), *range(11, 32), 127, *range(128, 160)])


def plain(text: str) -> str:
    """``text`` without terminal control codes (what a hostile host could use on the terminal)."""
    return text.translate(_CONTROL)


def message(text: str, as_json: bool = False, stream: TextIO | None = None) -> None:
    """A line about the run on stderr: plain text, or with ``--json`` a JSON line ``{"at", "message"}``."""
    stream = stream or sys.stderr
    if as_json:
        text = json.dumps({"at": time.time(), "message": text})
    stream.write(plain(text) + "\n")
    stream.flush()


class _Plain:
    """A text stream that writes ``plain`` text."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(plain(text))

    def flush(self) -> None:
        self.stream.flush()


class MessagePrinter(Observer):
    """Only a run's messages, each a line on stderr (a watch's: its group's lead and its records)."""

    def __init__(self, as_json: bool = False) -> None:
        self.as_json = as_json

    def say(self, text: str) -> None:
        message(text, self.as_json)


class ProgressPrinter(Observer):
    """Progress on stderr, safe to call from worker threads: what each host is doing as it
    changes, and one line per host as it finishes; the run's messages between them.

    ``mode``: ``live`` (a terminal: each host in flight with its step and how long it has been at
    it, redrawn, and the finished lines above), ``lines`` (not a terminal: a timestamped line each
    time a host's step changes, a long wait's line again every ``LINE_EVERY_S``), ``json`` (the
    same as JSON lines, for ``--json``); ``auto`` picks live or lines by whether stderr is a
    terminal."""

    LINE_EVERY_S = 15.0
    LINE_MIN_S = 2.0
    watching = True

    def __init__(self, kind: str, total: int, stream: TextIO | None = None, mode: str = "auto") -> None:
        self.kind = kind
        self.total = total
        self.stream = stream or sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        if mode == "auto":
            term = os.environ.get("TERM", "")
            mode = "live" if self.stream.isatty() and term not in ("", "dumb") else "lines"
        self.mode = mode
        self._steps: dict[str, tuple[Step, float]] = {}  # host -> its step, and since when
        self._shown: dict[str, tuple[str, float, str]] = {}  # host -> step last printed, when, its detail
        self._live: Any = None
        self.failed: list[tuple[str, str]] = []  # (host, its failed gate), in the order they ended
        self.height: int | None = None  # the terminal's lines (None: ask the console)

    # --- events ---------------------------------------------------------------------------

    def host_started(self, report: HostReport) -> None:
        """A host's work began: it enters the live view."""
        with self._lock:
            self._steps.setdefault(report.name, (Step(report.name, "starting"), time.monotonic()))
            self._start_live()

    def say(self, text: str) -> None:
        """A run's message, as its own line."""
        message(text, self.mode == "json", self.stream)

    def host_done(self, report: HostReport) -> None:
        """A host's work ended: one line with its result, and it leaves the live view."""
        with self._lock:
            self.done += 1
            self._steps.pop(report.name, None)
            if not report.ready:
                self.failed.append((report.name, report.failed_gate or "?"))
            self._write_done(report)
            if self.done >= self.total:
                self._stop_live()

    def step(self, step: Step) -> None:
        """A host's current step changed (or its detail did): shown live, or as a line."""
        with self._lock:
            now = time.monotonic()
            before = self._steps.get(step.host)
            since = before[1] if before is not None and before[0].what == step.what else now
            self._steps[step.host] = (step, since)
            if self.mode == "live":
                return  # drawn at the next refresh
            shown = self._shown.get(step.host)
            if shown is not None and shown[0] == step.what:
                age = now - shown[1]
                if age < self.LINE_EVERY_S and (shown[2] == step.detail or age < self.LINE_MIN_S):
                    return  # the same step: a new detail at most every 2 s, the same one every 15 s
            self._shown[step.host] = (step.what, now, step.detail)
            if self.mode == "json":
                data = {"at": time.time(), "host": step.host, "step": step.what, "detail": step.detail}
                if step.elapsed_s is not None:
                    data["elapsed_s"] = step.elapsed_s
                self.stream.write(json.dumps(data) + "\n")
            else:
                said = step.describe()
                self.stream.write(plain(f"{_clock()} {step.host}  {step.what}{': ' + said if said else ''}\n"))
            self.stream.flush()

    def close(self) -> None:
        """Stop the live view (a run that ends early, or is interrupted)."""
        with self._lock:
            self._stop_live()

    # --- output -----------------------------------------------------------------------------

    def _write_done(self, report: HostReport) -> None:
        mark = "ok  " if report.ready else "FAIL"
        gate = report.failed_gate
        if gate is None and "acceptance" in report.gates:
            gate = "acceptance"  # READY: show the measured tau
        detail = report.gates[gate].detail if gate else _last_detail(report)
        if self.mode == "json":
            data = {
                "at": time.time(),
                "host": report.name,
                "step": "done",
                "ready": report.ready,
                "gate": gate,
                "detail": detail,
                "seconds": round(report.duration_s, 2),
                **({"time": report.time} if report.time else {}),
            }
            self.stream.write(json.dumps(data) + "\n")
            self.stream.flush()
            return
        label = f"{gate}: " if gate else ""
        split = ""
        if report.time:
            t = report.time
            speed = t.get("speedup_baseline_s", 0.0) + t.get("speedup_drafter_s", 0.0)
            split = f": vLLM's start {t['vllm_start_s']:.1f} s, the probe {t['probe_s']:.1f} s"
            split += f", the speed-up's load {speed:.1f} s" if speed else ""
            split += f", the tool {t['tool_s']:.1f} s"
        line = (
            f"[{self.done:>{len(str(self.total))}}/{self.total}] {mark} {report.name}  {label}{detail}"
            f"  ({report.duration_s:.2f} s{split})"
        )
        if self._live is not None:
            if report.ready and self.total > self._lines():
                return  # a fleet: its ready hosts are counted in the summary and listed in the result table
            self._live.console.print(plain(line), markup=False, highlight=False, soft_wrap=True)
        else:
            self.stream.write(plain(line) + "\n")
            self.stream.flush()

    def _start_live(self) -> None:
        if self.mode != "live" or self._live is not None:
            return
        from rich.console import Console  # only on a terminal: ~70 ms of imports
        from rich.live import Live

        console = Console(file=self.stream)
        self._live = Live(console=console, get_renderable=self._render, refresh_per_second=4, transient=True)
        self._live.start()

    def _stop_live(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()

    # How many of the slowest hosts in flight, and of the last failed ones, the summary names.
    SUMMARY_SLOWEST = 5

    def _lines(self) -> int:
        if self.height is not None:
            return self.height
        if self._live is not None:
            return int(self._live.console.size.height)
        return 24

    def _render(self) -> Any:
        from rich.table import Table

        # No lock here: Live's refresh thread holds its own lock while it calls this, and a worker
        # thread may hold ours while it prints through Live. Copying a dict's values is atomic.
        now = time.monotonic()
        rows = sorted(list(self._steps.values()), key=lambda item: item[0].host)
        done = self.done
        if len(rows) + 4 > self._lines() // 2:
            return self._summary(rows, now)
        table = Table(box=None, show_header=False, pad_edge=False, expand=False)
        # Host, step and time keep their width; the detail (a log line) gets what is left.
        host_w = max((len(step.host) for step, _ in rows), default=4)
        step_w = max((len(step.what) for step, _ in rows), default=4)
        table.add_column("host", style="bold", no_wrap=True, min_width=host_w)
        table.add_column("step", no_wrap=True, min_width=step_w)
        table.add_column("for", justify="right", no_wrap=True, min_width=6)
        table.add_column("detail", overflow="ellipsis", no_wrap=True)
        for step, since in rows:
            table.add_row(step.host, plain(step.what), f"{now - since:.0f} s", plain(step.detail))
        table.caption = f"{self.kind}: {done}/{self.total} done, {now - self.started:.0f} s"
        return table

    def _summary(self, rows: list[tuple[Step, float]], now: float) -> Any:
        """The live view when the hosts in flight do not fit the terminal: how many are at each
        step, the slowest of them, and the hosts that failed so far (the result table and --json
        still list every host)."""
        from rich.console import Group
        from rich.text import Text

        failed = list(self.failed)
        at: dict[str, int] = {}
        for step, _ in rows:
            at[step.what] = at.get(step.what, 0) + 1
        lines = [
            f"{self.kind}: {self.done}/{self.total} done ({self.done - len(failed)} ready, {len(failed)} failed), "
            f"{len(rows)} in flight, {now - self.started:.0f} s",
            "  at: " + ", ".join(f"{what} {n}" for what, n in sorted(at.items(), key=lambda kv: (-kv[1], kv[0]))),
        ]
        slowest = sorted(rows, key=lambda item: item[1])[: self.SUMMARY_SLOWEST]
        if slowest:
            lines.append(
                "  slowest: " + "; ".join(f"{step.host} {step.what} {now - since:.0f} s" for step, since in slowest)
            )
        if failed:
            shown = ", ".join(f"{host} ({gate})" for host, gate in failed[-self.SUMMARY_SLOWEST :])
            more = f" and {len(failed) - self.SUMMARY_SLOWEST} more" if len(failed) > self.SUMMARY_SLOWEST else ""
            lines.append(f"  failed: {shown}{more}")
        return Group(*(Text(plain(line), no_wrap=True, overflow="ellipsis") for line in lines))


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def _last_detail(report: HostReport) -> str:
    if not report.gates:
        return ""
    return list(report.gates.values())[-1].detail


_STATUS = {
    # kind: (word when every gate passed, word when not)
    "deploy": ("READY", "NOT READY"),
    "rollback": ("READY", "NOT READY"),
    "verify": ("IN SYNC", "NOT IN SYNC"),
    "dry-run": ("CHECKED", "FAILED"),
    "stop": ("STOPPED", "FAILED"),
}


def render_table(run: RunReport, stream: TextIO | None = None) -> None:
    """A run's result as a table on stdout: a row per host, its failed gate and why, then the
    counts."""
    # sys.stdout as it is at the call, not at import: callers (and tests) may have replaced it.
    out = _Plain(stream or sys.stdout)
    good, bad = _STATUS[run.kind]
    for problem in run.lint or []:
        out.write(f"lint {problem.line()}\n")
    headers = ("HOST", "STATUS", "RELEASE", "GATE", "DETAIL")
    rows = []
    for h in run.hosts:
        gate = h.failed_gate or (list(h.gates)[-1] if h.gates else "-")
        if h.ready and "acceptance" in h.gates:
            gate = "acceptance"  # the proof worth showing: the measured tau
        detail = h.gates[gate].detail if gate in h.gates else ""
        rows.append((h.name, good if h.ready else bad, h.release_id or "-", gate, detail))
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(4)]
    for row in [headers, *rows]:
        out.write("  ".join(str(c).ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4] + "\n")
    ready = sum(h.ready for h in run.hosts)
    out.write(f"\n{run.kind}: {ready}/{len(run.hosts)} hosts {good} in {run.finished - run.started:.2f} s\n")
    for h in run.hosts:
        for diff in h.diffs:
            out.write(f"\n# {h.name}\n{diff}")
        for line in h.diagnosis:
            out.write(f"{h.name}: diagnosis: {line}\n")
        if h.standby:
            out.write(f"{h.name}: standby: {standby_line(h.standby)}\n")
        for gate_name, found in h.gates.items():
            for warning in found.data.get("warnings") or []:
                out.write(f"{h.name}: warning ({gate_name}): {warning}\n")


def standby_line(standby: dict[str, Any]) -> str:
    """A host's standby in one line: kept asleep (and what it holds), woken, or why not kept."""
    release = standby.get("release_id")
    if standby.get("why"):
        return f"not kept: {standby['why']}"
    if standby.get("woken"):
        return f"release {release} woken in {standby.get('wake_s')} s (no server started)"
    memory = ", ".join(
        f"{what} {standby[key]} MiB"
        for key, what in (("host_mib", "host memory"), ("gpu_mib", "GPU memory"))
        if isinstance(standby.get(key), int)
    )
    asleep = standby.get("asleep", standby.get("kept"))
    state = "asleep" if asleep else "AWAKE"
    return f"release {release} {state} on port {standby.get('port')}, pid {standby.get('pid')}" + (
        f" ({memory})" if memory else ""
    )


def render_json(data: Any, stream: TextIO | None = None) -> None:
    """Any result as indented JSON on stdout (--json)."""
    stream = stream or sys.stdout
    json.dump(data, stream, indent=2, sort_keys=False)
    stream.write("\n")


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def render_transition(t: Transition, stream: TextIO | None = None) -> None:
    """One line a state change: when, which host, from and to, and why."""
    out = _Plain(stream or sys.stdout)
    why = "; ".join(t.round.reasons) or _live(t.round)
    out.write(f"{_when(t.at)}  {t.host}  {t.before or 'START'} -> {t.after}  {why}\n")


def _live(r: Round) -> str:
    if r.live is None:
        if r.window_drafts is None:
            return "no acceptance read"
        return f"no window judged yet: {r.window_drafts} of the {r.window_needed} drafts needed"
    return f"live {r.live.detail}"


def render_watch_table(rounds: list[Round], stream: TextIO | None = None) -> None:
    """One watch round as a table: each host's state, release and what decided it."""
    out = _Plain(stream or sys.stdout)
    headers = ("HOST", "STATE", "RELEASE", "DETAIL")
    rows = [(r.host, r.state, r.release_id or "-", "; ".join(r.reasons) or _live(r)) for r in rounds]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(3)]
    for row in [headers, *rows]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3] + "\n")
    ready = sum(r.state == "READY" for r in rounds)
    out.write(f"\nwatch: {ready}/{len(rounds)} hosts READY\n")


def render_round(
    number: int, rounds: list[Round], transitions: list[Transition], as_json: bool, stream: TextIO | None = None
) -> None:
    """A watch round as it ends: with ``--json`` one JSON line (every host, the transitions), else a
    line per state change."""
    stream = stream or sys.stdout
    if as_json:
        data = {
            "round": number,
            "hosts": [r.to_json() for r in rounds],
            "transitions": [t.to_json() for t in transitions],
        }
        stream.write(json.dumps(data) + "\n")
    else:
        for t in transitions:
            render_transition(t, stream)
    stream.flush()


def round_summary(number: int, rounds: list[Round]) -> str:
    """ "round 3: 7 READY, 1 DEGRADED", for stderr."""
    counts: dict[str, int] = {}
    for r in rounds:
        counts[r.state] = counts.get(r.state, 0) + 1
    return f"round {number}: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


# What vLLM does with the drafter, as lint predicts it (the same words as real vLLM's recorded
# verdicts): a drafter that "serves" can still accept nothing, which the errors say.
_START_WORDS = {
    dflash.STARTS: "would start and serve",
    dflash.REFUSES_TO_START: "would refuse to start",
    dflash.FIRST_REQUEST: "would start healthy, then fail at the first request",
}


def render_lint(path: object, problems: list[Problem], vllm: str, stream: TextIO | None = None) -> None:
    """Each finding on a line, then the count and what vLLM would do."""
    out = _Plain(stream or sys.stdout)
    for p in problems:
        out.write(p.line() + "\n")
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    out.write(f"lint {path}: {_count(errors, 'error')}, {_count(warnings, 'warning')}; vLLM {_START_WORDS[vllm]}\n")


def _count(n: int, noun: str) -> str:
    """``1 error``, ``2 errors``, ``0 errors``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def render_history(runs: list[dict[str, Any]], stream: TextIO | None = None) -> None:
    """One line a recorded run, newest first."""
    out = _Plain(stream or sys.stdout)
    for run in runs:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["started"]))
        status = "ok" if run["ok"] else "NOT OK"
        by = run.get("by")
        who = f"  by {by['user']}@{by['host']} pid {by['pid']}" if by else ""
        out.write(
            f"#{run['id']:<5} {when}  {run['kind']:<8} {status:<6} {run['hosts_ready']}/{run['hosts_total']} hosts  "
            f"release {run['release_id'] or '-'}  {run['playbook']}  ({run['finished'] - run['started']:.2f} s){who}\n"
        )
    if not runs:
        out.write("no runs recorded yet\n")


def render_fleet(hosts: list[HostHistory], stream: TextIO | None = None) -> None:
    """``orchestrate report`` as text: one line a host (its state, its last tau, its last run)."""
    out = _Plain(stream or sys.stdout)
    for h in hosts:
        last = h.samples[-1] if h.samples else None
        tau = f"tau {last['mean_acceptance_length']:.2f} ({last['source']})" if last else "no tau yet"
        run = h.runs[0] if h.runs else None
        said = f"last run {run['kind']} {'ready' if run['host']['ready'] else 'not ready'}" if run else "no run"
        out.write(f"{h.name:<20} {h.state or '-':<9} {tau:<24} {len(h.releases())} releases, {said}\n")


def render_inventory(view: dict[str, Any], stream: TextIO | None = None) -> None:
    """``orchestrate inventory list``: a line a GPU host, and one a container under it."""
    out = _Plain(stream or sys.stdout)
    for host in view["hosts"]:
        out.write(f"{host['name']:<16} {host['address'] or '-':<16} lxd {host['lxd'] or '-'}\n")
        for c in host["containers"]:
            gpus = ",".join(map(str, c["gpus"])) or "-"
            groups = ",".join(c["groups"]) or "-"
            out.write(f"  {c['name']:<14} {c['address'] or '(via lxd)':<16} gpus {gpus:<16} groups {groups}\n")


def render_sandbox(status: dict[str, Any], stream: TextIO | None = None) -> None:
    """``orchestrate sandbox status``: what is up."""
    out = _Plain(stream or sys.stdout)
    hosts = status["hosts"]
    out.write(f"kind {status['kind']}: {len(hosts)} hosts, {'up' if status['up'] else 'not up'}\n")
    for h in hosts:
        out.write(f"  {h['name']:<14} {h['address']:<15} {'running' if h['running'] else 'STOPPED'}\n")


def render_sandbox_files(status: dict[str, Any], stream: TextIO | None = None) -> None:
    """``orchestrate sandbox up``: the files written for it."""
    out = _Plain(stream or sys.stdout)
    out.write(f"inventory:   {status['inventory']}\n")
    out.write(f"ssh_config:  {status['ssh_config']}\n")
    out.write(f"known_hosts: {status['known_hosts']}\n")
