"""``orchestrate``: a thin shell over the library. Parse, call, render; progress on stderr.

Exit codes: 0 all hosts ready / in sync, 1 some host is not (or a run failed), 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# The `orchestrate` process is ours alone: paramiko imports invoke (installed beside Fabric) only
# to run ssh_config `Match exec` lines, which we never read, and that import (asyncio,
# unittest.mock) costs ~25 ms of every start. A None entry makes paramiko skip it. Code that
# imports orchestrator as a library is not affected.
# For the same reason the cyclic garbage collector is paused while the modules load (~10 ms of
# passes over objects that all live to the end) and what they made is then frozen out of later
# passes: see entry().
if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "orchestrate":
    sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]
    gc.disable()

from orchestrator import dflash, runs
from orchestrator.configs import read_json, read_mapping
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_NOT_READY, EXIT_OK, InputError, OrchestratorError, SandboxError
from orchestrator.inventory import Inventory, Target, inventory_view, load_inventory, show_one
from orchestrator.playbook import Playbook, load_playbook
from orchestrator.report import ProgressPrinter, plain, render_json, render_table
from orchestrator.results import RunReport
from orchestrator.runner import RunOptions
from orchestrator.sandbox import DEFAULT_DIR as DEFAULT_SANDBOX_DIR
from orchestrator.state import StateDB

if TYPE_CHECKING:
    from orchestrator import watch
    from orchestrator.sandbox.lxdhosts import LxdSandbox
    from orchestrator.sandbox.sshhosts import SshSandbox

DEFAULT_INVENTORY = "inventory/inventory.yaml"
RELEASE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


# With --json, everything on stderr is a JSON line (progress events, and these messages).
_json_stderr = False


def _say(message: str) -> None:
    if _json_stderr:
        message = json.dumps({"at": time.time(), "message": message})
    sys.stderr.write(plain(message) + "\n")  # what hosts said, without terminal control codes
    sys.stderr.flush()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _gpu_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1,2,3, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("GPU indices are >= 0")
    return values


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def _interval(text: str) -> float:
    value = _seconds(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def _release_id(text: str) -> str:
    """A release's name: a directory under releases/ on every host, so refused here, not there."""
    if not RELEASE_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a release id is 1 to 128 of letters, digits, '.', '_' and '-', not starting with '.'"
        )
    return text


