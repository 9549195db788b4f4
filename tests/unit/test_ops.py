"""What ships for running watch as a team's service: the Prometheus rules (promtool's own checks
and rule tests), the systemd unit (systemd's own verifier, and its command line read by our
parser), the container recipe's command line, and the Grafana dashboard's queries (only series
watch serves). The live rules are held to a real Prometheus in test_alerts.py."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from orchestrator.cli import main as cli
from orchestrator.rules.watch import STATES
from orchestrator.store import metrics

OPS = Path(__file__).resolve().parents[2] / "ops"


@pytest.mark.usefixtures("programs")
def test_the_rules_pass_promtools_checks_and_their_own_tests() -> None:
    rules = OPS / "prometheus" / "dflash-orchestrator-rules.yml"
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS: 7 rules found" in checked.stdout, checked.stderr
    tested = subprocess.run(
        ["promtool", "test", "rules", "dflash-orchestrator-rules.test.yml"],
        capture_output=True, text=True, timeout=60, cwd=rules.parent,
    )  # fmt: skip
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def watch_argv(words: list[str], instance: str = "qwen3-8b-dflash") -> object:
    """Our own parser on a shipped command line (the program name dropped)."""
    assert Path(words[0]).name == "orchestrate", words
    return cli.build_parser().parse_args([w.replace("%i", instance) for w in words[1:]])


@pytest.mark.usefixtures("programs")
def test_the_watch_unit_is_valid_for_systemd_and_runs_our_watch(tmp_path: Path) -> None:
    unit = (OPS / "systemd" / "orchestrate-watch@.service").read_text()
    parsed = configparser.ConfigParser(strict=False, interpolation=None)
    parsed.read_string(unit)
    args = watch_argv(shlex.split(parsed["Service"]["ExecStart"]))
    assert args.func is cli._cmd_watch and args.watch_group == "qwen3-8b-dflash"  # type: ignore[attr-defined]
    assert (args.metrics_port, args.interval) == (9400, 30.0)  # type: ignore[attr-defined]
    assert parsed["Service"]["KillSignal"] == "SIGTERM" and parsed["Service"]["Restart"] == "always"
    # systemd's own verifier, on the unit as shipped but for the program's path and the
    # environment file (an operator's, absent here)
    here = unit.replace("/opt/dflash-orchestrator/bin/orchestrate", "/bin/true")
    here = here.replace("EnvironmentFile=/", "EnvironmentFile=-/")
    (tmp_path / "orchestrate-watch@.service").write_text(here)
    verified = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "./orchestrate-watch@qwen3-8b-dflash.service"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, ""), verified


def test_the_container_recipe_runs_our_watch() -> None:
    """The image is not built here (no container daemon or image registry on these machines): its
    entry point and default command are read by our own parser."""
    recipe = (OPS / "container" / "Containerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", recipe, re.M).group(1))  # type: ignore[union-attr]
    command = json.loads(re.search(r"^CMD (\[.*\])$", recipe, re.M).group(1))  # type: ignore[union-attr]
    args = watch_argv(entry + command)
    assert args.func is cli._cmd_watch and args.metrics_address == "0.0.0.0"  # type: ignore[attr-defined]
    assert '"/src[postgres]"' in recipe  # a team's watchers share PostgreSQL


def test_the_dashboard_reads_only_series_watch_serves() -> None:
    dashboard = json.loads((OPS / "grafana" / "dflash-orchestrator-watch.json").read_text())
    served = {f"{metrics.PREFIX}{name}" for name in (
        "host_state", "mean_acceptance_length_tokens", "acceptance_rate_ratio", "window_drafts", "open_window_drafts",
        "files_in_drift", "last_good_round_age_seconds", "last_round_timestamp_seconds", "release_info",
        "in_rotation", "state_rounds", "live_min_mean_acceptance_length_tokens", "watch_leader",
    )}  # fmt: skip
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bdflash_orchestrator_[a-z_]+", e)}
    assert used and used <= served, used - served
    assert {p["id"] for p in dashboard["panels"]} == set(range(1, len(dashboard["panels"]) + 1))
    state_values = set(re.findall(r'dflash_orchestrator_host_state="([A-Z_]+)"', json.dumps(dashboard)))
    assert state_values <= set(STATES)
