"""Deciding, with no I/O: what a run asks of a host, and what the answers mean as gates.

Every function here is pure: the answers come in typed (``protocol``), the gates go out into a
``HostReport`` (``results``). So the meaning of every answer is tested without any host.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.playbook import DRAFTER_DIR, Playbook
from orchestrator.results import (
    GATE_ENGINE,
    GATE_LOADER,
    Gate,
    HostReport,
)
from orchestrator.rules import dflash, serving
from orchestrator.rules.gates import models
from orchestrator.rules.gates.build import read_build
from orchestrator.rules.gates.engine import read_engine
from orchestrator.rules.gates.files import paths, read_verified
from orchestrator.rules.gates.health import read_serving_status, read_standby
from orchestrator.rules.gates.loader import read_loader
from orchestrator.rules.gates.models import ModelChecks, Pins, manifests, names


def new_release_id(now: float | None = None) -> str:
    """A new release's id: UTC time to the second, then 6 random hex digits (sortable, and unique
    across controllers)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{os.urandom(3).hex()}"


class Checks:
    """The loader and build checks, run by the serving environment's own Python. ``release``: an
    id, None for ``current``, or the batch's ``release_apply`` (the release it settled on).
    ``findings`` (verify): both in this batch, their failures not stopping it (verify reads every
    gate at once). Else (deploy) the build in this batch (its metadata, no import: the speed-up
    gate's key needs it) and the loader check started in the background, with vLLM's verdict on
    ``command`` (the engine gate) in the same process where it is given (``checks_start``): the
    batch does not wait for either import."""

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        release: str | protocol.Op[protocol.Applied] | None,
        findings: bool = False,
        command: protocol.ServerCommand | None = None,
        expect: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        python, drafter = playbook.serving.python, playbook.drafter
        assert python is not None and drafter is not None
        fields = [f for f in dflash.LOADER_FIELDS if f in drafter.values]
        # The server's environment (``serving.environment``, the command's): the checks import what
        # it will, and deploy and verify key the loader cache alike.
        env = dict(command.env) if command is not None else dict(env or {})
        self.build = protocol.vllm_build(python, env)
        self.loader: protocol.Op[protocol.LoaderView] | None = None
        self.start: protocol.Op[protocol.ChecksStarted] | None = None
        if findings:
            self.loader = protocol.loader_view(root, release, python, fields, DRAFTER_DIR, env=env).finding()
            self.build = self.build.finding()
            self.ops: list[protocol.Op[Any]] = [self.loader, self.build]
        else:
            self.start = protocol.checks_start(
                root,
                release,
                python,
                fields,
                serving.SERVER,
                command,
                expect,
                DRAFTER_DIR,
                env=env,
                keep_if_running=True,
            )
            self.ops = [self.build, self.start]

    @staticmethod
    def wanted(playbook: Playbook) -> bool:
        """Whether a playbook has them: a serving Python to ask, and a drafter config to ask about."""
        return playbook.serving.python is not None and playbook.drafter is not None

    def read(self, playbook: Playbook, answers: protocol.Answers, report: HostReport) -> protocol.ChecksStarted | None:
        """Their gates, from the batch's answers (a check whose op failed is its gate's failure,
        ``read_failures``): the one place deploy and verify read them, so a check added here is
        run and judged by both. Returns what was started in the background (None: nothing)."""
        started = answers.get(self.start) if self.start is not None else None
        view = answers.get(self.loader) if self.loader is not None else (started.loader if started else None)
        read_checks(playbook, view, answers.get(self.build), report)
        if started is not None and started.engine is not None:
            read_engine(started.engine, report)
        return started if started is not None and started.token is not None else None


def read_checks_done(playbook: Playbook, done: protocol.ChecksDone, report: HostReport) -> None:
    """The loader and engine gates from what the background checks found."""
    if done.loader_error is not None:
        report.gates[GATE_LOADER] = Gate(False, done.loader_error)
    elif done.loader is not None:
        read_checks(playbook, done.loader, None, report)
    if done.engine_refused is not None:
        refused = done.engine_refused
        report.gates[GATE_ENGINE] = Gate(False, refused.message, reason=refused.code)
    elif done.engine is not None:
        read_engine(done.engine, report)


class Stage:
    """The first batch of a deploy: take the lock, read the model directories, stage the release
    (the drafter's overlay included), then the checks on it (the build's answer, the loader and
    engine checks started: ``Checks``).

    With no checks, no models and no server to launch, nothing needs to run between staging and
    the switch, so the release is switched in the same exec (one round trip per host). ``reuse``:
    keep ``current`` when it already holds these files (else always stage ``release_id``).
    """

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        release_id: str,
        owner: str,
        lock_timeout: float,
        reuse: bool = True,
        rehash: bool = False,
        pins: Pins | None = None,
        command: protocol.ServerCommand | None = None,
        expect: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        pins = pins if pins is not None else manifests(playbook)
        self.models = ModelChecks(playbook, root, record=True, rehash=rehash, pins=pins)
        drafter = playbook.models.drafter
        overlays = [protocol.Overlay(DRAFTER_DIR, drafter.path, names(pins, drafter))] if drafter is not None else []
        wanted = Checks.wanted(playbook)
        switch_now = not wanted and playbook.serving.target is None and not self.models.ops
        files = playbook.release_files
        self.lock = protocol.lock(root, owner, lock_timeout)
        # The release records the model files this batch read (by reference to their answers).
        self.apply = protocol.release_apply(
            root, release_id, files, playbook.keep_releases, switch_now, reuse, overlays, self.models.ops, rehash
        )
        # The checks read the release that release_apply settled on (a new one, or current).
        # ``command``: vLLM's verdict on it (the engine gate) in the same background process.
        self.checks = Checks(playbook, root, self.apply, command=command, expect=expect, env=env) if wanted else None
        # Whether the server runs this very command from the release settled on: else the launch
        # restarts it, and a gateway must drain it first (a changed flag, not only changed files).
        self.runs = protocol.serving_runs(root, serving.SERVER, command, self.apply) if command is not None else None
        self.ops: list[protocol.Op[Any]] = [
            self.lock,
            *self.models.ops,
            self.apply,
            *([self.runs] if self.runs is not None else []),
            *(self.checks.ops if self.checks else []),
        ]


