"""No small hostile file crashes, hangs or exhausts a reader, and no reader changes a file.

Two parts. Named cases, each a hostile file found in review (a scalar backed by a 2^40-element array, a
``zarr.json`` nested 100,000 deep, a 2^40-chunk grid, offsets beyond 2^63, 3,000-component key paths, look-alike
digits, FIFOs, NUL bytes, strings that are not strings, an int4 array): every reader must refuse each with a
library error. Then generated cases (`--hostile-cases N`, default 300, from case `--hostile-start S`, default
0): byte flips, truncations, JSON mutations, hostile names (paths leaving the directory, absolute, drives,
NUL, over-long), removals, and FIFOs,
sockets and links to FIFOs in place of any file, of every format read (ours v1 and v2, OCDBT and directories,
Orbax zarr v3 and v2, a root of steps, safetensors files and directories, DCP directories, a torch_xla
CheckpointManager root). Every case runs every reader and CLI
command in a worker process under a memory and a time limit (tests/hostile.py): it must end in success or a
library error, never a signal, a hang, a traceback, or a file changed outside the destination.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import struct
import sys

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import storage
from xla_tensorstore_ckpt.tools import convert

sys.path.insert(0, os.path.dirname(__file__))
import hostile  # noqa: E402
from hf_files import write_hf_dir  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _torch_xla_marker(step: int) -> bytes:
    """torch_xla's CheckpointManager marker, a pickle of its ``_CheckpointMetadata(step, ts)``, written without
    torch_xla (absent on the newest stack): the class by name, then its state, as pickle writes a dataclass."""
    state = pickle.dumps({"step": step, "ts": datetime.datetime(2026, 1, 1)}, protocol=3)
    head = b"ctorch_xla.experimental.distributed_checkpoint.manager\n_CheckpointMetadata\n)\x81"
    return state[:2] + head + state[2:-1] + b"b."


def _orbax_zarr2(path: str) -> None:
    """An item as Orbax writes it with ``use_ocdbt=False, use_zarr3=False``: a zarr v2 directory per array."""
    arrays = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "lr": np.float64(0.5)}
    entries = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": f"{path}/{name}/"},
                 "metadata": {"shape": list(value.shape), "chunks": [max(1, n // 2) for n in value.shape],
                              "dtype": value.dtype.str, "compressor": None}, "create": True}).result().write(
            value).result()
        entries[str((name,))] = {"key_metadata": [{"key": name, "key_type": 2}], "value_metadata": {
            "value_type": "scalar" if value.ndim == 0 else "jax.Array", "skip_deserialize": False}}
    with open(os.path.join(path, "_METADATA"), "w") as f:
        json.dump({"tree_metadata": entries, "use_ocdbt": False, "use_zarr3": False,
                   "store_array_data_equal_to_fill_value": True, "custom_metadata": None}, f)


def _as_orbax(item: str) -> None:
    """Our item, read as Orbax's: without this library's part of ``_METADATA``."""
    path = os.path.join(item, "_METADATA")
    doc = json.load(open(path))
    del doc["xla_tensorstore_ckpt"]
    json.dump(doc, open(path, "w"))


@pytest.fixture(scope="session")
def seeds(tmp_path_factory) -> list[hostile.Seed]:
    base = tmp_path_factory.mktemp("hostile-seeds")
    hf = str(base / "hf-dir")
    write_hf_dir(hf)
    save_file({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
              str(base / "single.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    for name, ocdbt in (("ours-ocdbt", True), ("ours-dirs", False)):
        convert.convert_item(storage.location(hf), storage.location(str(base / name)),
                             options=convert.ConvertOptions(mesh=(2, 2), use_ocdbt=ocdbt))
    xtc.save(base / "ours-tree", {"w": torch.arange(6.0).reshape(2, 3), "s": "text", "n": 3, "x": float("nan"),
                                  "nested": {"l": [1, 2], "t": (torch.ones(2, dtype=torch.int64), "u")}})
    for ours, theirs in (("ours-dirs", "orbax-zarr3"), ("ours-tree", "orbax-strings")):
        shutil.copytree(base / ours, base / theirs)
        _as_orbax(str(base / theirs))
    _orbax_zarr2(str(base / "orbax-zarr2"))
    root = base / "root"
    for step in (1, 2):
        convert.convert_to_step(storage.location(hf), storage.location(str(root / str(step))))
    shutil.copytree(os.path.join(GOLDEN, "orbax-0.11", "root", "2"), root / "3")
    for name in ("v1", "v2-unchecked"):
        shutil.copytree(os.path.join(GOLDEN, name, "1"), base / f"{name}-step")
    state = {"w": torch.arange(12.0).reshape(3, 4), "layers": [torch.ones(2, dtype=torch.bfloat16)], "n": 3}
    dcp.save(state, checkpoint_id=str(base / "dcp"), no_dist=True)
    for step in (2, 4):  # a torch_xla CheckpointManager root: DCP steps, each with the manager's marker
        dcp.save(state, checkpoint_id=str(base / "xla-root" / str(step)), no_dist=True)
        (base / "xla-root" / str(step) / ".manager_metadata").write_bytes(_torch_xla_marker(step))
    return [hostile.Seed("dcp", str(base / "dcp"), "item", "w"),
            hostile.Seed("xla-root", str(base / "xla-root"), "xla-root", None),hostile.Seed("hf-dir", hf, "item", key),
            hostile.Seed("hf-file", str(base / "single.safetensors"), "item", "w"),
            hostile.Seed("ours-ocdbt", str(base / "ours-ocdbt"), "item", key),
            hostile.Seed("ours-dirs", str(base / "ours-dirs"), "item", key),
            hostile.Seed("ours-tree", str(base / "ours-tree"), "item", "w"),
            hostile.Seed("orbax-ocdbt", os.path.join(GOLDEN, "orbax-0.11", "item"), "item", None),
            hostile.Seed("orbax-zarr3", str(base / "orbax-zarr3"), "item", key),
            hostile.Seed("orbax-zarr2", str(base / "orbax-zarr2"), "item", "w"),
            hostile.Seed("orbax-strings", str(base / "orbax-strings"), "item", "w"),
            hostile.Seed("root", str(root), "root", None),
            hostile.Seed("v1-step", str(base / "v1-step"), "step", None),
            hostile.Seed("v2-unchecked-step", str(base / "v2-unchecked-step"), "step", None)]


@pytest.fixture(scope="module")
def harness():
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    h = hostile.Harness(env)
    yield h
    h.close()


def _run(harness: hostile.Harness, case: hostile.Case, out: str) -> tuple[list[str], list[dict] | str]:
    watched = case.seed.path
    before = hostile.snapshot(watched)
    outcome = harness.run(case.id, hostile.ops_for(case.seed, out))
    return hostile.failures(case, outcome, before, hostile.snapshot(watched)), outcome


def _seed(seeds: list[hostile.Seed], name: str) -> hostile.Seed:
    return next(s for s in seeds if s.name == name)


def _copy(seed: hostile.Seed, tmp_path) -> hostile.Seed:
    target = tmp_path / "case" / os.path.basename(seed.path)
    (tmp_path / "case").mkdir()
    (shutil.copy if os.path.isfile(seed.path) else shutil.copytree)(seed.path, target)
    return hostile.Seed(seed.name, str(target), seed.kind, seed.array_key)


def _edit_json(path: str, edit) -> None:
    doc = json.load(open(path))
    edit(doc)
    json.dump(doc, open(path, "w"))


def _zarr(shape, chunks, dtype="float64") -> dict:
    return {"zarr_format": 3, "node_type": "array", "shape": shape, "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}


def _scalar_as_huge_array(case: str, elements: int) -> None:
    # The Orbax item's scalar "lr" stored as a zarr v2 array of `elements` float64 values, none of them stored:
    # written without store_array_data_equal_to_fill_value, they read as zeros.
    json.dump({"zarr_format": 2, "shape": [elements], "chunks": [elements], "dtype": "<f8", "compressor": None,
               "fill_value": 0.0, "order": "C", "filters": None}, open(os.path.join(case, "lr", ".zarray"), "w"))
    os.remove(os.path.join(case, "lr", "0"))
    _edit_json(os.path.join(case, "_METADATA"), lambda d: d.update(store_array_data_equal_to_fill_value=False))


def _header(path: str, edit) -> None:
    """Rewrite the JSON header of a safetensors file with `edit` applied, keeping its data."""
    data = open(path, "rb").read()
    (length,) = struct.unpack("<Q", data[:8])
    doc = json.loads(data[8:8 + length])
    edit(doc)
    head = json.dumps(doc).encode()
    head += b" " * (-len(head) % 8)
    open(path, "wb").write(struct.pack("<Q", len(head)) + head + data[8 + length:])


def _orbax_key(case: str, edit) -> None:
    def apply(doc):
        entry = doc["tree_metadata"][str(("w",))]
        edit(entry)
    _edit_json(os.path.join(case, "_METADATA"), apply)


def _deep_zarr_json(case: str) -> None:
    with open(os.path.join(case, "model.norm.weight", "zarr.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)


def _strings(case: str, content: str) -> None:
    with open(os.path.join(case, "_strings.json"), "w") as f:
        f.write(content)


def _int4(case: str) -> None:
    name = os.path.join(case, "model.norm.weight")
    shutil.rmtree(name)
    ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{name}/"}, "create": True,
             "metadata": _zarr([48], [48], "int4")}).result().write(np.ones(48, ml_dtypes.int4)).result()


def _fifo(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


def _first_file(case: str, directory: str) -> str:
    """The first file (in sorted order) in a directory named `directory` (``d``: OCDBT data files; ``c``: zarr
    chunk files, the directory of the first chunk index) of the case."""
    for root, _, files in sorted(os.walk(case)):
        if directory in root[len(case):].split(os.sep) and files:
            return os.path.join(root, sorted(files)[0])
    raise AssertionError(f"no file under a directory {directory!r} in {case}")


def _special(case: str, path: str, kind: str) -> None:
    """`path` replaced by a FIFO, a socket or a link to a FIFO beside the case (`hostile._special`)."""
    hostile._special(os.path.join(case, path), kind, os.path.dirname(case))


def _index_nul(case: str) -> None:
    _edit_json(os.path.join(case, "model.safetensors.index.json"),
               lambda d: d["weight_map"].update({"lm_head.weight": "model-00001\x00.safetensors"}))


def _sequence_key(value: str):
    return lambda case: _orbax_key(case, lambda e: e["key_metadata"].append({"key": value, "key_type": 1}))


METADATA_READS = ("tree", "metadata", "verify", "restore", "convert")  # every reader of the item's metadata
DATA_READS = ("verify", "restore", "convert", "stats")  # and of its arrays

# name: (seed, how the copy is made hostile, the ops that must refuse it)
NAMED = {
    "orbax scalar backed by 2^40 float64": ("orbax-zarr2", lambda c: _scalar_as_huge_array(c, 1 << 40),
                                            METADATA_READS),
    "orbax scalar backed by 256 MiB": ("orbax-zarr2", lambda c: _scalar_as_huge_array(c, 1 << 25), METADATA_READS),
    "zarr.json nested 100,000 deep (ours)": ("ours-dirs", _deep_zarr_json, DATA_READS),
    "zarr.json nested 100,000 deep (Orbax's)": ("orbax-zarr3", _deep_zarr_json, METADATA_READS),
    "2^40 chunks of [1] (Orbax's)": ("orbax-zarr3", lambda c: json.dump(
        _zarr([1 << 40], [1], "float32"), open(os.path.join(c, "model.norm.weight", "zarr.json"), "w")),
        METADATA_READS),
    "2^40 chunks of [1] (ours, no checksums)": ("v2-unchecked-step", lambda c: _edit_json(
        os.path.join(c, "model", "_METADATA"), _giant_grid), ("tree", "verify", "convert")),
    "safetensors offsets beyond 2^63": ("hf-file", lambda c: _header(
        c, lambda d: d["w"].update(data_offsets=[2**63, 2**63 + 48])), METADATA_READS),
    "zero-size tensor with a dimension of 2^63": ("hf-file", lambda c: _header(
        c, lambda d: d.update(z={"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]})), METADATA_READS),
    "key path of 3,000 components": ("orbax-zarr2", lambda c: _orbax_key(
        c, lambda e: e.update(key_metadata=[{"key": "k", "key_type": 2}] * 3000,
                              value_metadata={"value_type": "Dict", "skip_deserialize": True})), METADATA_READS),
    "_strings.json nested 100,000 deep (Orbax's)": ("orbax-strings", lambda c: _strings(
        c, "[" * 100_000 + "]" * 100_000), METADATA_READS),
    "_strings.json nested 100,000 deep (ours)": ("ours-tree", lambda c: _strings(
        c, "[" * 100_000 + "]" * 100_000), ("verify", "restore")),
    "sequence key '²'": ("orbax-zarr2", _sequence_key("²"), METADATA_READS),
    "sequence key of 5,000 digits": ("orbax-zarr2", _sequence_key("9" * 5000), METADATA_READS),
    "FIFO as model.safetensors": ("hf-dir", lambda c: _fifo(os.path.join(c, "model-00001-of-00002.safetensors")),
                                  METADATA_READS),
    "FIFO as _METADATA": ("ours-ocdbt", lambda c: _fifo(os.path.join(c, "_METADATA")), METADATA_READS),
    "FIFO as manifest.ocdbt": ("ours-tree", lambda c: _fifo(os.path.join(c, "manifest.ocdbt")), DATA_READS),
    "FIFO as zarr.json": ("ours-dirs", lambda c: _fifo(os.path.join(c, "model.norm.weight", "zarr.json")),
                          DATA_READS),
    "FIFO as an OCDBT data file (ours)": ("ours-ocdbt", lambda c: _special(c, _first_file(c, "d"), "fifo"), DATA_READS),
    "socket as an OCDBT data file (Orbax's)": ("orbax-ocdbt", lambda c: _special(c, _first_file(c, "d"), "socket"),
                                               ("verify", "restore", "convert")),
    "link to a FIFO as a zarr chunk file": ("ours-dirs", lambda c: _special(c, _first_file(c, "c"), "fifo-link"),
                                            DATA_READS),
    "FIFO as a DCP data file": ("dcp", lambda c: _special(c, "__0_0.distcp", "fifo"),
                                ("verify", "restore", "convert")),
    "socket as DCP's .metadata": ("dcp", lambda c: _special(c, ".metadata", "socket"),
                                  METADATA_READS),
    "DCP .metadata declaring a bytearray of 2^62 bytes": ("dcp", lambda c: open(
        os.path.join(c, ".metadata"), "wb").write(b"\x80\x04\x96" + (1 << 62).to_bytes(8, "little") + b"."),
        METADATA_READS),
    "our part of _METADATA not an object": ("ours-ocdbt", lambda c: _edit_json(
        os.path.join(c, "_METADATA"), lambda d: d.update(xla_tensorstore_ckpt="a\x00b")), METADATA_READS),
    "NUL byte in an index file name": ("hf-dir", _index_nul, METADATA_READS),
    "_strings.json holding a non-string": ("orbax-strings", lambda c: _strings(
        c, '{"s": {"not": "a string"}, "nested.t.1": "u"}'), METADATA_READS),
    "int4 array (Orbax's)": ("orbax-zarr3", _int4, METADATA_READS),
}


def _giant_grid(doc: dict) -> None:
    """Declare the first array of a format-2 manifest (no checksums) 2^40 float32 elements in chunks of one."""
    def visit(node):
        if isinstance(node, dict):
            if "array" in node and isinstance(node["array"], dict):
                node["array"].update(shape=[1 << 40], chunk_shape=[1], dtype="float32")
                return True
            return any(visit(v) for v in node.values())
        return isinstance(node, list) and any(visit(v) for v in node)
    assert visit(doc["xla_tensorstore_ckpt"]["tree"])


@pytest.mark.parametrize("name", list(NAMED))
def test_named_hostile_files_are_refused(seeds, harness, tmp_path, name):
    """Each of these crashed, hung, exhausted or fooled a reader: now every reader that reads the hostile file
    refuses it with a library error (and `verify` always: it reads everything)."""
    seed_name, make, must_refuse = NAMED[name]
    seed = _copy(_seed(seeds, seed_name), tmp_path)
    make(seed.path)
    case = hostile.Case(name, seed, name)
    problems, outcome = _run(harness, case, str(tmp_path / "out"))
    assert not problems, "\n".join(problems)
    by_name = {(r["op"][1] if r["op"][0] == "cli" else r["op"][0]): r["outcome"] for r in outcome}
    assert {op: by_name[op] for op in must_refuse if op in by_name} == {
        op: "error" for op in must_refuse if op in by_name}, outcome


@pytest.fixture(scope="module")
def hostile_cases(request) -> range:
    start = request.config.getoption("--hostile-start")
    return range(start, start + request.config.getoption("--hostile-cases"))


@pytest.mark.timeout(0)  # scales with --hostile-cases; every case has its own limit (hostile.CASE_TIMEOUT_S)
def test_generated_hostile_checkpoints(seeds, harness, hostile_cases, tmp_path):
    """Mutations of real metadata files of every format: each ends in success or a library error, with no file
    outside the destination changed (see the module docstring)."""
    problems = []
    outcomes = {"ok": 0, "error": 0}
    for n in hostile_cases:
        seed = seeds[n % len(seeds)]
        work = tmp_path / f"case-{n}"
        work.mkdir()
        case = hostile.mutate(seed, str(work), n // len(seeds))
        found, outcome = _run(harness, case, str(work / "out"))
        problems += found
        for line in found:  # seen at once with -s in a long run
            print(line[:2000], flush=True)
        if not isinstance(outcome, str):
            for r in outcome:
                outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        shutil.rmtree(work)
    print(f"{len(hostile_cases)} hostile cases ({hostile_cases.start} .. {hostile_cases.stop - 1}): {outcomes}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])
    assert outcomes["error"] > len(hostile_cases), outcomes  # the mutations do reach the readers' checks


KEYS = 200_000


def _header_file(path, entries: list[tuple[str, dict]], data: bytes) -> None:
    """A safetensors file whose header lists `entries` in order, duplicates included (written as raw JSON)."""
    head = ("{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in entries) + "}").encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_metadata_decoders_do_linear_work_on_200k_keys(tmp_path):
    """Headers and indexes of 200,000 keys (tens of MB) decode, or are refused, in work linear in their size:
    duplicates are found with a set, files are grouped in one pass (a `list.count` per key took 28-44 s at 60k)."""
    tensors = [(f"layers.{i}.w", {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]})
               for i in range(KEYS)]
    big = tmp_path / "big.safetensors"
    _header_file(big, tensors, np.arange(KEYS, dtype=np.float32).tobytes())
    assert big.stat().st_size > 10 << 20
    info = xtc.metadata(big)
    assert len(info) == KEYS and info[f"layers.{KEYS - 1}.w"].shape == (1,)
    duplicated = tmp_path / "dup.safetensors"
    _header_file(duplicated, tensors + [tensors[7]], np.zeros(KEYS, dtype=np.float32).tobytes())
    with pytest.raises(xtc.CorruptCheckpointError, match="'layers.7.w' appears twice"):
        xtc.metadata(duplicated)
    # An index of 200,000 keys in 200,000 files, none there: the first missing file is named.
    hf = tmp_path / "hf"
    hf.mkdir()
    weight_map = {f"k{i}": f"part-{i}.safetensors" for i in range(KEYS)}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(xtc.CorruptCheckpointError, match="part-0.safetensors: missing"):
        xtc.metadata(hf)
    text = json.dumps({"weight_map": weight_map})
    (hf / "model.safetensors.index.json").write_text(text[:-2] + ', "k5": "x.safetensors"}}')
    with pytest.raises(xtc.CorruptCheckpointError, match="'k5' appears twice"):
        xtc.metadata(hf)


@pytest.mark.parametrize("damage", ["look-alike index", "not an object", "newer format"])
def test_one_malformed_step_does_not_sink_a_listing(seeds, tmp_path, capsys, damage):
    """`xtckpt steps` and `xtckpt verify` of a root list every step; a malformed one is reported as damaged, with
    the reason, and skipped, like a corrupt one."""
    from xla_tensorstore_ckpt import cli

    root = tmp_path / "root"
    shutil.copytree(_seed(seeds, "root").path, root)
    manifest = root / "3" / "model" / "_METADATA"
    doc = json.loads(manifest.read_text())
    if damage == "look-alike index":
        next(iter(doc["tree_metadata"].values()))["key_metadata"].append({"key": "²", "key_type": 1})
    elif damage == "not an object":
        doc = [doc]
    else:
        doc = {"format_version": 99, "tree": {}}
    manifest.write_text(json.dumps(doc))
    assert cli.main(["steps", str(root), "--json"]) == 0
    steps = {s["step"]: s for s in json.loads(capsys.readouterr().out)}
    assert [steps[s]["status"] for s in (1, 2, 3)] == ["committed", "committed", "invalid"]
    assert str(manifest) in steps[3]["problem"]
    assert cli.main(["verify", str(root), "--json"]) == cli.EXIT_DATA
    report = json.loads(capsys.readouterr().out)
    assert [p["where"].split(":")[0] for p in report["problems"]] == ["step 3"] and report["arrays"] >= 14
