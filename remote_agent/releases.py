"""Releases: staging, switching, reading back and pruning the release directories of a deploy root.

A release is an immutable directory under ``releases/``: the playbook's files (written with the
atomic protocol, read back), the links of its overlays (a model directory's files beside the
release's own config), and its records (``.manifest.sha256``, ``.links``, ``.models.sha256``).
``current`` is switched by a rename of a temporary link, so the server reads one release or the
other, never half of each.
"""

from remote_agent.core import (
    LINKS,
    MANIFEST,
    MODELS,
    NONE,
    REF,
    SEQUENCE,
    STAGING_PREFIX,
    OpError,
    atomic_write,
    b64,
    decode_content,
    deploy_root,
    digest_cache,
    errno,
    file_mode,
    fsync_dir,
    items,
    model_names,
    model_path,
    op,
    open_file,
    os,
    os_error,
    own_dir,
    own_tree,
    path_inside,
    read_back,
    read_own,
    sha256_hex,
    sha256_or_none,
    stat,
    stat_record,
    unlink_quietly,
)

# --- releases --------------------------------------------------------------------------


def _releases_dir(root_real):
    return own_dir(root_real, "releases")


def link_target(root_real, name, strict=True):
    """Release id a ``current``/``previous`` link points at, or None. A link of that name that
    points anywhere else (absolute, out of releases/) is reported, or with ``strict=False`` taken
    as no release: it is ours by its name, and the next switch replaces it."""
    link = os.path.join(root_real, name)
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise OpError("not_a_link", "%s exists and is not a symlink (not ours: left alone)" % name, link)
        raise os_error("io", exc, link)
    parent, release_id = os.path.split(os.path.normpath(target))
    if parent != "releases" or release_id.startswith(".") or not release_id:
        if not strict:
            return None
        raise OpError("bad_link", "%s points at %s, not at a release under releases/" % (name, target), link)
    return release_id


def _check_release_id(release_id):
    ok = isinstance(release_id, str) and release_id and len(release_id) <= 128
    if not ok or release_id.startswith(".") or "/" in release_id or "\x00" in release_id:
        raise OpError("bad_request", "bad release id %r" % (release_id,), None)


def _manifest_bytes(wanted):
    # The format of sha256sum(1): `cd releases/<id> && sha256sum -c .manifest.sha256` checks a
    # release by hand. Paths never hold a newline or a backslash (refused when staged).
    return "".join("%s  %s\n" % (wanted[p], p) for p in sorted(wanted)).encode("utf-8")


def _read_manifest(release_dir):
    """{path: sha256} of a release, or None when it has no readable, well-formed manifest."""
    try:
        with open_file(os.path.join(release_dir, MANIFEST)) as f:
            lines = f.read().decode("utf-8").split("\n")
    except (OSError, ValueError):
        return None
    if lines[-1] != "":
        return None
    files = {}
    for line in lines[:-1]:
        digest, sep, path = line[:64], line[64:66], line[66:]
        if sep != "  " or not path or len(digest) != 64 or digest.strip("0123456789abcdef"):
            return None
        files[path] = digest
    return files


def release_models(release_dir):
    """{absolute path: sha256} of the model files a release was proven with ({} when none)."""
    try:
        with open_file(os.path.join(release_dir, MODELS)) as f:
            lines = f.read().decode("utf-8", "surrogateescape").split("\n")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise os_error("io", exc, os.path.join(release_dir, MODELS))
    return dict((line[66:], line[:64]) for line in lines[:-1] if line[64:66] == "  ")


def _links_bytes(links):
    return "".join("%s\t%s\n" % (p, links[p]) for p in sorted(links)).encode("utf-8", "surrogateescape")


def _read_links(release_dir):
    """{path: target} of a release's overlay links ({} when it has none)."""
    try:
        with open_file(os.path.join(release_dir, LINKS)) as f:
            lines = f.read().decode("utf-8", "surrogateescape").split("\n")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise os_error("io", exc, os.path.join(release_dir, LINKS))
    links = {}
    for line in lines[:-1]:
        path, sep, target = line.partition("\t")
        if sep:
            links[path] = target
    return links


