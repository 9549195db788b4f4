# dflash-orchestrator agent loader: the first thing each batch runs on the host (stdlib, 3.8+).
#
# stdin: "<n> <key>\n" + zlib(agent source, n bytes) + the request. The source is the agent's
# modules a batch needs, packed by the controller (remote_agent.pack). Compiling it costs
# more than starting the interpreter, on every host for every batch, so the compiled code is kept
# in ~/.cache/dflash-orchestrator/agent-<key>.<cache tag>. Like Python's own __pycache__, the cache
# is trusted only when the directory and the file belong to this user and the directory is not
# writable by anyone else; anything unreadable or foreign is ignored and the source compiled.
import marshal
import os
import sys
import zlib

_b = sys.stdin.buffer
_n, _key = _b.readline().split()
_packed = _b.read(int(_n))
_uid = os.getuid()
_dir = os.path.join(os.path.expanduser("~"), ".cache", "dflash-orchestrator")
_path = os.path.join(_dir, "agent-%s.%s" % (_key.decode("ascii"), sys.implementation.cache_tag))
_code = None
try:
    _st = os.stat(_dir)
    if _st.st_uid == _uid and not _st.st_mode & 0o022:
        with open(_path, "rb") as _f:
            _fst = os.fstat(_f.fileno())
            if _fst.st_uid == _uid and not _fst.st_mode & 0o022:
                _code = marshal.loads(_f.read())
except Exception:  # noqa: BLE001 - no cache, or one we will not use: compile instead
    _code = None
if type(_code).__name__ != "code":
    _code = compile(zlib.decompress(_packed), "dflash-agent", "exec")
    try:
        # makedirs gives its mode to the leaf only: under a umask of 000, ~/.cache would be made
        # writable by anyone.
        _mask = os.umask(0o077)
        try:
            os.makedirs(_dir, 0o700, exist_ok=True)
        finally:
            os.umask(_mask)
        # The key is "<agent version>.<modules sent>": one entry per set of modules a batch
        # sends (files only, with models, serving...); those of earlier versions go.
        _version = _key.decode("ascii").split(".")[0]
        for _old in os.listdir(_dir):
            if _old.startswith("agent-") and not _old.startswith("agent-%s." % _version):
                os.unlink(os.path.join(_dir, _old))
        _tmp = "%s.tmp-%d" % (_path, os.getpid())
        with open(os.open(_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as _f:
            _f.write(marshal.dumps(_code))
        os.replace(_tmp, _path)
    except OSError:
        pass  # a read-only or full home only costs the compile next time
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})  # type: ignore[arg-type]
