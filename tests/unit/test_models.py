"""Model directories through whole local runs: the drafter overlay, pins, the digest cache, the
target's config where the server reads it, and the weights gate (local connector, real agent)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.playbook import Playbook
from orchestrator.deployment import Deployment
from tests.unit.localbox import (
    DRAFTER_CONFIG,
    OPTIONS,
    TARGET_CONFIG,
    Box,
    deploy,
    drafter_shapes,
    host,
    safetensors,
    verify,
)

STALE = dict(DRAFTER_CONFIG, dflash_config={"mask_token_id": 6, "target_layer_ids": [1]})


def model_dirs(box: Box) -> tuple[Path, Path]:
    """A target directory and a drafter directory whose own config.json is stale (the incident)."""
    target, drafter = box.dir / "models" / "target", box.dir / "models" / "drafter"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    safetensors(target / "model.safetensors", {"lm_head.weight": [64, 64]})
    safetensors(drafter / "model.safetensors", drafter_shapes())
    (drafter / "config.json").write_text(json.dumps(STALE))
    (drafter / "mask_embedding.pt").write_bytes(b"anything the published drafter ships")
    (drafter / ".cache" / "huggingface").mkdir(parents=True)  # what `hf download --local-dir` leaves
    (drafter / ".cache" / "huggingface" / "download.lock").write_text("")
    return target, drafter


def with_models(box: Box, name: str = "pb", config: dict[str, Any] | None = None, **models: Any) -> Playbook:
    target, draft = box.dir / "models" / "target", box.dir / "models" / "drafter"
    spec: dict[str, Any] = {"target": {"path": str(target)}, "drafter": {"path": str(draft)}}
    for role, extra in models.items():
        spec[role].update(extra)
    return box.playbook(name, top={"models": spec}, drafter=config)


def test_the_overlay_serves_the_releases_config_beside_the_model_directorys_weights(box: Box) -> None:
    _, drafter = model_dirs(box)
    playbook = with_models(box)
    assert playbook.serving.target == str(box.dir / "models" / "target")  # defaults to models.target.path
    run = deploy(box, playbook)
    solo = host(run, "solo")
    assert run.ok, solo.gates
    assert list(solo.gates)[:6] == ["lint", "connect", "files", "models", "weights", "loader"]
    # The server read the release's config (the right mask): the stand-in accepted every draft.
    assert solo.gates["acceptance"].data["mean_acceptance_length"] == 8
    overlay = box.root("solo") / "releases" / str(run.release_id) / "drafter"
    assert json.loads((overlay / "config.json").read_text())["dflash_config"]["mask_token_id"] == 5
    assert os.readlink(overlay / "model.safetensors") == str(drafter / "model.safetensors")
    assert os.readlink(overlay / "mask_embedding.pt") == str(drafter / "mask_embedding.pt")
    assert sorted(p.name for p in overlay.iterdir()) == ["config.json", "mask_embedding.pt", "model.safetensors"]
    assert [(m["name"], m["files"], m["verified"], m["drift"]) for m in solo.models] == [
        ("target", 2, "hashed", []),
        ("drafter", 2, "hashed", []),
    ]
    assert "pinned by nothing yet: recorded now" in solo.gates["models"].detail
    # `sha256sum -c` checks the release by hand, links and models included.
    release = box.root("solo") / "releases" / str(run.release_id)
    manifest = (release / ".manifest.sha256").read_text()
    digest = hashlib.sha256((drafter / "model.safetensors").read_bytes()).hexdigest()
    assert f"{digest}  drafter/model.safetensors\n" in manifest
    assert f"{digest}  {drafter}/model.safetensors\n" in (release / ".models.sha256").read_text()

    again = deploy(box, playbook)
    solo = host(again, "solo")
    assert again.ok and again.hosts[0].release_id == run.release_id and not solo.changed
    assert [m["verified"] for m in solo.models] == ["cached", "cached"]  # a stat per file
    assert f"pinned by release {run.release_id}" in solo.gates["models"].detail
    checked = verify(box, playbook)
    assert checked.ok, host(checked, "solo").gates
    assert "1 links in sync" not in host(checked, "solo").gates["models"].detail  # two links
    assert "2 links in sync" in host(checked, "solo").gates["models"].detail


def test_verify_probe_holds_the_probe_to_the_history_of_the_drafter_it_reads_through_the_links(box: Box) -> None:
    """verify reads the drafter through the release's links, deploy as a directory: both must name
    the same acceptance history, or `verify --probe` never compares with the READY record (seen on
    the H200: every verify said "a new acceptance history" of the very release it probed)."""
    model_dirs(box)
    playbook = with_models(box)
    run = deploy(box, playbook)
    assert run.ok, host(run, "solo").gates
    ready = host(run, "solo").gates["acceptance"].data
    probed = verify(box, playbook, probe=True)
    data = host(probed, "solo").gates["acceptance"].data
    assert probed.ok and data["history"] == ready["history"]
    assert data["regression"] == f"tau 8.00 against 8.00 of the last READY release {run.release_id} (floor 7.20)"
    drafted = next(m for m in host(probed, "solo").models if m["name"] == "drafter")
    assert drafted["sha256"] == next(m for m in host(run, "solo").models if m["name"] == "drafter")["sha256"]

    # The same weights at another path, with another config (a fault drafter beside the good one):
    # the same history, so the config change is held to the good release's tau.
    _, drafter = box.dir / "models" / "target", box.dir / "models" / "drafter"
    shutil.copytree(drafter, drafter.with_name("drafter-copy"))
    moved = deploy(box, with_models(box, "moved", drafter={"path": str(drafter.with_name("drafter-copy"))}))
    data = host(moved, "solo").gates["acceptance"].data
    assert moved.ok and data["history"] == ready["history"] and data["regression"].startswith("tau 8.00 against 8.00")


def test_a_flipped_byte_in_a_weight_file_is_drift_named_by_path(box: Box) -> None:
    _, drafter = model_dirs(box)
    playbook = with_models(box)
    first = deploy(box, playbook)
    assert first.ok
    weights = drafter / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    checked = host(verify(box, playbook), "solo")
    detail = checked.gates["models"].detail
    assert not checked.gates["models"].ok
    assert f"{weights} (served as drafter/model.safetensors) has sha256 {hashlib.sha256(data).hexdigest()}" in detail

    again = host(deploy(box, playbook), "solo")
    assert not again.ready and "health" not in again.gates
    assert f"drafter {drafter}: model.safetensors has sha256" in again.gates["models"].detail
    assert f"release {first.release_id} pinned" in again.gates["models"].detail
    cure = f"drafter {drafter}: if the new files are meant, pin them with models.drafter.manifest"
    assert cure in again.gates["models"].detail
    drifted = next(m for m in again.models if m["name"] == "drafter")
    assert drifted["changed"] and drifted["drift"][0].startswith("model.safetensors has sha256")

    # The cure it names: a manifest of the new files, checked in place of the release's record.
    lines = [
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(drafter.iterdir()) if p.is_file()
    ]
    (box.dir / "drafter.sha256").write_text("\n".join(lines) + "\n")
    meant = host(deploy(box, with_models(box, drafter={"manifest": "drafter.sha256"})), "solo")
    assert meant.ready, meant.gates
    assert "pinned by the playbook's manifest" in meant.gates["models"].detail


def planted(path: Path, old_digest: str) -> str:
    """Digest cache lines claiming that ``path`` as it is now holds ``old_digest``: what someone who
    can write the directory, but not read the controller's key, can write (unsigned, and signed
    with a key of their own)."""
    st = path.stat()
    fields = f"{old_digest} {st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {path}"
    return f"{fields}\n{hashlib.sha256(b'not the key').hexdigest()} {fields}\n"


def test_a_planted_digest_cache_line_costs_a_rehash_never_a_pass(box: Box) -> None:
    """Tampered weights, and a cache line with their current stat and the old digest, planted in
    the deploy root's cache and in the model directory's: verify and deploy hash the file again
    and find the drift. The cache trusts only lines signed with the controller's key."""
    _, drafter = model_dirs(box)
    playbook = with_models(box)
    assert deploy(box, playbook).ok
    weights = drafter / "model.safetensors"
    old = hashlib.sha256(weights.read_bytes()).hexdigest()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    for cache in (box.root("solo") / ".digests", drafter / ".digests"):  # first: the first line of a file wins
        cache.write_text(planted(weights, old) + (cache.read_text() if cache.exists() else ""))
    checked = host(verify(box, playbook), "solo")
    assert not checked.gates["models"].ok
    assert f"has sha256 {hashlib.sha256(data).hexdigest()}" in checked.gates["models"].detail
    again = host(deploy(box, playbook), "solo")
    assert not again.ready and "model.safetensors has sha256" in again.gates["models"].detail
    # The lines the tool itself wrote are signed, and a no-change verify still trusts them.
    weights.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))  # the original bytes again
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == old
    assert verify(box, playbook).ok
    signed = (box.root("solo") / ".digests").read_text().splitlines()
    assert signed and all(len(line.split(" ", 1)[0]) == 64 for line in signed)
    # the target's from the digest cache; the drafter's read through the release's links
    assert [m["verified"] for m in host(verify(box, playbook), "solo").models] == ["cached", "release"]


