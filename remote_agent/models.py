"""Model directories on the host: their files' digests, safetensors headers, tokens, and uploads.

Weights are read where the server reads them and never pulled to the controller: digests come
from the deploy root's cache (a stat per file) or are hashed now; the drafter's safetensors
headers (never the tensors) and the target's tokenizer files are read for the gates that judge
them. Uploads stream a file on stdin after the request, resumable from what a cut one left.
"""

from remote_agent.core import (
    CHUNK,
    DIGESTS,
    NONE,
    OpError,
    builtin_sha256,
    deploy_root,
    digest_cache,
    fcntl,
    file_mode,
    fsync_dir,
    items,
    model_names,
    model_path,
    op,
    open_file,
    os,
    os_error,
    read_small,
    stat,
    sys,
    unlink_quietly,
)
from remote_agent.releases import link_target, release_models

# What safetensors' reader (vLLM loads weights through its safe_open) requires of a file before it
# gives a single tensor, from its read_metadata and Metadata.validate: a header length within
# 100,000,000 and the file, UTF-8 JSON of an object, string metadata, and per tensor a
# known dtype, a shape of sizes and data offsets that tile the data from byte 0 to the file's
# end, each span exactly shape x dtype bytes. Checked here so that the weights gate never passes
# a file the server would refuse to load (a truncated copy, a header edited by hand).
HEADER_LIMIT = 100000000
# safetensors 0.8's dtypes that torch (vLLM's) can hold, in bits: F6_E2M3 and F6_E3M2 parse but
# no torch tensor takes them ("Dtype not understood" at load).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


