"""``orchestrate report``: per host, its releases, its runs with their gates and times, and tau over
time (from deploys, probes and watch windows) drawn as an inline SVG with the DEGRADED, DRIFT and
DOWN periods shaded. The state database's rows in, one self-contained HTML page (no script, no
stylesheet or font from the network) or plain data out; ``write_html`` puts the page in its file.

Everything shown that a host said (gate details, release ids, host names) is escaped: a report is
opened in a browser, and a hostile host must not be able to put markup in it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config.localfiles import write_output

if TYPE_CHECKING:
    from orchestrator.store.state import StateDB

SHADED = {"DEGRADED": "#f4c7c3", "DRIFT": "#fce8b2", "DOWN": "#dadce0"}
SOURCE_COLOURS = {"deploy": "#1a73e8", "rollback": "#9334e6", "verify": "#188038", "watch": "#5f6368"}


@dataclass
class Period:
    """A stretch of one watch state on one host, for the report's timeline."""

    state: str
    start: float
    end: float


@dataclass
class HostHistory:
    """One host as the state database remembers it: its runs, its live acceptance samples and its
    watch transitions."""

    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)  # newest first, as history() gives them
    samples: list[dict[str, Any]] = field(default_factory=list)  # oldest first
    transitions: list[dict[str, Any]] = field(default_factory=list)  # oldest first

    @property
    def state(self) -> str | None:
        """The host's last watch state, if it was ever watched; STOPPED when a stop ran after it
        (the watch that would have seen it down may have been stopped too: the host stayed READY
        in the report, serving nothing)."""
        watched = self.transitions[-1] if self.transitions else None
        run = self.runs[0] if self.runs else None  # newest first
        stopped = run is not None and run.get("kind") == "stop" and run["host"].get("ready")
        if stopped and (watched is None or float(run["finished"]) >= float(watched["at"])):  # type: ignore[index]
            return STOPPED
        return watched["to"] if watched else None

    def periods(self, now: float) -> list[Period]:
        """Each stretch of time the host spent in one watched state."""
        ends = [float(t["at"]) for t in self.transitions[1:]] + [now] if self.transitions else []
        return [Period(str(t["to"]), float(t["at"]), end) for t, end in zip(self.transitions, ends, strict=True)]

    def speedup(self) -> dict[str, Any] | None:
        """The last speed-up gate that measured (or held a canary's): its levels, verdict and run."""
        for run in self.runs:  # newest first
            gate = run["host"].get("gates", {}).get("speedup")
            if isinstance(gate, dict) and gate.get("levels"):
                return {**gate, "kind": run["kind"], "at": run["finished"]}
        return None

    def starts(self) -> list[dict[str, Any]]:
        """Each server start a run recorded (the health gate's startup ledger), newest first, with
        the run and release it belongs to."""
        out = []
        for run in self.runs:  # newest first
            health = run["host"].get("gates", {}).get("health")
            ledger = health.get("startup") if isinstance(health, dict) else None
            if isinstance(ledger, dict) and isinstance(ledger.get("phases"), dict) and not ledger.get("carried"):
                out.append(
                    {**ledger, "kind": run["kind"], "at": run["finished"], "release_id": run["host"].get("release_id")}
                )
        return out

    def releases(self) -> list[dict[str, Any]]:
        """Each release the runs saw: when first and last, how many runs, the last run's verdict."""
        seen: dict[str, dict[str, Any]] = {}
        for run in reversed(self.runs):  # oldest first
            host = run["host"]
            rid = host.get("release_id")
            if not rid:
                continue
            entry = seen.setdefault(rid, {"release_id": rid, "first": run["started"], "runs": 0})
            entry.update(last=run["finished"], runs=entry["runs"] + 1, ready=host["ready"], kind=run["kind"])
        return sorted(seen.values(), key=lambda e: e["first"], reverse=True)


def from_store(db: StateDB, host: str | None = None) -> list[HostHistory]:
    """Every host's history as the store holds it (``host``: that one alone)."""
    hosts = collect(db.history(limit=1_000_000, host=host), db.samples(host), db.transitions(host))
    return [h for h in hosts if h.name == host] if host else hosts