def test_a_manifest_pins_every_file_and_names_the_one_that_differs(box: Box) -> None:
    target, _ = model_dirs(box)
    real = hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest()
    config = hashlib.sha256((target / "config.json").read_bytes()).hexdigest()
    (box.dir / "target.sha256").write_text(f"{config}  config.json\n{'0' * 64}  model.safetensors\n")
    run = deploy(box, with_models(box, target={"manifest": "target.sha256"}))
    detail = host(run, "solo").gates["models"].detail
    assert not run.ok and f"model.safetensors has sha256 {real}, the manifest pins {'0' * 64}" in detail
    # the loader and engine checks started with the staging were stopped, and left nothing
    assert not list((box.root("solo") / "run").glob("checks-*"))
    assert not (box.root("solo") / "launched").is_symlink()

    (box.dir / "target.sha256").write_text(f"{config}  config.json\n{real}  model.safetensors\n")
    run = deploy(box, with_models(box, target={"manifest": "target.sha256"}))
    assert run.ok and "pinned by the playbook's manifest" in host(run, "solo").gates["models"].detail


def test_a_pinned_directory_holds_what_the_pin_says_and_nothing_else(box: Box) -> None:
    """A shard planted beside the pinned files, and an index that names it (vLLM loads shards by
    the index, or by glob): the files the pin lists still read right, yet the directory serves
    more. It was IN SYNC; now it is drift, named, in verify and deploy."""
    target, _ = model_dirs(box)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(target.iterdir())]
    (box.dir / "target.sha256").write_text("\n".join(lines) + "\n")
    playbook = with_models(box, target={"manifest": "target.sha256"})
    assert deploy(box, playbook).ok and verify(box, playbook).ok
    safetensors(target / "model-planted.safetensors", {"lm_head.weight": [64, 64]})
    weight_map = {"lm_head.weight": "model-planted.safetensors"}
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    checked = host(verify(box, playbook), "solo")
    detail = checked.gates["models"].detail
    assert not checked.gates["models"].ok
    assert f"target {target}: model-planted.safetensors is there, but not in the manifest" in detail
    assert "model.safetensors.index.json is there, but not in the manifest" in detail
    assert not host(deploy(box, playbook), "solo").ready