def _size_value(value):
    """A JSON number as safetensors reads a size (an unsigned 64-bit integer), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        return None
    return value


def _safetensors_header(path):
    """Tensor names, dtypes and shapes from a safetensors file's JSON header (never the tensors),
    once the header proves a file safetensors would load."""
    import json

    def bad(message, *args):
        return OpError("bad_weights", ("%s: " % path) + (message % args), path)

    def not_json(text):
        raise ValueError(text)

    with open_file(path) as f:
        total = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if size <= 1 or size > HEADER_LIMIT or 8 + size > total:
            raise OpError(
                "bad_weights",
                "%s is not a safetensors file (header length %d, file of %d bytes)" % (path, size, total),
                path,
            )
        data = f.read(size)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the safetensors header is not UTF-8")
    try:
        header = json.loads(text, parse_constant=not_json)  # NaN and Infinity are not JSON
    except ValueError:
        raise bad("the safetensors header is not JSON")
    except RecursionError:  # a header nested past the parser's depth: not one safetensors writes
        raise bad("the safetensors header is nested too deeply")
    if not isinstance(header, dict):
        raise bad("the safetensors header is not an object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("__metadata__ must map names to strings")
    tensors, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise bad("tensor %r is not an object", name)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise bad("tensor %r has dtype %r, not one the server can load", name, dtype)
        if not isinstance(shape, list) or any(_size_value(d) is None for d in shape):
            raise bad("tensor %r has shape %r, not a list of sizes", name, shape)
        if not isinstance(offsets, list) or len(offsets) != 2 or any(_size_value(o) is None for o in offsets):
            raise bad("tensor %r has data_offsets %r, not [begin, end]", name, offsets)
        spans.append((offsets[0], offsets[1], name, dtype, shape))
        tensors[name] = {"dtype": dtype, "shape": shape}
    end = 0
    for begin, stop, name, dtype, shape in sorted(spans):
        if begin != end or stop < begin:
            raise bad("tensor %r has data_offsets [%d, %d]: the data before it ends at %d", name, begin, stop, end)
        count = 1
        for d in shape:
            count *= d
        bits = count * DTYPE_BITS[dtype]
        if bits % 8:
            raise bad("tensor %r is %s %r: %d bits, not whole bytes", name, dtype, shape, bits)
        if stop - begin != bits // 8:
            raise bad(
                "tensor %r is %s %r, %d bytes, but its data_offsets hold %d",
                name,
                dtype,
                shape,
                bits // 8,
                stop - begin,
            )
        end = stop
    if 8 + size + end != total:
        raise bad(
            "the tensors' data ends at byte %d and the file at %d (%s)",
            8 + size + end,
            total,
            "truncated" if total < 8 + size + end else "bytes after the last tensor",
        )
    return tensors


WEIGHTS_INDEX = "model.safetensors.index.json"


def _loaded_weights(source, names):
    """The safetensors files vLLM's loader reads from a model directory: the top level's
    ``*.safetensors`` (a glob: no subdirectory), and when the directory holds an index, only those
    its weight_map names, every one of which must be there (vLLM 0.32, default_loader's
    _prepare_weights and filter_duplicate_safetensors_files: a shard the index does not name is
    never loaded, one it names and the directory lacks fails the load)."""
    import json

    names = [n for n in names if "/" not in n and n.endswith(".safetensors")]
    index = os.path.join(source, WEIGHTS_INDEX)
    text = read_small(index, 16 * CHUNK)
    if text is None:
        return names
    try:
        weight_map = json.loads(text)["weight_map"]
    except (ValueError, TypeError, KeyError, RecursionError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise OpError("bad_weights", "%s: no weight_map of tensor names to files (vLLM cannot read it)" % index, index)
    named = set(weight_map.values())
    missing = sorted(named - set(names))
    if missing:
        raise OpError(
            "bad_weights",
            "%s names %s, which the directory does not hold as a safetensors file (vLLM refuses to load it)"
            % (index, ", ".join(missing)),
            index,
        )
    return [n for n in names if n in named]


@op(
    "model_files",
    name=str,
    root=str,
    path=str,
    files=(list, NONE),
    config=bool,
    headers=bool,
    rehash=bool,
    record=bool,
    skip=list,
    tokens=list,
)
def op_model_files(req):
    """The files of a model directory with their digests (the cache's, or hashed now), and on
    request its config.json as text and its safetensors headers. Reads only: the cache is
    written when ``record`` (under the lock, by a deploy)."""
    root = deploy_root(req, create=req["record"])
    source = model_path(req["path"])
    skip = set(req["skip"])
    names = [n for n in model_names(source, req["files"]) if n not in skip]
    digests = digest_cache(root)
    digests.merge(os.path.join(source, DIGESTS))  # what a push recorded there
    current = link_target(root, "current")
    recorded = release_models(os.path.join(root, "releases", current)) if current else {}
    prefix = source + "/"
    pins = dict((p[len(prefix) :], d) for p, d in recorded.items() if p.startswith(prefix))
    files, missing = [], []
    for name in names:
        path = os.path.join(source, name)
        digest, verified = digests.digest(path, req["rehash"])
        if digest is None:
            missing.append(name)
            continue
        files.append({"path": name, "size": os.stat(path).st_size, "sha256": digest, "verified": verified})
    # pins: the digests the current release was proven with from this directory (None: it served
    # nothing from here: another directory, or a release from before models were recorded).
    out = {"path": source, "files": files, "missing": missing, "pins": pins or None, "release_id": current}
    if req["files"] is not None:
        # Pinned by name: what else the directory holds is not what was pinned (a planted shard
        # that an index names would be loaded).
        asked = set(names) | skip
        out["extra"] = [n for n in model_names(source) if n not in asked]
    if req["config"]:
        out["config"] = read_small(os.path.join(source, "config.json"))
    if req["tokens"]:
        out["tokens"] = _name_tokens(source, [t for t in req["tokens"] if isinstance(t, int)])
    if req["headers"]:
        out["headers"] = dict(
            (name, _safetensors_header(os.path.join(source, name)))
            for name in _loaded_weights(source, [f["path"] for f in files])
        )
    if req["record"]:
        digests.save()
    return out


TOKENIZER_LIMIT = 64 * CHUNK  # tokenizer.json of a 250k vocabulary is ~20 MB


def _json_file(path, limit):
    """A JSON object from a file, or None (missing, too large, unreadable: naming a token is worth
    no failure of the op that asked)."""
    import json

    try:
        text = read_small(path, limit)
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
    roles: dict[str, list[str]] = {}
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
            out[str(token_id)] = {
                "kind": "added",
                "content": content[:100],
                "special": special,
                "roles": roles.get(content, []),
            }
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


def _drop_partials(path, keep=None):
    """Remove what cut uploads of ``path`` left for other contents than ``keep`` (a digest): once a
    version of the file is whole in place, those prefixes serve nothing. Only names this agent
    makes (``.<name>.partial-<16 hex>``, regular files) are touched."""
    directory, base = os.path.dirname(path), os.path.basename(path)
    prefix = ".%s.partial-" % base
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        tag = name[len(prefix) :] if name.startswith(prefix) else ""
        if len(tag) != 16 or tag.strip("0123456789abcdef") or (keep is not None and tag == keep[:16]):
            continue
        found = os.path.join(directory, name)
        try:
            if stat.S_ISREG(os.lstat(found).st_mode):
                os.unlink(found)
        except OSError:
            pass


def _prefix_sha256(path, size):
    h = builtin_sha256() if size <= CHUNK else __import__("hashlib").sha256()
    with open_file(path) as f:
        left = size
        while left:
            block = f.read(min(CHUNK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


@op("upload_status", root=str, files=list, replace=bool)
def op_upload_status(req):
    """For each file to push: already there (its digest matches), or how much of it an upload
    cut short left behind, with the digest of that prefix (so the upload can resume after it).

    A push replaces only what a push put there: a file at a path no push of this controller's
    recorded in the directory's signed cache (an operator's own file, a model downloaded by
    hand, a link) is refused before any byte is sent, unless ``replace`` (the playbook's
    ``replace: true``). A file a push made and someone changed since is the push's to repair."""
    root = deploy_root(req, create=False)
    digests = digest_cache(root)
    pushed = set(entry[4] for entry in digests.known.values())  # the real paths pushes recorded
    specs = items(req, "files", path=str, size=int, sha256=str)
    if not req["replace"]:
        foreign = []
        for spec in specs:
            path = model_path(spec["path"])
            # What already holds the bytes pushed is kept as it is, whoever made it; anything
            # else at the path (a file, a link, a directory) is replaced only if a push made it.
            theirs = os.path.lexists(path) and not {path, os.path.realpath(path)} & pushed
            if theirs and digests.digest(path)[0] != spec["sha256"]:
                foreign.append(path)
        if foreign:
            raise OpError(
                "not_ours",
                "%s %s not put there by a push of this controller's: a push replaces only what it "
                "pushed (left as %s: remove %s, or set the model's replace: true)"
                % (
                    ", ".join(foreign[:5]) + (" and %d more" % (len(foreign) - 5) if len(foreign) > 5 else ""),
                    "was" if len(foreign) == 1 else "were",
                    "it is" if len(foreign) == 1 else "they are",
                    "it" if len(foreign) == 1 else "them",
                ),
                foreign[0],
            )
    out = []
    for spec in specs:
        path, digest, size = model_path(spec["path"]), spec["sha256"], spec["size"]
        have, _ = digests.digest(path)
        record = {"path": path, "present": have == digest, "partial": 0, "partial_sha256": None}
        if record["present"]:
            _drop_partials(path)  # the push finds it whole: what earlier cut pushes left goes
        else:
            try:
                st = os.lstat(_partial(path, digest))
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode) and 0 < st.st_size <= size:
                record["partial"] = st.st_size
                record["partial_sha256"] = _prefix_sha256(_partial(path, digest), st.st_size)
        out.append(record)
    return {"files": out}


