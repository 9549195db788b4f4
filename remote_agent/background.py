"""A deploy's loader and engine checks in one serving-Python process, in the background.

``checks_start`` (in the staging exec) starts the process and answers at once; ``checks_wait`` (in a
later exec: before the switch, or beside the launch where nothing serves yet) reads what it found,
or stops it when the run no longer needs it. The loader's view is the loader gate's (``checks``:
its cache), vLLM's verdict the engine gate's (``serving``: how it is read).
"""

from remote_agent.checks import loader_keep, loader_lookup
from remote_agent.core import (
    NONE,
    NUMBER,
    REF,
    OpError,
    atomic_write,
    deploy_root,
    helper_program,
    json_text,
    missing_reason,
    op,
    open_own,
    os,
    own_dir,
    process_start_time,
    read_own,
    sha256_hex,
    time,
    unlink_quietly,
)
from remote_agent.releases import LAUNCHED, link_target, point_launched, restore_launched
from remote_agent.serving import (
    checked_argv,
    engine_cached,
    engine_check_key,
    engine_keep,
    engine_may_run,
    engine_verdict,
    server_record,
    server_runs,
)

# What a background check leaves under <root>/run while it runs: its state, its output and errors.
CHECKS_PREFIX = "checks-"
CHECKS_OUT_BYTES = 8 << 20  # vLLM's own lines before its verdict: a few KB; read no more than this
CHECKS_STALE_S = 24 * 3600  # a controller that never waited: its files go at a later start
LOADER_MARK = "@@dflash-loader@@"
DONE_MARK = "@@dflash-checks-done@@"


