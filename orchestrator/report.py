"""Rendering: progress lines for stderr, tables for people, JSON for machines. No decisions here."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.results import HostReport, RunReport

if TYPE_CHECKING:
    from orchestrator.watch import Round, Transition


class ProgressPrinter:
    """One line per host as it finishes, on stderr, safe to call from worker threads."""

    def __init__(self, kind: str, total: int, stream: TextIO | None = None) -> None:
        self.kind = kind
        self.total = total
        self.stream = stream or sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, report: HostReport, event: str) -> None:
        if event != "done":
            return
        with self._lock:
            self.done += 1
            mark = "ok  " if report.ready else "FAIL"
            gate = report.failed_gate
            if gate is None and "acceptance" in report.gates:
                gate = "acceptance"  # READY: show the measured tau
            detail = report.gates[gate].detail if gate else _last_detail(report)
            label = f"{gate}: " if gate else ""
            self.stream.write(
                f"[{self.done:>{len(str(self.total))}}/{self.total}] {mark} {report.name}  {label}{detail}"
                f"  ({report.duration_s:.2f} s)\n"
            )
            self.stream.flush()


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
    # sys.stdout as it is at the call, not at import: callers (and tests) may have replaced it.
    stream = stream or sys.stdout
    good, bad = _STATUS[run.kind]
    for problem in run.lint or []:
        stream.write(f"lint {problem.line()}\n")
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
        stream.write("  ".join(str(c).ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4] + "\n")
    ready = sum(h.ready for h in run.hosts)
    stream.write(f"\n{run.kind}: {ready}/{len(run.hosts)} hosts {good} in {run.finished - run.started:.2f} s\n")
    for h in run.hosts:
        for diff in h.diffs:
            stream.write(f"\n# {h.name}\n{diff}")
        for line in h.diagnosis:
            stream.write(f"{h.name}: diagnosis: {line}\n")


def render_json(data: Any, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    json.dump(data, stream, indent=2, sort_keys=False)
    stream.write("\n")


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def render_transition(t: Transition, stream: TextIO | None = None) -> None:
    """One line a state change: when, which host, from and to, and why."""
    stream = stream or sys.stdout
    why = "; ".join(t.round.reasons) or _live(t.round)
    stream.write(f"{_when(t.at)}  {t.host}  {t.before or 'START'} -> {t.after}  {why}\n")


def _live(r: Round) -> str:
    if r.live is None:
        return "no window judged yet" if r.window_drafts is None else f"window open: {r.window_drafts} drafts so far"
    return f"live {r.live.detail}"


def render_watch_table(rounds: list[Round], stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    headers = ("HOST", "STATE", "RELEASE", "DETAIL")
    rows = [(r.host, r.state, r.release_id or "-", "; ".join(r.reasons) or _live(r)) for r in rounds]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(3)]
    for row in [headers, *rows]:
        stream.write("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3] + "\n")
    ready = sum(r.state == "READY" for r in rounds)
    stream.write(f"\nwatch: {ready}/{len(rounds)} hosts READY\n")
