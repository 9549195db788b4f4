"""What a batch carries of the agent: the modules its ops need and what those import of each
other (``remote_agent.closure``), read from the code, so that no batch misses a name it uses and
none carries a module it does not."""

from __future__ import annotations

import ast

import remote_agent
from orchestrator.agent import protocol


def _defined(module: str) -> set[str]:
    """The names a module defines at its top level (functions, classes, constants)."""
    out = set()
    for node in ast.parse(remote_agent.module_source(module)).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def test_every_name_a_module_takes_from_another_travels_with_it() -> None:
    """The packed agent is one namespace: a name defined in a module left out of the batch is a
    NameError on the host, at the first call that reaches it."""
    defined = {m: _defined(m) for m in remote_agent.MODULES}
    for module in remote_agent.MODULES:
        carried = set().union(*(defined[m] for m in remote_agent.closure([module])))
        own = defined[module]
        used = {
            n.id
            for n in ast.walk(ast.parse(remote_agent.module_source(module)))
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        }
        elsewhere = {name for name in used - own if any(name in defined[m] for m in remote_agent.MODULES)}
        assert elsewhere <= carried, (module, sorted(elsewhere - carried))


def test_a_gateway_call_carries_neither_the_serving_code_nor_the_releases() -> None:
    chosen = remote_agent.closure(protocol.modules(["gateway_http", "gateway_socket", "gateway_endpoints"]))
    assert chosen == ("core", "web", "gateway", "dispatch")
    assert remote_agent.closure(["serving"]) == ("core", "web", "releases", "serving", "dispatch")


def test_what_a_module_needs_is_what_it_imports() -> None:
    assert remote_agent.needs("gateway") == {"core", "web"}
    assert "web" in remote_agent.needs("serving") and "releases" in remote_agent.needs("serving")


def test_a_kept_pack_is_the_pack_and_a_torn_or_altered_one_is_made_again(tmp_path, monkeypatch) -> None:
    """Packs are kept in the user's cache between starts (packing costs ~0.2 s of CPU a run): what
    comes back is always what ``pack`` makes, whatever the file holds."""
    from orchestrator.agent import client

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    chosen = remote_agent.closure(["releases"])
    fresh = remote_agent.pack(chosen)
    assert client._kept_pack(chosen) == fresh
    (kept,) = (tmp_path / "dflash-orchestrator" / "packs").glob("*.py")
    assert kept.name == f"{remote_agent.fingerprint(chosen)}.py"
    whole = kept.read_bytes()
    for damaged in (whole[: len(whole) // 2], whole.replace(b"def ", b"def _", 1), b"", b"\n"):
        kept.write_bytes(damaged)
        assert client._kept_pack(chosen) == fresh
        assert kept.read_bytes() == whole
    # A cache that cannot be written (its folder is a file) costs the packing, not the run.
    monkeypatch.setenv("XDG_CACHE_HOME", str(kept))
    assert client._kept_pack(chosen) == fresh


def test_the_fingerprint_follows_every_source_a_pack_is_made_from(tmp_path, monkeypatch) -> None:
    """A kept pack is found by its fingerprint: any change to a module, a helper or the packer
    must change it, or a controller would send an agent older than its own code."""
    import shutil

    copy = tmp_path / "remote_agent"
    shutil.copytree(remote_agent._HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(remote_agent, "_HERE", copy)
    before = remote_agent.fingerprint()
    assert remote_agent.fingerprint(remote_agent.closure(["releases"])) != before
    seen = {before}
    for changed in ("core.py", "__init__.py", next(p.relative_to(copy).as_posix() for p in copy.glob("helpers/*.py"))):
        path = copy / changed
        path.write_text(path.read_text() + "\n# changed\n")
        now = remote_agent.fingerprint()
        assert now not in seen, changed
        seen.add(now)
