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
