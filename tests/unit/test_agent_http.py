"""The agent's HTTP client (/health, /metrics, the probe's completions, the gateway's admin API):
HTTP/1.1 over a plain socket against real local servers, each answer form a server or gateway
gives (a length, chunks, to the end of the connection, an error status), and each way one fails
(refused, trickling past the deadline, not HTTP, too large, a URL it cannot take)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from remote_agent.web import http_request, http_url

pytestmark = pytest.mark.usefixtures("loopback")


@pytest.fixture
def server() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """A real http.server: GET /ok (a length), POST /echo (the request back, status 201),
    anything else 404 with a body."""
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            seen.append({"method": "GET", "path": self.path, "host": self.headers["Host"]})
            if self.path == "/ok":
                self._answer(200, b"fine")
            else:
                self._answer(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            data = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append({"method": "POST", "path": self.path, "type": self.headers["Content-Type"], "body": data})
            self._answer(201, data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1], seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def raw_server(answer: Callable[[socket.socket], None], family: int = socket.AF_INET) -> Iterator[int]:
    """A server that reads a request's head and answers with ``answer`` (bytes as they come)."""
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                with contextlib.suppress(OSError):  # the client may hang up first
                    answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def test_answers_with_a_length_and_error_statuses(server: tuple[int, list[dict[str, Any]]]) -> None:
    port, seen = server
    assert http_request(port, "GET", "/ok") == (200, "fine")
    assert http_request(port, "GET", "/missing") == (404, '{"error": "not found"}')
    assert http_request(port, "POST", "/echo", {"prompt": "hi", "max_tokens": 4}) == (
        201,
        '{"prompt":"hi","max_tokens":4}',
    )
    assert seen[0] == {"method": "GET", "path": "/ok", "host": f"127.0.0.1:{port}"}
    assert seen[2]["type"] == "application/json" and json.loads(seen[2]["body"]) == {"prompt": "hi", "max_tokens": 4}


def test_chunked_and_to_the_end_of_the_connection() -> None:
    def chunked(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"vllm:spec_decode", b"_num_drafts_total 7.0\n"):
            conn.sendall(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
        conn.sendall(b"0\r\nX-Trailer: 1\r\n\r\n")

    def to_close(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.0 503 Service Unavailable\r\nServer: old\r\n\r\nloading the model")

    for answer, expected in (
        (chunked, (200, "vllm:spec_decode_num_drafts_total 7.0\n")),
        (to_close, (503, "loading the model")),
    ):
        for port in raw_server(answer):
            assert http_request(port, "GET", "/metrics") == expected


def test_an_ipv6_address_and_a_gateway_url() -> None:
    def ok(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    for port in raw_server(ok, socket.AF_INET6):
        assert http_request(port, "GET", "/health", host="::1") == (200, "{}")
        assert http_url(f"http://[::1]:{port}/v1/models?x=1", "GET") == (200, "{}")


def test_failures_are_answers_not_exceptions() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    status, why = http_request(port, "GET", "/health", timeout=5)
    assert status is None and "Connection refused" in why

    def trickle(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _ in range(100):
            conn.sendall(b"x")
            time.sleep(0.2)

    def garbage(conn: socket.socket) -> None:
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

    def silent(conn: socket.socket) -> None:
        pass  # closes without a word

    def large(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"y" * 5000)

    for port in raw_server(trickle):
        started = time.monotonic()
        status, why = http_request(port, "GET", "/metrics", timeout=1.0)
        assert status is None and why == "no whole answer to GET /metrics within 1 s"
        assert time.monotonic() - started < 5  # the deadline holds the whole exchange, not each read
    for port in raw_server(garbage):
        assert http_request(port, "GET", "/health") == (None, "not an HTTP answer: b'SSH-2.0-OpenSSH_9.2\\r\\n'")
    for port in raw_server(silent):
        assert http_request(port, "GET", "/health") == (None, "the server closed the connection without an answer")
    for port in raw_server(large):
        status, text = http_url(f"http://127.0.0.1:{port}/", "GET", limit=1000)
        assert status == 200 and text == "y" * 1000 + "\n(cut at 1000 bytes)"
    for url in ("https://example.org/", "http://h:99999/", "http://h:x/", "http:///path", "http://h/a b"):
        status, why = http_url(url, "GET")
        assert status is None and url in why, url
