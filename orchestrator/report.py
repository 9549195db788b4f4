"""Rendering: progress lines for stderr, tables for people, JSON for machines. No decisions here."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

from orchestrator.results import HostReport, RunReport


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
