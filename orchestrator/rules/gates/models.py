"""The models gate proves the model files are the pinned ones, and the target's config where the server
reads it fits the drafter.

Digests on the host (cached by stat), against a manifest, the pushed files or the release's record;
see Models.

What a host's model directories mean, pure: the ``models`` and ``weights`` gates.

A model file is pinned by the playbook's ``manifest:`` when it has one, else by the digests the
current release was proven with (the first deploy records them): a weight file that changed on
the host since is drift, named by path, and the host is not READY on it. The drafter is served
through the release's overlay (its own config.json, links to every other file), so each link
must still point where the release recorded and read as pinned. The target's config.json is read
where the server reads it, and the drafter linted against that one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.modelfiles import local_files
from orchestrator.config.playbook import DRAFTER_CONFIG, Model, Playbook
from orchestrator.results import (
    GATE_FILES,
    GATE_MODELS,
    GATE_WEIGHTS,
    Gate,
    HostReport,
    Problem,
)
from orchestrator.rules import dflash
from orchestrator.rules.gates import weights

# The config fields a target's dimensions come from (top level, or under text_config).
_TARGET_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "architectures", "model_type")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"


def _drift(model: Model, found: protocol.ModelFiles, pinned: dict[str, str] | None) -> tuple[list[str], bool, str]:
    """(what differs from the pin, whether the files changed since the current release, what pins
    them). ``pinned``: the playbook's manifest or the pushed files, else the host's record pins."""
    digests = {f.path: f.sha256 for f in found.files}
    drift = [f"{name} is missing" for name in found.missing]
    pins = found.pins or {}
    changed = found.pins is not None and pins != digests
    if pinned is not None:
        what = "the manifest" if model.manifest is not None else "the pushed file"
        for name, want in sorted(pinned.items()):
            if name in digests and digests[name] != want:
                drift.append(f"{name} has sha256 {digests[name]}, {what} pins {want}")
        # The directory holds what its pin says, and nothing else: vLLM loads by globs and indexes.
        pin = "the manifest" if model.manifest is not None else "what was pushed"
        drift += [f"{name} is there, but not in {pin}" for name in found.extra]
        by = "the playbook's manifest" if model.manifest is not None else f"the files pushed from {model.push}"
        return drift, changed, by
    if found.pins is None:
        return drift, False, "nothing yet: recorded now"
    for name in sorted(set(pins) | set(digests)):
        if name not in digests:
            drift.append(f"{name} is gone since release {found.release_id}")
        elif name not in pins:
            drift.append(f"{name} is new since release {found.release_id}")
        elif pins[name] != digests[name]:
            drift.append(f"{name} has sha256 {digests[name]}, release {found.release_id} pinned {pins[name]}")
    return drift, changed, f"release {found.release_id}"


def directory_digest(files: Iterable[tuple[str, str | None]]) -> str:
    """A model directory as one digest: its files' ``sha256sum`` lines, sorted by path."""
    return hashlib.sha256("".join(f"{sha}  {path}\n" for path, sha in sorted(files)).encode()).hexdigest()


def _summary(model: Model, found: protocol.ModelFiles, drift: list[str], changed: bool) -> dict[str, Any]:
    return {
        "name": model.role,
        "path": model.path,
        "files": len(found.files),
        "bytes": sum(f.size for f in found.files),
        "changed": changed,
        "verified": "hashed" if any(f.verified == "hashed" for f in found.files) else "cached",
        "drift": drift,
        # the directory as one digest: the acceptance history follows it
        "sha256": directory_digest((f.path, f.sha256) for f in found.files),
    }


def _linked_summary(model: Model, links: tuple[protocol.ServedFile, ...]) -> dict[str, Any]:
    """The drafter as verify finds it through the release's links: the same directory digest as
    ``_summary`` gives deploy for the same files (each link's path, relative to the overlay)."""
    return {
        "name": model.role,
        "path": model.path,
        "files": len(links),
        "verified": "release",
        "sha256": directory_digest((link.path.split("/", 1)[-1], link.sha256) for link in links),
    }


