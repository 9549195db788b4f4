"""The agent's entry: read a request, check each op against its spec, run the ops, answer.

A request is marshal data framed by its length: ``{"v": 1, "session": bool, "events": bool,
"ops": [...], "findings": [...], "key": hex}`` (``key``: the controller's, which signs the digest
cache's lines). Ops run in order. The batch stops at the first failure (the
rest are answered ``skipped``) unless that op's index is in ``findings``: then its failure is a
finding of the batch, reported, and the ops after it run (verify and watch read every gate this
way in one round trip). Every failure is a structured record (op, code, message, path, errno),
never a traceback for the controller to parse.

An op may take a value from an earlier answer of the same batch: ``{"$ref": key}`` (the whole
answer) or ``{"$ref": key, "field": name}``, where ``key`` is the op's name, or ``name:process``
for ops about a named process or model (as the controller finds answers). Only the keys whose
spec says ``REF`` take one (a list of them for a list), so nothing in the user's data (an
environment, a file) is ever read as a reference. A reference to an op that has not run, or
failed, is a ``bad_request``.

A session (``orchestrate watch``) is one process that answers request after request, each answer
framed by its length, until the controller closes stdin.
"""

import binascii
import errno
import marshal
import os
import sys

from remote_agent.core import (
    OPS,
    PROTOCOL_VERSION,
    REF,
    OpError,
    check,
    digest_caches,
    events_wanted,
    held_locks,
    json_text,
    request_digest_key,
    send_event,
)

REQUEST = {"v": int, "session": bool, "events": bool, "ops": list, "findings": list, "key": str}


def _key(req):
    name = req.get("name")
    return "%s:%s" % (req["op"], name) if isinstance(name, str) and name else req["op"]


def _answer_of(name, key, ref, done):
    if not isinstance(ref, dict) or set(ref) - {"$ref", "field"} or not isinstance(ref.get("$ref"), str):
        raise OpError("bad_request", "%s: %r is not a reference" % (name, key))
    if ref["$ref"] not in done:
        raise OpError("bad_request", "%s: %r refers to %r, which has not run in this batch" % (name, key, ref["$ref"]))
    answer, field = done[ref["$ref"]], ref.get("field")
    if field is None:
        return answer
    if not isinstance(answer, dict) or field not in answer:
        raise OpError(
            "bad_request", "%s: %r refers to %r's %r, which its answer does not hold" % (name, key, ref["$ref"], field)
        )
    return answer[field]


def _resolved(name, spec, req, done):
    """The request with the references its spec allows replaced by the answers they name."""
    out = dict(req)
    for key, kinds in spec.items():
        if key not in req or not isinstance(kinds, tuple) or REF not in kinds:
            continue
        value = req[key]
        if isinstance(value, dict):
            out[key] = _answer_of(name, key, value, done)
        elif isinstance(value, list):
            out[key] = [_answer_of(name, key, v, done) if isinstance(v, dict) else v for v in value]
    return out


def _error(name, code, message, path=None, err=None):
    return {
        "op": name,
        "ok": False,
        "error": {"op": name, "code": code, "message": message, "path": path, "errno": err},
    }


def run(request):
    """Every op of the request in order; the answer with one result per op."""
    request_digest_key[0] = request["key"]
    results: list[dict] = []
    done: dict[str, object] = {}
    findings = set(request["findings"])
    failed = False
    for index, req in enumerate(request["ops"]):
        name = req.get("op") if isinstance(req, dict) else None
        if failed:
            results.append({"op": name, "ok": False, "skipped": True})
            continue
        try:
            if name not in OPS:
                raise OpError("unknown_op", "unknown operation %r" % (name,))
            function, spec = OPS[name]
            args = check(name, dict(spec, op=str), _resolved(name, spec, req, done))
            send_event({"op": name})
            value = function(args)
            results.append({"op": name, "ok": True, "result": value})
            done[_key(req)] = value
            continue
        except OpError as exc:
            results.append(_error(name, exc.code, exc.message, exc.path, exc.errno))
        except OSError as exc:
            message = "%s: %s" % (errno.errorcode.get(exc.errno or 0, "error"), exc.strerror or exc)
            results.append(_error(name, "io", message, getattr(exc, "filename", None), exc.errno))
        except Exception as exc:
            results.append(_error(name, "internal", "%s: %s" % (type(exc).__name__, exc)))
        failed = index not in findings
    for cache in digest_caches.values():  # what the batch's uploads recorded, written once
        try:
            cache.save()
        except (OpError, OSError):
            pass  # a cache: the next batch hashes again
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
        raise ValueError(
            "protocol version %r, agent speaks %d"
            % (request.get("v") if isinstance(request, dict) else None, PROTOCOL_VERSION)
        )
    try:
        check("the request", REQUEST, request)
    except OpError as exc:
        raise ValueError(exc.message)
    try:
        binascii.unhexlify(request["key"])
    except (binascii.Error, ValueError):
        raise ValueError("the digest key is not hex")
    return request


def _answer(response, framed):
    # Lone surrogates (undecodable file names) leave as \udcXX escapes: still valid JSON.
    out = json_text(response).encode("utf-8", "backslashreplace")
    if framed:
        out = b"%d\n" % len(out) + out
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()


def _end_batch():
    """What a batch held ends with it: its locks. The digest caches stay (each entry is checked
    against its file's stat before it is used)."""
    while held_locks:
        os.close(held_locks.pop())


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
    """The agent's entry on the host: read the batch, check each request, run the ops in order,
    write the answer."""
    stdin = sys.stdin.buffer
    try:
        request = _read_request(stdin)
        if request is None:
            raise EOFError("no request")
    except (ValueError, EOFError, TypeError) as exc:
        response = {"v": PROTOCOL_VERSION, "error": "bad request: %s" % exc, "results": []}
    else:
        if request["session"]:
            _session(stdin)
            return
        events_wanted[0] = request["events"]
        response = run(request)
    _answer(response, False)


if __name__ == "__main__":
    main()