def _inventory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-i",
        "--inventory",
        type=Path,
        default=Path(os.environ.get("ORCHESTRATE_INVENTORY", DEFAULT_INVENTORY)),
        help=f"inventory YAML (default: $ORCHESTRATE_INVENTORY or {DEFAULT_INVENTORY})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrate",
        description="Deploy vLLM DFlash speculative decoding to LXC containers, and prove each host READY.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def run_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("playbook", type=Path, help="playbook YAML")
        _inventory_option(p)
        p.add_argument(
            "-l",
            "--limit",
            action="append",
            default=[],
            metavar="TARGET",
            help="only these containers, groups or GPU hosts (repeatable; within the playbook's targets)",
        )
        p.add_argument("-f", "--forks", type=_positive_int, default=16, help="hosts worked on at once (default 16)")
        p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        p.add_argument(
            "--accept-new-host-keys",
            action="store_true",
            help="trust and record host keys not yet in known_hosts (changed keys are always refused)",
        )
        p.add_argument(
            "--lock-timeout",
            type=_seconds,
            default=60.0,
            help="seconds to wait for another run's lock on a deploy root (default 60)",
        )
        p.add_argument("--state-dir", type=Path, default=None, help="state database directory")
        p.add_argument(
            "--skip-containers", action="store_true", help="do not check or change LXD containers (the containers gate)"
        )
        return p

    d = run_parser("deploy", "push the playbook's release to every target and gate it")
    d.add_argument("--dry-run", action="store_true", help="show what would change, with diffs; write nothing")
    d.add_argument(
        "--release-id", type=_release_id, default=None, help="name of the new release (default: UTC time + random)"
    )
    v = run_parser("verify", "re-read what every target serves and report drift; never writes")
    v.add_argument("--probe", action="store_true", help="also re-run the acceptance probe on live traffic")
    v.add_argument(
        "--rehash",
        action="store_true",
        help="hash every model file again instead of trusting the host's digest cache (reads all of each model)",
    )
    run_parser("stop", "end the vLLM server the playbook runs on every target")
    r = run_parser(
        "rollback",
        "switch every target back to its previous release (or --to RELEASE); with a server in the"
        " playbook, start it on that release and prove it (health, acceptance) like a deploy",
    )
    r.add_argument(
        "--to", dest="to_release", type=_release_id, default=None, metavar="RELEASE", help="release id to switch to"
    )

    w = run_parser(
        "watch",
        "keep proving every target: files, server, READY record and live acceptance from production"
        " traffic, round after round; print each state change (READY, DEGRADED, DRIFT, DOWN)",
    )
    w.add_argument("--interval", type=_interval, default=30.0, help="seconds from one round to the next (default 30)")
    w.add_argument("--once", action="store_true", help="one round, then exit 0 if every host is READY, else 1")
    w.add_argument(
        "--metrics-port", type=_port, default=None, metavar="PORT", help="serve Prometheus metrics on this port"
    )
    w.add_argument(
        "--metrics-address", default="127.0.0.1", metavar="ADDR", help="address to serve them on (default 127.0.0.1)"
    )
    w.add_argument(
        "--on-change",
        default=None,
        metavar="CMD",
        help="run CMD (with /bin/sh -c) for each state change, the change as JSON on its stdin",
    )
    lint = sub.add_parser("lint", help="check a DFlash drafter config against its target, a reference and a vLLM build")
    lint.add_argument("drafter", type=Path, help="the drafter's config.json")
    lint.add_argument("--target", type=Path, required=True, help="the target model's config.json")
    lint.add_argument("--reference", type=Path, default=None, help="pinned known-good drafter values (JSON or YAML)")
    lint.add_argument("--vllm-version", default=None, help="check the known-bug table for this vLLM version")
    lint.add_argument("--num-speculative-tokens", type=_positive_int, default=None, metavar="K")
    lint.add_argument("--json", action="store_true")

    inv = sub.add_parser("inventory", help="list, show, validate and edit the inventory (comments are kept)")
    isub = inv.add_subparsers(dest="inventory_command", required=True, metavar="ACTION")
    inv_parsers = []

    def inv_parser(name: str, help_text: str, edits: bool = False) -> argparse.ArgumentParser:
        p = isub.add_parser(name, help=help_text, description=help_text)
        inv_parsers.append(p)
        if edits:
            p.add_argument("--dry-run", action="store_true", help="print the unified diff; write nothing")
        return p

    inv_parser("list", "hosts and containers, one line each").add_argument("--json", action="store_true")
    show = inv_parser("show", "one container or GPU host (or everything) with resolved settings and vars")
    show.add_argument("name", nargs="?")
    show.add_argument("--json", action="store_true")
    inv_parser("validate", "the same typed checks as deploy").add_argument("--json", action="store_true")
    ah = inv_parser("add-host", "add a GPU host", edits=True)
    ah.add_argument("name")
    ah.add_argument("--address", required=True)
    ah.add_argument("--port", type=_positive_int)
    ah.add_argument("--user")
    ah.add_argument("--key")
    ah.add_argument("--lxd-endpoint", help="'local' or https://HOST:8443 (then add the certificates with set)")
    inv_parser("remove-host", "remove a GPU host and its containers", edits=True).add_argument("name")
    ac = inv_parser("add-container", "add a container to a GPU host", edits=True)
    ac.add_argument("host")
    ac.add_argument("name")
    ac.add_argument("--address")
    ac.add_argument("--gpus", type=_gpu_list, help="comma-separated GPU indices, e.g. 0,1,2,3")
    ac.add_argument("--group", action="append", default=[], help="repeatable")
    rc = inv_parser("remove-container", "remove a container", edits=True)
    rc.add_argument("host")
    rc.add_argument("name")
    st_ = inv_parser("set", "set any field: KEY.PATH VALUE (a YAML scalar or flow collection)", edits=True)
    st_.add_argument("key")
    st_.add_argument("value")
    inv_parser("unset", "remove any field: KEY.PATH", edits=True).add_argument("key")
    for p in inv_parsers:
        _inventory_option(p)

    rep = sub.add_parser(
        "report", help="per host: releases, runs with their gates and times, tau over time (an HTML page with --html)"
    )
    rep.add_argument("--html", type=Path, default=None, metavar="FILE", help="write a self-contained HTML page")
    rep.add_argument("--host", default=None, help="only this host")
    rep.add_argument("--json", action="store_true")
    rep.add_argument("--state-dir", type=Path, default=None)
    h = sub.add_parser("history", help="past runs from the state database")
    h.add_argument("--limit", type=_positive_int, default=20)
    h.add_argument("--host", default=None, help="only runs that touched this host")
    h.add_argument("--json", action="store_true")
    h.add_argument("--state-dir", type=Path, default=None)

    s = sub.add_parser("sandbox", help="local test hosts on this machine (needs root)")
    ssub = s.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    up = ssub.add_parser("up", help="create (or complete) the sandbox; idempotent")
    up.add_argument("--kind", choices=["lxd", "ssh"], default=None, help="lxd containers (default) or plain ssh hosts")
    up.add_argument("--hosts", type=_positive_int, default=2)
    up.add_argument("--prefix", default=None, help="prefix of its names (default dfo)")
    up.add_argument("--subnet", default=None, help="ssh kind: first two octets of its /16 (default 10.77)")
    up.add_argument(
        "--jump-port", type=_positive_int, default=None, help="lxd kind: port of the GPU host's sshd (2222)"
    )
    st = ssub.add_parser("status", help="what is up, and the files written for it")
    st.add_argument("--json", action="store_true")
    down = ssub.add_parser("down", help="end the sandbox's processes and remove everything it made")
    down.add_argument(
        "--purge", action="store_true", help="lxd kind: also remove LXD's network, pool, profile and image"
    )
    for p in (up, st, down):
        p.add_argument(
            "--dir",
            type=Path,
            default=None,
            help=f"sandbox directory (default $ORCHESTRATE_SANDBOX_DIR or {DEFAULT_SANDBOX_DIR})",
        )
    return parser


