"""``serving.compile_cache: share``: the first host of a key to be READY gives its vLLM compile cache
to the hosts of that key after it, through the controller.

- *taken*, once a host is READY and the controller keeps no copy under its key
  (``rules.compile_cache.share_key``): the hash directories its start's ledger names are listed
  on it with their digests, read into the controller's state directory (``compile-caches/<key>``),
  each file checked against the listing, and the manifest signed with the controller's digest key;
- *given*, before a host of that key starts a server and lacks those directories: the signed
  manifest is read, the copy hashed against it, and the files pushed as model files are (digests
  checked on the host, resumable) into ``torch_compile_cache/.given``, then each directory moved
  whole where vLLM reads it. Where the host's vLLM has ``VLLM_FORCE_AOT_LOAD`` the start is held
  to the cache (a start-only variable): a miss fails in vLLM's words instead of compiling.

The ``compile_cache`` gate says which, in numbers; it never fails a host that serves (a cache not
taken or not given costs a compile, and says why).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from orchestrator.agent import protocol
from orchestrator.config.modelfiles import LocalFile, sha256_of
from orchestrator.engine import push
from orchestrator.engine.runner import Node, Run
from orchestrator.errors import AgentError, ArtifactError
from orchestrator.results import GATE_COMPILE_CACHE, GATE_HEALTH, Gate
from orchestrator.rules import serving
from orchestrator.rules.gates import compile_cache as rules
from orchestrator.store.state import default_state_dir

STORE = "compile-caches"
MANIFEST = "manifest.json"
# Keys whose caches the controller keeps (each a whole cache: 66.6 MB for the tiny pair on an
# H100): a new drafter config is a new key, so without a bound the state directory only grows.
KEEP_KEYS = 8


def wanted(run: Run) -> bool:
    return run.playbook.serving.compile_cache == "share" and run.playbook.serving.target is not None


def _store(run: Run) -> Path:
    return (run.options.state_dir or default_state_dir()) / STORE


def _command(run: Run, node: Node) -> protocol.ServerCommand:
    return serving.command(run.playbook, node.target.container, node.report.release_id or "")


def _key(run: Run, node: Node, command: protocol.ServerCommand) -> tuple[str, str] | None:
    return rules.share_key(run.playbook, node.target.container, node.report, command.argv, command.env)


def _cache(run: Run, node: Node) -> str:
    return f"{serving.cache_root(run.playbook, node.target.container)}/torch_compile_cache"


def kept(run: Run, key: str) -> tuple[rules.Manifest, list[LocalFile]] | None:
    """The copy kept under ``key``, if this controller signed it and every file still hashes to
    what it signed (once a run: the answer is kept for the run's other hosts). ArtifactError:
    there is one, and it is not as signed."""
    with run.once_lock:
        entry = run.once.get(("compile-cache", key))
    if entry is not None:
        return entry  # type: ignore[no-any-return]
    where = _store(run) / key
    try:
        data = _read_manifest(where / MANIFEST)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArtifactError(f"the kept compile cache {where} cannot be read: {exc.strerror or exc}") from exc
    try:
        manifest = rules.Manifest.read(data, run.options.key())
    except ValueError as exc:
        raise ArtifactError(f"the kept compile cache {where / MANIFEST} is not given: {exc}") from exc
    if manifest.key != key:  # signed by this controller, for another key: moved here, never given
        raise ArtifactError(
            f"the kept compile cache {where / MANIFEST} is signed for another key ({manifest.key[:12]})"
        )
    if (where / "files").is_symlink():
        raise ArtifactError(f"{where / 'files'} is a symbolic link: the kept compile cache is not given")
    files = []
    for rel, (size, digest) in sorted(manifest.files.items()):
        path = where / "files" / rel
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size != size or sha256_of(path) != digest:
                raise ArtifactError(f"{path} is not what the manifest signed: the kept compile cache is not given")
        except OSError as exc:
            raise ArtifactError(f"{path} cannot be read: {exc.strerror or exc}") from exc
        files.append(LocalFile(rel, path, size, digest))
    found = (manifest, files)
    with run.once_lock:
        run.once[("compile-cache", key)] = found
    return found


MANIFEST_MAX = 64 << 20  # a manifest of MAX_FILES paths is about 30 MB


def _read_manifest(path: Path) -> bytes:
    """A kept manifest's bytes, from a regular file only: a link is not followed, a FIFO not waited
    on (it hung the run), a device or a file past any manifest's size not read (a link to
    /dev/zero filled the controller's memory). OSError says which."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "it is a symbolic link, not a manifest the controller wrote") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "its manifest is not a regular file (a FIFO, a device or a directory)")
        if st.st_size > MANIFEST_MAX:
            raise OSError(errno.EFBIG, f"its manifest is {st.st_size} bytes, past any manifest's {MANIFEST_MAX}")
        return f.read(MANIFEST_MAX + 1)


def give(run: Run, node: Node) -> dict[str, str]:
    """Before a server starts on ``node``: the kept cache of its key where it lacks it. Returns the
    start's own variables (the guard, where its vLLM has it and the cache was given)."""
    if not wanted(run):
        return {}
    command = _command(run, node)
    found = _key(run, node, command)
    if found is None:
        return {}
    key, words = found
    try:
        copy = kept(run, key)
    except ArtifactError as exc:
        node.report.gates[GATE_COMPILE_CACHE] = Gate(True, f"not given: {exc}", {"key": key})
        return {}
    if copy is None:
        return {}  # the first host of its key: it compiles, and gives once READY
    manifest, files = copy
    root = node.root
    run.step(node, "giving it the compile cache", f"{len(files)} files from {manifest.host}")
    # Whether it has them is all that is asked: its files are not hashed (a GB cache on each restart).
    ask = protocol.compile_cache_files(root, manifest.dirs, rules.MAX_BYTES, rules.MAX_FILES, digests=False)
    try:
        # an empty hash directory (vLLM made it and ended before it wrote) is no cache of that key
        have = [d for d, listed in run.batch(node, [ask])[ask].items() if listed]
        if have:
            node.report.gates[GATE_COMPILE_CACHE] = Gate(
                True, f"not given: it has its own compile cache of this key ({', '.join(have)})", {"key": key}
            )
            return {}
        given = f"{_cache(run, node)}/{protocol.GIVEN}"  # placed from here whole, once every file is in
        where = push.Destination(node.target, given, f"{node.name}:{given}")
        pushed = push.send(run, where, files, node.name)
        place = protocol.compile_cache_place(root, manifest.dirs)
        placed = run.batch(node, [place])[place]
    except (AgentError, ArtifactError) as exc:
        detail = exc.failure.describe() if isinstance(exc, AgentError) else str(exc)
        node.report.gates[GATE_COMPILE_CACHE] = Gate(True, f"not given: {detail}", {"key": key})
        return {}
    guard = rules.guarded(node.report, command.argv, command.env)
    data = {
        "key": key,
        "given_from": manifest.host,
        "release": manifest.release,
        "dirs": list(placed.placed),
        "files": len(files),
        "bytes": manifest.size,
        "bytes_sent": pushed.sent,
        "seconds": round(pushed.seconds, 2),
        "guard": guard,
    }
    held = "; started with VLLM_FORCE_AOT_LOAD=1 (a miss fails instead of compiling)" if guard else ""
    node.report.gates[GATE_COMPILE_CACHE] = Gate(
        True,
        f"given {manifest.host}'s compile cache ({words}): {len(files)} files, {manifest.size / 1e6:.1f} MB, "
        f"{pushed.sent / 1e6:.1f} MB sent in {pushed.seconds:.1f} s{held}",
        data,
    )
    return dict(rules.GUARD) if guard else {}


def judge(node: Node) -> None:
    """After a given host's proof: did vLLM use what it was given? Said beside the gift."""
    gate = node.report.gates.get(GATE_COMPILE_CACHE)
    health = node.report.gates.get(GATE_HEALTH)
    if gate is not None and health is not None:
        node.report.gates[GATE_COMPILE_CACHE] = rules.read_use(gate, health)


def take(run: Run, node: Node) -> None:
    """Once ``node`` is READY: its compile cache kept by the controller, where none is under its key."""
    if not wanted(run):
        return
    found = _key(run, node, _command(run, node))
    health = node.report.gates.get(GATE_HEALTH)
    ledger = health.data.get("startup") if health is not None else None
    if found is None or not isinstance(ledger, dict):
        return
    key, words = found
    with run.once_lock:
        if run.once.get(("compile-cache-taking", key)):
            return
        run.once[("compile-cache-taking", key)] = True
    try:
        if kept(run, key) is not None:
            return
    except ArtifactError:
        pass  # a copy not as signed is replaced by this host's
    dirs = rules.hash_dirs(ledger.get("cache_dirs") or [], _cache(run, node))
    if not dirs:
        if ledger.get("compile") not in (None, "none"):
            node.report.gates[GATE_COMPILE_CACHE] = Gate(
                True, "not taken: its start's ledger names no compile cache under its deploy root", {"key": key}
            )
        return
    run.step(node, "taking its compile cache", ", ".join(dirs))
    started = time.monotonic()
    try:
        manifest = _take(run, node, key, words, dirs)
    except (AgentError, ArtifactError, OSError) as exc:
        detail = exc.failure.describe() if isinstance(exc, AgentError) else str(exc)
        node.report.gates[GATE_COMPILE_CACHE] = Gate(True, f"not taken: {detail}", {"key": key})
        return
    seconds = time.monotonic() - started
    before = node.report.gates.get(GATE_COMPILE_CACHE)  # a copy not given to it, replaced by its own
    node.report.gates[GATE_COMPILE_CACHE] = Gate(
        True,
        (f"{before.detail}; then " if before is not None else "")
        + f"taken for the hosts of its key ({words}): {len(manifest.files)} files, {manifest.size / 1e6:.1f} MB "
        f"in {seconds:.1f} s, kept by the controller and signed",
        {
            "key": key,
            "taken": True,
            "dirs": dirs,
            "files": len(manifest.files),
            "bytes": manifest.size,
            "seconds": round(seconds, 2),
        },
    )
    run.say(f"{node.name}: its compile cache taken for the hosts of its key ({len(manifest.files)} files)")


def _take(run: Run, node: Node, key: str, words: str, dirs: list[str]) -> rules.Manifest:
    ask = protocol.compile_cache_files(node.root, dirs, rules.MAX_BYTES, rules.MAX_FILES)
    listing = run.batch(node, [ask])[ask]
    missing = [d for d, files in listing.items() if files is None]
    if missing:
        raise ArtifactError(f"{', '.join(missing)} not found in its compile cache (pruned, or never written)")
    dirs = [d for d in dirs if listing.get(d)]  # a directory of no file gives nothing
    if not dirs:
        raise ArtifactError("its compile cache's directories hold no file")
    files = {f.path: f for listed in listing.values() for f in listed or ()}
    past = rules.past_bounds([f.size for f in files.values()])
    if past is not None:
        raise ArtifactError(past)
    for path in files:
        parts = path.split("/")
        if path.startswith("/") or ".." in parts or not any(path.startswith(d + "/") for d in dirs):
            raise ArtifactError(f"its listing names {path!r}, outside the hash directories asked for")
    store = _store(run)
    store.mkdir(parents=True, exist_ok=True, mode=0o700)
    temp = store / f".taking-{key}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        _read_files(run, node, list(files.values()), temp / "files")
        manifest = rules.Manifest(
            key,
            words,
            node.name,
            node.report.release_id or "",
            time.time(),
            tuple(dirs),
            {p: (f.size, f.sha256) for p, f in files.items()},
        )
        (temp / MANIFEST).write_bytes(manifest.signed(run.options.key()))
        final = store / key
        old = store / f".old-{key}-{os.getpid()}"
        if final.exists():
            final.rename(old)
        temp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    prune(store, KEEP_KEYS)
    with run.once_lock:
        run.once.pop(("compile-cache", key), None)
    return manifest


def prune(store: Path, keep: int) -> list[str]:
    """The kept caches beyond the ``keep`` taken last removed (by their manifest's time on disk:
    the controller wrote each), and what a cut take left. Returns the keys removed."""
    kept: list[tuple[float, str]] = []
    for entry in store.iterdir():
        if entry.name.startswith("."):
            if entry.name.startswith((".taking-", ".old-")) and time.time() - entry.stat().st_mtime > 3600:
                shutil.rmtree(entry, ignore_errors=True)  # a take cut an hour ago or more
            continue
        try:
            kept.append(((entry / MANIFEST).stat().st_mtime, entry.name))
        except OSError:
            kept.append((0.0, entry.name))  # no manifest: never given, removed first
    removed = [name for _, name in sorted(kept, reverse=True)[keep:]]
    for name in removed:
        shutil.rmtree(store / name, ignore_errors=True)
    return removed


def _read_files(run: Run, node: Node, files: list[protocol.CacheFile], into: Path) -> None:
    """Every file's bytes, many reads a round trip, each file checked whole against its listing."""
    listed = {f.path: f for f in files}
    opened: dict[str, Any] = {}
    digests: dict[str, Any] = {}
    try:
        for batch in rules.read_batches([(f.path, f.size) for f in files]):
            ops = [protocol.compile_cache_read(node.root, path, off, max(length, 1)) for path, off, length in batch]
            answers = run.batch(node, list(ops))
            for (path, _, length), op in zip(batch, ops, strict=True):
                size, data = answers[op]
                if size != listed[path].size or len(data) != length:
                    raise ArtifactError(f"{path} changed while it was read ({size} bytes, listed {listed[path].size})")
                if path not in opened:
                    target = into / path
                    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    opened[path] = open(target, "wb")  # noqa: SIM115 (closed below, all together)
                    digests[path] = hashlib.sha256()
                opened[path].write(data)
                digests[path].update(data)
    finally:
        for stream in opened.values():
            stream.close()
    for f in files:
        if f.path not in digests or digests[f.path].hexdigest() != f.sha256:
            raise ArtifactError(f"{f.path} does not hash to what the host listed: not taken")
