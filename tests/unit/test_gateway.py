"""The gateway's adapters, pure: the commands each sends, the readers of each gateway's answers
(hostile ones included), the playbook's ``gateway:`` block, and the agent's gateway ops run for
real (a unix socket that answers, an endpoints file changed under its lock). Whole rollouts
against real HAProxy and vllm-router are in ``tests/integration/test_gateway.py``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agent import protocol
from orchestrator.config.gateway import KINDS, Gateway
from orchestrator.config.inventory import Container, SshSettings
from orchestrator.config.playbook import load_playbook
from orchestrator.errors import GatewayError, InputError
from orchestrator.gateways import base, command, haproxy, vllm_router
from orchestrator.rules import serving
from tests.unit.test_agent import run

STAT_HEAD = (
    "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,weight,act\n"
)


def stat_row(px: str, sv: str, scur: int, status: str, weight: int = 1, qcur: int = 0) -> str:
    return f"{px},{sv},{qcur},0,{scur},3,,10,0,0,0,0,,0,0,0,0,{status},{weight},1\n"


def test_haproxy_show_stat_reads_rotation_and_in_flight_of_its_backend_only() -> None:
    text = (
        STAT_HEAD
        + stat_row("users", "FRONTEND", 9, "OPEN")
        + stat_row("vllm", "g1", 2, "UP", qcur=1)
        + stat_row("vllm", "g2", 1, "DRAIN")
        + stat_row("vllm", "g3", 0, "MAINT")
        + stat_row("vllm", "g4", 0, "UP", weight=0)
        + stat_row("vllm", "g5", 0, "no check")
        + stat_row("vllm", "g6", 0, "DOWN 1/2")
        + stat_row("vllm", "BACKEND", 3, "UP")
        + stat_row("other", "g1", 7, "DOWN")
        + "\n"
    )
    rotation = haproxy.read_haproxy_stat(text, "vllm")
    assert {k: (m.in_rotation, m.in_flight) for k, m in rotation.members.items()} == {
        "g1": (True, 3),
        "g2": (False, 1),
        "g3": (False, 0),
        "g4": (False, 0),  # UP at weight 0 takes no new request
        "g5": (True, 0),
        "g6": (False, 0),
    }
    assert rotation.serving() == 2 and rotation.serving(besides="g1") == 1
    server = base.Server("g9", "g9", "http://10.0.0.9:8000")
    assert rotation.of(server) == base.Member("g9", False, None, "absent")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("Unknown command. Please enter one of the following commands only :\n  help\n", "did not answer with its CSV"),
        ("", "did not answer with its CSV"),
        ("# pxname,svname,status\nvllm,g1,UP\n", "no column qcur, scur, weight"),
        (STAT_HEAD + stat_row("other", "g1", 0, "UP"), "no backend 'vllm'"),
        (STAT_HEAD + "vllm,g1,x,0,y,3,,10,0,0,0,0,,0,0,0,0,UP,1,1\n", "is not numbers"),
    ],
)
def test_haproxy_answers_that_cannot_be_read_are_gateway_errors(text: str, said: str) -> None:
    with pytest.raises(GatewayError, match=said):
        haproxy.read_haproxy_stat(text, "vllm")


def test_haproxy_changes_answer_nothing_when_they_work_and_their_words_when_refused() -> None:
    haproxy.haproxy_changed("\n", "set server vllm/g1 state drain")
    with pytest.raises(GatewayError, match=r"HAProxy refused `set server vllm/g9 state drain`: No such server\."):
        haproxy.haproxy_changed("No such server.\n\n", "set server vllm/g9 state drain")


def test_vllm_router_workers_and_their_loads() -> None:
    text = json.dumps(
        {
            "workers": [
                {"url": "http://10.0.0.1:8000", "load": 2, "is_healthy": True},
                {"url": "http://10.0.0.2:8000", "load": -1, "is_healthy": True},
                {"url": "http://10.0.0.3:8000", "load": True, "is_healthy": False},
            ]
        }
    )
    rotation = vllm_router.read_router_workers(200, text)
    assert {k: (m.in_rotation, m.in_flight) for k, m in rotation.members.items()} == {
        "http://10.0.0.1:8000": (True, 2),
        "http://10.0.0.2:8000": (True, None),  # -1: the router does not know
        "http://10.0.0.3:8000": (False, None),  # a bool is not a load; unhealthy takes no traffic
    }
    assert vllm_router.read_router_urls(200, '{"urls": ["http://a:1"]}').members["http://a:1"].in_rotation


@pytest.mark.parametrize(
    ("status", "text", "said"),
    [
        (None, "[Errno 111] Connection refused", "no answer .*Connection refused"),
        (500, "boom", "HTTP 500: boom"),
        (200, "<html>", "is not JSON"),
        (200, '{"workers": {}}', "is not"),
        (200, '{"workers": [{"load": 1}]}', "without a url"),
        (200, "[]", "is not"),
    ],
)
def test_vllm_router_answers_that_cannot_be_read(status: int | None, text: str, said: str) -> None:
    with pytest.raises(GatewayError, match=said):
        vllm_router.read_router_workers(status, text)


def test_vllm_router_is_asked_with_the_worker_url_quoted() -> None:
    adapter = vllm_router.RouterAdapter(Gateway("vllm-router", "gw", "http://127.0.0.1:30000"))
    server = base.Server("g1", "http://10.0.0.1:8000", "http://10.0.0.1:8000")
    op, check = adapter.change(server, into=False)
    assert op.request["method"] == "POST"
    assert op.request["url"] == "http://127.0.0.1:30000/remove_worker?url=http%3A%2F%2F10.0.0.1%3A8000"
    check(protocol.HttpAnswer(200, "Successfully removed worker"))
    with pytest.raises(GatewayError, match="HTTP 400"):
        check(protocol.HttpAnswer(400, "bad url"))
    admin = vllm_router.RouterAdapter(
        Gateway("vllm-router", "gw", "http://127.0.0.1:30000", admin="http://127.0.0.1:30001")
    )
    assert admin.change(server, into=True)[0].request["url"].startswith("http://127.0.0.1:30001/add_worker?url=")


def test_haproxy_commands_name_the_backend_and_server() -> None:
    spec = Gateway("haproxy", "gw", "http://127.0.0.1:80", socket="/run/h.sock", backend="vllm", servers={"g1": "s-1"})
    adapter = haproxy.HaproxyAdapter(spec)
    server = base.Server("g1", adapter.key("g1", "http://x:1"), "http://x:1")
    assert server.key == "s-1"
    op, _ = adapter.change(server, into=False)
    assert op.request == {
        "op": "gateway_socket",
        "path": "/run/h.sock",
        "command": "set server vllm/s-1 state drain",
        "timeout": 10.0,
    }
    assert adapter.change(server, into=True)[0].request["command"] == "set server vllm/s-1 state ready"


def output(code: int, text: str) -> protocol.Output:
    return protocol.Output(code, text)


def test_the_command_hook_gets_the_host_on_stdin_and_must_say_where_it_stands() -> None:
    server = base.Server("g1", "g1", "http://10.0.0.1:8000")
    assert json.loads(command.hook_request("out", server)) == {
        "action": "out",
        "host": {"name": "g1", "url": "http://10.0.0.1:8000", "address": "10.0.0.1", "port": 8000},
    }
    member = command.read_hook(output(0, 'draining g1\n{"in_rotation": false, "in_flight": 3}\n'), "out", server)
    assert (member.in_rotation, member.in_flight) == (False, 3)
    for code, text, said in [
        (3, "lb says no", "exited 3: lb says no"),
        (0, "ok", "must end with"),
        (0, '{"in_rotation": "yes"}', "must end with"),
        (0, '{"in_rotation": true, "in_flight": true}', "must end with"),
        (0, '{"in_rotation": true, "in_flight": -1}', "must end with"),
        (0, "", "must end with"),
    ]:
        with pytest.raises(GatewayError, match=said):
            command.read_hook(output(code, text), "out", server)


# --- the playbook's gateway: block ------------------------------------------------------------

BOOK = """\
name: gw
targets: [all]
deploy_root: /srv/dflash
drafter: {{config: drafter.json}}
serving: {{python: /opt/vllm/bin/python, target: /models/t{serving}}}
gateway: {gateway}
"""


def book(tmp_path: Path, gateway_yaml: str, serving_yaml: str = "") -> Path:
    (tmp_path / "drafter.json").write_text('{"model_type": "qwen3"}\n')
    path = tmp_path / "pb.yaml"
    path.write_text(BOOK.format(gateway=gateway_yaml, serving=serving_yaml))
    return path


def test_a_gateway_defaults_drain_and_listening_to_what_a_gateway_needs(tmp_path: Path) -> None:
    pb = load_playbook(book(tmp_path, "{kind: vllm-router, runs_on: gw, url: 'http://127.0.0.1:30000/'}"))
    assert pb.gateway == Gateway("vllm-router", "gw", "http://127.0.0.1:30000")
    assert pb.serving.drain_timeout == 60.0 and pb.serving.stop_timeout == 90
    container = Container("g1", "box", "10.0.0.5", SshSettings())
    command = serving.command(pb, container, "R1")
    argv = list(command.argv)
    assert argv[argv.index("--host") + 1] == "10.0.0.5"  # the container's own address, never 0.0.0.0
    assert argv[argv.index("--shutdown-timeout") + 1] == "60"
    assert command.stop_timeout == 90  # our SIGKILL (and TimeoutStopSec) after vLLM's own drain
    assert serving.url(pb, container) == "http://10.0.0.5:8000"
    with pytest.raises(InputError, match="g1 has no address to listen on"):
        serving.command(pb, Container("g1", "box", None, SshSettings()), "R1")


@pytest.mark.parametrize(("listen", "probe"), [("0.0.0.0", "127.0.0.1"), ("'::'", "::1")])
def test_a_server_on_every_address_is_given_to_the_gateway_at_the_containers_address(
    tmp_path: Path, listen: str, probe: str
) -> None:
    """Loopback is where the container's own agent probes; to the gateway it is the gateway's own
    machine, which would send its users elsewhere (or nowhere)."""
    pb = load_playbook(
        book(tmp_path, "{kind: vllm-router, runs_on: gw, url: 'http://127.0.0.1:30000'}", f", host: {listen}")
    )
    container = Container("g1", "box", "10.0.0.5", SshSettings())
    assert serving.probe_host(pb, container) == probe
    assert serving.url(pb, container) == "http://10.0.0.5:8000"
    local = Container("g1", "box", None, SshSettings(), connection="local")
    assert serving.url(pb, local) == f"http://{'[::1]' if ':' in probe else probe}:8000"
    with pytest.raises(InputError, match=r"g1 listens on .* but has no address a gateway reaches"):
        serving.url(pb, Container("g1", "box", None, SshSettings()))


def test_without_a_gateway_the_server_stays_on_loopback_and_vllms_own_stop(tmp_path: Path) -> None:
    (tmp_path / "drafter.json").write_text('{"model_type": "qwen3"}\n')
    path = tmp_path / "pb.yaml"
    path.write_text(BOOK.split("gateway:")[0].format(serving=""))
    pb = load_playbook(path)
    argv = list(serving.command(pb, Container("g1", "box", "10.0.0.5", SshSettings()), "R1").argv)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--shutdown-timeout" not in argv
    path.write_text(BOOK.split("gateway:")[0].format(serving=", host: 0.0.0.0, drain_timeout: 5"))
    pb = load_playbook(path)
    container = Container("g1", "box", "10.0.0.5", SshSettings())
    assert serving.probe_host(pb, container) == "127.0.0.1"  # asked for every address: probes on loopback
    assert serving.command(pb, container, "R1").argv[-4:-2] == ("--shutdown-timeout", "5")


@pytest.mark.parametrize(
    ("gateway_yaml", "serving_yaml", "said"),
    [
        ("{kind: nginx, runs_on: gw, url: 'http://a:1'}", "", "gateway.kind: expected one of vllm-router, haproxy"),
        ("{kind: haproxy, runs_on: gw, url: 'http://a:1', backend: b}", "", "a haproxy gateway needs 'socket'"),
        (
            "{kind: haproxy, runs_on: gw, url: 'http://a:1', socket: s, backend: b}",
            "",
            "gateway.socket: expected an absolute path",
        ),
        (
            "{kind: haproxy, runs_on: gw, url: 'http://a:1', socket: /s, backend: 'b; disable server b/x'}",
            "",
            "is not an HAProxy name",
        ),
        (
            "{kind: haproxy, runs_on: gw, url: 'http://a:1', socket: /s, backend: b, servers: {g1: 'a b'}}",
            "",
            "'a b' is not an HAProxy name",
        ),
        (
            "{kind: vllm-router, runs_on: gw, url: 'http://a:1', socket: /s}",
            "",
            "gateway.socket: not a key of a vllm-router gateway",
        ),
        ("{kind: vllm-router, runs_on: gw, url: 'https://a:1'}", "", r"gateway.url: expected http://HOST:PORT"),
        ("{kind: vllm-router, runs_on: gw, url: 'http://a:x'}", "", r"gateway.url: 'http://a:x'"),
        ("{kind: vllm-router, runs_on: gw, url: 'http://u:p@a:1'}", "", r"gateway.url: expected http://HOST:PORT"),
        ("{kind: vllm-router, runs_on: gw}", "", "missing required key 'url'"),
        (
            "{kind: command, runs_on: gw, url: 'http://a:1', command: []}",
            "",
            "gateway.command: expected the hook's argv",
        ),
        ("{kind: vllm-router, runs_on: gw, url: 'http://a:1', timeout_s: 0}", "", "gateway.timeout_s"),
        (
            "{kind: haproxy, runs_on: gw, url: 'http://a:1', socket: /s, backend: b, servers: {g1: web, g2: web}}",
            "",
            r"gateway.servers.g2: server 'web' is g1's too: one container, one server",
        ),
        (
            "{kind: vllm-router, runs_on: gw, url: 'http://a:1'}",
            ", extra_args: [--shutdown-timeout, '5']",
            "serving.drain_timeout",
        ),
        # a host the resolver folds into another (fullwidth digits), as every address is held to
        (
            "{kind: vllm-router, runs_on: gw, url: 'http://\uff11\uff10.0.0.1:8000'}",
            "",
            "gateway.url: 'http://\uff11\uff10.0.0.1:8000': '\uff11\uff10.0.0.1' is not an IP address or a host name",
        ),
    ],
)
def test_a_bad_gateway_block_is_one_error_naming_the_key(
    tmp_path: Path, gateway_yaml: str, serving_yaml: str, said: str
) -> None:
    with pytest.raises(InputError, match=said) as caught:
        load_playbook(book(tmp_path, gateway_yaml, serving_yaml))
    assert "pb.yaml:" in str(caught.value)


# --- the agent's gateway ops, run for real ----------------------------------------------------


@pytest.fixture
def runtime_api(tmp_path: Path, loopback: None) -> Iterator[tuple[Path, list[str]]]:
    """A unix socket that answers each command as HAProxy's runtime API does (then closes), and
    records what it was sent."""
    path = tmp_path / "admin.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    seen: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                line = conn.recv(4096).decode()
                seen.append(line)
                conn.sendall(b"No such server.\n\n" if "g9" in line else b"\n")

    threading.Thread(target=serve, daemon=True).start()
    yield path, seen
    listener.close()


def test_the_socket_op_sends_one_command_and_returns_the_answer(runtime_api: tuple[Path, list[str]]) -> None:
    path, seen = runtime_api
    ok, refused = run(
        [
            {"op": "gateway_socket", "path": str(path), "command": "set server vllm/g1 state drain", "timeout": 5},
            {"op": "gateway_socket", "path": str(path), "command": "set server vllm/g9 state drain", "timeout": 5},
        ]
    )
    (two,) = run([{"op": "gateway_socket", "path": str(path), "command": "show stat; shutdown sessions", "timeout": 5}])
    (missing,) = run([{"op": "gateway_socket", "path": str(path) + ".gone", "command": "show stat", "timeout": 5}])
    assert ok["ok"] and ok["result"]["text"] == "\n"
    assert refused["ok"] and refused["result"]["text"].startswith("No such server.")
    assert not two["ok"] and two["error"]["code"] == "bad_request"
    assert not missing["ok"] and missing["error"]["path"] == str(path) + ".gone"
    assert seen == ["set server vllm/g1 state drain\n", "set server vllm/g9 state drain\n"]


def endpoints_op(path: Path, action: str, name: str | None = None, url: str | None = None) -> dict[str, Any]:
    return {"op": "gateway_endpoints", "path": str(path), "action": action, "name": name, "url": url, "timeout": 5}


@pytest.mark.usefixtures("agent")
def test_the_endpoints_file_is_changed_whole_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"
    results = run(
        [
            endpoints_op(path, "read"),
            endpoints_op(path, "add", "g2", "http://10.0.0.2:8000"),
            endpoints_op(path, "add", "g1", "http://10.0.0.1:8000"),
            endpoints_op(path, "add", "g1", "http://10.0.0.1:8000"),
            endpoints_op(path, "remove", "g2"),
        ]
    )
    assert [r["ok"] for r in results] == [True] * 5
    assert results[0]["result"] == {"endpoints": [], "changed": False}
    assert [e["name"] for e in results[2]["result"]["endpoints"]] == ["g1", "g2"]
    assert results[3]["result"]["changed"] is False
    assert json.loads(path.read_text()) == {"endpoints": [{"name": "g1", "url": "http://10.0.0.1:8000"}]}
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.parametrize("content", [b"{not json", b'{"endpoints": {"g1": 1}}', b'{"endpoints": [{"name": 1}]}', b"[]"])
@pytest.mark.usefixtures("agent")
def test_an_endpoints_file_we_cannot_read_is_left_as_it_is(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "endpoints.json"
    path.write_bytes(content)
    (result,) = run([endpoints_op(path, "add", "g1", "http://10.0.0.1:8000")])
    assert not result["ok"] and "left as it is" in result["error"]["message"]
    assert path.read_bytes() == content


@pytest.mark.usefixtures("agent")
def test_an_endpoints_file_reached_through_a_link_is_changed_where_the_router_reads_it(tmp_path: Path) -> None:
    """The playbook names a link (``/etc/router/endpoints.json`` to a shared file, say): the file
    the router reads changes, and the link stays a link (renamed over, the new list landed beside
    the router's file and the router never saw it)."""
    shared = tmp_path / "shared" / "endpoints.json"
    shared.parent.mkdir()
    shared.write_text('{"endpoints": [{"name": "g2", "url": "http://10.0.0.2:8000"}]}\n')
    link = tmp_path / "endpoints.json"
    link.symlink_to(shared)
    (result,) = run([endpoints_op(link, "add", "g1", "http://10.0.0.1:8000")])
    assert result["ok"], result
    assert link.is_symlink() and os.readlink(link) == str(shared)
    assert [e["name"] for e in json.loads(shared.read_text())["endpoints"]] == ["g1", "g2"]


@pytest.mark.parametrize("kind", ["fifo", "directory", "link to a fifo"])
@pytest.mark.usefixtures("agent")
def test_an_endpoints_file_that_is_no_file_is_refused_at_once_and_left(tmp_path: Path, kind: str) -> None:
    """A FIFO in its place held the agent, and the rollout, for ever."""
    path = tmp_path / "endpoints.json"
    if kind == "directory":
        path.mkdir()
    else:
        fifo = tmp_path / "fifo" if kind == "link to a fifo" else path
        os.mkfifo(fifo)
        if fifo != path:
            path.symlink_to(fifo)
    for action in ("read", "add"):
        (result,) = run([endpoints_op(path, action, "g1", "http://10.0.0.1:8000")])  # run() bounds it at 60 s
        assert not result["ok"] and "not a regular file" in result["error"]["message"] + str(result["error"]), result
    assert path.is_dir() if kind == "directory" else (path.is_symlink() or not path.is_file())


@pytest.mark.usefixtures("agent")
def test_a_server_listed_at_another_url_is_out_of_rotation_until_put_back(tmp_path: Path) -> None:
    """Listed under its name at an old address or port, the router sends its users there, not to
    this server: that is not in rotation (it passed verify's gateway gate as IN SYNC)."""
    from orchestrator.gateways.endpoints_file import EndpointsFileAdapter

    path = tmp_path / "endpoints.json"
    path.write_text('{"endpoints": [{"name": "g1", "url": "http://10.0.0.9:8000"}]}\n')
    adapter = EndpointsFileAdapter(Gateway("endpoints-file", "gw", None, path=str(path)))
    server = base.Server("g1", "g1", "http://10.0.0.1:8000")

    def batch(ops: list[Any]) -> protocol.Answers:
        results = run([op.request for op in ops])
        assert all(r["ok"] for r in results), results
        return protocol.Answers.of([(op, op.reader(r["result"])) for op, r in zip(ops, results, strict=True)])

    member = adapter.rotation([server], batch).of(server)
    assert not member.in_rotation and member.status == "listed at http://10.0.0.9:8000, not http://10.0.0.1:8000"
    op, _ = adapter.change(server, True)
    batch([op])
    assert adapter.rotation([server], batch).of(server).in_rotation
    assert json.loads(path.read_text()) == {"endpoints": [{"name": "g1", "url": "http://10.0.0.1:8000"}]}


@pytest.mark.usefixtures("agent")
def test_endpoints_changed_at_once_by_two_agents_are_all_kept(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"
    names = [f"g{i}" for i in range(8)]
    threads = [
        threading.Thread(target=run, args=([endpoints_op(path, "add", n, f"http://10.0.0.{i}:8000")],))
        for i, n in enumerate(names)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [e["name"] for e in json.loads(path.read_text())["endpoints"]] == names


@pytest.mark.usefixtures("agent")
def test_a_hook_asked_about_several_servers_in_one_batch_gives_each_its_own_answer(tmp_path: Path) -> None:
    """Ops of one kind share a key: by key, each server was given the last one's answer, so a host
    about to be drained read another's state (out of rotation) and was stopped undrained, and the
    floor counted servers that were out. Each op's answer is found by the op itself."""
    from orchestrator.agent.client import BOOTSTRAP, decode_response, encode_request, read_answers
    from tests.unit.test_agent import complete

    hook = tmp_path / "hook"
    hook.write_text(
        f"#!{sys.executable}\nimport json, sys\nname = json.load(sys.stdin)['host']['name']\n"
        "print(json.dumps({'in_rotation': name != 'g2', 'in_flight': int(name[1:])}))\n"
    )
    hook.chmod(0o755)
    adapter = command.CommandAdapter(Gateway("command", "gw", "http://127.0.0.1:1", command=(str(hook),)))
    servers = [base.Server(n, n, f"http://10.0.0.{i}:8000") for i, n in enumerate(["g1", "g2", "g3"], 1)]

    def batch(ops: list[Any]) -> protocol.Answers:
        proc = subprocess.run(
            [sys.executable, "-c", BOOTSTRAP], input=encode_request(complete([op.request for op in ops])),
            capture_output=True, timeout=60,
        )  # fmt: skip
        return read_answers("gw", ops, decode_response("gw", proc.returncode, proc.stdout, proc.stderr), 0, "")

    rotation = adapter.rotation(servers, batch)
    assert {k: (m.in_rotation, m.in_flight) for k, m in rotation.members.items()} == {
        "g1": (True, 1), "g2": (False, 2), "g3": (True, 3)
    }  # fmt: skip
    assert rotation.serving(besides="g1") == 1


@pytest.mark.usefixtures("agent")
def test_a_hooks_output_is_held_only_as_far_as_its_tail_however_much_it_writes(tmp_path: Path) -> None:
    """A gateway hook that writes 200 MB before its answer: the agent holds its last 16 KB, not
    the whole (400 MB of output took the agent to 836 MB), and still reads the answer."""
    from orchestrator.agent.client import BOOTSTRAP, encode_request
    from tests.unit.test_agent import complete

    script = "head -c 200000000 /dev/zero | tr '\\0' x; echo; echo '{\"in_rotation\": true, \"in_flight\": 0}'"
    op = {"op": "command", "argv": ["sh", "-c", script], "env": {}, "timeout": 120, "input": None}
    # The agent under a parent that reports the largest peak RSS of what it waited for (the
    # agent; the hook's own processes are small).
    measure = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], stdin=sys.stdin, stdout=sys.stdout)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(p.returncode)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", measure, sys.executable, "-c", BOOTSTRAP],
        input=encode_request(complete([op])), capture_output=True, timeout=180,
    )  # fmt: skip
    out, err = proc.stdout, proc.stderr
    peak_kib = int(err.decode().strip().splitlines()[-1])
    assert proc.returncode == 0, err.decode()
    (result,) = json.loads(out)["results"]
    output = result["result"]["output"]
    assert len(output) <= 16384 and output.endswith('{"in_rotation": true, "in_flight": 0}\n')
    assert peak_kib < 150 * 1024, f"the agent's peak RSS was {peak_kib // 1024} MiB"


