"""torch.distributed.checkpoint (DCP) directories restore through this library like its own items: onto any
mesh or the CPU, matching DCP's flattened keys by name (a ``state_dict`` with integer optimizer keys too), with
dtype casts, key maps and strict=False; from local disk, gs:// and s3://; written by one process or by a job of two
(DTensors with uneven shards); read by the offline tools and converted. Nothing in a checkpoint is ever run: a
hostile pickle is refused naming its class, and damaged chunk records fail clearly, naming file and key."""

from __future__ import annotations

import fractions
import json
import os
import pickle
from collections import Counter

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import GCS_BUCKET, S3_BUCKET, sharded
from forked import launch_job
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from xla_stack import torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli, storage
from xla_tensorstore_ckpt.core import events, tree
from xla_tensorstore_ckpt.core.errors import CorruptCheckpointError, KeyMismatchError, ShapeMismatchError

HERE = os.path.dirname(__file__)
DCP_SAVE = os.path.join(HERE, "scripts", "dcp_save.py")


def training_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A model and AdamW after one step, and the state a DCP user saves: its integer-keyed optimizer state, a
    scheduler's values, a transposed (strided) tensor, bfloat16, a step and a list of floats."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    net(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    sched.step()
    state = {"model": net.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
             "extra": {"t": torch.randn(6, 5).t(), "half": torch.randn(8, 4).to(torch.bfloat16),
                       "ints": torch.arange(12, dtype=torch.int32).reshape(3, 4)},
             "step": 7, "lr": [0.5, 0.25]}
    return net, opt, state


@pytest.fixture
def dcp_dir(tmp_path) -> tuple[str, dict]:
    _, _, state = training_state()
    path = str(tmp_path / "dcp")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path, state


def MODEL_ONLY(name: str) -> str | None:  # noqa: N802 - a key map, used like a constant
    return name if name.startswith("model.") else None


def flat(value) -> dict:
    """Leaves by dotted name: DCP's names, and how a restore without target nests string keys."""
    return {".".join(str(k) for k in path): leaf for path, leaf in tree.flatten(value)}


def assert_same(restored, expected, dtype: torch.dtype | None = None) -> None:
    got, want = flat(restored), flat(expected)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            value = value.to(dtype) if dtype is not None and value.is_floating_point() else value
            have = got[key].cpu()
            assert have.dtype == value.dtype and torch.equal(have, value), key
        else:
            assert got[key] == value, key


