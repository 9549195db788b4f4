"""The transport's TCP socket re-arms quick ACKs after every read (Linux), on real loopback TCP."""

from __future__ import annotations

import socket

import pytest

from orchestrator.connectors.ssh import _PromptAckSocket

pytestmark = [
    pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux-only"),
    pytest.mark.usefixtures("loopback"),
]


def test_every_read_leaves_the_socket_in_quick_ack_mode() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        plain = socket.create_connection(server.getsockname())
        client = _PromptAckSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        peer, _ = server.accept()
        with client, peer:
            # Back-and-forth traffic is what makes the kernel switch to delayed ACKs.
            for i in range(20):
                client.sendall(b"ping %d" % i)
                assert peer.recv(64) == b"ping %d" % i
                peer.sendall(b"pong %d" % i)
                assert client.recv(64) == b"pong %d" % i
                assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1
