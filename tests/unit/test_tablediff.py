"""lab/tablediff.py over two small wheels made here: what it must find in a new vLLM release (a
cited definition changed or gone, a file gone, new DFlash files and registry entries) and what it
must not call a change (a comment, a moved definition)."""

from __future__ import annotations

import zipfile
from pathlib import Path

from lab import tablediff

OLD = {
    "config/vllm.py": "def use_v2_model_runner(x):\n    return x > 1\n\n\ndef other():\n    return 1\n",
    "model_executor/models/qwen3_dflash.py": "class A:\n    def _resolve_layer_attention(self):\n        return 1\n",
    "model_executor/models/registry.py": '_SPECULATIVE_DECODING_MODELS = {"DFlashDraftModel": ("qwen3_dflash", "A")}\n',
    "v1/worker/gpu_model_runner.py": "X = 1\n",
}
NEW = {
    # a comment and a changed unrelated function: the cited one is unchanged
    "config/vllm.py": "# moved\n\n\ndef other():\n    return 2\n\n\ndef use_v2_model_runner(x):\n    return x > 1\n",
    "model_executor/models/qwen3_dflash.py": "class A:\n    def _resolve_layer_attention(self):\n        return 2\n",
    "model_executor/models/registry.py": (
        '_SPECULATIVE_DECODING_MODELS = {"DFlashDraftModel": ("qwen3_dflash", "A"), "NewDraft": ("new_dflash", "B")}\n'
    ),
    "model_executor/models/new_dflash.py": "class B:\n    pass\n",
}
ROWS = [
    ("build:runner", ("vLLM config/vllm.py use_v2_model_runner",)),
    ("lint:window", ("vLLM qwen3_dflash.py _resolve_layer_attention",)),
    ("lint:v1", ("v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config", "a recorded run")),
    ("lint:outside", ("transformers models/laguna/configuration_laguna.py __post_init__",)),
]


def wheel(path: Path, version: str, files: dict[str, str]) -> tablediff.Wheel:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(f"vllm/{name}", text)
        z.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
    return tablediff.Wheel(path)


def test_a_new_wheel_is_a_short_list_of_rows_files_and_registry_entries(tmp_path: Path) -> None:
    result = tablediff.review(wheel(tmp_path / "a.whl", "1.0", OLD), wheel(tmp_path / "b.whl", "1.1", NEW), ROWS)
    assert (result["old"], result["new"]) == ("1.0", "1.1")
    rows = {(r["row"], r["cited"]): r for r in result["rows"]}
    assert rows["build:runner", "config/vllm.py"]["state"] == "unchanged"  # a comment, a move, another function
    window = rows["lint:window", "qwen3_dflash.py"]
    assert window["state"] == "changed" and window["changed"] == ["_resolve_layer_attention"]
    assert window["path"] == "model_executor/models/qwen3_dflash.py"  # a bare name found where it lives
    assert rows["lint:v1", "v1/worker/gpu_model_runner.py"]["state"] == "gone"
    assert rows["lint:outside", "models/laguna/configuration_laguna.py"]["state"] == "not-in-vllm"
    assert result["rows_to_review"] == ["lint:v1", "lint:window"]
    assert result["new_files"] == ["model_executor/models/new_dflash.py"]
    assert result["registry_added"] == {"NewDraft": ["new_dflash", "B"]} and result["registry_removed"] == []
    text = tablediff.render(result)
    assert "rows whose evidence changed (2): lint:v1, lint:window" in text and "registry: added NewDraft" in text


def test_the_project_s_own_rows_all_cite_something_the_script_can_read() -> None:
    """Every build-table row and lint rule is in the review; each cited vLLM path parses as one."""
    rows = tablediff.table_rows()
    from orchestrator.rules import dflash

    assert {r for r, _ in rows} == {f"build:{b.code}" for b in dflash.BUILD_TABLE} | {
        f"lint:{r.code}" for r in dflash.RULES
    }
    cited = {f for c in tablediff.citations(rows) for f in c.files}
    assert "config/vllm.py" in cited and "qwen3_dflash.py" in cited


def test_not_a_wheel_is_refused_with_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "x.whl").write_text("no zip")
    assert tablediff.main([str(tmp_path / "x.whl"), str(tmp_path / "x.whl")]) == 2
    assert "is not a wheel" in capsys.readouterr().err
