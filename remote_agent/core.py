"""The agent's core: what every batch needs, whatever its ops.

The agent runs on the host with nothing but the Python standard library (3.8+). The controller
packs the modules a batch needs into one source (``remote_agent.pack``: this core first, then
releases, models, serving, checks as the batch's ops need them, then dispatch), sends it
compressed behind ``loader.py`` with the request, and reads the answer as JSON. Here: the
operation registry and the argument specs the dispatcher checks requests against, failures as
data (``OpError``), progress events, deploy-root paths that cannot escape it, the atomic write
and read-back primitives, the deploy root's digest cache, model file names, and the two ops
every run uses (``lock`` and ``put``).

Everything the agent writes lives under the deploy root the request names:

    <root>/.lock                          flock held for the rest of the batch by the ``lock`` op
    <root>/.digests                       the digest cache: sha256 by (device, inode, size, mtimes),
                                          each line signed with the controller's key
    <root>/releases/<id>/...              one immutable directory per release
    <root>/releases/<id>/.manifest.sha256 sha256sum(1) lines for every file of the release
    <root>/releases/<id>/.sequence       its number in the root's order (pruning, listing)
    <root>/current  -> releases/<id>      what the server reads
    <root>/previous -> releases/<id>      where ``rollback`` goes
    <root>/ready.json                     the READY record (written with ``put``)
    <root>/run/<name>.json, logs/<name>.log  the supervised processes (vLLM, Ray) and their logs
"""

import binascii
import errno
import fcntl
import os
import stat
import sys
import time

# Every batch pays this interpreter's start-up on every host, so the modules a files-only batch
# needs are the cheap ones: json, base64 and hashlib each pull in re/enum or OpenSSL (together
# about 9 ms a start, more than the interpreter itself). The request arrives as marshal, answers
# are written by json_text below, manifests are sha256sum lines, and sha256 is the builtin one. json,
# hashlib (fast for big files), platform, shutil, signal, socket and subprocess are imported
# where they are used.
try:
    from _sha256 import sha256 as builtin_sha256  # 3.8 - 3.11
except ImportError:
    try:
        from _sha2 import sha256 as builtin_sha256  # 3.12+
    except ImportError:
        from hashlib import sha256 as builtin_sha256

PROTOCOL_VERSION = 1
MANIFEST = ".manifest.sha256"
LINKS = ".links"  # a release's overlay links: "<path>\t<target>" lines
MODELS = ".models.sha256"  # the model files a release was proven with: "<sha256>  <absolute path>"
DIGESTS = ".digests"  # the digest cache of the deploy root
STAGING_PREFIX = ".staging-"
SEQUENCE = ".sequence"  # a release's place in its deploy root's order: 1 + the latest's, never a clock
CHUNK = 1 << 20

# Kept open for the life of the process: the flock is released when the batch ends.
held_locks: "list[int]" = []
# The deploy roots' digest caches, by root: kept for a session's life (each entry is checked
# against its file's stat before it is used). Nothing else is kept between ops: an op that needs
# an earlier op's answer names it in its request ({"$ref": key}), resolved by the dispatcher.
digest_caches: "dict[str, _Digests]" = {}


EVENT = b"@dflash-event "
events_wanted = [False]  # on when the request asks (a person is watching the run)
# The controller's key for digest cache lines, as the request gives it (hex; "" trusts no line).
request_digest_key = [""]


def send_event(fields):
    """A progress event for the controller, on stderr as one line (stdout carries the answer
    alone). Best effort: a closed stderr only loses the progress."""
    if not events_wanted[0]:
        return
    try:
        sys.stderr.buffer.write(EVENT + json_text(fields).encode("utf-8", "backslashreplace") + b"\n")
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


# --- the operations and the keys they take ---------------------------------------------

NONE = type(None)
NUMBER = (int, float)
REF = "a reference"  # in a key's types: it may name an earlier answer of the batch (see dispatch)

# name -> (function, {key: accepted types}), in the order the modules define them; the
# controller's protocol table lists the same names in the same order (a test holds them equal).
OPS: "dict[str, tuple]" = {}


