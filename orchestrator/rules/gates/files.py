"""The files gate proves the bytes meant are the bytes on disk where the server reads.

Atomic writes into a staged release, read back; `current` switched only after the gates below pass.
"""

from __future__ import annotations

from orchestrator.agent import protocol
from orchestrator.config.playbook import FileSpec, Playbook
from orchestrator.results import (
    GATE_FILES,
    FileState,
    Gate,
    HostReport,
)


def paths(playbook: Playbook) -> list[str]:
    """The release's files, as the playbook names them (relative to the release)."""
    return [f.dest for f in playbook.release_files]


def expected_digests(playbook: Playbook) -> dict[str, str]:
    return {f.dest: f.sha256 for f in playbook.release_files}


def read_applied(playbook: Playbook, applied: protocol.Applied, report: HostReport) -> None:
    """Fill a deploy report from ``release_apply``'s answer, checking digests against our own copy."""
    expected = expected_digests(playbook)
    report.release_id = applied.release_id
    report.previous = applied.previous
    report.changed = applied.changed
    # The overlay's links are the models gate's to judge (their digests against the pins).
    states = file_states(tuple(f for f in applied.files if f.link is None), expected, report)
    if states is None:
        return
    report.files = states
    drifted = [f for f in report.files if f.drift]
    if drifted:
        report.gates[GATE_FILES] = Gate(False, "read-back differs: " + "; ".join(drift_text(f) for f in drifted))
        return
    changed = sum(f.changed for f in report.files)
    if applied.retried:
        detail = (
            f"release {report.release_id} is current, made by this run: a retry found it in place "
            f"(the connection was cut after it was written), all {len(report.files)} files verified by read-back"
        )
    elif report.changed and not applied.switched:
        detail = (
            f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} staged"
        )
    elif report.changed:
        detail = f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} is current"
    else:
        detail = f"no change: release {report.release_id} already holds all {len(report.files)} files"
    report.gates[GATE_FILES] = Gate(True, detail + foreign_note(applied.foreign))


def foreign_note(foreign: tuple[str, ...]) -> str:
    if not foreign:
        return ""
    return f" (releases/ also holds {', '.join(foreign)}: not made by this tool, left alone)"


def file_states(
    files: tuple[protocol.ServedFile, ...], expected: dict[str, str], report: HostReport
) -> list[FileState] | None:
    """The host's files against the playbook's: one each, none missing, none extra (else the
    files gate fails and None)."""
    got = [f.path for f in files]
    if sorted(got) != sorted(expected):
        report.gates[GATE_FILES] = Gate(
            False, f"the host answered for files {sorted(got)}, the release holds {sorted(expected)}"
        )
        return None
    return [FileState(f.path, f.remote_path, f.sha256, expected[f.path], f.changed) for f in files]


def read_verified(playbook: Playbook, served: protocol.Served, report: HostReport, root: str) -> None:
    """Fill a verify report: every file the server reads must hold the playbook's digest. ``root``:
    the node's deploy root (the inventory's own for the container, else the playbook's)."""
    report.release_id = served.current
    report.previous = served.previous
    states = file_states(served.files, expected_digests(playbook), report)
    if states is None:
        return
    report.files = states
    if report.release_id is None:
        report.gates[GATE_FILES] = Gate(False, f"nothing deployed: {root}/current does not exist")
        return
    # The release is exactly its files with their modes: nothing else served beside them.
    problems = [drift_text(f) for f in report.files if f.drift]
    modes = {spec.dest: spec.mode for spec in playbook.release_files}
    problems += [
        f"{f.remote_path} has mode {f.mode}, the playbook says {modes[f.path]}"
        for f in served.files
        if f.sha256 is not None and f.mode is not None and f.mode != modes[f.path]
    ]
    linked = {link.path for link in served.links}
    left = sorted(set(served.manifest or {}) - set(modes) - linked)
    problems += [f"{path} is served but no longer in the playbook" for path in left]
    if served.manifest is None:  # every file would look planted: say what is really wrong
        problems.append(f"release {served.current} has no readable manifest (.manifest.sha256)")
    else:
        problems += [f"{path} is served but not part of release {served.current}" for path in served.extra]
    if problems:
        report.gates[GATE_FILES] = Gate(False, "drift: " + "; ".join(problems))
    else:
        report.gates[GATE_FILES] = Gate(True, f"in sync: {len(report.files)} files of release {report.release_id}")