@pytest.mark.parametrize("op", ["vllm_build", "command"])
@pytest.mark.usefixtures("agent")
def test_a_program_whose_child_holds_its_output_is_ended_at_the_bound(tmp_path: Path, op: str) -> None:
    """A serving interpreter or a gateway hook that leaves a process behind holding its output
    (a compile worker, a shell's background job): subprocess.run would kill the program and then
    wait for that process's pipe for as long as it lives. The op ends at its bound and the whole
    process group goes with it. (run() gives the agent 60 s: an op that waits fails the test there.)"""
    script = tmp_path / "holds"
    script.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {tmp_path}/child\nsleep 600\n")
    script.chmod(0o755)
    request: dict[str, Any] = (
        {"op": "vllm_build", "python": str(script), "timeout": 2}
        if op == "vllm_build"
        else {"op": "command", "argv": [str(script)], "env": {}, "timeout": 2, "input": "{}"}
    )
    (result,) = run([request])
    assert not result["ok"] and result["error"]["code"] == "timeout", result
    child = int((tmp_path / "child").read_text())
    from tests.unit.localbox import ended

    assert ended(child)  # killed with its group at the bound (a moment to end), not left for 600 s


def test_a_gateway_on_no_container_of_the_inventory_is_bad_input_before_anything_runs(tmp_path: Path) -> None:
    from orchestrator.config.inventory import load_inventory
    from orchestrator.deployment import Deployment

    (tmp_path / "inventory.yaml").write_text(
        "hosts:\n  box:\n    containers:\n      g1: {connection: local, address: 127.0.0.11}\n"
    )
    inventory = load_inventory(tmp_path / "inventory.yaml")
    for on, said in (("gw", "'gw' is not a container of"), ("box", "'box' is not a container of")):
        pb = load_playbook(book(tmp_path, f"{{kind: vllm-router, runs_on: {on}, url: 'http://127.0.0.1:30000'}}"))
        with pytest.raises(InputError, match=said) as caught:
            Deployment(pb, inventory)
        assert caught.value.exit_code == 2 and caught.value.key == "gateway.runs_on"