def collect(
    runs: list[dict[str, Any]], samples: list[dict[str, Any]], transitions: list[dict[str, Any]]
) -> list[HostHistory]:
    """The state database's rows (``StateDB.history``, ``samples``, ``transitions``) by host."""
    hosts: dict[str, HostHistory] = {}

    def of(name: str) -> HostHistory:
        return hosts.setdefault(name, HostHistory(name))

    for run in runs:
        head = _stored_run(run)
        for host in run.get("hosts") or []:
            kept = _stored_host(host)
            if kept is not None:
                of(kept["name"]).runs.append({**head, "host": kept})
    for sample in samples:  # typed columns, but SQLite keeps whatever another writer put there
        if _number(sample.get("at")) is not None and _number(sample.get("mean_acceptance_length")) is not None:
            of(str(sample["host"])).samples.append({**sample, "source": str(sample.get("source"))})
    for t in transitions:  # each a stored JSON document
        if isinstance(t, dict) and isinstance(t.get("host"), str) and _number(t.get("at")) is not None:
            of(t["host"]).transitions.append({**t, "to": str(t.get("to"))})
    return [hosts[name] for name in sorted(hosts)]


def _stored_run(run: dict[str, Any]) -> dict[str, Any]:
    """A run's row as the report reads it: its kind a word and its times numbers, whatever the
    store held (a stored record is data: another tool's row or a damaged one)."""
    head = {k: v for k, v in run.items() if k != "hosts"}
    head["kind"] = str(run.get("kind"))
    for key in ("started", "finished"):
        head[key] = _number(run.get(key)) or 0.0
    return head


def _stored_host(host: Any) -> dict[str, Any] | None:
    """A host's record within a stored run, in the shapes the report draws (None: not a record of
    a host at all): ready only when true, seconds only when a number, each gate a mapping with its
    verdict and words, a start's ledger with numbers only where it holds numbers. A record the
    report cannot draw was a traceback (``report --html`` on a ledger total that is not a number)."""
    if not isinstance(host, dict) or not isinstance(host.get("name"), str):
        return None
    gates = host.get("gates")
    kept_gates: dict[str, Any] = {}
    if not isinstance(gates, dict):
        gates = {}
    for name, gate in gates.items():
        if not isinstance(gate, dict):
            continue
        gate = {**gate, "ok": gate.get("ok") is True, "detail": str(gate.get("detail", ""))}
        if not isinstance(gate.get("data"), dict):
            gate.pop("data", None)
        if "startup" in gate:
            gate["startup"] = _stored_ledger(gate["startup"])
        kept_gates[str(name)] = gate
    release = host.get("release_id")
    return {
        **host,
        "ready": host.get("ready") is True,
        "duration_s": _number(host.get("duration_s")) or 0.0,
        "release_id": release if isinstance(release, str) else None,
        "gates": kept_gates,
    }


def _stored_ledger(ledger: Any) -> dict[str, Any] | None:
    """A start's ledger with its figures kept only where they are numbers (its phases' seconds, its
    total, its KV cache's tokens) and its words as text."""
    if not isinstance(ledger, dict) or not isinstance(ledger.get("phases"), dict):
        return None
    out = {**ledger, "phases": {str(k): v for k, v in ledger["phases"].items() if _number(v) is not None}}
    out["total_s"] = _number(ledger.get("total_s"))
    kv = ledger.get("kv_tokens")
    out["kv_tokens"] = kv if isinstance(kv, int) and not isinstance(kv, bool) else None
    for key in ("clock", "compile"):
        if key in ledger:
            out[key] = str(ledger[key])
    return out


def to_json(hosts: list[HostHistory], now: float) -> dict[str, Any]:
    """The fleet report as data (`orchestrate report --json`): per host its state, releases and tau
    over time."""
    return {
        "generated": now,
        "hosts": [
            {
                "name": h.name,
                "state": h.state,
                "releases": h.releases(),
                "runs": [{**{k: v for k, v in r.items() if k != "host"}, **r["host"]} for r in h.runs],
                "acceptance": h.samples,
                "speedup": h.speedup(),
                "starts": h.starts(),
                "periods": [p.__dict__ for p in h.periods(now)],
            }
            for h in hosts
        ],
    }