def test_the_target_config_on_the_host_is_what_the_drafter_is_linted_against(box: Box) -> None:
    target, _ = model_dirs(box)
    (target / "config.json").write_text(json.dumps(dict(TARGET_CONFIG, num_hidden_layers=1)))
    run = deploy(box, with_models(box))
    detail = host(run, "solo").gates["models"].detail
    assert not run.ok
    assert "differs from drafter.target_config in num_hidden_layers (2 here, 1 on the host)" in detail
    assert "dflash_config.target_layer_ids: layers [1] are outside the target's 0..0" in detail

    (target / "config.json").unlink()
    missing = host(deploy(box, with_models(box)), "solo").gates["models"].detail
    assert missing == f"the target has no config.json on this host ({target}/config.json)"


def test_a_config_that_does_not_describe_its_weights_fails_the_weights_gate(box: Box) -> None:
    model_dirs(box)
    two_layers = {"num_hidden_layers": 2, "layer_types": ["full_attention", "full_attention"]}
    run = deploy(box, with_models(box, config=two_layers))
    gate = host(run, "solo").gates["weights"]
    assert not run.ok and gate.detail == "num_hidden_layers: the weights hold 1 layers"

    taps = {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 1]}}
    gate = host(deploy(box, with_models(box, "taps", config=taps)), "solo").gates["weights"]
    assert "fc.weight takes 64 inputs = hidden_size 64 x 1 tapped layers, but the config taps 2 ([0, 1])" in gate.detail