def test_every_gateway_kind_the_playbook_takes_has_one_adapter_module_and_no_other() -> None:
    """A kind is one row of ``config.gateway.KINDS`` (its keys) and one module of
    ``orchestrator.gateways`` registered under the same name: neither without the other."""
    import pkgutil

    import orchestrator.gateways as gateways
    from orchestrator.gateways import ADAPTERS

    assert list(ADAPTERS) == list(KINDS)
    modules = {m.name for m in pkgutil.iter_modules(gateways.__path__)} - {"base", "client"}
    assert {ADAPTERS[k].__module__.rsplit(".", 1)[1] for k in KINDS} == modules
    assert len(modules) == len(KINDS)  # one module a kind


MOVE = json.loads((Path(__file__).resolve().parents[1] / "data" / "gateways" / "haproxy-2.6.12-move.json").read_text())


def test_haproxy_moves_a_server_to_its_new_port_and_reads_back_where_it_sends_it() -> None:
    """What HAProxy 2.6.12 answered (recorded): the move's words, then `show servers state`."""
    spec = Gateway("haproxy", "gw", "http://127.0.0.1:80", socket="/run/h.sock", backend="b", servers={"g1": "s1"})
    adapter = haproxy.HaproxyAdapter(spec)
    server = base.Server("g1", adapter.key("g1", "http://127.0.0.1:18002"), "http://127.0.0.1:18002")
    (moved, said), (shown, landed) = adapter.move(server)
    assert moved.request["command"] == "set server b/s1 addr 127.0.0.1 port 18002"
    assert shown.request["command"] == "show servers state b"
    said(MOVE["moved"])
    said(MOVE["again"])  # already there: fine
    landed(MOVE["state"])
    assert haproxy.read_server_address(MOVE["state"], "b", "s1") == ("127.0.0.1", 18002)
    elsewhere = base.Server("g1", "s1", "http://127.0.0.1:18003")
    with pytest.raises(GatewayError, match=re.escape("sends b/s1 to 127.0.0.1:18002, not 127.0.0.1:18003")):
        adapter.move(elsewhere)[1][1](MOVE["state"])
    with pytest.raises(
        GatewayError, match=re.escape("HAProxy refused `set server b/s1 addr 127.0.0.1 port 18002`: No such server")
    ):
        said("No such server.\n\n")
    with pytest.raises(GatewayError, match="no answer"):
        said("\n")


def test_haproxy_is_never_asked_for_a_port_it_would_wrap() -> None:
    """HAProxy 2.6.12 took port 99999 as 34463 and said it changed (recorded): such a URL is refused
    before anything is sent."""
    assert MOVE["wrapped_asked"].endswith("port 99999") and "to '34463'" in MOVE["wrapped"]
    spec = Gateway("haproxy", "gw", "http://127.0.0.1:80", socket="/run/h.sock", backend="b")
    adapter = haproxy.HaproxyAdapter(spec)
    for url in ("http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1", "http://:8000"):
        with pytest.raises(GatewayError, match="an address and a port of 1-65535"):
            adapter.move(base.Server("g1", "s1", url))


def test_a_gateway_that_knows_a_server_by_its_url_needs_no_move() -> None:
    router = vllm_router.RouterAdapter(Gateway("vllm-router", "gw", "http://127.0.0.1:30000"))
    assert router.move(base.Server("g1", "http://10.0.0.2:8001", "http://10.0.0.2:8001")) == []