def _targets(args: argparse.Namespace, playbook: Playbook, inventory: Inventory) -> list[Target]:
    multi = playbook.serving.multi_node
    try:
        chosen = inventory.resolve(playbook.targets)
    except InputError as exc:
        if multi is None or playbook.targets != multi.nodes:
            raise
        raise multi.error(f"{exc.message} (nodes and targets name containers or groups of the inventory)") from None
    if args.limit:
        limited = {t.name for t in inventory.resolve(args.limit)}
        chosen = [t for t in chosen if t.name in limited]
    if not chosen:
        raise InputError("no targets: the playbook's targets and --limit select no container")
    return chosen


def _cmd_run(args: argparse.Namespace) -> int:
    playbook = load_playbook(args.playbook)
    inventory = load_inventory(args.inventory)
    targets = _targets(args, playbook, inventory)
    kind = "dry-run" if getattr(args, "dry_run", False) else args.command
    progress = ProgressPrinter(kind, len(targets), mode="json" if args.json else "auto")
    options = RunOptions(
        forks=args.forks,
        skip_containers=args.skip_containers,
        accept_new_host_keys=args.accept_new_host_keys,
        lock_timeout=args.lock_timeout,
        release_id=getattr(args, "release_id", None),
        steps=progress.step,
    )
    _say(f"{kind} {playbook.name}: {len(targets)} hosts, forks {args.forks}")
    try:
        with _first_interrupt_finishes(options.interrupt):
            run = _run(kind, args, playbook, inventory, targets, options, progress)
    finally:
        progress.close()
    run.interrupted = options.interrupt.is_set()
    for key in run.accepted_host_keys:
        _say(f"accepted new host key: {key}")
    db = StateDB(args.state_dir)
    try:
        db.record(run)
    finally:
        db.close()
    if args.json:
        render_json(run.to_json())
    else:
        render_table(run)
    if run.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if run.ok else EXIT_NOT_READY