def op(name, /, **spec):
    """Register a function as the operation ``name``, taking exactly the keys of ``spec`` (each
    one required: its types say whether null is allowed). The dispatcher checks a request against
    the spec before the function runs, so the function reads ``req[key]`` and never guesses."""

    def register(function):
        OPS[name] = (function, spec)
        return function

    return register


# The helper programs the serving Python runs (``remote_agent/helpers/``), by name: filled by the
# packer with those the batch's modules use; read from the files when imported unpacked.
HELPERS: "dict[str, str]" = {}


def helper_program(name):
    if name not in HELPERS:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "helpers", name + ".py")) as f:
            HELPERS[name] = f.read()
    return HELPERS[name]


def run_bounded(argv, timeout, env=None, cwd=None, data=None, merge=False, keep=None):
    """A program run to completion within ``timeout`` seconds: (exit status, stdout, stderr).

    It runs in a session of its own, and at the deadline its whole process group is killed:
    subprocess.run kills the child alone and then waits for its pipes, which a grandchild that
    inherited them (a compile worker, a shell's background job) holds open for as long as it
    lives, so the op would outlive its bound. Raises ``subprocess.TimeoutExpired``. ``keep``
    (with ``merge``): only the output's last ``keep`` bytes are held, however much the program
    writes (a gateway hook's 400 MB of output took 836 MB here)."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        if keep is not None and merge:
            out = _tail(proc, data, timeout, keep)
            return proc.returncode, out, b""
        out, err = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild that left the group: its pipes go with us
            proc.kill()
        raise
    return proc.returncode, out, err or b""


def _tail(proc, data, timeout, keep):
    """The last ``keep`` bytes of a program's (merged) output, read as it comes until it ends,
    its input written beside; raises ``subprocess.TimeoutExpired`` at the deadline."""
    import select
    import subprocess
    import threading
    import time

    stdin, stdout = proc.stdin, proc.stdout
    proc.stdin = proc.stdout = None  # ours from here: the caller's clean-up only waits
    if stdin is not None:

        def feed():
            try:
                stdin.write(data)
            except OSError:
                pass  # it ended, or closed its input without reading it all
            finally:
                try:
                    stdin.close()
                except OSError:
                    pass

        threading.Thread(target=feed, daemon=True).start()
    deadline = time.monotonic() + timeout
    fd = stdout.fileno()
    held = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            stdout.close()
            raise subprocess.TimeoutExpired(proc.args, timeout)
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        held += chunk
        if len(held) > 2 * keep:
            del held[:-keep]
    stdout.close()
    proc.wait(max(0.0, deadline - time.monotonic()))
    return bytes(held[-keep:])


def check(where, spec, value):
    """``value`` if it is an object with every key of ``spec``, each of its types, and no other;
    else a ``bad_request`` naming the key (``where``: the op, or the list and item it is in)."""
    if not isinstance(value, dict):
        raise OpError("bad_request", "%s: expected an object, got %s" % (where, type(value).__name__))
    for key in value:
        if key not in spec:
            raise OpError("bad_request", "%s: unknown key %r" % (where, key))
    for key, kinds in spec.items():
        if key not in value:
            raise OpError("bad_request", "%s: %r is missing" % (where, key))
        kinds = tuple(k for k in (kinds if isinstance(kinds, tuple) else (kinds,)) if k is not REF)
        got = value[key]
        if not isinstance(got, kinds) or (isinstance(got, bool) and bool not in kinds):
            wanted = " or ".join("null" if k is NONE else k.__name__ for k in kinds)
            raise OpError("bad_request", "%s: %r is %s, expected %s" % (where, key, type(got).__name__, wanted))
    return value


def items(req, key, **spec):
    """The objects of list ``req[key]``, each checked against ``spec``."""
    return [check("%s[%d]" % (key, i), spec, item) for i, item in enumerate(req[key])]


def os_error(code, exc, path):
    name = errno.errorcode.get(exc.errno or 0, "")
    return OpError(code, "%s: %s" % (name or "error", exc.strerror or exc), path, exc.errno)


# --- paths -----------------------------------------------------------------------------


def deploy_root(req, create=True):
    """The deploy root, made when missing unless the op only reads (verify and the dry run never
    write, not even the directory)."""
    root = req["root"]
    if not isinstance(root, str) or not os.path.isabs(root):
        raise OpError("bad_request", "root must be an absolute path", root)
    if create:
        try:
            os.makedirs(root, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise os_error("io", exc, root)
    return os.path.realpath(root)


def path_inside(root_real, path):
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


def own_dir(root_real, name):
    """A directory of the tool's own under the deploy root (releases, run, logs), made when
    missing. Anything else in its place, a link included, was not made by us: it is neither
    followed nor removed, and refused by name (a link an operator made, to a tmpfs say, holds
    the records of what runs: replacing it lost them, and the server with them)."""
    path = os.path.join(root_real, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    try:
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise OpError(
                "not_a_directory",
                "%s is a symbolic link, not made by this tool (left alone, not followed): make it a directory "
                "or remove it" % path,
                path,
            )
        if st is None:
            os.mkdir(path, 0o755)
        elif not stat.S_ISDIR(st.st_mode):
            raise OpError("not_a_directory", "%s is not a directory (not ours: left alone)" % path, path)
    except FileExistsError:
        pass  # made meanwhile by another agent of ours
    except OSError as exc:
        raise os_error("io", exc, path)
    return path


def own_tree(root_real, rel, make=True):
    """A directory of the tool's own some levels under the deploy root (``cache/used``, the
    compile cache), each level made when missing (``make=False``: None where one is missing) and
    held to ``own_dir``'s rule: a link or a non-directory at any level is refused by name and left
    as it is, never walked, written or pruned through (an operator's ``cache`` linked elsewhere had
    files outside the root deleted, another root's compile caches pruned)."""
    path = root_real
    for part in rel.split("/"):
        if not make and not os.path.lexists(os.path.join(path, part)):
            return None
        path = own_dir(path, part)
    return path


def open_own(path, flags, mode=0o600):
    """Open a file of the tool's own without following a link: a link, FIFO, socket or device
    node in its place is removed (the node only: it holds no data) and the file made afresh.
    O_NONBLOCK: opening a FIFO to write would wait for a reader for ever."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(2):
        try:
            fd = os.open(path, flags, mode)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO with no reader
                raise os_error("io", exc, path)
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
            raise os_error("io", exc, path)
    raise OpError("io", "%s keeps being replaced by something that is not a file" % path, path)


def open_file(path, follow=True):
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


def read_own(path):
    """A file of the tool's own, or None: a link or anything but a regular file in its place is
    not read through."""
    try:
        f = open_file(path, follow=False)
    except OSError:
        return None
    with f:
        return f.read()


# --- file primitives -------------------------------------------------------------------


def sha256_hex(data):
    return builtin_sha256(data).hexdigest()


def sha256_file(path, follow=True):
    with open_file(path, follow) as f:
        if os.fstat(f.fileno()).st_size > CHUNK:
            import hashlib  # OpenSSL's sha256 is several times faster on big files

            h = hashlib.sha256()
        else:
            h = builtin_sha256()
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def sha256_or_none(path):
    try:
        return sha256_file(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENXIO):  # not a regular file (a FIFO, a socket): not the file meant
            return None
        raise


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stat_record(path):
    st = os.stat(path)
    return {
        "size": st.st_size,
        "mode": "%04o" % stat.S_IMODE(st.st_mode),
        "inode": st.st_ino,
        "mtime": st.st_mtime,
    }


def atomic_write(final, data, expected, mode):
    """Steps 4-7 of the write protocol: temp file, verify, rename, fresh read-back."""
    directory = os.path.dirname(final)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise os_error("io", exc, directory)
    tmp = os.path.join(directory, ".%s.tmp-%d" % (os.path.basename(final), os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as exc:
        raise os_error("io", exc, tmp)
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
        got = sha256_file(tmp)
        if got != expected:
            raise OpError(
                "checksum",
                "temp file holds sha256 %s, expected %s" % (got, expected),
                tmp,
            )
        os.replace(tmp, final)
        fsync_dir(directory)
    except OSError as exc:
        unlink_quietly(tmp)
        raise os_error("io", exc, final)
    except OpError:
        unlink_quietly(tmp)
        raise
    read_back(final, expected)


def read_back(path, expected):
    """Open the final path afresh: what the server will read must be what we meant."""
    got = sha256_or_none(path)
    if got != expected:
        raise OpError(
            "drift",
            "read-back of the final path gives sha256 %s, expected %s: the file was changed "
            "after the write, or this path is not where the bytes landed" % (got, expected),
            path,
        )


_ESCAPES = dict((i, "\\u%04x" % i) for i in range(32))
_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\"})


def json_text(value):
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
        return "{" + ",".join(json_text(str(k)) + ":" + json_text(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(json_text(v) for v in value) + "]"
    raise TypeError("cannot write %s as JSON" % type(value).__name__)


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def decode_content(spec):
    data, expected = spec["content"], spec["sha256"]
    if sha256_hex(data) != expected:
        raise OpError("checksum", "content does not match its sha256 in transit", spec["path"])
    return data, expected


def file_mode(spec):
    try:
        value = int(spec["mode"], 8)
    except (TypeError, ValueError):
        raise OpError("bad_request", "mode must be an octal string", spec["path"])
    if value & ~0o7777:
        raise OpError("bad_request", "mode out of range", spec["path"])
    return value


# --- model files and their digests ---------------------------------------------------------


def line_mac(fields):
    """A digest cache line's signature: HMAC-SHA256 with the controller's key (None: no key)."""
    if not request_digest_key[0]:
        return None
    import hmac

    key = binascii.unhexlify(request_digest_key[0])
    return hmac.new(key, fields.encode("utf-8", "surrogateescape"), "sha256").hexdigest()


class _Digests:
    """sha256 of files by (device, inode, size, mtime_ns, ctime_ns), kept in <root>/.digests: a
    no-change verify of a model of many GB is a stat per file. ctime cannot be set back by hand,
    so a file rewritten in place (same size, mtime restored) is hashed again.

    A line is trusted only when it carries the signature of the controller's key (sent with each
    request, never stored on the host): a line planted by anyone who can write a model directory
    or the deploy root, with a file's current stat and an old digest, is not signed, so it costs
    a re-hash and nothing else. Lines written by a controller with another key are re-hashed too."""

    def __init__(self, root_real):
        self.path = os.path.join(root_real, DIGESTS)
        self.known = {}
        self.dirty = False
        self.merge(self.path)

    def merge(self, path):
        """Take the entries of another cache file (a pushed model directory keeps its own): each
        is still checked against the file's stat before it is used."""
        try:
            with open_file(path) as f:
                text = f.read().decode("utf-8", "replace")
        except OSError:
            text = ""
        for line in text.split("\n"):
            mac, _, fields = line.partition(" ")
            parts = fields.split(" ", 6)
            if len(parts) != 7 or len(parts[0]) != 64 or mac != line_mac(fields):
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
        digest = sha256_or_none(path)
        try:
            after = os.stat(path)
        except OSError:
            return None, None
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == stamp and digest is not None:
            self.known[key] = (*stamp, digest, os.path.realpath(path))
            self.dirty = True
        return digest, "hashed"

    def save(self):
        """Written under the deploy-root lock only; entries whose file is gone or changed are dropped."""
        if not self.dirty or not request_digest_key[0]:
            return
        lines = []
        for (dev, ino), (size, mtime, ctime, digest, real) in sorted(self.known.items()):
            try:
                st = os.stat(real)
            except OSError:
                continue
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (dev, ino, size, mtime, ctime):
                fields = "%s %d %d %d %d %d %s" % (digest, dev, ino, size, mtime, ctime, real)
                lines.append("%s %s\n" % (line_mac(fields), fields))
        body = "".join(lines).encode("utf-8", "surrogateescape")
        atomic_write(self.path, body, sha256_hex(body), 0o644)
        self.dirty = False