# --- HTML ------------------------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #202124; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin: 0 0 8px; }
section.host { border: 1px solid #dadce0; border-radius: 8px; padding: 16px; margin: 16px 0; }
.state { font-weight: 600; padding: 1px 8px; border-radius: 10px; margin-left: 8px; font-size: 12px; }
.state-READY { background: #ceead6; } .state-DEGRADED { background: #f4c7c3; }
.state-DRIFT { background: #fce8b2; } .state-DOWN { background: #dadce0; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { text-align: left; padding: 3px 10px 3px 0; vertical-align: top; }
td.detail { color: #5f6368; max-width: 640px; }
.ok { color: #188038; } .fail { color: #c5221f; }
.legend span { margin-right: 14px; font-size: 12px; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: middle; }
.state-OUT_OF_ROTATION { background: #d2e3fc; } .state-NOT_WATCHED { background: #f1f3f4; }
.state-STOPPED { background: #e8eaed; }
.filters input { margin: 0 4px 0 12px; } .filters label { font-size: 13px; }
table.fleet { margin-top: 10px; } table.fleet td { padding-right: 18px; }
"""


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) if at is not None else "-"


def write_html(path: Path, hosts: list[HostHistory], now: float) -> None:
    """The page written to ``path``: a file by an atomic replace (a reader never sees half a
    page, a failed write leaves what was there), a device or a pipe written through, never
    replaced (``localfiles.write_output``)."""
    write_output(path, render_html(hosts, now).encode("utf-8"), "--html")


def render_html(hosts: list[HostHistory], now: float) -> str:
    """The fleet report as one self-contained HTML page (inline SVG, no script), everything a host
    said escaped."""
    body = [f"<h1>dflash-orchestrator: fleet report</h1><p>{len(hosts)} hosts, generated {_when(now)} UTC</p>"]
    if not hosts:
        body.append("<p>The state database records no run yet.</p>")
    else:
        body.append(_overview(hosts))
    body.append(_legend())
    body += [_host(h, now) for h in worst_first(hosts)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>dflash-orchestrator fleet report</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )


# Worst first: what needs someone now, then what drifted, then the rest; a host never watched
# (no state) before the READY ones, since nothing vouches for it.
STOPPED = "STOPPED"  # a stop ran after the last watch state: asked for, and nothing serves
_RANK = {"DOWN": 0, "DEGRADED": 1, "DRIFT": 2, "OUT_OF_ROTATION": 3, STOPPED: 4, None: 4, "READY": 5}
NO_STATE = "NOT_WATCHED"
UNKNOWN = "UNKNOWN"  # a stored state this tool never writes (another tool's row, a damaged one)


def _shown(state: Any) -> str:
    """A host's state as the page names it (in text, class names and its CSS filter): only a
    state the tool writes, since a stored one is data like any other."""
    if state is None:
        return NO_STATE
    return state if isinstance(state, str) and state in _RANK else UNKNOWN


def worst_first(hosts: list[HostHistory]) -> list[HostHistory]:
    """The hosts by state, worst first; within a state the latest change first, then by name."""

    def key(h: HostHistory) -> tuple[int, float, str]:
        changed = h.transitions[-1]["at"] if h.transitions else 0.0
        return _RANK.get(h.state, 4), -changed, h.name

    return sorted(hosts, key=key)


def _overview(hosts: list[HostHistory]) -> str:
    """The fleet at a glance: hosts by state, and a table of every host worst first, filtered by
    state with the radio buttons above it (CSS alone: the page has no script)."""
    counts: dict[str, int] = {}
    for h in hosts:
        counts[_shown(h.state)] = counts.get(_shown(h.state), 0) + 1
    states = sorted(counts, key=lambda st: _RANK.get(None if st == NO_STATE else st, 4))
    filters = ['<input type="radio" name="state-filter" id="filter-all" checked><label for="filter-all">'
               f"all ({len(hosts)})</label>"]  # fmt: skip
    for st in states:
        filters.append(
            f'<input type="radio" name="state-filter" id="filter-{st}"><label for="filter-{st}">'
            f'<span class="state state-{st}">{st}</span> {counts[st]}</label>'
        )
    rows = []
    for h in worst_first(hosts):
        st = _shown(h.state)
        last = h.samples[-1] if h.samples else None
        tau = f"{last['mean_acceptance_length']:.2f} ({escape(last['source'])})" if last else "-"
        fast = _speedup(h.speedup()) or "-"
        change = h.transitions[-1] if h.transitions else None
        changed = (
            f"{_when(change['at'])} {escape(str(change.get('from')))} &rarr; {escape(change['to'])}" if change else "-"
        )
        run = h.runs[0] if h.runs else None
        ran = f"{escape(run['kind'])} {'ready' if run['host']['ready'] else 'not ready'}" if run else "-"
        name = escape(h.name, quote=True)
        rows.append(
            f'<tr class="fleet-row row-{st}" data-state="{st}"><td><a href="#host-{name}">{escape(h.name)}</a></td>'
            f'<td><span class="state state-{st}">{st}</span></td><td>{tau}</td><td>{fast}</td><td>{changed}</td><td>{ran}</td></tr>'
        )
    hide = " ".join(
        f"#filter-{st}:checked ~ table.fleet tr.fleet-row:not(.row-{st}) {{ display: none; }}" for st in states
    )
    head = (
        "<tr><th>host</th><th>state</th><th>last tau</th><th>speed-up by concurrency</th><th>last change</th>"
        "<th>last run</th></tr>"
    )
    summary = " &middot; ".join(f'<span class="state state-{st}">{st}</span> {counts[st]}' for st in states)
    return (
        f'<section class="overview"><h2>Fleet</h2><p class="counts">{summary}</p><style>{hide}</style>'
        f'<div class="filters">{"".join(filters)}<table class="fleet">{head}{"".join(rows)}</table></div></section>'
    )


def _speedup(gate: dict[str, Any] | None) -> str:
    """The speed-up per concurrency, as the report shows it beside tau: "1: 2.10x, 64: 0.91x"."""
    if not gate:
        return ""
    least = _number(gate.get("min")) or 0.0
    levels = [lv for lv in gate.get("levels", []) if isinstance(lv, dict)]
    return ", ".join(
        f'<span class="{"ok" if speedup >= least else "fail"}">{int(concurrency)}: {speedup:.2f}x</span>'
        for lv in levels
        if (speedup := _number(lv.get("speedup"))) is not None
        and (concurrency := _number(lv.get("concurrency"))) is not None
    )


def _number(value: Any) -> float | None:
    """A stored number, only if it is one (a stored record is data: a string or a NaN there is
    not shown as a figure)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _legend() -> str:
    items = [f'<span><i class="swatch" style="background:{c}"></i>{s}</span>' for s, c in SHADED.items()]
    items += [
        f'<span><i class="swatch" style="background:{c};border-radius:5px"></i>tau from {s}</span>'
        for s, c in SOURCE_COLOURS.items()
    ]
    return f'<p class="legend">{"".join(items)}</p>'


def _host(h: HostHistory, now: float) -> str:
    state = _shown(h.state) if h.state is not None else None
    said = f" ({escape(str(h.state)[:80])})" if state == UNKNOWN else ""
    badge = f'<span class="state state-{state}">{state}{said}</span>' if state else ""
    last = h.samples[-1] if h.samples else None
    tau = f"last tau {last['mean_acceptance_length']:.2f} ({escape(last['source'])})" if last else "no tau measured yet"
    fast = h.speedup()
    if fast is not None:
        verdict = "passed" if fast.get("ok") else "failed"
        tau += f"; speed-up by concurrency {_speedup(fast)} (min {escape(str(fast.get('min')))}: {verdict}, {escape(fast['kind'])} {_when(fast['at'])})"
    parts = [
        f'<section class="host" id="host-{escape(h.name, quote=True)}">',
        f"<h2>{escape(h.name)}{badge}</h2><p>{tau}</p>",
        chart(h, now),
        _starts(h),
        _releases(h),
        _runs(h),
        "</section>",
    ]
    return "".join(parts)


def _releases(h: HostHistory) -> str:
    rows = "".join(
        f"<tr><td>{escape(r['release_id'])}</td><td>{_when(r['first'])}</td><td>{_when(r['last'])}</td>"
        f'<td>{r["runs"]}</td><td class="{"ok" if r["ready"] else "fail"}">{escape(r["kind"])}: '
        f"{'ready' if r['ready'] else 'not ready'}</td></tr>"
        for r in h.releases()
    )
    head = "<tr><th>release</th><th>first run</th><th>last run</th><th>runs</th><th>last result</th></tr>"
    return f'<h3>Releases</h3><table class="releases">{head}{rows}</table>'


# The startup ledger's phases (``rules.startup.PHASES``), coloured in the order vLLM passes them.
PHASE_COLOURS = {
    "imports": "#9aa0a6",
    "config": "#bdc1c6",
    "weights": "#8ab4f8",
    "compile": "#f28b82",
    "profile": "#fdd663",
    "graphs": "#81c995",
    "warm-up": "#c58af9",
    "API": "#78d9ec",
    "health": "#e8eaed",
}
BAR_W = 560


def _starts(h: HostHistory) -> str:
    """One stacked bar per server start (newest first, at most 20), to one scale: where each
    start's time went, whether the compile cache hit, and the KV cache vLLM sized."""
    starts = h.starts()[:20]
    if not starts:
        return ""
    longest = max(max(float(s.get("total_s") or 0) for s in starts), 1.0)
    rows = []
    for s in starts:
        x, rects = 0.0, []
        for name, seconds in s["phases"].items():
            if not isinstance(seconds, (int, float)) or seconds <= 0:
                continue
            w = BAR_W * float(seconds) / longest
            colour = PHASE_COLOURS.get(name, "#dadce0")
            rects.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="14" fill="{colour}">'
                f"<title>{escape(name)} {float(seconds):.1f} s</title></rect>"
            )
            x += w
        bar = f'<svg class="start-bar" width="{BAR_W}" height="14">{"".join(rects)}</svg>'
        kv = f"{int(s['kv_tokens']):,} tokens" if isinstance(s.get("kv_tokens"), int) else "-"
        clock = f" ({escape(str(s['clock']))})" if s.get("clock") else ""
        rows.append(
            f"<tr><td>{_when(s['at'])}</td><td>{escape(str(s.get('release_id') or '-'))}</td>"
            f"<td>{float(s.get('total_s') or 0):.1f} s{clock}</td><td>{bar}</td>"
            f"<td>{escape(str(s.get('compile', '-')))}</td><td>{kv}</td></tr>"
        )
    legend = "".join(
        f'<span><span class="swatch" style="background:{c}"></span>{escape(n)}</span>' for n, c in PHASE_COLOURS.items()
    )
    head = "<tr><th>finished</th><th>release</th><th>launch to /health</th><th>phases</th><th>compile</th><th>KV cache</th></tr>"
    return f'<h3>Server starts</h3><p class="legend">{legend}</p><table class="starts">{head}{"".join(rows)}</table>'


def _runs(h: HostHistory) -> str:
    rows = []
    for run in h.runs[:50]:
        host = run["host"]
        gates = []
        for name, gate in host["gates"].items():
            seconds = (gate.get("data") or {}).get("seconds") if isinstance(gate, dict) else None
            mark = "ok" if gate.get("ok") else "fail"
            took = f" {seconds:.1f} s" if isinstance(seconds, (int, float)) else ""
            gates.append(f'<span class="{mark}">{escape(name)}{took}</span>')
        failed = next((g for g in host["gates"].values() if not g.get("ok")), None)
        detail = failed["detail"] if failed else ""
        by = run.get("by")
        who = f"{by.get('user')}@{by.get('host')} pid {by.get('pid')}" if isinstance(by, dict) else "-"
        rows.append(
            f"<tr><td>{_when(run['started'])}</td><td>{escape(run['kind'])}</td><td>{escape(who)}</td>"
            f"<td>{escape(host.get('release_id') or '-')}</td>"
            f'<td class="{"ok" if host["ready"] else "fail"}">{"ready" if host["ready"] else "not ready"}</td>'
            f"<td>{host['duration_s']:.1f} s</td><td>{' '.join(gates)}</td>"
            f'<td class="detail">{escape(str(detail)[:400])}</td></tr>'
        )
    head = "<tr><th>started</th><th>run</th><th>by</th><th>release</th><th>result</th><th>took</th><th>gates</th><th></th></tr>"
    more = f"<p>{len(h.runs) - 50} older runs not shown.</p>" if len(h.runs) > 50 else ""
    return f'<h3>Runs</h3><table class="runs">{head}{"".join(rows)}</table>{more}'


# --- the chart ----------------------------------------------------------------------------------

W, H = 880, 240
LEFT, RIGHT, TOP, BOTTOM = 48, 16, 12, 36


def chart(h: HostHistory, now: float) -> str:
    """tau over time: one point per measurement (coloured by what measured it), joined by a line;
    the watched states' periods shaded behind."""
    periods = [p for p in h.periods(now) if p.state in SHADED]
    times: list[float] = [float(s["at"]) for s in h.samples] + [t for p in periods for t in (p.start, p.end)]
    times += [float(r["finished"]) for r in h.runs]
    if not times:
        return '<svg class="tau-chart" width="0" height="0"></svg>'
    t0, t1 = min(times), max(times)
    if t1 - t0 < 60:
        t0, t1 = t0 - 30, t1 + 30
    top = max([8.0, *(float(s["mean_acceptance_length"]) for s in h.samples)])
    y_max = math.ceil(top * 1.1)

    def x(t: float) -> float:
        return LEFT + (t - t0) / (t1 - t0) * (W - LEFT - RIGHT)

    def y(v: float) -> float:
        return TOP + (1 - v / y_max) * (H - TOP - BOTTOM)

    out = [
        f'<svg class="tau-chart" data-host="{escape(h.name, quote=True)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="tau over time for {escape(h.name)}">'
    ]
    for p in periods:
        out.append(
            f'<rect class="period period-{p.state.lower()}" x="{x(p.start):.1f}" y="{TOP}" '
            f'width="{max(1.0, x(p.end) - x(p.start)):.1f}" height="{H - TOP - BOTTOM}" fill="{SHADED[p.state]}">'
            f"<title>{p.state} {_when(p.start)} to {_when(p.end)}</title></rect>"
        )
    for i in range(5):  # horizontal grid with tau ticks
        v = y_max * i / 4
        out.append(
            f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e8eaed"/>'
            f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end" fill="#5f6368">{v:g}</text>'
        )
    span = t1 - t0
    fmt = "%H:%M:%S" if span < 600 else "%H:%M" if span < 86400 else "%m-%d %H:%M"
    for i in range(4):  # time ticks (UTC)
        t = t0 + span * i / 3
        anchor = ("start", "middle", "middle", "end")[i]
        out.append(
            f'<text x="{x(t):.1f}" y="{H - BOTTOM + 16}" font-size="11" text-anchor="{anchor}" '
            f'fill="#5f6368">{time.strftime(fmt, time.gmtime(t))}</text>'
        )
    out.append(
        f'<text x="12" y="{TOP + (H - TOP - BOTTOM) / 2:.0f}" font-size="11" fill="#5f6368" '
        f'transform="rotate(-90 12 {TOP + (H - TOP - BOTTOM) / 2:.0f})" text-anchor="middle">tau</text>'
    )
    if h.samples:
        points = " ".join(f"{x(s['at']):.1f},{y(s['mean_acceptance_length']):.1f}" for s in h.samples)
        out.append(f'<polyline class="tau" points="{points}" fill="none" stroke="#80868b" stroke-width="1.2"/>')
        for s in h.samples:
            colour = SOURCE_COLOURS.get(s["source"], "#202124")
            out.append(
                f'<circle class="sample" data-source="{escape(s["source"], quote=True)}" cx="{x(s["at"]):.1f}" '
                f'cy="{y(s["mean_acceptance_length"]):.1f}" r="3.5" fill="{colour}">'
                f"<title>{_when(s['at'])} {escape(s['source'])}: tau {s['mean_acceptance_length']:.2f}, "
                f"rate {s['acceptance_rate']:.1%}, {s['drafts']} drafts</title></circle>"
            )
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" fill="none" '
        'stroke="#bdc1c6"/></svg>'
    )
    return "".join(out)