def host_target_config(
    playbook: Playbook, found: protocol.ModelFiles | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The target's config.json as the host holds it, and what is wrong with it for this drafter."""
    if found is None or playbook.models.target is None:
        return None, []
    where = f"{playbook.models.target.path}/config.json"
    if found.config is None:
        return None, [f"the target has no config.json on this host ({where})"]
    try:
        config = json.loads(found.config)
    except ValueError as exc:
        return None, [f"the target's {where} on this host is not JSON: {exc}"]
    if not isinstance(config, dict):
        return None, [f"the target's {where} on this host is not a JSON object"]
    problems = []
    local = playbook.drafter.target if playbook.drafter is not None else None
    if local is not None:
        differ = _differing(local, config)
        if differ:
            problems.append(
                f"the target's {where} on this host differs from drafter.target_config in " + ", ".join(differ)
            )
    if playbook.drafter is not None:
        found_problems = dflash.lint(
            playbook.drafter.values,
            config,
            playbook.drafter.reference,
            num_speculative_tokens=playbook.serving.num_speculative_tokens,
        )
        problems += [
            f"against the target's config on this host: {p.field}: {p.message}"
            for p in found_problems
            if p.severity == "error"
        ]
    return config, problems


def _differing(local: dict[str, Any], host: dict[str, Any]) -> list[str]:
    out = []
    for scope in (None, "text_config"):
        a = local.get(scope, {}) if scope else local
        b = host.get(scope, {}) if scope else host
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        for name in _TARGET_FIELDS:
            if a.get(name) != b.get(name):
                key = f"{scope}.{name}" if scope else name
                out.append(f"{key} ({a.get(name)!r} here, {b.get(name)!r} on the host)")
    return out


def read_models(
    playbook: Playbook,
    target: protocol.ModelFiles | None,
    drafter: protocol.ModelFiles | None,
    report: HostReport,
    links: tuple[protocol.ServedFile, ...] = (),
    manifest: dict[str, str] | None = None,
    pins: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any] | None:
    """The models gate (deploy and verify), and the target's config as the host holds it.

    ``links`` and ``manifest`` (verify): the overlay's links as they are now, and the digests the
    current release recorded for them: each must still point where it did and read the same.
    """
    models = playbook.models
    if not models.all:
        return None
    problems: list[str] = []
    parts = []
    report.models = []
    for model, found in ((models.target, target), (models.drafter, drafter)):
        if model is None or found is None:
            continue
        pinned = (pins or {}).get(model.role, model.manifest)
        drift, changed, pinned_by = _drift(model, found, pinned)
        report.models.append(_summary(model, found, drift, changed))
        problems += [f"{model.role} {model.path}: {d}" for d in drift]
        if drift and found.pins is not None and pinned is None:
            # Drift from what the current release was proven with: say how to mean a new model.
            problems.append(
                f"{model.role} {model.path}: if the new files are meant, pin them with models.{model.role}.manifest"
                " (a sha256sum file of the directory), which is then checked in place of the release's record"
            )
        size = _size(sum(f.size for f in found.files))
        parts.append(f"{model.role} {model.path}: {len(found.files)} files, {size}, pinned by {pinned_by}")
    if models.drafter is not None and drafter is None and links:
        # verify reads the drafter through the overlay's links, not as a directory: its digest
        # from them, as deploy's from the directory (the acceptance history follows it)
        report.models.append(_linked_summary(models.drafter, links))
    for link in links:
        want = (models.drafter.manifest or {}).get(link.path.split("/", 1)[-1]) if models.drafter else None
        want = want or (manifest or {}).get(link.path)
        if link.link != link.remote_path:
            problems.append(f"{link.path} points at {link.link}, the release made it point at {link.remote_path}")
        elif link.sha256 != want:
            problems.append(f"{link.remote_path} (served as {link.path}) has sha256 {link.sha256}, pinned {want}")
    config, target_problems = host_target_config(playbook, target)
    problems += target_problems
    notes = mask_token_notes(playbook, target)
    warnings = [f"{n.field}: {n.message}" for n in notes if n.severity == "warning"]
    said = [
        f"{n.field} {n.actual} {n.message}" if n.message.startswith("is ") else f"{n.field} {n.actual}: {n.message}"
        for n in notes
    ]
    if problems:
        report.gates[GATE_MODELS] = Gate(False, "; ".join(problems + said))
    else:
        detail = "; ".join(parts) + (f"; {len(links)} links in sync" if links else "")
        report.gates[GATE_MODELS] = Gate(True, "; ".join([detail, *said]), {"warnings": warnings} if warnings else {})
    return config


def read_model_changes(
    playbook: Playbook,
    target: protocol.ModelFiles | None,
    drafter: protocol.ModelFiles | None,
    report: HostReport,
    failed: dict[str, str] | None = None,
) -> None:
    """Dry run: what a deploy would do to the model directories, as the host holds them (None:
    not readable there yet, or ``failed[role]`` says why it could not be read): files a push
    would send, and models whose files differ from what the current release was proven with
    (either makes a new release). Added to the files gate's words; the report then says it would
    change."""

    said = []
    for model, found in ((playbook.models.target, target), (playbook.models.drafter, drafter)):
        if model is None:
            continue
        on_host = {f.path: f.sha256 for f in found.files} if found is not None else {}
        if model.push is not None:
            local = [f for f in local_files(model.push) if on_host.get(f.rel) != f.sha256]
            if local:
                said.append(f"would push {len(local)} files ({_size(sum(f.size for f in local))}) to {model.path}")
            wanted = {f.rel: f.sha256 for f in local_files(model.push)}
        else:
            wanted = model.manifest or on_host
        if found is None and (failed or {}).get(model.role):
            said.append(f"{model.role} {model.path}: {(failed or {})[model.role]}")
        elif found is None:
            said.append(f"{model.role} {model.path} cannot be read on the host yet")
        elif found.pins is None:
            said.append(f"{model.role} {model.path} is not what the current release serves: a new release pins it")
        elif found.pins != wanted:
            said.append(f"{model.role} {model.path} differs from what release {found.release_id} was proven with")
    gate = report.gates.get(GATE_FILES)
    if not said or gate is None or not gate.ok:  # files that could not be read are the news
        return
    files = [] if gate.detail == "dry run: no change" else [gate.detail.removeprefix("dry run: ")]
    report.changed = True
    report.gates[GATE_FILES] = Gate(True, "dry run: " + "; ".join(files + said))


def mask_token_notes(playbook: Playbook, target: protocol.ModelFiles | None) -> list[Problem]:
    """The drafter's mask token as the target's tokenizer on the host names it (nothing when the
    target has no tokenizer files there, or was not read)."""
    if target is None or not target.tokens or playbook.drafter is None:
        return []
    mask = dflash.mask_token_id(playbook.drafter.values)
    token = target.tokens.get(mask) if mask is not None else None
    if mask is None or token is None:
        return []
    return [dflash.mask_token_note(mask, dflash.normalise(playbook.drafter.values).mask_field, token)]


def read_weights(
    playbook: Playbook, drafter: protocol.ModelFiles | None, target_config: dict[str, Any] | None, report: HostReport
) -> None:
    """The weights gate: the drafter config against its safetensors headers on the host."""
    if drafter is None or playbook.drafter is None:
        return
    target = dflash.Target.from_config(target_config) if target_config is not None else None
    found = weights.check(playbook.drafter.values, drafter.headers, target)
    if found:
        report.gates[GATE_WEIGHTS] = Gate(False, "; ".join(f"{p.field}: {p.message}" for p in found))
        return
    count = len(weights.tensors(drafter.headers))
    report.gates[GATE_WEIGHTS] = Gate(
        True, f"{count} tensors in {len(drafter.headers)} safetensors files agree with the drafter config"
    )


class ModelChecks:
    """The model directories of a playbook, read on a host: every file's digest (cached on the
    host), the target's config.json where the server reads it, the drafter's safetensors headers."""

    def __init__(
        self,
        playbook: Playbook,
        root: str,
        record: bool,
        rehash: bool = False,
        drafter: bool = True,
        pins: Pins | None = None,
        tokens: bool = True,
        findings: bool = False,
    ) -> None:
        """``tokens``: name the drafter's mask token in the target's tokenizer (not every watch
        round: the tokenizer's files are megabytes). ``findings``: a model directory that cannot
        be read does not stop the batch (verify, watch)."""
        models, pins = playbook.models, pins if pins is not None else manifests(playbook)
        self.target = self.drafter = None
        if models.target is not None:
            m = models.target
            mask = dflash.mask_token_id(playbook.drafter.values) if playbook.drafter is not None else None
            self.target = protocol.model_files(
                root,
                m.role,
                m.path,
                names(pins, m),
                config=True,
                rehash=rehash,
                record=record,
                tokens=[mask] if mask is not None and tokens else (),
            )
        if models.drafter is not None and drafter:
            m = models.drafter
            self.drafter = protocol.model_files(
                root, m.role, m.path, names(pins, m), headers=True, rehash=rehash, record=record, skip=[DRAFTER_CONFIG]
            )
        if findings:
            self.target = self.target.finding() if self.target is not None else None
            self.drafter = self.drafter.finding() if self.drafter is not None else None
        self.ops: list[protocol.Op[Any]] = [op for op in (self.target, self.drafter) if op is not None]


# Per model (by role): the files it must hold and their digests, when something pins them (the
# playbook's manifest, or the directory pushed from the controller); else the host's record is.
Pins = dict[str, dict[str, str]]


def manifests(playbook: Playbook) -> Pins:
    """The digests each model's ``manifest:`` pins, by role."""
    return {m.role: m.manifest for m in playbook.models.all if m.manifest is not None}


def pins(playbook: Playbook, pushed: Pins) -> Pins:
    """A model's manifest pins it; else what was pushed to it (the drafter's config.json aside:
    the release serves its own)."""
    out = manifests(playbook)
    for role, digests in pushed.items():
        out.setdefault(role, {p: d for p, d in digests.items() if (role, p) != ("drafter", DRAFTER_CONFIG)})
    return out


def names(pins: Pins, model: Model) -> tuple[str, ...] | None:
    return tuple(sorted(pins[model.role])) if model.role in pins else None