def read_checks(
    playbook: Playbook, view: protocol.LoaderView | None, build: protocol.Build | None, report: HostReport
) -> None:
    """The loader and build gates (the build's multi-node limits included, for a group's nodes),
    each from its answer where there is one."""
    if playbook.drafter is None or (view is not None and view.missing is not None):
        return  # nothing deployed there: the files gate says so, and there is nothing to ask about
    if view is not None:
        read_loader(playbook, view, report)
    if build is not None:
        read_build(playbook, build, report)


def common_release(
    listings: dict[str, protocol.Releases], to_release: str | None, alone: bool
) -> tuple[str | None, dict[str, str]]:
    """The release every node goes back to (the previous one, or ``to_release``), or None and
    why not, per node. ``alone``: a single host (then there is simply no previous release)."""
    wanted = {name: to_release or listing.previous for name, listing in listings.items()}
    problems = {
        name: f"release {release} does not exist here"
        for name, release in wanted.items()
        if release is not None and release not in listings[name].releases
    }
    if alone and None in wanted.values():
        problems = {name: "there is no previous release to go back to" for name in wanted}
    elif None in wanted.values() or len(set(wanted.values())) > 1:
        held = ", ".join(f"{name}: {release or 'none'}" for name, release in wanted.items())
        problems = {name: f"the nodes have no common previous release ({held}): name one with --to" for name in wanted}
    return (None if problems else next(iter(wanted.values()))), problems


def rollout_batches(names: list[str], canary: int, batch_size: int | None) -> list[list[str]]:
    """Canary hosts first (one batch), then the rest in batches (all at once when unset)."""
    batches: list[list[str]] = []
    rest = list(names)
    if canary:
        batches.append(rest[:canary])
        rest = rest[canary:]
    size = batch_size or len(rest) or 1
    batches.extend(rest[i : i + size] for i in range(0, len(rest), size))
    return [b for b in batches if b]


def read_failures(answers: protocol.Answers, report: HostReport, besides: Sequence[protocol.Op[Any]] = ()) -> None:
    """Every finding that failed (but those ``besides``, which the caller judges), as a failed
    gate: the gate its op's contract names (unless a reader already failed that gate with more to
    say, as the gpus gate does of its preflight)."""
    judged = {id(f) for op in besides if (f := answers.failure(op)) is not None}
    for failure in answers.failures:
        if id(failure) in judged:
            continue
        gate = report.gates.get(failure.gate)
        if gate is None or gate.ok:
            report.gates[failure.gate] = Gate(False, failure.describe())


class ServedChecks:
    """What verify and watch both check on a node, in one batch: the files the server reads
    (through ``current``) and its overlay's links, the target's model files by the host's digest
    cache, and the process we started (alive, and on the head healthy) with its READY record.

    ``release_verify`` stops the batch when it fails (nothing else means anything without it); the
    rest are findings, each failure reported under its op's gate. The drafter's files are checked
    through the overlay's links. ``tokens``: name the mask token too (not every watch round)."""

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        process: str,
        head: bool,
        rehash: bool = False,
        tokens: bool = True,
        host: str = protocol.LOOPBACK,
    ) -> None:
        self.playbook, self.root = playbook, root
        self.served = protocol.release_verify(root, paths(playbook), rehash)
        self.models = ModelChecks(
            playbook, root, record=False, rehash=rehash, drafter=False, tokens=tokens, findings=True
        )
        self.status: protocol.Op[protocol.Status] | None = None
        self.standby: protocol.Op[protocol.Status] | None = None
        if playbook.serving.target is not None:
            port = playbook.serving.port if head else None
            self.status = protocol.serving_status(root, process, port, host=host).finding()
            if playbook.serving.standby is not None and head:
                self.standby = protocol.serving_status(root, serving.STANDBY, port, host=host).finding()
        status = [op for op in (self.status, self.standby) if op is not None]
        self.ops: list[protocol.Op[Any]] = [self.served, *self.models.ops, *status]

    def read(self, answers: protocol.Answers, report: HostReport, role: str | None) -> None:
        """The files, models, health and ready gates (``role``: a rank that serves no HTTP)."""
        found = answers[self.served]
        read_verified(self.playbook, found, report, self.root)
        target = self.models.target
        if target is None or target in answers:  # else its failure is the models gate
            models.read_models(self.playbook, answers.get(target), None, report, found.links, found.manifest)
        if self.status is not None and self.status in answers and report.release_id is not None:
            read_serving_status(answers[self.status], report, role)
            if self.standby is not None and self.standby in answers:
                read_standby(answers[self.standby], report)