def test_a_missing_model_directory_fails_the_models_gate_before_anything_is_staged(box: Box) -> None:
    model_dirs(box)
    gone = box.dir / "models" / "not-downloaded-yet"
    run = deploy(box, with_models(box, drafter={"path": str(gone)}))
    gate = host(run, "solo").gates["models"]
    assert not run.ok and gate.detail == f"model_files {gone}: model directory {gone} does not exist"
    assert not (box.root("solo") / "releases").exists() or not list((box.root("solo") / "releases").iterdir())


def test_push_uploads_once_keeps_what_is_there_and_resumes_a_cut_upload(box: Box) -> None:
    """Files streamed from the controller (no size limit, chunk by chunk), nothing resent when the
    host has them, and an upload that was cut continues after the prefix it left."""
    local = box.dir / "local-drafter"
    safetensors(local / "model.safetensors", drafter_shapes())
    (local / "config.json").write_text(json.dumps(STALE))
    (local / "big.bin").write_bytes(os.urandom(6 << 20))
    dest = box.dir / "pushed" / "drafter"
    model_dirs(box)
    playbook = with_models(box, drafter={"path": str(dest), "push": str(local)})

    run = deploy(box, playbook)
    solo = host(run, "solo")
    assert run.ok, solo.gates
    assert (dest / "big.bin").read_bytes() == (local / "big.bin").read_bytes()
    pushed = next(m for m in solo.models if m["name"] == "drafter")["pushed"]
    total = sum(p.stat().st_size for p in local.iterdir())
    assert pushed["files"] == 3 and pushed["bytes_sent"] == total and pushed["resumed"] == 0
    assert oct((dest / "big.bin").stat().st_mode & 0o777) == "0o644"  # readable by the server's user

    again = host(deploy(box, playbook), "solo")
    assert next(m for m in again.models if m["name"] == "drafter")["pushed"]["bytes_sent"] == 0
    assert "all 3 files already there" in again.gates["models"].detail

    # A new version of the big file, of which a cut upload left the first 2 MiB on the host.
    new = os.urandom(6 << 20)
    (local / "big.bin").write_bytes(new)
    partial = dest / f".big.bin.partial-{hashlib.sha256(new).hexdigest()[:16]}"
    partial.write_bytes(new[: 2 << 20])
    resumed = host(deploy(box, playbook), "solo")
    drafter = next(m for m in resumed.models if m["name"] == "drafter")
    assert drafter["pushed"] == {**drafter["pushed"], "files": 1, "bytes_sent": 4 << 20, "resumed": 1}
    assert (dest / "big.bin").read_bytes() == new and not partial.exists()
    # What was pushed pins the model: a new version pushed is a change, not drift.
    assert resumed.ready and drafter["changed"] and drafter["drift"] == []
    assert f"pinned by the files pushed from {local}" in resumed.gates["models"].detail

    # A partial whose bytes are not the file's prefix is started over.
    newer = os.urandom(3 << 20)
    (local / "big.bin").write_bytes(newer)
    partial = dest / f".big.bin.partial-{hashlib.sha256(newer).hexdigest()[:16]}"
    partial.write_bytes(os.urandom(1 << 20))
    restarted = host(deploy(box, playbook), "solo")
    entry = next(m for m in restarted.models if m["name"] == "drafter")["pushed"]
    assert entry["bytes_sent"] == 3 << 20 and entry["resumed"] == 0
    assert (dest / "big.bin").read_bytes() == newer
    assert restarted.ready

    # Changed on the host behind the controller's back: the pushed digest pins it, so it is
    # pushed again (the host's file is replaced), not served as it is.
    (dest / "big.bin").write_bytes(b"tampered")
    repaired = host(deploy(box, playbook), "solo")
    assert repaired.ready and (dest / "big.bin").read_bytes() == newer
    assert next(m for m in repaired.models if m["name"] == "drafter")["pushed"]["bytes_sent"] == 3 << 20