@contextlib.contextmanager
def _first_interrupt_finishes(interrupt: threading.Event) -> Iterator[None]:
    """The first Ctrl-C starts nothing new and lets the hosts in flight finish (their own deadlines
    bound them), then the table and the record of what happened; a second one aborts."""

    def handle(signum: int, frame: object) -> None:
        if interrupt.is_set():
            raise KeyboardInterrupt
        interrupt.set()
        _say("interrupted: starting no new host; the hosts in flight finish (Ctrl-C again to abort)")

    if threading.current_thread() is not threading.main_thread():
        yield  # a library caller's thread: signals are not ours to take
        return
    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run(
    kind: str,
    args: argparse.Namespace,
    playbook: Playbook,
    inventory: Inventory,
    targets: list[Target],
    options: RunOptions,
    progress: ProgressPrinter,
) -> RunReport:
    if kind == "dry-run":
        return runs.dry_run(playbook, inventory, targets, options, progress)
    if kind == "deploy":
        return runs.deploy(playbook, inventory, targets, options, progress, _say)
    if kind == "stop":
        return runs.stop(playbook, inventory, targets, options, progress, _say)
    if kind == "verify":
        return runs.verify(playbook, inventory, targets, options, progress, args.probe, _say, args.rehash)
    return runs.rollback(playbook, inventory, targets, options, progress, args.to_release, _say)


