"""The remote agent: stdlib-only modules (Python 3.8+) packed into one source for each batch.

The agent is written as modules split by what they do, documented and linted like the rest of
the project, and imported from here by the tests:

    core       the op registry and argument specs, failures as data, paths confined to the
               deploy root, atomic writes and read-back, the digest cache, ``lock`` and ``put``
    web        HTTP/1.1 to the server or the gateway, whole within its deadline
    releases   staging, switching, reading back and pruning releases
    models     model directories: digests, safetensors headers, tokens, uploads
    compile_cache  vLLM's compile cache, listed and read for the controller to give to other hosts
    serving    the server process: launch, stop, health, status, probe, metrics
    standby    vLLM's sleep mode on that server: put to sleep, woken, read back
    checks     what the serving Python answers (loader, build), the GPUs, the NCCL preflight
    background a deploy's loader and engine checks in one serving-Python process, run on in the
               background between execs
    gateway    the router or load balancer in front of the servers, on its own host
    dispatch   the request, each op checked against its spec, references, findings, sessions
    helpers/   the programs the serving Python runs for ``checks``

For the wire, ``pack`` joins the modules a batch's ops need (with what they import of each other),
core first and dispatch last, with their docstrings, comments and imports of each other taken out
(as mitogen minifies the core it ships): one namespace, as if one file had been written. The host
caches the compiled code by the digest of exactly what was sent (``loader.py``). This package
itself is never imported on a host.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path

# Beside this file (importlib.resources would cost ~3 ms of every start for the same answer).
_HERE = Path(__file__).resolve().parent

# In the order they are packed (and so the order the agent's registry lists its ops in).
MODULES = (
    "core",
    "web",
    "releases",
    "models",
    "compile_cache",
    "serving",
    "standby",
    "checks",
    "background",
    "gateway",
    "dispatch",
)
_HELPER = re.compile(r'helper_program\("(\w+)"\)')
# A module's imports of its siblings, each on a line of its own at the top level (as ruff's isort
# writes them): read by pattern, as parsing every module on every start costs ~30 ms.
_SIBLING = re.compile(r"^from remote_agent\.(\w+) import", re.MULTILINE)
# Bumped whenever ``pack`` would make something else of the same sources.
PACK_FORMAT = b"pack 2"


def module_source(name: str) -> str:
    """One module's source as it is in the tree."""
    return (_HERE / f"{name}.py").read_text()


def helper_source(name: str) -> str:
    """A helper program's source (``helpers/<name>.py``), as the serving Python runs it."""
    return (_HERE / "helpers" / f"{name}.py").read_text()


@cache
def needs(name: str) -> frozenset[str]:
    """The agent modules ``name`` imports from (``from remote_agent.X import ...``): what a batch
    carrying it must carry too. Read from its source, so that the wire follows the code."""
    return frozenset(_SIBLING.findall(module_source(name)))


def closure(modules: Iterable[str]) -> tuple[str, ...]:
    """The modules named, all they need (and what that needs), core and dispatch: in packing order."""
    wanted = {"core", "dispatch"}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        if name not in MODULES:
            raise ValueError(f"no agent module {name!r}")
        wanted.add(name)
        todo.extend(needs(name))
    return tuple(m for m in MODULES if m in wanted)


def _minified(source: str) -> str:
    """The module without docstrings, comments or imports of the other agent modules."""
    import ast  # here: a controller that finds its packs kept never pays the import (~3 ms)

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef):
            body = node.body
            first = body[0].value if body and isinstance(body[0], ast.Expr) else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                node.body = body[1:] or [ast.Pass()]
    tree.body = [
        n for n in tree.body if not (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "remote_agent")
    ]
    return ast.unparse(tree)


@cache
def pack(modules: tuple[str, ...] = MODULES) -> bytes:
    """The agent's source for a batch whose ops live in ``modules`` (a closure, in order)."""
    parts = []
    for name in closure(modules):
        source = module_source(name)
        parts.append(_minified(source))
        if name == "core":
            helpers = sorted({h for m in closure(modules) for h in _HELPER.findall(module_source(m))})
            if helpers:
                parts.append(f"HELPERS.update({ {h: helper_source(h) for h in helpers}!r})")
    return ("\n".join(parts) + "\n").encode()


def fingerprint(modules: tuple[str, ...] = MODULES) -> str:
    """A digest of everything ``pack(modules)`` is made from (the package's sources, its helpers,
    the packer itself and the Python that unparses them): equal fingerprints, equal packs. Costs a
    read of the files, not a parse, so that a controller can keep packs from one start to the next."""
    digest = hashlib.sha256(PACK_FORMAT + b"%d.%d\n" % sys.version_info[:2])
    digest.update(" ".join(closure(modules)).encode() + b"\n")
    for path in sorted(_HERE.glob("*.py")) + sorted(_HERE.glob("helpers/*.py")):
        data = path.read_bytes()
        digest.update(b"%s %d\n%s" % (path.relative_to(_HERE).as_posix().encode(), len(data), data))
    return digest.hexdigest()


def source() -> bytes:
    """The whole agent, every module, as one batch of every op would carry it."""
    return pack(MODULES)


def loader_source() -> bytes:
    """The loader's source, exactly as it will run on the host."""
    return (_HERE / "loader.py").read_bytes()
