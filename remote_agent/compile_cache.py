"""vLLM's compile cache as the controller takes it from one host to give to others.

A host that compiled (the rollout's first, its canary) has under ``<root>/cache/vllm/
torch_compile_cache`` one hash directory per compile key; the controller lists the ones its READY
start used, with every file's size and digest, and reads them in chunks, to keep a signed copy and
push it (``upload``, digests checked) to hosts of the same key. What it lists and reads is only
what vLLM writes there: regular files of one link, in directories, none reached through a link,
each under a name vLLM gives it (``vllm_wrote``); a hash directory holding anything else (a link
planted to read a secret of the serving user's, a FIFO, a file the serving user dropped beside
vLLM's) is refused, never followed, read or given to other hosts.
"""

from remote_agent.core import (
    OpError,
    deploy_root,
    fsync_dir,
    op,
    open_file,
    os,
    os_error,
    own_tree,
    sha256_file,
    stat,
)
from remote_agent.releases import AOT, CACHE, cache_key_dir, remove_tree

READ_MAX = 8 << 20  # bytes one read answers (base64 in the JSON answer: 11 MB)

# What vLLM writes in a hash directory (vLLM 0.26 and 0.32, ``compilation/backends.py``,
# ``compiler_interface.py``, ``decorators.py``): ``<hash>/rank_<r>_<d>/<model tag>/`` (``backbone``,
# ``dflash_head``) holds its cache index (``vllm_compile_cache.py``, read by ``ast.literal_eval``),
# the key's factors, the graph's and the transformed code's text for people, and one artifact per
# compile range and subgraph (a file, or a directory in VLLM_COMPILE_CACHE_SAVE_FORMAT=unpacked);
# ``rank_<r>_<d>/inductor_cache`` and ``triton_cache`` are Inductor's and Triton's own trees (the
# non-standalone compiler); ``torch_aot_compile/<hash>/`` holds ``rank_<r>_<d>/model`` and
# Inductor's tree. Inside Inductor's and Triton's trees the names are theirs (hashes): any
# regular file. A name anywhere else is not vLLM's.
_RANK = "rank_"
TAG_FILES = ("vllm_compile_cache.py", "cache_key_factors.json", "computation_graph.py", "transformed_code.py")
TREES = ("inductor_cache", "triton_cache")
_WROTE = (
    "rank_<r>_<d>/<model tag>/ holding " + ", ".join(TAG_FILES) + " and artifact_compile_range_<a>_<b>_subgraph_<n>; "
    "rank_<r>_<d>/inductor_cache and triton_cache; torch_aot_compile/<hash>/rank_<r>_<d>/model and inductor_cache"
)


def _number(text):
    return text.isdigit() and text.isascii()


def _rank(name):
    parts = name[len(_RANK) :].split("_") if name.startswith(_RANK) else []
    return len(parts) == 2 and all(_number(p) for p in parts)


def _artifact(name):
    # artifact_compile_range_<start>_<end>_subgraph_<index>
    head, sep, index = name.rpartition("_subgraph_")
    bounds = head[len("artifact_compile_range_") :].split("_") if head.startswith("artifact_compile_range_") else []
    return bool(sep) and _number(index) and len(bounds) == 2 and all(_number(b) for b in bounds)


def _tag(name):
    return bool(name) and name.isascii() and name.replace("_", "").isalnum()


def vllm_wrote(hash_dir, parts, is_dir):
    """Whether ``parts`` (a path below the hash directory ``hash_dir``, ``<hash>`` or
    ``torch_aot_compile/<hash>``) is a directory (``is_dir``) or file vLLM writes there."""
    n = len(parts)
    if hash_dir.startswith(AOT + "/"):
        if parts[0] == "inductor_cache":
            return n > 1 or is_dir
        return _rank(parts[0]) and (is_dir if n == 1 else n == 2 and parts[1] == "model" and not is_dir)
    if not _rank(parts[0]):
        return False
    if n == 1:
        return is_dir
    if parts[1] in TREES:
        return n > 2 or is_dir
    if not _tag(parts[1]):
        return False
    if n == 2:
        return is_dir
    if _artifact(parts[2]):
        return True  # a file, or (unpacked) Inductor's tree of it
    return n == 3 and not is_dir and parts[2] in TAG_FILES


def _check_layout(top, name, path, is_dir):
    parts = os.path.relpath(path, top).split(os.sep)
    if not vllm_wrote(name, parts, is_dir):
        raise OpError(
            "not_vllms",
            "%s is not a name vLLM gives %s in its compile cache (%s): not listed, read or given to other hosts"
            % (path, "a directory" if is_dir else "a file", _WROTE),
            path,
        )


# Where a given cache is uploaded before it is placed: a hash directory vLLM can see is always
# whole (a cut push leaves its files here, resumable, and vLLM never reads a half of one).
GIVEN = ".given"


def _cache_name(name):
    """A hash directory's name relative to the compile cache, as ``cache_key_dir`` cuts it."""
    if not isinstance(name, str) or cache_key_dir("torch_compile_cache/" + name) != name:
        raise OpError("bad_request", "%r is not one of vLLM's compile-cache hash directories" % (name,))
    return name


def _refuse(path, what):
    raise OpError(
        "not_vllms",
        "%s is %s, which vLLM never writes in its compile cache: not listed, read or given to other hosts"
        % (path, what),
        path,
    )


