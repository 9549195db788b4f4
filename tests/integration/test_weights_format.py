"""The weights gate accepts only what vLLM could load as weights: held to real vLLM's verdicts.

Each file of a corpus of damaged safetensors files (made from the tiny drafter's real weights) is
read by the agent's header reader and by the safetensors that vLLM loads weights through
(``safe_open`` and ``get_tensor`` of every tensor, in the vLLM venv); the two must agree on every
one. Likewise the files vLLM's loader picks from a directory (the top level's ``*.safetensors``,
narrowed by ``model.safetensors.index.json``) are held to vLLM's own ``_prepare_weights`` helpers.
Before, the agent read only the header's JSON: a copy cut short, a shape edited by hand or an
unknown dtype passed the gate, and vLLM refused the file as the server started.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from remote_agent.core import OpError
from remote_agent.models import _loaded_weights, _safetensors_header
from tests.integration.test_serving import MODELS, VLLM

pytestmark = pytest.mark.usefixtures("vllm_cpu")

Header = dict[str, object]


def split(raw: bytes) -> tuple[Header, bytes]:
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def join(header: Header | str, data: bytes, pad: str = "") -> bytes:
    text = (header if isinstance(header, str) else json.dumps(header)) + pad
    raw = text.encode()
    return len(raw).to_bytes(8, "little") + raw + data


def first(header: Header) -> str:
    """The tensor whose data comes first."""
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])  # type: ignore[index]


def edit(change: Callable[[Header], None]) -> Callable[[bytes], bytes]:
    def make(raw: bytes) -> bytes:
        header, data = split(raw)
        change(header)
        return join(header, data)

    return make


def tensor(field: str, value: object) -> Callable[[bytes], bytes]:
    return edit(lambda h: h[first(h)].__setitem__(field, value))  # type: ignore[union-attr]


def shifted(h: Header) -> None:
    name = first(h)
    begin, end = h[name]["data_offsets"]  # type: ignore[index]
    h[name]["data_offsets"] = [begin + 1, end + 1]  # type: ignore[index]


def grown(h: Header) -> None:
    name = first(h)
    h[name]["shape"] = [*h[name]["shape"], 2]  # type: ignore[index]


def odd_f4(raw: bytes) -> bytes:
    """One F4 element fewer than the bytes hold, and a byte fewer of data: 4 bits short of a byte."""
    header, data = split(raw)
    name = first(header)
    begin, end = header[name]["data_offsets"]  # type: ignore[index]
    header[name].update(dtype="F4", shape=[2 * (end - begin) - 1])  # type: ignore[union-attr]
    return join(header, data)


def retyped(dtype: str, per_byte: float) -> Callable[[bytes], bytes]:
    """The first tensor's bytes read as another dtype (``per_byte`` elements a byte, rounded down)."""

    def change(h: Header) -> None:
        name = first(h)
        begin, end = h[name]["data_offsets"]  # type: ignore[index]
        h[name].update(dtype=dtype, shape=[int((end - begin) * per_byte)])  # type: ignore[union-attr]

    return edit(change)


CASES: dict[str, Callable[[bytes], bytes]] = {
    "F4, two to a byte": retyped("F4", 2),
    "F4, an odd count": lambda raw: odd_f4(raw),
    "C64": retyped("C64", 1 / 8),
    "F8_E8M0": retyped("F8_E8M0", 1),
    "F6_E2M3 (no torch dtype)": retyped("F6_E2M3", 8 / 6),
    "BOOL": retyped("BOOL", 1),
    "as made": lambda raw: raw,
    "cut one byte short": lambda raw: raw[:-1],
    "cut to the header": lambda raw: join(split(raw)[0], b""),
    "a byte after the last tensor": lambda raw: raw + b"\0",
    "header padded with spaces": lambda raw: join(split(raw)[0], split(raw)[1], pad="        "),
    "header padded with NULs": lambda raw: join(split(raw)[0], split(raw)[1], pad="\0\0\0\0"),
    "tensors in another order in the header": lambda raw: join(dict(reversed(split(raw)[0].items())), split(raw)[1]),
    "a field safetensors does not know": tensor("note", "hand-made"),
    "an unknown dtype": tensor("dtype", "F7"),
    "a dtype in lower case": tensor("dtype", "f32"),
    "a shape that does not fit its bytes": edit(grown),
    "a negative dimension": tensor("shape", [-1]),
    "a fractional dimension": tensor("shape", [2.5]),
    "a dimension written 2.0": tensor("shape", [2.0]),
    "a dimension true": tensor("shape", [True]),
    "a shape that is not a list": tensor("shape", "64"),
    "offsets past the data": edit(shifted),
    "three offsets": tensor("data_offsets", [0, 4, 8]),
    "no offsets": edit(lambda h: h[first(h)].pop("data_offsets")),  # type: ignore[union-attr]
    "no dtype": edit(lambda h: h[first(h)].pop("dtype")),  # type: ignore[union-attr]
    "a tensor that is not an object": edit(lambda h: h.__setitem__(first(h), [1, 2])),
    "metadata with a number": edit(lambda h: h.__setitem__("__metadata__", {"format": 1})),
    "metadata null": edit(lambda h: h.__setitem__("__metadata__", None)),
    "metadata a list": edit(lambda h: h.__setitem__("__metadata__", ["pt"])),
    "NaN in a field": lambda raw: join(json.dumps(split(raw)[0])[:-1] + ', "x": NaN}', split(raw)[1]),
    "a header that starts with a space": lambda raw: join(" " + json.dumps(split(raw)[0]), split(raw)[1]),
    "a header with a byte-order mark": lambda raw: join("\ufeff" + json.dumps(split(raw)[0]), split(raw)[1]),
    "a header that is not UTF-8": lambda raw: (
        join(json.dumps(split(raw)[0]), split(raw)[1])[:9]
        + b"\xff"
        + join(json.dumps(split(raw)[0]), split(raw)[1])[10:]
    ),
    "a header length past the file": lambda raw: (len(raw)).to_bytes(8, "little") + raw[8:],
    "a header length of 0": lambda raw: bytes(8) + raw[8:],
    "eight bytes": lambda raw: raw[:8],
}