def _cmd_watch(args: argparse.Namespace) -> int:
    from orchestrator import watcher
    from orchestrator.report import render_transition, render_watch_table
    from orchestrator.watch import READY

    playbook = load_playbook(args.playbook)
    inventory = load_inventory(args.inventory)
    targets = _targets(args, playbook, inventory)
    options = RunOptions(
        forks=args.forks, skip_containers=args.skip_containers, accept_new_host_keys=args.accept_new_host_keys
    )
    db = StateDB(args.state_dir)
    stop = threading.Event()
    interrupted = threading.Event()
    collector = server = None
    if args.metrics_port is not None:
        from orchestrator import metrics

        collector = metrics.WatchCollector()
        try:
            server = metrics.serve(collector, args.metrics_port, args.metrics_address)
        except OSError as exc:
            raise InputError(
                f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_address}: {exc.strerror or exc}"
            ) from None
        _say(f"metrics on http://{args.metrics_address}:{args.metrics_port}/metrics")
    on_change = watcher.OnChange(args.on_change, _say) if args.on_change else None
    what = "one round" if args.once else f"every {args.interval:g} s"
    _say(f"watch {playbook.name}: {len(targets)} hosts, {what}")

    def on_round(number: int, rounds: list[watch.Round], transitions: list[watch.Transition]) -> None:
        db.record_watch(transitions, rounds)
        if collector is not None:
            collector.update(rounds)
        counts: dict[str, int] = {}
        for r in rounds:
            counts[r.state] = counts.get(r.state, 0) + 1
        _say(f"round {number}: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
        if args.json and not args.once:
            data = {
                "round": number,
                "hosts": [r.to_json() for r in rounds],
                "transitions": [t.to_json() for t in transitions],
            }
            sys.stdout.write(json.dumps(data) + "\n")
            sys.stdout.flush()
        elif not args.once:
            for t in transitions:
                render_transition(t)
            sys.stdout.flush()
        for t in transitions:
            # A watch that starts does not page for hosts that are fine.
            if on_change is not None and (t.before is not None or t.after != READY):
                on_change(t)

    def handle(signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            if interrupted.is_set():
                raise KeyboardInterrupt
            interrupted.set()
            _say("interrupted: ending after this round (Ctrl-C again to abort)")
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    w = watcher.Watcher(playbook, inventory, targets, options)
    aborted = False
    try:
        last = watcher.run_rounds(w, args.interval, args.once, on_round, stop)
    except KeyboardInterrupt:
        aborted = True  # a second Ctrl-C: not waiting for the hosts in flight
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        w.close(wait=not aborted)
        db.close()
        if server is not None:
            server.shutdown()
    if args.once:
        if args.json:
            render_json({"hosts": [r.to_json() for r in last]})
        else:
            render_watch_table(last)
    if interrupted.is_set():
        return EXIT_INTERRUPTED
    return EXIT_OK if all(r.state == READY for r in last) else EXIT_NOT_READY


def _cmd_report(args: argparse.Namespace) -> int:
    from orchestrator import fleetreport

    db = StateDB(args.state_dir)
    try:
        hosts = fleetreport.collect(
            db.history(limit=1_000_000, host=args.host), db.samples(args.host), db.transitions(args.host)
        )
    finally:
        db.close()
    if args.host:
        hosts = [h for h in hosts if h.name == args.host]
    now = time.time()
    if args.html is not None:
        page = fleetreport.render_html(hosts, now).encode("utf-8")
        tmp = args.html.with_name(f".{args.html.name}.tmp-{os.getpid()}")
        try:
            tmp.write_bytes(page)
            os.replace(tmp, args.html)  # a reader never sees half a page
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise InputError(f"--html {args.html}: {exc.strerror or exc}") from None
        _say(f"report: {len(hosts)} hosts in {args.html}")
    if args.json:
        render_json(fleetreport.to_json(hosts, now))
    elif args.html is None:
        for h in hosts:
            last = h.samples[-1] if h.samples else None
            tau = f"tau {last['mean_acceptance_length']:.2f} ({last['source']})" if last else "no tau yet"
            run = h.runs[0] if h.runs else None
            said = f"last run {run['kind']} {'ready' if run['host']['ready'] else 'not ready'}" if run else "no run"
            print(f"{h.name:<20} {h.state or '-':<9} {tau:<24} {len(h.releases())} releases, {said}")
    return EXIT_OK


# What vLLM does with the drafter, as lint predicts it (the same words as real vLLM's recorded
# verdicts): a drafter that "serves" can still accept nothing, which the errors above say.
_START_WORDS = {
    dflash.STARTS: "would start and serve",
    dflash.REFUSES_TO_START: "would refuse to start",
    dflash.FIRST_REQUEST: "would start healthy, then fail at the first request",
}


def _cmd_lint(args: argparse.Namespace) -> int:
    problems = dflash.lint(
        read_json(args.drafter),
        read_json(args.target),
        read_mapping(args.reference) if args.reference else None,
        args.vllm_version,
        args.num_speculative_tokens,
    )
    ok = not any(p.severity == "error" for p in problems)
    vllm = dflash.predicted_start(problems)
    if args.json:
        render_json({"ok": ok, "vllm": vllm, "problems": [p.to_json() for p in problems]})
    else:
        for p in problems:
            print(p.line())
        errors = sum(p.severity == "error" for p in problems)
        print(f"lint {args.drafter}: {errors} errors, {len(problems) - errors} warnings; vLLM {_START_WORDS[vllm]}")
    return EXIT_OK if ok else EXIT_NOT_READY


def _cmd_inventory(args: argparse.Namespace) -> int:
    action = args.inventory_command
    if action in ("list", "show", "validate"):
        inventory = load_inventory(args.inventory)
        if action == "validate":
            if args.json:
                render_json({"ok": True, "file": str(args.inventory)})
            else:
                print(
                    f"{args.inventory}: valid ({len(inventory.hosts)} GPU hosts, {len(inventory.containers)} containers)"
                )
            return EXIT_OK
        view = inventory_view(inventory)
        if action == "show" and args.name:
            view = show_one(view, args.name)
        if getattr(args, "json", False):
            render_json(view)
            return EXIT_OK
        if action == "show":
            render_json(view)  # YAML-like nesting reads fine as indented JSON
            return EXIT_OK
        for host in view["hosts"]:
            print(f"{host['name']:<16} {host['address'] or '-':<16} lxd {host['lxd'] or '-'}")
            for c in host["containers"]:
                gpus = ",".join(map(str, c["gpus"])) or "-"
                print(
                    f"  {c['name']:<14} {c['address'] or '(via lxd)':<16} gpus {gpus:<16} groups {','.join(c['groups']) or '-'}"
                )
        return EXIT_OK
    from orchestrator import inventory_edit  # ruamel.yaml only for edits

    edit = {
        "add-host": lambda: inventory_edit.add_host(
            args.name, args.address, args.port, args.user, args.key, args.lxd_endpoint
        ),
        "remove-host": lambda: inventory_edit.remove_host(args.name),
        "add-container": lambda: inventory_edit.add_container(
            args.host, args.name, args.address, args.gpus, args.group
        ),
        "remove-container": lambda: inventory_edit.remove_container(args.host, args.name),
        "set": lambda: inventory_edit.set_key(args.key, inventory_edit.parse_value(args.value)),
        "unset": lambda: inventory_edit.unset_key(args.key),
    }[action]()
    try:
        result = inventory_edit.edit_inventory(args.inventory, edit, dry_run=args.dry_run)
    except InputError as exc:
        if exc.file is None:
            exc = InputError(exc.message, file=str(args.inventory), key=exc.key)
        raise InputError(f"refused, {args.inventory} is unchanged: {exc.render()}") from exc
    if args.dry_run:
        sys.stdout.write(result.diff or "no change\n")
    else:
        _say(f"{result.summary} in {result.path}" if result.written else "no change")
    return EXIT_OK


def _cmd_history(args: argparse.Namespace) -> int:
    db = StateDB(args.state_dir)
    try:
        runs = db.history(args.limit, args.host)
    finally:
        db.close()
    if args.json:
        render_json({"runs": runs})
        return EXIT_OK
    for run in runs:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["started"]))
        status = "ok" if run["ok"] else "NOT OK"
        print(
            f"#{run['id']:<5} {when}  {run['kind']:<8} {status:<6} {run['hosts_ready']}/{run['hosts_total']} hosts  "
            f"release {run['release_id'] or '-'}  {run['playbook']}  ({run['finished'] - run['started']:.2f} s)"
        )
    if not runs:
        print("no runs recorded yet")
    return EXIT_OK