@op(
    "checks_start",
    root=str,
    release_id=(str, NONE, REF),
    subdir=str,
    python=str,
    fields=list,
    keep=bool,
    name=str,
    argv=list,
    env=dict,
    expect=dict,
    keep_if_running=bool,
    timeout=NUMBER,
)
def op_checks_start(req):
    """The loader gate's view of the release's drafter config and, with ``argv``, vLLM's verdict on
    the server's exact command (the engine gate), in one serving-Python process started in the
    background: transformers is imported once (vLLM imports it too), and the process runs while the
    controller drains, measures or launches; ``checks_wait`` collects it. Returns at once what needs
    no process (a view in the loader cache, a check not asked because the server already runs the
    command), ``serving`` (whether the server we started is alive) and the ``token`` to wait for
    (null: nothing runs). The command's drafter is read through ``launched``, pointed at the release
    for the check; ``checks_wait`` puts it back where a running server needs it."""
    import json
    import subprocess

    root = deploy_root(req, create=False)
    release = req["release_id"]
    path, key, known = loader_lookup(root, req)
    current = server_record(root, req["name"])
    serving = bool(current and current.get("alive"))
    out: dict = {"token": None, "serving": serving, "loader": None, "engine": None}
    _stale_checks(root)
    if serving and isinstance(current.get("release_id"), str):
        # A check a controller never collected may have left it elsewhere: a restart reads it.
        point_launched(root, current["release_id"])
    spec: dict = {"timeout": float(req["timeout"]), "loader": None, "engine": None}
    out["loader"] = known
    if known is None:
        spec["loader"] = {"source": helper_program("loader_view"), "argv": [path, json.dumps(req["fields"])]}
    python, env = req["python"], req["env"]  # the server's environment, as the launch gives it
    if req["argv"]:
        argv = checked_argv(req)
        if req["keep_if_running"] and server_runs(current, argv, env, release):
            out["engine"] = {"skipped": "the server already runs this command"}
        else:
            engine_may_run(root, req["name"], argv)
            engine_key = engine_check_key(argv, env, req["expect"])
            out["engine"] = engine_cached(root, engine_key, release)
            if out["engine"] is None:
                python = argv[0]
                spec["engine"] = {"source": helper_program("engine_check"), "argv": list(argv[3:]), "cwd": root}
    if spec["loader"] is None and spec["engine"] is None:
        return out
    if not python:
        raise OpError("bad_request", "python (the serving interpreter) is required")
    token = "%d-%s" % (int(time.time()), os.urandom(4).hex())
    run = own_dir(root, "run")
    full = dict(os.environ)
    full.pop("PYTHONDONTWRITEBYTECODE", None)  # as the loader op: bytecode where the site allows it
    full.update(env)  # as the launch gives it
    full.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    before = link_target(root, LAUNCHED, strict=False)
    if spec["engine"] is not None and release is not None:
        before = point_launched(root, release)
    files = {}
    for part in ("out", "err"):
        files[part] = os.path.join(run, "%s%s.%s" % (CHECKS_PREFIX, token, part))
    started = time.time()
    out_fd = open_own(files["out"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(out_fd, "wb") as stdout, os.fdopen(
        open_own(files["err"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb"
    ) as stderr:
        try:
            proc = subprocess.Popen(
                [python, "-c", helper_program("serving_checks")],
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                env=full,
                cwd="/",  # the loader's import path is not the login's home (see _serving_python)
                start_new_session=True,  # it outlives this batch's SSH session
                close_fds=True,
            )
        except FileNotFoundError:
            restore_launched(root, before)
            for name in files.values():
                unlink_quietly(name)
            raise OpError("no_python", missing_reason("serving interpreter", python), python)
    with proc.stdin as pipe:  # type: ignore[union-attr]
        pipe.write(json.dumps(spec).encode("utf-8"))
    state = {
        "pid": proc.pid,
        "start": process_start_time(proc.pid),
        "started_at": started,
        "timeout": float(req["timeout"]),
        "name": req["name"],
        "before": before,
        "loader": {"key": key, "keep": req["keep"], "path": path} if spec["loader"] else None,
        "engine": {"expect": req["expect"], "key": engine_key, "keep": req["keep"], "release": release}
        if spec["engine"]
        else None,
    }
    body = json_text(state).encode("utf-8")
    atomic_write(os.path.join(run, "%s%s.json" % (CHECKS_PREFIX, token)), body, sha256_hex(body), 0o600)
    out["token"] = token
    return out


@op("checks_wait", root=str, token=str, timeout=NUMBER, cancel=bool)
def op_checks_wait(req):
    """What ``checks_start``'s process found, once it ends (stopped at its deadline): the loader's
    view (kept in the loader cache where asked) or why it could not load, and vLLM's verdict or its
    refusal in its own words; each a gate's answer, none a failure of the batch. ``cancel``: the
    run no longer needs them (the host failed another gate): stopped now, nothing read. Either way
    ``launched`` is put back where the server we started, alive, was started from (or where it
    was, if none runs and none was launched since), and the check's files go."""
    import json
    import re
    import signal

    root = deploy_root(req, create=False)
    token = req["token"]
    if not re.match(r"^[0-9]+-[0-9a-f]{8}$", token):
        raise OpError("bad_request", "token %r is not one checks_start gives" % token)
    run = os.path.join(root, "run")
    names = dict((part, os.path.join(run, "%s%s.%s" % (CHECKS_PREFIX, token, part))) for part in ("json", "out", "err"))
    try:
        state = json.loads(read_own(names["json"]) or b"null")
    except ValueError:
        state = None
    if not isinstance(state, dict):
        raise OpError("no_checks", "no checks started under %s (already collected, or never started)" % token, run)
    deadline = min(state["started_at"] + state["timeout"], time.time() + float(req["timeout"]))
    stopped = False
    while process_start_time(state["pid"]) == state["start"] and state["start"] is not None:
        if req["cancel"] or time.time() >= deadline:
            try:
                os.killpg(state["pid"], signal.SIGKILL)
            except OSError:
                pass
            stopped = True
            break
        time.sleep(0.05)
    out = _tail(names["out"], CHECKS_OUT_BYTES)
    err = _tail(names["err"], 1 << 16)
    for name in names.values():
        unlink_quietly(name)
    _settle_launched(root, state)
    if req["cancel"]:
        return {"seconds": round(time.time() - state["started_at"], 2), "loader": None, "engine": None}
    marks = {}
    for line in out.splitlines():
        for mark in (LOADER_MARK, DONE_MARK):
            if line.startswith(mark):
                try:
                    marks[mark] = json.loads(line[len(mark) :])
                except ValueError:
                    pass
    seconds = round(time.time() - state["started_at"], 2)
    ended = DONE_MARK in marks
    said = " / ".join(err.strip().splitlines()[-3:]) or "no output"
    if stopped:
        why = "did not finish in %g s (stopped)" % (time.time() - state["started_at"])
    else:
        why = "ended before its answer: %s" % said
    answer: dict = {"seconds": seconds, "loader": None, "engine": None}
    loader = state.get("loader")
    if loader:
        found = marks.get(LOADER_MARK)
        if isinstance(found, dict) and isinstance(found.get("view"), dict):
            view = found["view"]
            if loader["key"] is not None and loader["keep"]:
                loader_keep(root, loader["key"], view)
            view.pop("where", None)
            view["path"] = loader["path"]
            answer["loader"] = view
        elif isinstance(found, dict):
            answer["loader"] = {
                "error": "the serving Python could not load the drafter config: %s" % found.get("error")
            }
        else:
            answer["loader"] = {"error": "the serving Python's loader check %s" % why}
    if state.get("engine"):
        code = marks.get(DONE_MARK, {}).get("code") if ended else None
        try:
            if not ended and "@@dflash-engine@@" not in out:
                raise OpError("timeout" if stopped else "engine_refused", "vLLM's check %s" % why)
            verdict = engine_verdict(code, out, err, state["engine"]["expect"])
            if state["engine"].get("keep") and isinstance(state["engine"].get("key"), str):
                engine_keep(root, state["engine"]["key"], verdict, state["engine"].get("release"))
            verdict.pop("where", None)
            answer["engine"] = verdict
        except OpError as exc:
            answer["engine"] = {"refused": {"code": exc.code, "message": exc.message}}
    return answer


def _tail(path, limit):
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _settle_launched(root, state):
    """After a background check: ``launched`` names the release the server we started runs (a
    restart must read it), or, with none alive and none launched since the check, what it named
    before."""
    record = server_record(root, state["name"])
    if record and record.get("alive") and isinstance(record.get("release_id"), str):
        point_launched(root, record["release_id"])
    elif not record or float(record.get("started_at") or 0) < state["started_at"]:
        restore_launched(root, state["before"])


def _stale_checks(root):
    """Files of background checks no controller collected, a day old: removed."""
    run = os.path.join(root, "run")
    try:
        names = os.listdir(run)
    except OSError:
        return
    now = time.time()
    for name in names:
        if name.startswith(CHECKS_PREFIX):
            path = os.path.join(run, name)
            try:
                if now - os.lstat(path).st_mtime > CHECKS_STALE_S:
                    os.unlink(path)
            except OSError:
                pass