@op("upload", name=str, root=str, path=str, size=int, sha256=str, offset=int, mode=str)
def op_upload(req):
    """A file streamed on stdin after the request (``size - offset`` bytes), appended to what an
    earlier upload left at ``offset``, then checked whole against ``sha256``, renamed into place
    (fsync, rename, directory fsync) and read back afresh. Memory stays flat whatever the size."""
    root = deploy_root(req)
    path, digest = model_path(req["path"]), req["sha256"]
    size, offset = req["size"], req["offset"]
    if len(digest) != 64 or not 0 <= offset <= size:
        raise OpError("bad_request", "upload needs a sha256, a size and an offset within it", path)
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise os_error("io", exc, directory)
    partial = _partial(path, digest)
    try:
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise os_error("io", exc, partial)
    h = builtin_sha256() if size <= CHUNK else __import__("hashlib").sha256()
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
                view = view[os.write(fd, view) :]
            h.update(block)
            left -= len(block)
        os.fsync(fd)
        written = os.fstat(fd)
    except OSError as exc:
        raise os_error("io", exc, partial)
    finally:
        os.close(fd)
    if h.hexdigest() != digest:
        unlink_quietly(partial)
        raise OpError("checksum", "the uploaded bytes hash to %s, expected %s" % (h.hexdigest(), digest), path)
    try:
        os.chmod(partial, file_mode(req))
        os.replace(partial, path)
        fsync_dir(directory)
    except OSError as exc:
        raise os_error("io", exc, path)
    # Read back through a fresh open of the final path: the very file hashed above (same device,
    # inode, size and mtime: nothing wrote it since) is what a reader gets there. Hashing many GB a
    # second time would double the host's work for nothing more; any other answer is hashed whole.
    digests = digest_cache(root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise os_error("io", exc, path)
    same = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (
        written.st_dev,
        written.st_ino,
        written.st_size,
        written.st_mtime_ns,
    )
    if same and stat.S_ISREG(st.st_mode):
        digests.known[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, path)
        digests.dirty = True
    else:
        got, _ = digests.digest(path, rehash=True)
        if got != digest:
            raise OpError("drift", "read-back of %s: sha256 %s, expected %s" % (path, got, digest), path)
    # Saved once the batch ends (dispatch): saving it after each of a batch's uploads rewrote and
    # re-signed the whole cache every file (783 files of a compile cache: 4 s instead of 0.6).
    _drop_partials(path)  # whole in place: cut uploads of other versions of it serve nothing now
    return {"path": path, "size": size, "sha256": digest, "written": size - offset}