def _open_sandbox(args: argparse.Namespace) -> SshSandbox | LxdSandbox:
    from orchestrator.sandbox.lxdhosts import LxdSandbox
    from orchestrator.sandbox.sshhosts import SshSandbox

    directory = args.dir or DEFAULT_SANDBOX_DIR
    kind = getattr(args, "kind", None)
    try:
        existing = json.loads((directory / "sandbox.json").read_text()).get("kind")
    except (OSError, ValueError):
        existing = None
    if kind and existing and kind != existing:
        raise SandboxError(f"{directory} holds a {existing} sandbox: run 'orchestrate sandbox down' first")
    if (kind or existing or "lxd") == "lxd":
        return LxdSandbox(directory, getattr(args, "prefix", None), getattr(args, "jump_port", None))
    return SshSandbox(directory, getattr(args, "prefix", None), getattr(args, "subnet", None))


def _cmd_sandbox(args: argparse.Namespace) -> int:
    box = _open_sandbox(args)
    if args.sandbox_command == "up":
        _say(f"sandbox: bringing up {args.hosts} {box.kind} hosts in {box.dir}")
        status = box.up(args.hosts, _say)
        print(f"inventory:   {status['inventory']}")
        print(f"ssh_config:  {status['ssh_config']}")
        print(f"known_hosts: {status['known_hosts']}")
        return EXIT_OK
    if args.sandbox_command == "status":
        status = box.status()
        if args.json:
            render_json(status)
        else:
            hosts = status["hosts"]
            assert isinstance(hosts, list)
            print(f"kind {status['kind']}: {len(hosts)} hosts, {'up' if status['up'] else 'not up'}")
            for h in hosts:
                print(f"  {h['name']:<14} {h['address']:<15} {'running' if h['running'] else 'STOPPED'}")
        return EXIT_OK if status["up"] else EXIT_NOT_READY
    from orchestrator.sandbox.lxdhosts import LxdSandbox

    if isinstance(box, LxdSandbox):
        box.down(_say, purge=args.purge)
    else:
        box.down(_say)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    global _json_stderr
    parser = build_parser()
    args = parser.parse_args(argv)
    _json_stderr = bool(getattr(args, "json", False)) and args.command in (
        "deploy",
        "verify",
        "rollback",
        "stop",
        "watch",
    )
    try:
        if args.command in ("deploy", "verify", "rollback", "stop"):
            return _cmd_run(args)
        if args.command == "watch":
            return _cmd_watch(args)
        if args.command == "history":
            return _cmd_history(args)
        if args.command == "report":
            return _cmd_report(args)
        if args.command == "lint":
            return _cmd_lint(args)
        if args.command == "inventory":
            return _cmd_inventory(args)
        return _cmd_sandbox(args)
    except OrchestratorError as exc:
        if args.verbose:
            raise
        _say(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        global _aborted
        _aborted = True
        _say("aborted: not waiting for the hosts in flight (each stops at its own deadline, and its steps are atomic)")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_NOT_READY


# Set when a Ctrl-C aborted the run: the process then ends without joining the threads still
# waiting on hosts (an interpreter exit would wait for each of them).
_aborted = False


def entry() -> None:
    if not gc.isenabled():  # paused above, in our own process only
        gc.freeze()
        gc.enable()
    code = main()
    if _aborted:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