def drift_text(f: FileState) -> str:
    found = f.sha256 if f.sha256 is not None else "missing"
    return f"{f.remote_path} has sha256 {found}, expected {f.expected}"


def read_inspected(playbook: Playbook, served: protocol.Served, report: HostReport) -> None:
    """Dry run: what a deploy would change, with unified diffs for text files."""
    by_dest = {f.dest: f for f in playbook.release_files}
    report.release_id = served.current
    report.files = []
    for f in served.files:
        spec = by_dest.get(f.path)
        if spec is None:
            report.gates[GATE_FILES] = Gate(False, f"the host answered for {f.path}, which the release does not hold")
            return
        state = FileState(f.path, f.remote_path, f.sha256, spec.sha256, changed=f.sha256 != spec.sha256)
        report.files.append(state)
        if state.changed:
            report.diffs.append(file_diff(spec, f.remote_path, f.content, f.sha256, f.private))
    report.changed = any(f.changed for f in report.files)
    n = sum(f.changed for f in report.files)
    report.gates[GATE_FILES] = Gate(
        True, f"dry run: {n} of {len(report.files)} files would change" if n else "dry run: no change"
    )


def file_diff(
    spec: FileSpec, remote_path: str, old: bytes | None, old_sha: str | None, old_private: bool = False
) -> str:
    """A unified diff of a text file; only digests (and the new size) for a binary, large or
    private file: a token rotated in a 0600 file never reaches the terminal, old or new."""
    header = f"--- {remote_path}\n+++ {spec.src}\n"
    if spec.private or old_private:
        return f"{header}not shown (secret or not world-readable): sha256 {old_sha or 'missing'} -> {spec.sha256}, {len(spec.content)} bytes\n"
    new_text = text_of(spec.content)
    old_text = text_of(old) if old is not None else ("" if old_sha is None else None)
    if new_text is None or old_text is None:
        return f"{header}binary or large file: sha256 {old_sha or 'missing'} -> {spec.sha256}\n"
    import difflib  # only for --diff

    return "".join(
        difflib.unified_diff(
            old_text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=remote_path if old_sha is not None else "/dev/null",
            tofile=str(spec.src),
        )
    )


def text_of(data: bytes) -> str | None:
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_made_current(playbook: Playbook, switched: protocol.Switched, report: HostReport) -> None:
    """After the gates passed and ``current`` was switched: every served file must read as intended."""
    expected = expected_digests(playbook)
    served = {f.path: f.sha256 for f in switched.files}
    wrong = [p for p, digest in expected.items() if served.get(p) != digest]
    report.previous = switched.previous
    if wrong:
        report.gates[GATE_FILES] = Gate(False, f"after the switch, {', '.join(wrong)} do not read as intended")
        return
    changed = sum(f.changed for f in report.files)
    report.gates[GATE_FILES] = Gate(
        True,
        f"{changed} of {len(report.files)} files changed, verified by read-back; release {report.release_id} is current"
        + foreign_note(switched.foreign),
    )


def read_switched(switched: protocol.Switched, report: HostReport) -> None:
    """A release made current again (rollback): its own files, as its manifest holds them."""
    report.release_id = switched.release_id
    report.previous = switched.previous
    report.changed = switched.release_id != switched.previous
    report.files = [
        FileState(f.path, f.remote_path, f.sha256, f.sha256 or "") for f in switched.files if f.link is None
    ]
    report.gates[GATE_FILES] = Gate(
        True, f"release {report.release_id} is current, {len(report.files)} files verified by read-back"
    )


def read_started(playbook: Playbook, switched: protocol.Switched | None, report: HostReport) -> None:
    """The switch made just before a launch: the new release's files, or (going back) the earlier
    release's own."""
    if switched is None:
        return
    if report.files:
        read_made_current(playbook, switched, report)
    else:
        read_switched(switched, report)