def test_restores_without_a_target_bit_exact(dcp_dir):
    path, state = dcp_dir
    restored = xtc.restore(path)
    assert restored["step"] == 7 and restored["lr"] == [0.5, 0.25]
    assert restored["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert restored["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert_same(restored, state)


@pytest.mark.xla
def test_a_state_dict_target_matches_by_name_onto_meshes(dcp_dir, mesh_4x2, mesh_8):
    """The target holds the optimizer's integer keys (DCP saved them as "optim.state.0..."), model weights on a
    2D mesh, and the rest on the CPU, an unsharded device tensor and a 1D mesh."""
    path, state = dcp_dir
    net, opt, _ = training_state()
    x, y = mesh_4x2.axis_names
    target = {"model": {"0.weight": sharded(torch.zeros(16, 8), mesh_4x2, (x, y)),
                        "0.bias": sharded(torch.zeros(16), mesh_4x2, (x,)),
                        "2.weight": sharded(torch.zeros(4, 16), mesh_4x2, (y, x)),
                        "2.bias": torch.zeros(4).to("xla")},
              "optim": {"state": {i: {"step": torch.zeros(()), "exp_avg": torch.zeros(p.shape),
                                      "exp_avg_sq": sharded(torch.zeros(p.shape), mesh_8, ("d",) + (None,) *
                                                            (p.dim() - 1))}
                                  for i, p in enumerate(net.parameters())},
                        "param_groups": [{}]},
              "sched": {}, "extra": {"t": torch.zeros(5, 6), "half": torch.zeros(8, 4, dtype=torch.bfloat16),
                                     "ints": torch.zeros(3, 4, dtype=torch.int32)},
              "step": 0, "lr": [0.0, 0.0]}
    restored = xtc.restore(path, target, strict=False)  # param_groups / sched: the target names none of theirs
    torch_xla.sync()
    assert torch_xla._XLAC._get_xla_sharding_spec(restored["model"]["0.weight"]) == \
        torch_xla._XLAC._get_xla_sharding_spec(target["model"]["0.weight"])
    for i, entries in state["optim"]["state"].items():
        for name, value in entries.items():
            assert torch.equal(restored["optim"]["state"][i][name].cpu(), value), (i, name)
    for key, value in state["model"].items():
        assert torch.equal(restored["model"][key].cpu(), value), key
    for key, value in state["extra"].items():
        assert torch.equal(restored["extra"][key], value), key
    assert restored["step"] == 7 and restored["lr"] == [0.5, 0.25]
    # The optimizer loads what the restore gives it, and then steps like the original.
    with pytest.warns(UserWarning, match="not in the target: model"):
        opt.load_state_dict(xtc.restore(path, {"optim": state["optim"]}, strict=False)["optim"])
    assert opt.state_dict()["state"][0]["exp_avg"].equal(state["optim"]["state"][0]["exp_avg"])


@pytest.mark.xla
def test_dtype_casts_key_maps_and_key_and_shape_errors(dcp_dir, mesh_4x2):
    path, state = dcp_dir
    target = {"w": sharded(torch.zeros(16, 8, dtype=torch.bfloat16), mesh_4x2, ("x", "y")),
              "half": torch.zeros(8, 4, dtype=torch.float32)}
    key_map = {"model.0.weight": "w", "extra.half": "half"}
    restored = xtc.restore(path, target, key_map=key_map, strict=False)
    assert torch.equal(restored["w"].cpu(), state["model"]["0.weight"].to(torch.bfloat16))
    assert torch.equal(restored["half"], state["extra"]["half"].float())
    with pytest.raises(KeyMismatchError, match=r"missing from the checkpoint: model/nope"):
        xtc.restore(path, {"model": {"nope": torch.zeros(2)}}, key_map=MODEL_ONLY)
    with pytest.warns(UserWarning, match="restoring the common keys"):
        partial = xtc.restore(path, {"model": {"0.bias": torch.zeros(16), "nope": torch.zeros(2)}}, strict=False)
    assert torch.equal(partial["model"]["0.bias"], state["model"]["0.bias"])
    with pytest.raises(ShapeMismatchError, match=r"model/0\.bias: checkpoint shape \(16,\) .*dcp/model\.0\.bias "
                                                  r".*\(15,\)"):
        xtc.restore(path, {"model": {"0.bias": torch.zeros(15)}}, strict=False)


def test_metadata_and_offline_tools(dcp_dir, tmp_path, capsys):
    path, state = dcp_dir
    meta = xtc.metadata(path)
    assert meta["model"]["0.weight"].shape == (16, 8) and meta["extra"]["half"].dtype == "bfloat16"
    assert meta["step"] == 7
    assert cli.main(["tree", path, "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["optim.state.0.exp_avg"]["shape"] == [16, 8] and rows["extra.t"]["shape"] == [5, 6]
    assert cli.main(["show", path, "extra.t[1, ::2]", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == state["extra"]["t"][1, ::2].tolist()
    assert cli.main(["stats", path, "model.2.weight", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["max"] == pytest.approx(state["model"]["2.weight"].max().item())
    assert cli.main(["verify", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["problems"] == []
    # convert --to step streams it into a step of ours, which restores equal; --to safetensors the tensors.
    root = tmp_path / "run"
    assert cli.main(["convert", path, str(root / "3"), "--to", "step", "--max-host-bytes", "4KiB"]) == 0
    capsys.readouterr()
    assert cli.main(["steps", str(root), "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)] == [3]
    assert_same(xtc.restore(str(root / "3" / "model")), state)
    assert cli.main(["convert", path, str(tmp_path / "st"), "--to", "safetensors"]) == 0
    capsys.readouterr()
    exported = xtc.restore(str(tmp_path / "st"))
    tensors = {k: v for k, v in flat(state).items() if isinstance(v, torch.Tensor)}
    assert sorted(exported) == sorted(tensors)
    for key, value in tensors.items():
        assert torch.equal(exported[key], value.contiguous()), key


@pytest.mark.xla
def test_a_two_process_job_with_dtensors_restores_onto_a_mesh(tmp_path, mesh_4x2):
    import sys

    sys.path.insert(0, os.path.dirname(DCP_SAVE))
    from dcp_save import expected

    path = str(tmp_path / "job")
    results = launch_job(DCP_SAVE, 2, path)
    assert [r["returncode"] for r in results] == [0, 0], [r["stderr"][-2000:] for r in results]
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    values = expected()
    target = {"model": {"rows": sharded(torch.zeros(11, 6), mesh_4x2, ("x", "y")),  # 11 rows over 4: uneven
                        "cols": sharded(torch.zeros(4, 10, dtype=torch.bfloat16), mesh_4x2, ("y", "x")),
                        "rep": torch.zeros(7, dtype=torch.int64)},
              "plain": sharded(torch.zeros(3, 3), mesh_4x2, (None, "y")), "step": 0, "lr": [0.0, 0.0]}
    restored = xtc.restore(path, target)
    torch_xla.sync()
    for key in ("rows", "cols", "rep"):
        assert torch.equal(restored["model"][key].cpu(), values[key]), key
    assert torch.equal(restored["plain"].cpu(), values["plain"])
    assert restored["step"] == 12 and restored["lr"] == [0.5, 0.25]
    assert_same(xtc.restore(path), {"model": {k: values[k] for k in ("rows", "cols", "rep")},
                                    "plain": values["plain"], "step": 12, "lr": [0.5, 0.25]})


@pytest.mark.parametrize("scheme", ["gs", "s3"])
@pytest.mark.xla
def test_object_stores_read_byte_ranges(dcp_dir, mesh_4x2, scheme, request):
    path, state = dcp_dir
    if scheme == "gs":
        request.getfixturevalue("gcs_emulator_server")
        remote = storage.location(f"gs://{GCS_BUCKET}/dcp-{os.getpid()}")
    else:
        request.getfixturevalue("s3_server_process")
        remote = storage.location(f"s3://{S3_BUCKET}/dcp-{os.getpid()}")
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            remote.write(name, f.read())
    paths = Counter()

    def listener(event):
        if event.kind == events.RESTORE_FINISHED:
            paths.update(event.details["paths"])

    target = {"model": {k: sharded(torch.zeros(v.shape), mesh_4x2, ("x",) + (None,) * (v.dim() - 1))
                        for k, v in state["model"].items()}}
    restored = xtc.restore(str(remote), target, key_map=MODEL_ONLY, options=xtc.RestoreOptions(listeners=(listener,)))
    torch_xla.sync()
    for key, value in state["model"].items():
        assert torch.equal(restored["model"][key].cpu(), value), key
    assert paths["whole_reads"] == 0  # tensor chunks and values: ranged reads only
    assert paths["ranged_read_bytes"] >= sum(v.nbytes for v in state["model"].values())
    assert_same(xtc.restore(str(remote)), state)


# ------------------------------------------------------------------------------------------- hostile input


class _RunsCode:
    """Pickles as a call of os.system: what a hostile checkpoint would hide in its pickles."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _metadata(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # noqa: S301 - the test's own file: trusted


def _write_metadata(path: str, meta) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _index(meta, fqn: str) -> MetadataIndex:
    return next(i for i in meta.storage_data if i.fqn == fqn)


def test_a_metadata_pickle_that_runs_code_is_refused_and_runs_nothing(dcp_dir, tmp_path):
    path, _ = dcp_dir
    sentinel = tmp_path / "ran"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(pickle.dumps(_RunsCode(str(sentinel)), protocol=2))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata: refusing to load class posix\.system"):
        xtc.restore(path)
    # Hidden deep inside an otherwise valid Metadata too.
    fresh = tmp_path / "fresh"
    dcp.save(training_state()[2], checkpoint_id=str(fresh), no_dist=True)
    meta = _metadata(str(fresh))
    meta.storage_meta = _RunsCode(str(sentinel))
    _write_metadata(str(fresh), meta)
    with pytest.raises(CorruptCheckpointError, match=r"refusing to load class posix\.system"):
        xtc.metadata(str(fresh))
    assert cli.main(["tree", str(fresh)]) == 1
    assert not sentinel.exists()


def test_a_tensor_record_that_runs_code_is_refused(dcp_dir, tmp_path):
    path, _ = dcp_dir
    sentinel = tmp_path / "ran"
    import io
    import zipfile

    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(_RunsCode(str(sentinel)), protocol=2))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/data/0", b"\0" * 64)
    with open(os.path.join(path, "evil.distcp"), "wb") as f:
        f.write(blob.getvalue())
    meta = _metadata(path)
    index = _index(meta, "model.2.bias")
    meta.storage_data[index] = _StorageInfo("evil.distcp", 0, len(blob.getvalue()))
    _write_metadata(path, meta)
    with pytest.raises(CorruptCheckpointError, match=r"evil\.distcp.*model\.2\.bias.*refusing to load class "
                                                     r"posix\.system"):
        xtc.restore(path)
    assert not sentinel.exists()


def test_values_that_are_objects_are_left_out_naming_their_keys(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3), "fraction": fractions.Fraction(1, 3), "n": 4}, checkpoint_id=path, no_dist=True)
    with pytest.warns(UserWarning, match=r"left out bytes entries that are not plain values.*fraction"):
        restored = xtc.restore(path)
    assert sorted(restored) == ["n", "w"] and restored["n"] == 4


def _damage(path: str, how: str) -> str:
    """Damage the DCP directory at `path` as `how` says; the message the restore must raise."""
    meta = _metadata(path)
    index = _index(meta, "model.0.weight")
    info = meta.storage_data[index]
    size = os.path.getsize(os.path.join(path, info.relative_path))
    entry = meta.state_dict_metadata["model.0.weight"]
    if how == "offset past the end":
        meta.storage_data[index] = _StorageInfo(info.relative_path, size + 100, info.length)
        message = r"__0_0\.distcp.*model\.0\.weight.*truncated"
    elif how == "length past the end":
        meta.storage_data[index] = _StorageInfo(info.relative_path, info.offset, size)
        message = r"__0_0\.distcp.*model\.0\.weight.*truncated"
    elif how == "truncated file":
        with open(os.path.join(path, info.relative_path), "r+b") as f:
            f.truncate(info.offset + info.length // 2)
        return r"__0_0\.distcp.*model\.0\.weight.*truncated"
    elif how == "missing file":
        os.remove(os.path.join(path, info.relative_path))
        return r"__0_0\.distcp.*missing"
    elif how == "overlapping chunks":  # same total volume as the tensor, rows 8..11 twice, 12..15 never
        entry.chunks[:] = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([12, 8])),
                           ChunkStorageMetadata(torch.Size([8, 0]), torch.Size([4, 8]))]
        meta.storage_data[MetadataIndex("model.0.weight", torch.Size([8, 0]))] = info
        message = r"chunks of tensor 'model\.0\.weight' at \(0, 0\) and \(8, 0\) overlap"
    elif how == "chunks that do not tile":
        entry.chunks[:] = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 8]))]
        message = r"chunks of tensor 'model\.0\.weight' do not cover its shape \(16, 8\)"
    elif how == "chunk outside the tensor":
        entry.chunks[:] = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([32, 8]))]
        message = r"'model\.0\.weight' of shape \(16, 8\) has a chunk at \(0, 0\) of size \(32, 8\), outside it"
    elif how == "path outside the directory":
        meta.storage_data[index] = _StorageInfo("../elsewhere.distcp", info.offset, info.length)
        message = r"\['model\.0\.weight'\]: file name '\.\./elsewhere\.distcp', which is not a plain name"
    else:
        raise AssertionError(how)
    _write_metadata(path, meta)
    return message


DAMAGE = ["offset past the end", "length past the end", "truncated file", "missing file", "overlapping chunks",
          "chunks that do not tile", "chunk outside the tensor", "path outside the directory"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_chunk_records_fail_clearly_and_change_nothing(dcp_dir, how):
    path, state = dcp_dir
    message = _damage(path, how)
    before = {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}
    target = {"model": {k: torch.zeros(v.shape) for k, v in state["model"].items()}}
    with pytest.raises(CorruptCheckpointError, match=message):
        xtc.restore(path, target, key_map=MODEL_ONLY)
    assert cli.main(["verify", path]) in (cli.EXIT_DATA, 1)
    assert {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)} == before