def in_vllm_venv(program: str, *paths: Path) -> Any:
    """What ``program`` prints as JSON, run by the vLLM venv's Python on ``paths``."""
    run = subprocess.run(
        [str(VLLM / "bin" / "python"), "-c", program, *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(run.stdout)


TRUTH = """
import json, sys
from safetensors import safe_open
out = {}
for path in sys.argv[1:]:
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
        out[path] = None
    except Exception as exc:
        out[path] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
"""


def test_the_header_reader_refuses_exactly_what_vllms_safetensors_refuses(tmp_path: Path) -> None:
    raw = (MODELS / "drafter-good" / "model.safetensors").read_bytes()
    paths = {}
    for name, make in CASES.items():
        path = tmp_path / f"{len(paths):02d}.safetensors"
        path.write_bytes(make(raw))
        paths[name] = path
    truth = in_vllm_venv(TRUTH, *paths.values())
    disagree = {}
    refused = 0
    for name, path in paths.items():
        try:
            _safetensors_header(str(path))
            ours = None
        except OpError as exc:
            ours = exc.message
            assert exc.code == "bad_weights" and str(path) in ours, (name, ours)
            refused += 1
        if (ours is None) != (truth[str(path)] is None):
            disagree[name] = {"agent": ours, "vLLM's safetensors": truth[str(path)]}
    assert not disagree, json.dumps(disagree, indent=1)
    assert refused >= 20  # the corpus is mostly damage: a reader that refuses nothing cannot pass


SELECT = """
import json, sys
from vllm.model_executor.model_loader.weight_utils import filter_duplicate_safetensors_files
import glob, os
out = {}
for folder in sys.argv[1:]:
    files = glob.glob(os.path.join(folder, "*.safetensors"))
    try:
        kept = filter_duplicate_safetensors_files(files, folder, "model.safetensors.index.json")
        out[folder] = sorted(os.path.basename(f) for f in kept)
    except Exception as exc:
        out[folder] = type(exc).__name__
print(json.dumps(out))
"""

DIRECTORIES: dict[str, tuple[list[str], object, list[str] | None]] = {
    "one file": (["model.safetensors"], None, ["model.safetensors"]),
    "two shards": (["a.safetensors", "b.safetensors"], None, ["a.safetensors", "b.safetensors"]),
    "a shard the index does not name": (
        ["a.safetensors", "planted.safetensors"],
        {"x": "a.safetensors"},
        ["a.safetensors"],
    ),
    "a shard named and absent": (["a.safetensors"], {"x": "a.safetensors", "y": "b.safetensors"}, None),
    "no weight_map": (["a.safetensors"], [], None),
    "a shard in a subdirectory": (["a.safetensors", "sub/c.safetensors"], None, ["a.safetensors"]),
    "an index naming a subdirectory's shard": (
        ["a.safetensors", "sub/c.safetensors"],
        {"x": "sub/c.safetensors"},
        None,
    ),
}


@pytest.fixture(scope="module")
def vllm_picks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """Each directory made once, and what vLLM's loader picks from it (one import of vLLM)."""
    made = {}
    for n, (name, (shards, index, _)) in enumerate(DIRECTORIES.items()):
        folder = tmp_path_factory.mktemp(f"weights-{n}")
        for shard in shards:
            (folder / shard).parent.mkdir(parents=True, exist_ok=True)
            (folder / shard).write_bytes(b"")
        if index is not None:
            body = {"weight_map": index} if isinstance(index, dict) else {"not_a_weight_map": index}
            (folder / "model.safetensors.index.json").write_text(json.dumps(body))
        made[name] = folder
    picked = in_vllm_venv(SELECT, *made.values())
    return {name: (folder, picked[str(folder)]) for name, folder in made.items()}


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_the_files_loaded_are_those_vllms_loader_picks(vllm_picks: dict[str, tuple[Path, object]], name: str) -> None:
    shards, _, loaded = DIRECTORIES[name]
    folder, vllm = vllm_picks[name]
    try:
        ours: list[str] | None = sorted(_loaded_weights(str(folder), shards))
    except OpError as exc:
        assert exc.code == "bad_weights" and "model.safetensors.index.json" in exc.message
        ours = None
    assert ours == loaded
    assert (vllm if isinstance(vllm, list) else None) == loaded, vllm
