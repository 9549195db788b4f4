"""The gateway's side: what the controller asks of the router or load balancer in front of the
servers, run by the agent on the gateway's own host (reached as any host is, never by a new
network path).

Each op is one exchange, kept to its deadline, and answers in the gateway's own words: the
controller (``orchestrator/gateway.py``) reads them. HAProxy's runtime API on its unix socket; an
HTTP call to a router's admin API, or through the gateway as a client would send it; an endpoints
file changed under its lock with the atomic write protocol and read back.
"""

from remote_agent.core import NONE, NUMBER, OpError, atomic_write, op, os, os_error, sha256_hex, stat
from remote_agent.web import http_url

# The largest answer read from a gateway (HAProxy's `show stat` of a big backend is a few hundred KB).
GATEWAY_LIMIT = 4 << 20


@op("gateway_socket", path=str, command=str, timeout=NUMBER)
def op_gateway_socket(req):
    """One command to a unix socket that answers and closes (HAProxy's runtime API): its answer."""
    import socket
    import time

    command, path = req["command"], req["path"]
    # One command per request: the runtime API would run a second one after ';' or a newline.
    if not command or any(c in command for c in ";\n\r\x00"):
        raise OpError("bad_request", "one command, without ';' or line breaks")
    deadline = time.monotonic() + float(req["timeout"])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(float(req["timeout"]))
        try:
            sock.connect(path)
        except OSError as exc:
            raise os_error("gateway", exc, path)
        sock.sendall((command + "\n").encode("utf-8"))
        chunks, size = [], 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OpError("gateway", "no whole answer to %r within %s s" % (command, req["timeout"]), path)
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                raise OpError("gateway", "no whole answer to %r within %s s" % (command, req["timeout"]), path)
            except OSError as exc:
                raise os_error("gateway", exc, path)
            if not chunk:
                break
            size += len(chunk)
            if size > GATEWAY_LIMIT:
                raise OpError("gateway", "the answer to %r is over %d bytes" % (command, GATEWAY_LIMIT), path)
            chunks.append(chunk)
    finally:
        sock.close()
    return {"text": b"".join(chunks).decode("utf-8", "replace")}


@op("gateway_http", method=str, url=str, body=(str, NONE), timeout=NUMBER)
def op_gateway_http(req):
    """One HTTP exchange with the gateway (its admin API, or a request through it as a client
    sends one): the status (null when nothing answered) and the body."""
    if req["method"] not in ("GET", "POST", "PUT", "DELETE"):
        raise OpError("bad_request", "method %r" % req["method"])
    if not req["url"].startswith("http://"):
        raise OpError("bad_request", "only http:// URLs: %r" % req["url"])
    body = req["body"].encode("utf-8") if req["body"] is not None else None
    status, text = http_url(req["url"], req["method"], body, float(req["timeout"]), limit=GATEWAY_LIMIT)
    return {"status": status, "text": text}


@op("gateway_endpoints", path=str, action=str, name=(str, NONE), url=(str, NONE), timeout=NUMBER)
def op_gateway_endpoints(req):
    """An endpoints file (``{"endpoints": [{"name", "url"}]}``) as a router that watches it reads it:
    ``read`` it, ``add`` a server (or change its URL) or ``remove`` one, under the file's lock
    (another controller's change is never lost), written with the atomic protocol and read back."""
    import fcntl
    import json
    import time

    path, action, name = req["path"], req["action"], req["name"]
    if action not in ("read", "add", "remove"):
        raise OpError("bad_request", "action %r" % action)
    if action != "read" and not name:
        raise OpError("bad_request", "%s needs the server's name" % action)
    if action == "add" and not req["url"]:
        raise OpError("bad_request", "add needs the server's url")
    if not os.path.isabs(path):
        raise OpError("bad_path", "the endpoints file must be an absolute path", path)
    # The file the router reads, through any link to it: written in place of the link, the new
    # list landed beside the router's file and the router never saw it.
    path = os.path.realpath(path)
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise os_error("gateway", exc, path + ".lock")
    try:
        deadline = time.monotonic() + float(req["timeout"])
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise OpError("gateway", "the endpoints file's lock is held by another process", path)
                time.sleep(0.05)
        endpoints = _read_endpoints(path)
        before = list(endpoints)
        if action != "read":
            endpoints = [e for e in endpoints if e["name"] != name]
            if action == "add":
                endpoints.append({"name": name, "url": req["url"]})
                endpoints.sort(key=lambda e: e["name"])
        changed = endpoints != before
        if changed:
            data = (json.dumps({"endpoints": endpoints}, indent=2, sort_keys=True) + "\n").encode("utf-8")
            atomic_write(path, data, sha256_hex(data), 0o644)
            if _read_endpoints(path) != endpoints:
                raise OpError("gateway", "the endpoints file does not read back as written", path)
        return {"endpoints": endpoints, "changed": changed}
    finally:
        os.close(fd)


def _read_endpoints(path):
    import json

    try:
        # Never waited on: a FIFO in its place held the agent (and the rollout) for ever.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise os_error("gateway", exc, path)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OpError("gateway", "the endpoints file is not a regular file: left as it is", path)
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(GATEWAY_LIMIT + 1)
        except OSError as exc:
            raise os_error("gateway", exc, path)
    if len(raw) > GATEWAY_LIMIT:
        raise OpError("gateway", "the endpoints file is over %d bytes" % GATEWAY_LIMIT, path)
    try:
        doc = json.loads(raw.decode("utf-8")) if raw.strip() else {"endpoints": []}
    except ValueError as exc:
        raise OpError("gateway", "the endpoints file is not JSON (%s): left as it is" % exc, path)
    endpoints = doc.get("endpoints") if isinstance(doc, dict) else None
    if not isinstance(endpoints, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("url"), str) for e in endpoints
    ):
        raise OpError("gateway", 'the endpoints file is not {"endpoints": [{"name", "url"}]}: left as it is', path)
    return [{"name": e["name"], "url": e["url"]} for e in endpoints]