def _directory(path, code="io"):
    """A directory reached through no link (its lstat), else refused: what vLLM never makes."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise os_error(code, exc, path)
    if not stat.S_ISDIR(st.st_mode):
        _refuse(path, _kind(st) if not stat.S_ISREG(st.st_mode) else "a file")


def _kind(st):
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(st.st_mode):
            return what
    return "a device or other special file"


@op("compile_cache_files", root=str, dirs=list, max_bytes=int, max_files=int, digests=bool)
def op_compile_cache_files(req):
    """The files of each hash directory named (None: absent here): path relative to the compile
    cache, size, and (``digests``) sha256. Past ``max_files`` or ``max_bytes`` in all, refused
    (``too_large``)."""
    root = deploy_root(req, create=False)
    cache = own_tree(root, CACHE, make=False) or os.path.join(root, CACHE)  # missing: each dir absent
    # asked before a gift is uploaded into .given: a link there (or on the way to an AOT hash
    # directory) is refused by name here, before any byte is written through it
    for sub in (GIVEN, os.path.join(GIVEN, AOT), AOT):
        own_tree(root, os.path.join(CACHE, sub), make=False)
    out = {}  # type: dict
    total, count = 0, 0
    for name in req["dirs"]:
        top = os.path.join(cache, _cache_name(name))
        if not os.path.lexists(top):
            out[name] = None
            continue
        _directory(top)
        listed = []
        for here, subdirs, files in os.walk(top, onerror=lambda exc: _raise(exc)):
            for sub in subdirs:
                st = os.lstat(os.path.join(here, sub))
                if not stat.S_ISDIR(st.st_mode):
                    _refuse(os.path.join(here, sub), _kind(st))
                _check_layout(top, name, os.path.join(here, sub), True)
            for file in files:
                path = os.path.join(here, file)
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    _refuse(path, _kind(st))
                _check_layout(top, name, path, False)
                if st.st_nlink != 1:
                    _refuse(path, "a file of %d links (another name of it may be anything the user owns)" % st.st_nlink)
                count, total = count + 1, total + st.st_size
                if count > req["max_files"] or total > req["max_bytes"]:
                    raise OpError(
                        "too_large",
                        "the compile cache holds more than %d files or %d bytes: not taken"
                        % (req["max_files"], req["max_bytes"]),
                        top,
                    )
                digest = sha256_file(path, follow=False) if req["digests"] else None
                listed.append({"path": os.path.relpath(path, cache), "size": st.st_size, "sha256": digest})
        out[name] = sorted(listed, key=lambda f: f["path"])
    return {"dirs": out}


def _raise(exc):
    raise os_error("io", exc, getattr(exc, "filename", None))


@op("compile_cache_read", name=str, root=str, path=str, offset=int, length=int)
def op_compile_cache_read(req):
    """Up to ``length`` bytes (at most 8 MiB) of a compile-cache file from ``offset``, base64, with
    the file's size: the file must be a regular file of one link, reached through no link."""
    import base64

    root = deploy_root(req, create=False)
    cache = own_tree(root, CACHE, make=False) or os.path.join(root, CACHE)
    parts = req["path"].split("/")
    if any(p in ("", ".", "..") for p in parts) or cache_key_dir("torch_compile_cache/" + req["path"]) is None:
        raise OpError("bad_request", "%r is not a file of a compile-cache hash directory" % req["path"])
    where = cache
    for part in parts[:-1]:  # no link on the way: the path stays inside the compile cache
        where = os.path.join(where, part)
        _directory(where)
    path = os.path.join(where, parts[-1])
    if req["offset"] < 0 or not 0 < req["length"] <= READ_MAX:
        raise OpError("bad_request", "a read takes an offset and 1 to %d bytes" % READ_MAX, path)
    try:
        with open_file(path, follow=False) as f:
            st = os.fstat(f.fileno())
            if st.st_nlink != 1:
                _refuse(path, "a file of %d links" % st.st_nlink)
            f.seek(req["offset"])
            data = f.read(req["length"])
    except OSError as exc:
        raise os_error("io", exc, path)
    return {"size": st.st_size, "data": base64.b64encode(data).decode("ascii")}


@op("compile_cache_place", root=str, dirs=list)
def op_compile_cache_place(req):
    """Move each uploaded hash directory from ``.given`` to where vLLM looks for it (a rename: it
    appears whole), unless the host has one of that key by now (vLLM's own: kept, the upload
    dropped)."""
    root = deploy_root(req, create=False)
    cache = own_tree(root, CACHE)
    for sub in (GIVEN, os.path.join(GIVEN, AOT), AOT):
        own_tree(root, os.path.join(CACHE, sub), make=False)
    placed, kept = [], []
    for name in req["dirs"]:
        src, dst = os.path.join(cache, GIVEN, _cache_name(name)), os.path.join(cache, name)
        _directory(src, "missing")
        for here, subdirs, files in os.walk(src, onerror=lambda exc: _raise(exc)):
            for entry, is_dir in [(d, True) for d in subdirs] + [(f, False) for f in files]:
                _check_layout(src, name, os.path.join(here, entry), is_dir)
        try:
            os.rmdir(dst)  # an empty hash directory (vLLM made it and ended before it wrote): no cache
        except OSError:
            pass  # not there, or the host's own cache of that key: kept below
        if os.path.lexists(dst):
            kept.append(name)
            remove_tree(src, ignore_errors=True)
            continue
        try:
            os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
            os.rename(src, dst)
            fsync_dir(os.path.dirname(dst))
        except OSError as exc:
            raise os_error("io", exc, dst)
        placed.append(name)
    try:
        os.rmdir(os.path.join(cache, GIVEN, "torch_aot_compile"))  # emptied by the moves
    except OSError:
        pass
    return {"placed": placed, "kept": kept}
