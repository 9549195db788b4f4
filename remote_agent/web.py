"""HTTP/1.1 as the agent speaks it: one request a connection, straight to the server or the
gateway (never through a proxy of the host's environment), the whole exchange within its deadline.
Its own module so that a batch that only asks a gateway carries neither the serving code nor the
releases' (``remote_agent/__init__.py`` derives what each module needs from its imports)."""

from remote_agent.core import json_text


class _Expired(Exception):
    """The whole of an HTTP exchange did not finish by its deadline."""


HTTP_LIMIT = 64 << 20  # the largest answer read (a vLLM /metrics is a few hundred KB)


def http_request(port, method, path, body=None, timeout=30.0, host="127.0.0.1"):
    """One request to the server and its whole answer, within ``timeout`` seconds in all."""
    url = "http://%s:%d%s" % ("[%s]" % host if ":" in host else host, int(port), path)
    data = json_text(body).encode("utf-8") if body is not None else None
    return http_url(url, method, data, timeout)


def http_url(url, method, data=None, timeout=30.0, limit=None):
    """One HTTP exchange and its whole answer, within ``timeout`` seconds in all: (status, text),
    or (None, why) when nothing whole answered.

    A socket timeout bounds each read only: a server that trickles a byte a second would hold
    the agent for ever (and a watch round with it, leaving one stuck agent a round). So the whole
    exchange runs under an interval timer; past it, the answer is (None, why).

    HTTP/1.1 over a plain socket, one request a connection, never through a proxy of the host's
    environment (the gateway and the server are reached directly): urllib.request would bring
    http.client, email and ssl into every agent that reads /health, 6 MiB of memory and tens of
    milliseconds a start on each host of a watched fleet."""
    import signal

    limit = limit or HTTP_LIMIT
    try:
        host, port, authority, path = _split_url(url)
    except ValueError as exc:
        return None, str(exc)

    def expire(signum, frame):
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(float(timeout), 0.001))
    try:
        try:
            return _exchange(host, port, authority, path, method, data, timeout, limit)
        except OSError as exc:
            return None, str(exc)
    except _Expired:
        return None, "no whole answer to %s %s within %g s" % (method, path, timeout)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _split_url(url):
    """(host, port, authority, path) of an ``http://`` URL; ValueError for anything else."""
    if not url.startswith("http://"):
        raise ValueError("only http:// URLs: %r" % url)
    authority, slash, rest = url[len("http://") :].partition("/")
    path = slash + rest or "/"
    host, port = authority, 80
    if authority.startswith("["):
        host, _, tail = authority[1:].partition("]")
        if tail:
            if not tail.startswith(":"):
                raise ValueError("bad address in URL: %r" % url)
            port = tail[1:]
    elif ":" in authority:
        host, port = authority.rsplit(":", 1)
    try:
        port = int(port)
    except ValueError:
        raise ValueError("bad port in URL: %r" % url)
    if not host or not 0 < port < 65536 or any(c in url for c in " \r\n"):
        raise ValueError("bad URL: %r" % url)
    return host, port, authority, path


def _exchange(host, port, authority, path, method, data, timeout, limit):
    import socket

    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        head = "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nAccept: */*\r\n" % (method, path, authority)
        if data is not None:
            head += "Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data)
        sock.sendall(head.encode("latin-1") + b"\r\n" + (data or b""))
        answer = sock.makefile("rb")
        try:
            line = answer.readline(65537)
            if not line:
                return None, "the server closed the connection without an answer"
            parts = line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                return None, "not an HTTP answer: %r" % line[:80]
            status = int(parts[1])
            headers = {}
            while True:
                line = answer.readline(65537)
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", "").lower():
                body = _chunked(answer, limit)
            elif headers.get("content-length", "").isdigit():
                body = answer.read(min(int(headers["content-length"]), limit + 1))
            else:
                body = answer.read(limit + 1)  # to the end of the connection
        finally:
            answer.close()
        return status, _bounded(body, limit)
    finally:
        sock.close()


def _chunked(answer, limit):
    """A chunked body, up to ``limit`` + 1 bytes (past that it is cut anyway)."""
    body = bytearray()
    while len(body) <= limit:
        size = answer.readline(1026).split(b";", 1)[0].strip()
        try:
            size = int(size, 16)
        except ValueError:
            raise OSError("a chunked answer with a bad chunk size %r" % size[:20])
        if size == 0:
            break
        body += answer.read(min(size, limit + 1 - len(body)))
        if len(body) > limit:
            break
        answer.readline(3)  # the CRLF after the chunk
    return bytes(body)


def _bounded(raw, limit):
    if len(raw) > limit:
        return raw[:limit].decode("utf-8", "replace") + "\n(cut at %d bytes)" % limit
    return raw.decode("utf-8", "replace")