def test_a_push_replaces_only_what_a_push_put_there(box: Box) -> None:
    """A push to a directory that holds an operator's own files (another model downloaded by hand,
    a path mistyped in the playbook) replaced every file that differed. Refused now before any
    byte is sent, naming them, each left byte-identical; a link is not ours either. What a push made
    and someone changed since is still repaired, and ``replace: true`` lets a push take over."""
    local = box.dir / "local-drafter"
    safetensors(local / "model.safetensors", drafter_shapes())
    (local / "config.json").write_text(json.dumps(STALE))
    (local / "tokenizer.json").write_text("{}")
    dest = box.dir / "models" / "theirs"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text('{"theirs": true}\n')
    (box.dir / "their-tokenizer.json").write_text('{"theirs": true}')
    (dest / "tokenizer.json").symlink_to(box.dir / "their-tokenizer.json")  # a link is not ours either
    model_dirs(box)
    playbook = with_models(box, "push", drafter={"path": str(dest), "push": str(local)})
    refused = host(deploy(box, playbook), "solo")
    said = " ".join(g.detail for g in refused.gates.values())
    assert not refused.ready
    assert f"{dest}/config.json, {dest}/tokenizer.json were not put there by a push of this controller's" in said
    assert "set the model's replace: true" in said
    assert (dest / "config.json").read_text() == '{"theirs": true}\n' and (dest / "tokenizer.json").is_symlink()
    assert (box.dir / "their-tokenizer.json").read_text() == '{"theirs": true}'
    assert not (dest / "model.safetensors").exists()  # refused before any byte was sent
    assert not list(dest.glob(".*partial*"))

    taking = with_models(box, "take", drafter={"path": str(dest), "push": str(local), "replace": True})
    taken = host(deploy(box, taking), "solo")
    assert taken.ready, taken.gates
    assert (dest / "config.json").read_text() == json.dumps(STALE) and not (dest / "tokenizer.json").is_symlink()
    assert (box.dir / "their-tokenizer.json").read_text() == '{"theirs": true}'  # the link replaced, not followed
    # Pushed by us, then changed on the host: the push's to repair, without replace.
    (dest / "config.json").write_text('{"edited": "by hand"}')
    repaired = host(deploy(box, playbook), "solo")
    assert repaired.ready, repaired.gates
    assert (dest / "config.json").read_text() == json.dumps(STALE)


def test_another_model_directory_is_pinned_afresh_not_drift(box: Box) -> None:
    """Pins belong to a directory: serving a drafter from another directory (another drafter, or a
    new download) records its digests; only a change inside a pinned directory is drift."""
    model_dirs(box)
    assert deploy(box, with_models(box)).ok
    other = box.dir / "models" / "drafter-v2"
    safetensors(other / "model.safetensors", drafter_shapes())
    (other / "README.md").write_text("a newer upload\n")
    run = deploy(box, with_models(box, drafter={"path": str(other)}))
    solo = host(run, "solo")
    assert run.ok, solo.gates
    assert f"drafter {other}: 2 files" in solo.gates["models"].detail and "recorded now" in solo.gates["models"].detail
    assert "pinned by release" in solo.gates["models"].detail  # the target's pins carried over


def tokenizer_files(target: Path, added: list[dict[str, Any]], vocab: dict[str, int], **config: Any) -> None:
    """A target's tokenizer as Hugging Face writes it: tokenizer.json (added tokens and the BPE
    vocabulary) and tokenizer_config.json (the roles)."""
    (target / "tokenizer.json").write_text(
        json.dumps({"added_tokens": added, "model": {"type": "BPE", "vocab": vocab}})
    )
    (target / "tokenizer_config.json").write_text(json.dumps(config))