def _set_link(root_real, name, release_id):
    """Point ``name`` at a release with a rename over the old link (atomic)."""
    link = os.path.join(root_real, name)
    tmp = os.path.join(root_real, ".%s.tmp-%d" % (name, os.getpid()))
    unlink_quietly(tmp)
    try:
        os.symlink(os.path.join("releases", release_id), tmp)
        os.replace(tmp, link)
        fsync_dir(root_real)
    except OSError as exc:
        unlink_quietly(tmp)
        raise os_error("io", exc, link)


# The release the server was last started from. The server reads its drafter through this link
# (``<root>/launched/drafter``), a path that stays the same from release to release: vLLM's compile
# cache key hashes the drafter's path, so a release's own path would make every release a cold
# compile. Only a launch (or the engine check just before it) moves it, never a switch: what the
# server reads is the release it was started from, even while ``current`` moves.
LAUNCHED = "launched"


def point_launched(root_real, release_id):
    """Point ``launched`` at a release before a server starts from it; returns the release it
    pointed at before. A release that is not there removes the link: the server then fails to
    find its drafter, rather than start from another release's."""
    _check_release_id(release_id)
    before = link_target(root_real, LAUNCHED, strict=False)
    if before == release_id:
        return before  # nothing written
    if os.path.isdir(os.path.join(root_real, "releases", release_id)):
        _set_link(root_real, LAUNCHED, release_id)
    else:
        unlink_quietly(os.path.join(root_real, LAUNCHED))
    return before


def restore_launched(root_real, before):
    """Put ``launched`` back where it was (after an engine check)."""
    if link_target(root_real, LAUNCHED, strict=False) == before:
        return
    if before is None:
        unlink_quietly(os.path.join(root_real, LAUNCHED))
    else:
        _set_link(root_real, LAUNCHED, before)


def _switch(root_real, release_id):
    """Make ``release_id`` current, keeping the old current as ``previous`` (a damaged link of
    either name, ours by its name, is replaced)."""
    old = link_target(root_real, "current", strict=False)
    if old == release_id:
        return old
    if old is not None:
        _set_link(root_real, "previous", old)
    _set_link(root_real, "current", release_id)
    return old


def _served_files(root_real, files, rehash=False, strict=True):
    """Digests through ``current``, resolved: the path the server reads. A link of the release's
    overlay must still point where the release recorded; its digest is the digest cache's. Any
    other file must be the release's own file, not a link (to a copy elsewhere in the root, or out
    of it): such a file reads as missing, with where it leads. ``strict=False``: a damaged
    ``current`` link is no release (a deploy replaces it)."""
    current = link_target(root_real, "current", strict)
    links = _read_links(os.path.join(root_real, "releases", current)) if current else {}
    out = []
    for spec in files:
        if spec["path"] in links:
            out.append(_served_link(root_real, "current", spec["path"], links[spec["path"]], rehash))
            continue
        joined = os.path.normpath(os.path.join(root_real, "current", spec["path"]))
        if not joined.startswith(root_real + os.sep):
            raise OpError("outside_root", "path is outside the deploy root %s" % root_real, spec["path"])
        real = os.path.realpath(joined)
        own = os.path.join(root_real, "releases", current, spec["path"]) if current else None
        record = {"path": spec["path"], "remote_path": real, "sha256": None}
        if current is None or real == own:
            record["sha256"] = sha256_or_none(real)
            if record["sha256"] is not None:
                record["mode"] = "%04o" % stat.S_IMODE(os.stat(real).st_mode)
        elif os.path.lexists(joined):
            record["remote_path"] = "%s (a link to %s, not the release's own file)" % (joined, real)
        out.append(record)
    return current, out


def _extra_files(root_real, current, manifest, links):
    """Files in the served release that it does not record: planted (a generation_config.json
    that transformers and vLLM would read), or left from by hand."""
    release_dir = os.path.join(root_real, "releases", current)
    known = set(manifest or {}) | set(links) | {MANIFEST, LINKS, MODELS, SEQUENCE}
    extra = []
    for dirpath, dirnames, filenames in os.walk(release_dir):
        rel_dir = os.path.relpath(dirpath, release_dir)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = name if rel_dir == "." else os.path.join(rel_dir, name)
            if rel not in known:
                extra.append(rel)
    return sorted(extra)


def _served_link(root_real, base, path, target, rehash=False):
    """One overlay link under ``base`` (``current``, or a release's directory): where it points
    (``link``), and the digest of what it points at when that is where the release says."""
    parent = path_inside(root_real, os.path.join(base, os.path.dirname(path))) if os.path.dirname(path) else None
    link = os.path.join(parent or path_inside(root_real, base), os.path.basename(path))
    try:
        found = os.readlink(link)
    except OSError:
        found = None
    record = {"path": path, "remote_path": target, "link": found, "sha256": None, "verified": None}
    if found == target:
        record["sha256"], record["verified"] = digest_cache(root_real).digest(link, rehash)
    return record