def digest_cache(root_real):
    """The deploy root's digest cache, shared by every op of the batch."""
    if root_real not in digest_caches:
        digest_caches[root_real] = _Digests(root_real)
    return digest_caches[root_real]


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


def missing_reason(what, path):
    """Why ``path`` is not there, with the cause when it is a replaced mount."""
    point = _replaced_mount(path)
    if point is None:
        return "%s %s does not exist" % (what, path)
    return (
        "%s %s does not exist here: the directory mounted at %s was replaced on the host after the "
        "container started (the mount shows it deleted); restart the container to mount the new one"
        % (what, path, point)
    )


def model_path(value):
    if not isinstance(value, str) or not os.path.isabs(value) or os.path.normpath(value) != value or value == "/":
        raise OpError("bad_request", "a model path must be absolute and normalised", value)
    return value


def model_names(source, names=None):
    """The files of a model directory, relative to it (hidden entries, such as the .cache/ that
    `hf download` leaves, skipped), or the named ones. Directories that are links are not entered."""
    if names is None:
        if not os.path.isdir(source):
            raise OpError("missing_model", missing_reason("model directory", source), source)
        names = []
        for dirpath, dirnames, filenames in os.walk(source):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = os.path.relpath(dirpath, source)
            for name in filenames:
                if not name.startswith("."):
                    names.append(name if rel == "." else os.path.join(rel, name))
    for name in names:
        norm = os.path.normpath(name) if isinstance(name, str) and name else ""
        if not norm or norm != name or name.startswith(("/", "../")) or any(c in name for c in "\t\n\r\\"):
            raise OpError("bad_path", "model file name %r cannot be served from a release" % (name,), source)
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raw = name.encode("utf-8", "surrogateescape")
            raise OpError(
                "bad_path",
                "model file name %r in %s is not UTF-8: a release cannot name it (rename it)" % (raw, source),
                source,
            )
    return sorted(names)