def test_the_mask_token_is_named_from_the_targets_tokenizer_on_the_host(box: Box) -> None:
    """The seed incident's other half: nothing said which token mask_token_id was. On the host, the
    target's tokenizer names it; an ordinary token, or one the target's sequences hold, is a warning
    (the gate passes: the numbers decide, but the user is told where to look)."""
    base, _ = model_dirs(box)
    vocab = {f"tok{i}": i for i in range(5)}  # the localbox drafter's mask is 5
    eos = {"id": 7, "content": "<|endoftext|>", "special": True}

    def models_gate(name: str, added: list[dict[str, Any]], words: dict[str, int], **config: Any) -> Any:
        target = base.with_name(f"target-{name}")  # a directory of its own: pinned afresh
        shutil.copytree(base, target)
        tokenizer_files(target, added, words, **config)
        report = host(deploy(box, with_models(box, target={"path": str(target)})), "solo")
        assert report.ready, report.gates
        return report.gates["models"]

    gate = models_gate("unused", [eos], vocab, eos_token="<|endoftext|>")
    assert "dflash_config.mask_token_id 5: no token of the target's tokenizer has this id" in gate.detail
    assert "warnings" not in gate.data

    gate = models_gate("ordinary", [eos], {**vocab, "the": 5})
    assert "dflash_config.mask_token_id 5 is 'the', an ordinary token" in gate.detail
    assert gate.data["warnings"] == [
        "dflash_config.mask_token_id: is 'the', an ordinary token of the target's vocabulary: the target reads and"
        " writes it in normal text, and a drafter trained with another mask id accepts almost nothing"
    ]
    gate = models_gate("pad", [{**eos, "id": 5}], vocab, pad_token={"content": "<|endoftext|>"})
    assert "is '<|endoftext|>', the tokenizer's pad_token" in gate.data["warnings"][0]
    gate = models_gate("plain-added", [{"id": 5, "content": "<think>", "special": False}], vocab)
    assert "is '<think>', an added token that is not special" in gate.data["warnings"][0]
    gate = models_gate("special", [{"id": 5, "content": "<|mask|>", "special": True}], vocab)
    assert "dflash_config.mask_token_id 5 is '<|mask|>', a special token" in gate.detail and not gate.data

    silent = host(deploy(box, with_models(box, target={"path": str(base)})), "solo").gates["models"]
    assert "mask_token_id" not in silent.detail  # no tokenizer files: nothing to say


def test_the_digest_key_is_made_once_and_readable_by_this_user_alone(tmp_path: Path) -> None:
    from orchestrator.errors import StateError
    from orchestrator.store.state import digest_key

    key = digest_key(tmp_path / "state")
    assert len(key) == 64 and int(key, 16) >= 0 and digest_key(tmp_path / "state") == key
    assert (tmp_path / "state" / "digest.key").stat().st_mode & 0o777 == 0o600
    (tmp_path / "state" / "digest.key").write_text("not hex\n")
    try:
        digest_key(tmp_path / "state")
    except StateError as exc:
        assert "digest.key cannot be used" in str(exc)
    else:
        raise AssertionError("a damaged key was used")


@pytest.mark.parametrize("kind", ["others-read", "group-write", "fifo", "link", "directory", "binary"])
def test_a_digest_key_that_is_not_this_users_private_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """As OpenSSH takes a private key: a key others may read could sign a planted digest cache
    line; a FIFO in its place hung the controller; a link is not followed. One message, at once."""
    from orchestrator.errors import StateError
    from orchestrator.store.state import digest_key

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    key = state / "digest.key"
    if kind in ("others-read", "group-write"):
        key.write_text("ab" * 32 + "\n")
        key.chmod(0o644 if kind == "others-read" else 0o620)
    elif kind == "fifo":
        os.mkfifo(key, 0o600)
    elif kind == "link":
        (tmp_path / "elsewhere").write_text("ab" * 32 + "\n")
        (tmp_path / "elsewhere").chmod(0o600)
        key.symlink_to(tmp_path / "elsewhere")
    elif kind == "directory":
        key.mkdir()
    else:
        key.write_bytes(b"\xff" * 64)
        key.chmod(0o600)
    done: list[BaseException] = []

    def read() -> None:
        try:
            digest_key(state)
        except BaseException as exc:  # handed to the test's thread
            done.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert done, "reading the digest key blocked"
    (exc,) = done
    assert isinstance(exc, StateError) and f"the digest key {key} cannot be used" in str(exc)
    said = {
        "others-read": "others may read or write it (mode 0644): chmod 600 it",
        "group-write": "others may read or write it (mode 0620)",
        "fifo": "it is not a regular file",
        "link": "it is a symbolic link",
        "directory": "",
        "binary": "it is not hex text",
    }[kind]
    assert said in str(exc)