def remove_tree(path, ignore_errors=False):
    """Remove a directory tree without following symlinks (shutil's fd-based walk, in short).

    Not shutil itself: it pulls in re, bz2 and lzma, ~5 ms of every deploy once old releases
    are pruned. Every step is relative to an open directory, so a link swapped in mid-way
    is removed as a link, never followed.
    """
    try:
        _rmtree_at(None, path)
    except OSError:
        if not ignore_errors:
            raise


def _rmtree_at(parent_fd, name):
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    try:
        with os.scandir(fd) as entries:
            children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for child, is_dir in children:
            if is_dir:
                _rmtree_at(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _clean_staging(releases):
    """Remove what a cut deploy left half-staged (under the deploy root's lock: no agent of ours is
    staging now): only what is named as the agent names it, ``.staging-<release id>-<pid>``. An
    operator's ``.staging-backup-2024/`` holding files and no sequence number is not ours and
    stays (it was removed with the rest)."""
    for name in os.listdir(releases):
        release_id, _, pid = name[len(STAGING_PREFIX) :].rpartition("-")
        if not name.startswith(STAGING_PREFIX) or not pid.isdigit() or not release_id:
            continue
        try:
            _check_release_id(release_id)
        except OpError:
            continue
        path = os.path.join(releases, name)
        try:
            held = None if os.path.islink(path) else os.listdir(path)
        except OSError:
            continue
        # The agent makes the directory and writes its sequence number first: what holds files
        # and no number was not staged by us.
        if held is None or (held and SEQUENCE not in held):
            continue
        remove_tree(path, ignore_errors=True)


def _ours(releases, name):
    """A release this tool made: a release id's name, a real directory, its manifest readable.
    Anything else under releases/ (an operator's backup-2024/) is never removed."""
    try:
        _check_release_id(name)
    except OpError:
        return False
    path = os.path.join(releases, name)
    return not os.path.islink(path) and os.path.isdir(path) and _read_manifest(path) is not None


def _foreign(releases):
    """What releases/ holds that the tool did not make (reported, left alone)."""
    return sorted(n for n in os.listdir(releases) if not n.startswith(".") and not _ours(releases, n))


def _order(releases, name):
    """Where a release stands in its root's order: by its sequence number, which no clock sets (a
    host whose clock went back would otherwise prune its newest release as its oldest); releases
    from before sequence numbers come first, by their time."""
    path = os.path.join(releases, name)
    try:
        with open_file(os.path.join(path, SEQUENCE)) as f:
            return (1, int(f.read(32).decode("ascii").strip()), name)
    except (OSError, ValueError, UnicodeDecodeError):
        return (0, os.lstat(path).st_mtime, name)


def _next_sequence(releases):
    """1 + the latest release's number (under the deploy-root lock, as every release is made)."""
    orders = [_order(releases, n) for n in os.listdir(releases) if not n.startswith(".") and _ours(releases, n)]
    return 1 + max([int(o[1]) for o in orders if o[0] == 1] + [0])


def _prune(root_real, releases, keep):
    """Remove the oldest releases beyond ``keep``, then the compile caches no kept release used."""
    # ``launched``: the release the server was started from reads its drafter through it.
    protected = set(x for x in (link_target(root_real, n, False) for n in ("current", "previous", LAUNCHED)) if x)
    candidates = []
    for name in os.listdir(releases):
        if name.startswith(".") or name in protected or not _ours(releases, name):
            continue
        candidates.append((_order(releases, name), name))
    candidates.sort()
    excess = len(candidates) + len(protected) - keep
    pruned = []
    for _, name in candidates[: max(0, excess)]:
        remove_tree(os.path.join(releases, name))
        pruned.append(name)
    _prune_cache(root_real, releases)
    return pruned


# --- vLLM's compile cache -----------------------------------------------------------------
# VLLM_CACHE_ROOT is <root>/cache/vllm (rules.serving.cache_root): it outlives releases, so that a
# release keeping the drafter's config and the command finds its graphs. vLLM keeps one directory
# per compile key, ``torch_compile_cache/<hash>`` and ``torch_compile_cache/torch_aot_compile/
# <hash>``. Which ones a release's start used is in the READY record's ledger (the controller
# reads vLLM's own lines); each is noted under cache/used/<release id> when the next apply or
# switch finds it, and a hash directory that no kept release used is removed with the releases.

CACHE = os.path.join("cache", "vllm", "torch_compile_cache")
AOT = "torch_aot_compile"
CACHE_USED = os.path.join("cache", "used")


def _hash_name(name):
    return 8 <= len(name) <= 64 and all(c in "0123456789abcdef" for c in name)


def cache_key_dir(path):
    """A logged cache path cut to its hash directory, relative to the compile cache: ``<hash>``
    or ``torch_aot_compile/<hash>``; None when it is not one."""
    parts = [x for x in str(path).split("/") if x]
    if "torch_compile_cache" not in parts:
        return None
    rest = parts[parts.index("torch_compile_cache") + 1 :]
    if rest[:1] == [AOT]:
        rest = rest[1:]
        return AOT + "/" + rest[0] if rest and _hash_name(rest[0]) else None
    return rest[0] if rest and _hash_name(rest[0]) else None


def _note_ready_cache(root_real):
    """The READY release's compile caches, from its record's ledger, noted as that release's (only
    those under this root's cache: a cache root set elsewhere in serving.env is not ours). Returns
    whether the record named any here (no ledger, a rank without one: nothing is pruned)."""
    try:
        text = read_own(os.path.join(root_real, "ready.json"))
    except OpError:
        return False
    if not text:
        return False  # no READY record (a files-only root): no json import, ~10 ms of every batch
    import json

    try:
        record = json.loads(text)
        release = record["release_id"]
        dirs = record["gates"]["health"]["startup"]["cache_dirs"]
        _check_release_id(release)
    except (ValueError, TypeError, KeyError, OpError):
        return False
    ours = os.path.realpath(os.path.join(root_real, CACHE))
    names = set()
    for d in dirs if isinstance(dirs, list) else ():
        name = cache_key_dir(d)
        cut = str(d).split("/torch_compile_cache/")[0]
        if name and os.path.realpath(os.path.join(cut, "torch_compile_cache")) == ours:
            names.add(name)
    if not names:
        return False
    used = os.path.join(own_tree(root_real, CACHE_USED), release)
    names |= set(_used(used))
    data = ("\n".join(sorted(names)) + "\n").encode()
    if read_own(used) != data:
        atomic_write(used, data, sha256_hex(data), 0o644)
    return True


def _used(path):
    text = (read_own(path) or b"").decode("utf-8", "replace")
    return [x for x in text.splitlines() if cache_key_dir("torch_compile_cache/" + x) == x]


def _prune_cache(root_real, releases):
    """Remove the hash directories known to be unused: those a release now gone used and no
    kept release did, and the notes of releases gone. A hash directory no note names is not known
    to be unused (a start whose log the ledger could not read, a refused release whose graphs the
    same command will want again, one vLLM made for an engine check) and is kept: on the H100
    the same server command compiled three times in three rollouts when every directory a READY
    release had not named was removed. Nothing is removed unless the READY release's own are
    noted, and nothing through a link in the cache's tree (it is the tool's own: a link there is
    refused by name, and what it points to is never walked)."""
    if not _note_ready_cache(root_real):
        return []
    notes = own_tree(root_real, CACHE_USED)
    kept = set(x for x in os.listdir(releases) if not x.startswith("."))
    keep, gone = set(), set()  # type: (set, set)
    for name in os.listdir(notes):
        if name.startswith("."):
            continue
        used = _used(os.path.join(notes, name))
        (keep if name in kept else gone).update(used)
    cache, removed = own_tree(root_real, CACHE), []
    for rel in sorted(gone - keep):
        where = os.path.join(cache, rel)
        try:
            is_dir = stat.S_ISDIR(os.lstat(where).st_mode)  # a link is not
            if rel.startswith(AOT + "/"):
                is_dir = is_dir and stat.S_ISDIR(os.lstat(os.path.join(cache, AOT)).st_mode)
        except OSError:
            is_dir = False
        if is_dir:
            remove_tree(where, ignore_errors=True)
            removed.append(rel)
    for name in os.listdir(notes):
        if not name.startswith(".") and name not in kept:
            unlink_quietly(os.path.join(notes, name))
    return removed


def _stage_release(staging, files, wanted, links, models, sequence):
    os.mkdir(staging, 0o755)
    number = b"%d\n" % sequence
    atomic_write(os.path.join(staging, SEQUENCE), number, sha256_hex(number), 0o644)
    for spec in files:
        if "\n" in spec["path"] or "\\" in spec["path"]:
            raise OpError("bad_request", "a file path may not hold a newline or a backslash", spec["path"])
        data, expected = decode_content(spec)
        atomic_write(os.path.join(staging, spec["path"]), data, expected, file_mode(spec))
    for path in sorted(links):
        where = os.path.join(staging, path)
        os.makedirs(os.path.dirname(where), mode=0o755, exist_ok=True)
        os.symlink(links[path], where)
    if links:
        body = _links_bytes(links)
        atomic_write(os.path.join(staging, LINKS), body, sha256_hex(body), 0o644)
    if models:
        # sha256sum(1) format with absolute paths: `sha256sum -c` checks the models from anywhere.
        body = "".join("%s  %s\n" % (models[p], p) for p in sorted(models)).encode("utf-8", "surrogateescape")
        atomic_write(os.path.join(staging, MODELS), body, sha256_hex(body), 0o644)
    body = _manifest_bytes(wanted)
    atomic_write(os.path.join(staging, MANIFEST), body, sha256_hex(body), 0o644)


def _overlay_links(overlays, pushed):
    """{release path: target} for every overlay: each file of a model directory not pushed itself
    (the drafter's weights beside the release's own config.json)."""
    links = {}
    for overlay in overlays:
        dest, source = overlay["dest"], model_path(overlay["source"])
        if not dest or os.path.normpath(dest) != dest or dest.startswith(("/", "..")):
            raise OpError("bad_request", "an overlay's dest must be a relative path", dest)
        for name in model_names(source, overlay["files"]):
            path = "%s/%s" % (dest, name)
            if path not in pushed:
                links[path] = os.path.join(source, name)
    return links


def _models_read(answers):
    """{absolute path: sha256} of the model files that ``model_files`` ops of this batch read."""
    out = {}
    for i, answer in enumerate(answers):
        if not isinstance(answer, dict) or not isinstance(answer.get("path"), str):
            raise OpError("bad_request", "models[%d] is not a model_files answer" % i)
        for f in answer.get("files") or []:
            out[os.path.join(answer["path"], f["path"])] = f["sha256"]
    return out


@op(
    "release_apply",
    root=str,
    release_id=str,
    keep=int,
    switch=bool,
    reuse=bool,
    rehash=bool,
    files=list,
    overlays=list,
    models=(list, REF),
)
def op_release_apply(req):
    """Put a release's files and make it current, or report that current already holds them.

    ``overlays`` add links to model files beside the files pushed (the drafter's weights beside
    the release's config.json): each link and its target's digest are part of the release.
    ``models``: the answers of this batch's ``model_files`` ops (by reference): the model files
    the release is proven with, recorded in its ``.models.sha256``."""
    root = deploy_root(req)
    release_id = req["release_id"]
    _check_release_id(release_id)
    files = items(req, "files", path=str, sha256=str, mode=str, content=bytes)
    overlays = items(req, "overlays", dest=str, source=str, files=(list, NONE))
    keep, switch = req["keep"], req["switch"]
    releases = _releases_dir(root)  # a link in its place is replaced before any path is resolved
    for spec in files:
        path_inside(root, os.path.join("releases", release_id, spec["path"]))
    _clean_staging(releases)

    wanted = dict((f["path"], f["sha256"]) for f in files)
    links = _overlay_links(overlays, wanted)
    digests = digest_cache(root)
    verified = {}
    for path in sorted(links):
        path_inside(root, os.path.join("releases", release_id, os.path.dirname(path)))
        wanted[path], verified[path] = digests.digest(links[path], req["rehash"])
        if wanted[path] is None:
            raise OpError("missing_model_file", "%s is missing or not a readable file" % links[path], links[path])
    current, served = _served_files(root, files + [{"path": p} for p in sorted(links)], strict=False)
    before = dict((f["path"], f["sha256"]) for f in served)
    # A release is its files with their modes: a mode changed in the playbook or on the host is a
    # new release (chmod 0666 by hand is repaired by the next deploy).
    same_modes = all(f.get("mode") == "%04o" % file_mode(spec) for f, spec in zip(served, files))
    current_dir = os.path.join(releases, current) if current else None
    current_links = _read_links(current_dir) if current_dir else {}
    pinned = _read_manifest(current_dir) if current_dir else None
    # The model files this batch read (model_files): the release records what it is proven with.
    models = _models_read(req["models"])
    same_models = (release_models(current_dir) if current_dir else {}) == models
    # reuse=False: a new release even when current holds these files (a multi-node group must
    # share one release id, and a node that was repaired alone holds another).
    same_files = pinned == wanted and current_links == links and all(before[p] == wanted[p] for p in wanted)
    if current is not None and req["reuse"] and same_models and same_modes and same_files:
        digests.save()
        # This very release: a retried batch after a cut connection (the first attempt
        # finished, its answer was lost). It was made by this run: not "no change".
        made_now = current == release_id
        return {
            "changed": made_now,
            "switched": True,
            "retried": made_now,
            "release_id": current,
            "previous": link_target(root, "previous", strict=False),
            "files": [_with_link(dict(f, changed=False), links, verified, pinned, current_links) for f in served],
            "pruned": [],
        }

    final_dir = os.path.join(releases, release_id)
    if os.path.lexists(final_dir):
        # A retried batch after a cut connection may find its own finished release.
        if (
            _read_manifest(final_dir) != wanted
            or _read_links(final_dir) != links
            or release_models(final_dir) != models
        ):
            raise OpError("release_exists", "release %s exists with other content" % release_id, final_dir)
    else:
        staging = os.path.join(releases, "%s%s-%d" % (STAGING_PREFIX, release_id, os.getpid()))
        try:
            _stage_release(staging, files, wanted, links, models, _next_sequence(releases))
            os.rename(staging, final_dir)
            fsync_dir(releases)
        except OSError as exc:
            remove_tree(staging, ignore_errors=True)
            raise os_error("io", exc, final_dir)
        except OpError as exc:
            # A half-built release is never left behind: current is untouched and stays served.
            remove_tree(staging, ignore_errors=True)
            if exc.path and exc.path.startswith(staging):
                exc.path = final_dir + exc.path[len(staging) :]
            raise
    for spec in files:
        read_back(os.path.join(final_dir, spec["path"]), spec["sha256"])
    for path in sorted(links):
        found = _served_link(root, os.path.join("releases", release_id), path, links[path])
        if found["sha256"] != wanted[path]:
            raise OpError(
                "drift",
                "read-back of link %s: %s -> %s, sha256 %s, expected %s -> %s, %s"
                % (path, path, found["link"], found["sha256"], path, links[path], wanted[path]),
                path,
            )
    digests.save()
    if not switch:
        # Staged only: the controller switches after the gates that need the files have passed.
        out = []
        for path in sorted(wanted):
            where = os.path.join(final_dir, path)
            record = {
                "path": path,
                "remote_path": links.get(path, where),
                "sha256": wanted[path],
                "before": before[path],
            }
            record["changed"] = before[path] != wanted[path]
            if path not in links:
                record.update(stat_record(where))
            out.append(_with_link(record, links, verified, pinned, current_links))
        return {
            "changed": True,
            "switched": False,
            "release_id": release_id,
            "previous": link_target(root, "current", strict=False),
            "files": out,
            "pruned": [],
        }

    previous = _switch(root, release_id)
    current, served = _served_files(root, files + [{"path": p} for p in sorted(links)])
    for f in served:
        if f["sha256"] != wanted[f["path"]]:
            raise OpError(
                "drift",
                "after the switch, %s reads sha256 %s, expected %s"
                % (f["remote_path"], f["sha256"], wanted[f["path"]]),
                f["remote_path"],
            )
    out = []
    for f in served:
        record = dict(f, changed=before[f["path"]] != f["sha256"])
        if f["path"] not in links:
            record.update(stat_record(f["remote_path"]))
        record["before"] = before[f["path"]]
        out.append(_with_link(record, links, verified, pinned, current_links))
    return {
        "changed": True,
        "switched": True,
        "release_id": release_id,
        "previous": previous,
        "files": out,
        "pruned": _prune(root, releases, keep),
        "foreign": _foreign(releases),
    }


def _with_link(record, links, verified, pinned, current_links):
    """An overlay link's record: its target, how its digest was had, and the digest the release
    that was current recorded for the same link (the pin, when no manifest names one)."""
    path = record["path"]
    if path in links:
        record["link"] = links[path]
        record["remote_path"] = links[path]
        record["verified"] = verified.get(path) or record.get("verified")
        same = pinned is not None and current_links.get(path) == links[path]
        record["pinned"] = pinned.get(path) if same else None
    return record


@op("release_verify", root=str, files=list, rehash=bool)
def op_release_verify(req):
    """Read-only: the digests of the files the server reads, through ``current``, and every link of
    its overlay (where it points, and its target's digest: the cache's unless ``rehash``)."""
    root = deploy_root(req, create=False)
    rehash = req["rehash"]
    current, served = _served_files(root, items(req, "files", path=str), rehash)
    manifest, links = None, []
    if current is not None:
        release_dir = os.path.join(root, "releases", current)
        manifest = _read_manifest(release_dir)
        recorded = _read_links(release_dir)
        links = [_served_link(root, "current", p, recorded[p], rehash) for p in sorted(recorded)]
        models = release_models(release_dir)
        extra = _extra_files(root, current, manifest, recorded)
    else:
        models, extra = {}, []
    return {
        "current": current,
        "previous": link_target(root, "previous", strict=False),
        "files": served,
        "manifest": manifest,
        "links": links,
        "models": models,
        "extra": extra,
    }


@op("release_inspect", root=str, files=list, max_bytes=int)
def op_release_inspect(req):
    """What ``current`` holds, with small text contents, for dry-run diffs."""
    root = deploy_root(req, create=False)
    limit = req["max_bytes"]
    current, served = _served_files(root, items(req, "files", path=str))
    for f in served:
        f["content_b64"] = None
        if f["sha256"] is None:
            continue
        st = os.stat(f["remote_path"])
        # A file not everyone may read never leaves the host: dry-run shows digests for it.
        f["private"] = not st.st_mode & 0o004
        if not f["private"] and st.st_size <= limit:
            with open_file(f["remote_path"]) as fh:
                f["content_b64"] = b64(fh.read())
    return {"current": current, "files": served}


@op("release_list", root=str)
def op_release_list(req):
    """The releases this tool made under the deploy root, oldest first, and current and previous."""
    root = deploy_root(req, create=False)
    releases = os.path.join(root, "releases")
    names = []
    if os.path.isdir(releases):
        path_inside(root, "releases")
        names = sorted(os.listdir(releases))
    items: list[dict] = []
    for name in names:
        path = os.path.join(releases, name)
        if not name.startswith(".") and _ours(releases, name):
            items.append({"release_id": name, "mtime": os.stat(path).st_mtime, "order": _order(releases, name)})
    items.sort(key=lambda r: r.pop("order"))
    return {
        "current": link_target(root, "current"),
        "previous": link_target(root, "previous"),
        "releases": items,
    }


@op("release_switch", root=str, release_id=(str, NONE), keep=(int, NONE))
def op_release_switch(req):
    """Switch ``current`` (rollback when no release is named), then read it back."""
    root = deploy_root(req)
    target = req["release_id"] or link_target(root, "previous")
    if target is None:
        raise OpError("no_previous", "there is no previous release to go back to", root)
    _check_release_id(target)
    release_dir = os.path.join(root, "releases", target)
    manifest = _read_manifest(release_dir)
    if manifest is None:
        raise OpError("no_release", "release %s does not exist (or has no manifest)" % target, release_dir)
    wanted = manifest
    links = _read_links(release_dir)
    for path, digest in sorted(wanted.items()):
        if path in links:
            found = _served_link(root, os.path.join("releases", target), path, links[path])
            if found["sha256"] != digest:
                raise OpError(
                    "drift",
                    "link %s -> %s reads sha256 %s, the release recorded %s"
                    % (path, found["link"], found["sha256"], digest),
                    links[path],
                )
        else:
            read_back(os.path.join(release_dir, path), digest)
    previous = _switch(root, target)
    current, served = _served_files(root, [{"path": p} for p in sorted(wanted)])
    for f in served:
        if f["sha256"] != wanted[f["path"]]:
            raise OpError("drift", "after the switch, sha256 %s differs" % f["sha256"], f["remote_path"])
    releases = _releases_dir(root)
    pruned = _prune(root, releases, req["keep"]) if req["keep"] else []
    return {
        "release_id": current,
        "previous": previous,
        "files": served,
        "pruned": pruned,
        "foreign": _foreign(releases),
    }