def read_small(path, limit=CHUNK):
    """A small text file's content (a model's config.json), or None when there is none."""
    try:
        with open_file(path) as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise os_error("io", exc, path)
    if len(data) > limit:
        raise OpError("too_large", "%s is larger than %d bytes" % (path, limit), path)
    return data.decode("utf-8", "replace")


# --- single files and facts -------------------------------------------------------------


@op("put", root=str, path=str, content=bytes, sha256=str, mode=str)
def op_put(req):
    """Atomic write of one file under the root (steps 1-8 of the protocol). A link where the file
    goes is replaced by the file (the rename), never written through."""
    root = deploy_root(req)
    path = req["path"]
    if not path:
        raise OpError("bad_path", "path must be a non-empty string", path)
    final = os.path.join(path_inside(root, os.path.dirname(path) or "."), os.path.basename(path))
    if os.path.islink(final):
        os.unlink(final)
    data, expected = decode_content(req)
    before = sha256_or_none(final)
    if before == expected:
        record = {"path": final, "changed": False, "before": before, "sha256": expected}
        record.update(stat_record(final))
        return record
    atomic_write(final, data, expected, file_mode(req))
    record = {"path": final, "changed": True, "before": before, "sha256": expected}
    record.update(stat_record(final))
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
    if process_start_time(pid) is None:
        return "%s; its pid %d is no longer running: another process holds the lock" % (record.get("owner") or "?", pid)
    return "%s, pid %d" % (record.get("owner") or "?", pid)


@op("lock", root=str, timeout=NUMBER, owner=str)
def op_lock(req):
    """Exclusive flock on the deploy root, held until this batch ends."""
    root = deploy_root(req)
    timeout = float(req["timeout"])
    path = os.path.join(root, ".lock")
    fd = open_own(path, os.O_RDWR | os.O_CREAT)
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
    holder = json_text({"owner": req["owner"], "pid": os.getpid(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode("utf-8"), 0)
    held_locks.append(fd)
    return {"path": path, "waited_s": round(waited, 3)}


def process_start_time(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            data = f.read()
    except OSError:
        return None
    fields = data.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]