def test_a_model_file_name_a_release_cannot_hold_is_named_never_an_internal_error(box: Box) -> None:
    """A name that is not UTF-8 on the host used to fail every deploy with an internal message
    naming no file; a pushed name with a line break was uploaded, then refused. Each is named,
    and a push is refused before any byte goes."""
    target, _ = model_dirs(box)
    (target / os.fsdecode(b"shard-\xff.bin")).write_bytes(b"y")
    solo = host(deploy(box, with_models(box)), "solo")
    detail = solo.gates["models"].detail
    assert not solo.ready
    assert "model file name b'shard-\\xff.bin'" in detail and "is not UTF-8: a release cannot name it" in detail
    (target / os.fsdecode(b"shard-\xff.bin")).unlink()
    local = box.dir / "local-drafter"
    safetensors(local / "model.safetensors", drafter_shapes())
    (local / "config.json").write_text(json.dumps(STALE))
    (local / "notes\nmore.txt").write_text("a line break in the name")
    dest = box.dir / "pushed" / "drafter"
    refused = host(deploy(box, with_models(box, drafter={"path": str(dest), "push": str(local)})), "solo")
    assert not refused.ready and "may not hold a tab, a line break or a backslash" in str(refused.gates)
    assert not dest.exists()  # nothing was sent


def test_a_safetensors_header_nested_past_any_parser_is_named_with_its_file(box: Box) -> None:
    """The drafter's weights with a header of 100,000 nested lists: the weights gate names the
    file (it used to fail with the parser's RecursionError, naming no file)."""
    _, drafter = model_dirs(box)
    raw = b'{"fc.weight": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (drafter / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    solo = host(deploy(box, with_models(box)), "solo")
    assert not solo.ready
    said = " ".join(g.detail for g in solo.gates.values())
    assert f"{drafter}/model.safetensors: the safetensors header is nested too deeply" in said


