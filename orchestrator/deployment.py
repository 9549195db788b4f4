"""The library's entry point: a playbook over an inventory, and the runs a user asks of it.

    from orchestrator import Deployment, load_inventory, load_playbook

    deployment = Deployment(load_playbook("playbooks/sandbox.yaml"), load_inventory("inventory/x.yaml"))
    report = deployment.deploy()          # a RunReport: every host's gates, READY or why not
    assert report.ok, [h.failed_gate for h in report.hosts]
    deployment.verify(probe=True)

The CLI is a thin shell over this class; anything it does, a program can do the same way. Progress
goes to an ``Observer`` (none by default: a library run is quiet), and the hosts are reached
through the inventory's connections (SSH, or ``connection: local``) unless a ``connector`` is
given: a test's ``fake.FakeConnector``, say, which answers the agent's ops in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.config.inventory import LOCAL, Inventory, Target
from orchestrator.config.playbook import Playbook
from orchestrator.connectors.base import Connector
from orchestrator.engine import runs
from orchestrator.engine.runner import Observer, RunOptions, Scope
from orchestrator.errors import InputError
from orchestrator.results import RunReport

if TYPE_CHECKING:
    from orchestrator.engine.watcher import Watcher


def select_targets(playbook: Playbook, inventory: Inventory, limit: Sequence[str] = ()) -> list[Target]:
    """The containers a run works on: the playbook's targets, within ``limit`` (container, group or
    GPU host names, or ``all``) when given. None selected is bad input, never a run of nothing."""
    multi = playbook.serving.multi_node
    try:
        chosen = inventory.resolve(playbook.targets)
    except InputError as exc:
        if multi is None or playbook.targets != multi.nodes:
            raise
        raise multi.error(f"{exc.message} (nodes and targets name containers or groups of the inventory)") from None
    if limit:
        limited = {t.name for t in inventory.resolve(list(limit))}
        chosen = [t for t in chosen if t.name in limited]
    if not chosen:
        raise InputError("no targets: the playbook's targets and --limit select no container")
    local: dict[str, str] = {}
    for target in chosen:
        _check_root(playbook, inventory, target)
        if target.container.connection == LOCAL:
            # Two local containers on one deploy root would be one server, READY twice.
            root = target.container.deploy_root or playbook.deploy_root
            other = local.setdefault(root, target.name)
            if other != target.name:
                raise InputError(
                    f"containers {other} and {target.name} are both this machine with deploy root {root}: "
                    "one place cannot be two containers",
                    file=str(inventory.file),
                    key=f"hosts.{target.container.host}.containers.{target.name}.deploy_root",
                )
    return chosen


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _check_root(playbook: Playbook, inventory: Inventory, target: Target) -> None:
    """A deploy root apart from the model directories: inside one, each release would be a file of
    the model (hashed, and nested in the next release's overlay); around one, pruning releases
    would walk the weights."""
    container = target.container
    root = container.deploy_root or playbook.deploy_root
    for model in playbook.models.all:
        if _within(root, model.path) or _within(model.path, root):
            message = f"{root} overlaps models.{model.role}.path {model.path} (a deploy root is a directory of its own)"
            if container.deploy_root:
                key = f"hosts.{container.host}.containers.{container.name}.deploy_root"
                raise InputError(message, file=str(inventory.file), key=key)
            raise InputError(message, file=str(playbook.file), key="deploy_root")


@dataclass
class Deployment:
    """A playbook deployed to its targets in an inventory: ``deploy``, ``verify``, ``rollback``,
    ``stop`` and ``dry_run``, each returning the run's report (they raise only for bad input: a
    host that fails is a failed gate in the report, never an exception)."""

    playbook: Playbook
    inventory: Inventory
    options: RunOptions = field(default_factory=RunOptions)
    observer: Observer = field(default_factory=Observer)
    connector: Connector | None = None
    limit: Sequence[str] = ()
    targets: tuple[Target, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.targets = tuple(select_targets(self.playbook, self.inventory, self.limit))
        if self.playbook.gateway is not None:
            from orchestrator.gateways.client import gateway_target

            gateway_target(self.playbook, self.inventory)  # a gateway the inventory cannot reach is bad input

    @property
    def scope(self) -> Scope:
        """What every run of this deployment works with."""
        return Scope(self.playbook, self.inventory, self.targets, self.options, self.observer, self.connector)

    def deploy(self) -> RunReport:
        """Lint, push and check the release on every target, start the server and prove it (health,
        acceptance on live traffic): READY, or the previous release back where it was."""
        return runs.deploy(self.scope)

    def verify(self, *, probe: bool = False, rehash: bool = False, engine: bool = False) -> RunReport:
        """Read what every target serves and check it (never writes). ``probe``: prove acceptance
        again on live traffic; ``rehash``: hash every model file instead of trusting the cache;
        ``engine``: the installed vLLM's verdict on the served command (the engine gate)."""
        return runs.verify(self.scope, probe_acceptance=probe, rehash=rehash, engine=engine)

    def rollback(self, *, to: str | None = None) -> RunReport:
        """Make the previous release (or ``to``) current again, started and proven like a deploy."""
        return runs.rollback(self.scope, to_release=to)

    def stop(self) -> RunReport:
        """End the servers (vLLM, and Ray) this playbook runs, checking nothing of them is left."""
        return runs.stop(self.scope)

    def dry_run(self) -> RunReport:
        """What a deploy would change on every target, with diffs of text files; writes nothing."""
        return runs.dry_run(self.scope)

    def watcher(self) -> Watcher:
        """Rounds that keep proving every target (``Watcher.round``); close it when done."""
        from orchestrator.engine.watcher import Watcher

        return Watcher(self.scope)