def test_the_dry_run_says_what_a_deploy_would_do_to_the_models(box: Box) -> None:
    """It said "no change" when the deploy would push model files or pin changed ones, both of which
    make a new release; it says each now, and that the run would change the host."""
    _, drafter = model_dirs(box)
    local = box.dir / "local-drafter"
    safetensors(local / "model.safetensors", drafter_shapes())
    (local / "config.json").write_text(json.dumps(STALE))
    dest = box.dir / "pushed" / "drafter"
    pushing = with_models(box, "pushing", drafter={"path": str(dest), "push": str(local)})
    looked = host(Deployment(pushing, box.inventory, OPTIONS).dry_run(), "solo")
    assert looked.changed and "would push 2 files" in looked.gates["files"].detail
    assert f"to {dest}" in looked.gates["files"].detail and not dest.exists()  # a dry run writes nothing
    playbook = with_models(box)
    assert deploy(box, playbook).ok
    quiet = host(Deployment(playbook, box.inventory, OPTIONS).dry_run(), "solo")
    assert not quiet.changed and quiet.gates["files"].detail == "dry run: no change"
    weights = bytearray((drafter / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # a weight changed, the file still one vLLM loads
    (drafter / "model.safetensors").write_bytes(bytes(weights))
    looked = host(Deployment(playbook, box.inventory, OPTIONS).dry_run(), "solo")
    assert looked.changed
    assert f"drafter {drafter} differs from what release" in looked.gates["files"].detail
    # One vLLM would refuse: the dry run says why, not that the host cannot be read yet.
    (drafter / "model.safetensors").write_bytes(bytes(weights) + b"\0")
    looked = host(Deployment(playbook, box.inventory, OPTIONS).dry_run(), "solo")
    assert "(bytes after the last tensor)" in looked.gates["files"].detail, looked.gates["files"].detail
    assert "cannot be read on the host yet" not in looked.gates["files"].detail


def test_many_small_files_push_in_few_execs_and_leave_no_stale_partials(box: Box) -> None:
    """300 one-line files took an exec each; they now travel a batch at a time (256 files or
    64 MiB). What a cut push left for an older version of a file goes once that file is whole."""
    local = box.dir / "local-drafter"
    safetensors(local / "model.safetensors", drafter_shapes())
    (local / "config.json").write_text(json.dumps(STALE))
    for i in range(300):
        (local / f"shard-{i:03d}.txt").write_text(f"line {i}\n")
    dest = box.dir / "pushed" / "drafter"
    dest.mkdir(parents=True)
    stale = dest / ".shard-000.txt.partial-0123456789abcdef"  # an earlier, cut push of other content
    stale.write_text("lin")
    model_dirs(box)
    first = host(deploy(box, with_models(box, drafter={"path": str(dest), "push": str(local)})), "solo")
    assert first.ready, first.gates
    pushed = next(m for m in first.models if m["name"] == "drafter")["pushed"]
    assert pushed["files"] == 302 and (dest / "shard-299.txt").read_text() == "line 299\n"
    assert first.ssh["execs"] <= 10, first.ssh  # it was 300 execs and more for the push alone
    assert not stale.exists() and not list(dest.glob(".*.partial-*"))


@pytest.mark.usefixtures("programs")
def test_controllers_making_the_digest_key_at_once_all_use_one_whole_key(tmp_path: Path) -> None:
    """The key is written whole before it is linked into place: a controller that reads it while
    another makes it (or after one was killed making it) never finds it empty."""
    import subprocess
    import sys

    code = "import sys; from orchestrator.store.state import digest_key; print(digest_key(__import__('pathlib').Path(sys.argv[1])))"
    for attempt in range(5):
        state = tmp_path / f"state{attempt}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(state)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(8)
        ]
        said = [p.communicate(timeout=60) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _, err in said]
        assert len({out.strip() for out, _ in said}) == 1
        assert sorted(p.name for p in state.iterdir()) == ["digest.key"]  # no temporary file left


@pytest.mark.usefixtures("programs")
def test_a_controller_killed_while_making_the_digest_key_leaves_none_half_made(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from orchestrator.store.state import digest_key

    # Held where the key's bytes are made, then killed there: by PID, the process this test started.
    code = (
        "import os, sys, threading; from pathlib import Path; from orchestrator.store import state\n"
        "def held(n): print('making', flush=True); threading.Event().wait()\n"
        "state.os.urandom = held\n"
        "state.digest_key(Path(sys.argv[1]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "state")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "making\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    key = digest_key(tmp_path / "state")  # the next controller makes one, whole
    assert len(key) == 64 and (tmp_path / "state" / "digest.key").read_text() == key + "\n"


def test_a_batch_of_uploads_writes_the_digest_cache_once_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each upload recorded its file and rewrote (and re-signed) the whole cache: a batch of n
    files wrote it n times, O(n^2) (a compile cache's 783 files took 4 s to push, 1.1 s now). The
    cache is written once when the batch ends, every file of it recorded and signed."""
    import hashlib
    import io
    import sys

    import remote_agent.models  # noqa: F401 (its ops, registered)
    from remote_agent import core, dispatch

    blobs = [(str(tmp_path / "m" / f"f{i}.py"), bytes([i]) * 1000) for i in range(40)]
    ops = [
        {
            "op": "upload",
            "name": p,
            "root": str(tmp_path / "m"),
            "path": p,
            "size": len(b),
            "sha256": hashlib.sha256(b).hexdigest(),
            "offset": 0,
            "mode": "0644",
        }
        for p, b in blobs
    ]

    class Stdin:
        buffer = io.BytesIO(b"".join(b for _, b in blobs))

    writes: list[str] = []
    real = core.atomic_write
    monkeypatch.setattr(core, "atomic_write", lambda path, *a, **k: (writes.append(path), real(path, *a, **k))[1])
    monkeypatch.setattr(sys, "stdin", Stdin())
    monkeypatch.setattr(core, "digest_caches", {})
    monkeypatch.setattr(dispatch, "digest_caches", core.digest_caches)
    answer = dispatch.run({"v": 1, "session": False, "events": False, "ops": ops, "findings": [], "key": "ab" * 32})
    assert all(r["ok"] for r in answer["results"]), answer["results"][:2]
    cache = str(tmp_path / "m" / ".digests")
    assert writes.count(cache) == 1
    lines = Path(cache).read_text().splitlines()
    assert sorted(line.rsplit(" ", 1)[1] for line in lines) == sorted(p for p, _ in blobs)
