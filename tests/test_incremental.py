"""Incremental steps (issue 65, docs/incremental.md): unchanged chunks referenced from the step that stores
them, every reader following the references bit-exact, retention keeping referenced steps, clear errors when a
base is gone, and a standalone copy for Orbax. CPU tensors, both stacks."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys

import numpy as np
import pytest
import torch
from helpers import Paths, assert_trees_equal

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli
from xla_tensorstore_ckpt.checkpoint_manager import policies
from xla_tensorstore_ckpt.core.errors import CheckpointError
from xla_tensorstore_ckpt.core.records import StepMetadata

CHUNKS = 4  # chunks of the sharded array, 16 rows each


def _options(**kw) -> xtc.CheckpointManagerOptions:
    return xtc.CheckpointManagerOptions(**{"save_interval_steps": 1, "async_save": False, "save_rng": False,
                                           "incremental": True, **kw})


def _sharded(full: torch.Tensor) -> xtc.ShardedArray:
    rows = full.shape[0] // CHUNKS
    return xtc.ShardedArray(tuple(full.shape), full.dtype, (rows, full.shape[1]),
                            tuple((((i * rows, (i + 1) * rows), (0, full.shape[1])), full[i * rows:(i + 1) * rows])
                                  for i in range(CHUNKS)))


def _state(step: int) -> tuple[dict, dict]:
    """A frozen base (the same every step), an adapter that changes, and a sharded bf16 array whose first chunk of
    four changes every step; the state to save and the tensors expected back."""
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(64, 32, generator=g)
    big = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    big[3] += step  # the first chunk changes
    adapter = torch.full((8, 4), float(step))
    saved = {"frozen": frozen, "adapter": adapter, "big": _sharded(big), "step": step}
    return saved, {"frozen": frozen, "adapter": adapter, "big": big, "step": step}


def _step_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if "_chunk_hashes" not in f and not f.startswith("_") and f != "manifest.ocdbt")


def _metadata(path) -> dict:
    with open(os.path.join(path, "_METADATA")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("incr")
    with xtc.CheckpointManager(root, _options(max_to_keep=2)) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, extra=_state(step)[0])
        steps = mgr.all_steps()
    return root, steps


def test_unchanged_chunks_are_referenced_and_every_step_restores_bit_exact(saved):
    root, steps = saved
    # retention keeps two steps and step 1, whose frozen base they reference
    assert steps == [1, 3, 4]
    with xtc.CheckpointManager(root, _options()) as mgr:
        assert mgr.metadata(4).bases == (1,)
    for step in steps:
        assert_trees_equal(xtc.restore(root / str(step) / "extra"), _state(step)[1])
    meta = _metadata(root / "4" / "extra")
    ours = meta["xla_tensorstore_ckpt"]["incremental"]
    assert ours["arrays"] == ["big", "frozen"] and ours["bases"] == [[1, "1"]]
    # the referenced arrays are None to Orbax: it never reads a chunk stored elsewhere as a fill value
    kinds = {k: v["value_metadata"]["value_type"] for k, v in meta["tree_metadata"].items()}
    assert kinds == {"('frozen',)": "None", "('big',)": "None", "('adapter',)": "jax.Array", "('step',)": "scalar"}
    # step 4 wrote the adapter, one chunk of `big` and the step scalar, not the frozen base
    assert _step_bytes(root / "4") < _step_bytes(root / "1") / 3


def test_chunks_read_across_steps_by_region(saved, capsys):
    """A region that spans chunks of several steps is read piece by piece (`xtckpt show` reads a slice);
    `xtckpt steps` names the bases, `xtckpt verify` checks the chunks of every step a step references."""
    root, _ = saved
    assert cli.main(["steps", str(root)]) == 0
    out = capsys.readouterr().out
    assert "references steps 1" in out and "base of steps 3, 4" in out
    expected = _state(4)[1]["big"]
    got = xtc.restore(root / "4" / "extra", target={"frozen": torch.zeros(64, 32), "adapter": torch.zeros(8, 4),
                                                    "big": torch.zeros(64, 16, dtype=torch.bfloat16), "step": 0})
    assert torch.equal(got["big"], expected)
    assert cli.main(["show", str(root / "4"), "extra/big[10:40, 3:5]"]) == 0
    assert cli.main(["verify", str(root / "4")]) == 0


def test_materialized_step_is_standalone(saved, tmp_path):
    root, _ = saved
    out = tmp_path / "standalone" / "4"
    assert cli.main(["convert", str(root / "4"), str(out), "--to", "step", "--item", "extra"]) == 0
    assert "incremental" not in _metadata(out / "extra")["xla_tensorstore_ckpt"]
    assert_trees_equal(xtc.restore(out / "extra"), _state(4)[1])


def test_a_whole_step_materialized_standalone_keeps_every_item_and_its_metrics(tmp_path):
    """`xtckpt convert ROOT/S OUT/S --to step` without `--item` copies every item of an incremental step, so
    that its bases can go: the copy restores bit-exact with them deleted, and keeps the step's metrics."""
    root, out = tmp_path / "root", tmp_path / "out" / "3"
    with xtc.CheckpointManager(root, _options()) as mgr:
        for step in (1, 2, 3):
            saved, _ = _state(step)
            mgr.save(step, model={"frozen": saved["frozen"]}, extra=saved, metrics={"loss": 1.0 / step})
        assert mgr.metadata(3).bases == (1,)
    assert cli.main(["convert", str(root / "3"), str(out), "--to", "step"]) == 0
    shutil.rmtree(root)
    with xtc.CheckpointManager(out.parent, _options()) as mgr:
        marker = mgr.metadata(3)
        assert marker.items == ("model", "extra") and marker.bases == () and marker.metrics == {"loss": 1.0 / 3}
    for item in ("model", "extra"):
        assert "incremental" not in _metadata(out / item)["xla_tensorstore_ckpt"]
    assert_trees_equal(xtc.restore(out / "extra"), _state(3)[1])
    assert torch.equal(xtc.restore(out / "model")["frozen"], _state(3)[1]["frozen"])


def test_a_referenced_step_is_never_replaced_and_a_gone_base_is_written_again(tmp_path):
    """`save(force=True)` of a step that other steps reference is refused as `delete` is (replacing it would
    change what they restore), before anything is written; a base deleted by hand is not referenced again:
    the next save writes its chunks and says why."""
    seen = []
    with xtc.CheckpointManager(tmp_path, _options(listeners=(seen.append,))) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, extra=_state(step)[0])
        with pytest.raises(xtc.UsageError, match=r"cannot replace step 1 .*steps \[2, 3\] reference"):
            mgr.save(1, extra=_state(7)[0], force=True)
        mgr.save(3, extra=_state(3)[0], force=True)  # referenced by no step: replaced, on step 2
        assert mgr.all_steps() == [1, 2, 3] and mgr.metadata(3).bases == (1,)
    for step in (1, 2, 3):
        assert_trees_equal(xtc.restore(tmp_path / str(step) / "extra"), _state(step)[1])
    shutil.rmtree(tmp_path / "1")
    with xtc.CheckpointManager(tmp_path, _options(listeners=(seen.append,))) as mgr:
        mgr.save(4, extra=_state(4)[0])
        assert mgr.metadata(4).bases == ()
    whole = next(e.details for e in seen if e.kind == "save_written" and e.step == 4)["written_whole"]
    assert "steps [1] are gone" in whole["extra/frozen"]
    assert_trees_equal(xtc.restore(tmp_path / "4" / "extra"), _state(4)[1])


def _xy(step: int, x: float | None = None) -> dict:
    """`x` changes up to step 2, then stays (later steps reference step 2's chunks); `y` changes every step."""
    return {"x": torch.full((64, 64), float(min(step, 2) if x is None else x)), "y": torch.full((4,), float(step))}


def test_a_base_is_never_replaced_by_a_later_save_in_any_tier(tmp_path):
    """A step referenced by a save in flight (async) or by local steps is not replaced, with or without
    `force` (they would restore the new values); a rewound run's save takes an earlier step as its base, never
    a later one of the abandoned timeline, so it can replace that timeline's steps."""
    persistent, local = tmp_path / "p", tmp_path / "l"
    with xtc.CheckpointManager(persistent, _options(async_save=True)) as mgr:
        for step in (1, 2):
            mgr.save(step, extra=_xy(step))
        mgr.wait_until_finished()
        mgr.save(3, extra=_xy(3))  # its base, step 2, is pinned until it commits
        with pytest.raises(xtc.UsageError, match=r"cannot replace step 2 .*(a save in flight|steps \[3\])"):
            mgr.save(2, extra=_xy(2, 99.0), force=True)
        mgr.wait_until_finished()
        assert mgr.metadata(3).bases == (2,)
    assert torch.equal(xtc.restore(persistent / "3" / "extra")["x"], _xy(3)["x"])
    options = _options(local_directory=str(local), local_save_interval_steps=1, save_interval_steps=10)
    with xtc.CheckpointManager(tmp_path / "p2", options) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, extra=_xy(step))
    with xtc.CheckpointManager(tmp_path / "p2", options) as mgr:  # no restore: the local steps are all still there
        with pytest.raises(xtc.UsageError, match=r"cannot replace step 2 of .*steps \[3, 4\] reference"):
            mgr.save(2, extra=_xy(2, 99.0))
    for step in (3, 4):
        assert torch.equal(xtc.restore(local / str(step) / "extra")["x"], _xy(step)["x"])
    with xtc.CheckpointManager(tmp_path / "p3", _options()) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, extra=_xy(step))
        mgr.save(3, extra=_xy(4), force=True)  # the values of step 4: the old code took 4 as its base
        assert mgr.metadata(3).bases == (2,)
        mgr.save(4, extra=_xy(4, 5.0), force=True)
    assert_trees_equal(xtc.restore(tmp_path / "p3" / "3" / "extra"), _xy(4))
    assert_trees_equal(xtc.restore(tmp_path / "p3" / "4" / "extra"), _xy(4, 5.0))


def test_a_damaged_anchor_chunk_is_written_whole(tmp_path):
    """A delta save that cannot read its anchor's chunk writes the chunk whole (and says why), never fails."""
    seen = []
    with xtc.CheckpointManager(tmp_path, _options(delta=True, listeners=(seen.append,))) as mgr:
        mgr.save(1, extra={"w": _rl_weights(1)})
        for top, _, names in os.walk(tmp_path / "1" / "extra"):
            for name in names:
                if os.sep + "d" in top[len(str(tmp_path)):]:  # the OCDBT data files
                    path = os.path.join(top, name)
                    with open(path, "r+b") as f:
                        f.seek(os.path.getsize(path) // 2)
                        byte = f.read(1)
                        f.seek(-1, os.SEEK_CUR)
                        f.write(bytes([byte[0] ^ 0xFF]))
        mgr.save(2, extra={"w": _rl_weights(2)})
    whole = next(e.details for e in seen if e.kind == "save_written" and e.step == 2)["written_whole"]
    assert "anchor's chunk in step 1 cannot be read" in whole["extra/w"]
    assert torch.equal(xtc.restore(tmp_path / "2" / "extra")["w"], _rl_weights(2))


def test_training_goes_on_after_a_damaged_local_anchor(tmp_path):
    """A local anchor step damaged on disk: the resume falls back to the persistent step of the same number and
    deletes the local copy it skipped, so the next local saves do not take it as their base (they failed, each)."""
    local = tmp_path / "local"
    options = _options(delta=True, local_directory=str(local), local_save_interval_steps=1, save_interval_steps=3,
                       max_to_keep=2, local_max_to_keep=2)
    with xtc.CheckpointManager(tmp_path / "p", options) as mgr:
        for step in range(1, 8):
            mgr.save(step, extra={"w": _rl_weights(step)})
    marker = json.loads((local / "7" / "_CHECKPOINT_METADATA").read_text())
    assert marker["custom_metadata"]["xla_tensorstore_ckpt"]["bases"] == [1]
    for top, _, names in os.walk(local / "1" / "extra"):
        for name in names:
            if os.path.basename(top) == "d":
                path = os.path.join(top, name)
                data = bytearray(open(path, "rb").read())
                data[len(data) // 2] ^= 0xFF
                open(path, "wb").write(bytes(data))
    with xtc.CheckpointManager(tmp_path / "p", options) as mgr:
        target = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
        with pytest.warns(UserWarning, match="skipping step"):
            assert mgr.restore("latest", extra=target) == 6
        assert torch.equal(target["w"], _rl_weights(6)) and 6 not in mgr.all_steps("local")
        for step in (7, 8):
            mgr.save(step, extra={"w": _rl_weights(step)})
    assert torch.equal(xtc.restore(local / "8" / "extra")["w"], _rl_weights(8))


def test_a_policy_naming_steps_not_committed_keeps_the_committed_ones():
    class Milestones:
        def keep(self, committed):
            return {2, 100}

    def marker(step, bases=()):
        return StepMetadata(step=step, items=("model",), created_at=0.0, committed_at=0.0, bases=bases)

    committed = {1: marker(1), 2: marker(2, (1,)), 3: marker(3, (1,)), 4: marker(4, (1,))}
    assert policies.retention(Milestones(), committed) == ([3], {1: [2, 4]})


def test_a_missing_base_is_an_error_naming_step_and_path(saved, tmp_path):
    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(root / "4", copy / "4")
    with pytest.raises(CheckpointError, match=r"frozen.*step 1 at .*copy/1.*missing"):
        xtc.restore(copy / "4" / "extra")


def test_resave_in_place_and_manager_restore(tmp_path):
    """The manager's restore (in place) of an incremental step; a changed dtype is written whole, and the
    events say so, as they say which steps retention keeps only as bases."""
    seen = []
    with xtc.CheckpointManager(tmp_path, _options(max_to_keep=1, listeners=(seen.append,))) as mgr:
        mgr.save(1, extra={"w": torch.arange(12.0).reshape(3, 4)})
        mgr.save(2, extra={"w": torch.arange(12.0).reshape(3, 4).double()})  # dtype changed: whole
        assert mgr.metadata(2).bases == ()
        mgr.save(3, extra={"w": torch.arange(12.0).reshape(3, 4).double()})
        assert mgr.metadata(3).bases == (2,) and mgr.all_steps() == [2, 3]
        written = {e.step: e.details for e in seen if e.kind == "save_written"}
        assert list(written[2]["written_whole"]) == ["extra/w"] and "float32" in written[2]["written_whole"]["extra/w"]
        assert "written_whole" not in written[3]
        committed = {e.step: e.details for e in seen if e.kind == "save_committed"}
        assert committed[3]["bases"] == [2] and committed[3]["kept_as_bases"] == {2: [3]}
        assert "kept_as_bases" not in committed[2]
        target = {"w": torch.zeros(3, 4, dtype=torch.float64)}
        assert mgr.restore(3, extra=target) == 3
        with pytest.raises(xtc.UsageError, match=r"cannot delete step 2 .*steps \[3\] reference"):
            mgr.delete(2)
    assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4).double())


def test_retention_keeps_bases_of_kept_steps_and_of_saves_in_flight():
    def marker(step, bases=()):
        return StepMetadata(step=step, items=("model",), created_at=0.0, committed_at=0.0, bases=bases)

    committed = {1: marker(1), 2: marker(2, (1,)), 3: marker(3), 4: marker(4, (1, 3))}
    latest = policies.LatestN(1)
    assert policies.steps_to_delete(latest, committed) == [2]
    assert policies.steps_to_delete(latest, committed, pinned=[2]) == []
    assert policies.steps_to_delete(latest, {**committed, 5: marker(5)}) == [1, 2, 3, 4]


def _rl_weights(step: int) -> torch.Tensor:
    """bf16 weights of which a few elements move one bf16 step per training step, as small RL updates do."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    bits = w.view(torch.int16).clone()
    for s in range(1, step + 1):
        picked = torch.randperm(w.numel(), generator=torch.Generator().manual_seed(s))[:80]  # 2 % per step
        bits.view(-1)[picked] += 1
    return bits.view(torch.bfloat16)


def test_delta_steps_restore_bit_exact_through_chains(tmp_path):
    """Deltas (XOR against the base, zstd) chain up to `max_chain`, then the chunk is written whole; every step
    restores bit-exact, in place and as new tensors, and retention keeps the chain's steps."""
    options = _options(max_to_keep=1, delta=True, max_chain=2)
    with xtc.CheckpointManager(tmp_path, options) as mgr:
        for step in range(1, 6):
            mgr.save(step, extra={"w": _sharded(_rl_weights(step))})
        # steps 2 and 3 are deltas (chains 1, 2), step 4 whole again, step 5 a delta on 4
        assert mgr.all_steps() == [4, 5]  # step 4 kept as the base of 5
        assert mgr.metadata(4).bases == () and mgr.metadata(5).bases == (4,)
        target = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
        assert mgr.restore(5, extra=target) == 5
    assert torch.equal(target["w"], _rl_weights(5))
    assert os.path.getsize(tmp_path / "5" / "extra" / "_chunk_deltas.process_0") < 64 * 64 * 2 * 0.2


def test_delta_chain_and_damaged_delta(tmp_path):
    """Each delta is taken against its chunk's anchor, not the step before: step 4 is one frame on step 1,
    restores apply that one frame, and retention lets the delta steps between go."""
    with xtc.CheckpointManager(tmp_path, _options(max_to_keep=1, delta=True)) as mgr:
        for step in range(1, 5):
            mgr.save(step, extra={"w": _rl_weights(step)})
            assert mgr.metadata(step).chain == step - 1  # saves since the anchor, as `max_chain` counts them
        assert mgr.all_steps() == [1, 4] and mgr.metadata(4).bases == (1,)  # anchor 1, step 4's own frame
    for step in (1, 4):
        assert torch.equal(xtc.restore(tmp_path / str(step) / "extra")["w"], _rl_weights(step))
    assert cli.main(["verify", str(tmp_path / "4")]) == 0
    deltas = tmp_path / "4" / "extra" / "_chunk_deltas.process_0"
    data = bytearray(deltas.read_bytes())
    data[len(data) // 2] ^= 0xFF
    deltas.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"_chunk_deltas.process_0.*array w.*damaged"):
        xtc.restore(tmp_path / "4" / "extra")
    assert cli.main(["verify", str(tmp_path / "4")]) == 1


def test_delta_restore_reads_each_frame_once(tmp_path):
    """A delta step deep in its chain restores bit-exact reading one frame per changed chunk, each once: the
    restore's ``restore_finished`` event counts the ranged reads (frames) and their bytes, which are exactly the
    step's own delta file, however many saves lie between it and its anchor; the frames, end to end in that
    file, are read in one read (`LayeredReader.read_frame`), not one per chunk."""
    with xtc.CheckpointManager(tmp_path, _options(max_to_keep=None, delta=True)) as mgr:
        for step in range(1, 7):
            mgr.save(step, extra={"w": _sharded(_rl_weights(step))})
        assert mgr.metadata(6).chain == 5 and mgr.metadata(6).bases == (1,)
    frames = os.path.getsize(tmp_path / "6" / "extra" / "_chunk_deltas.process_0")
    for restore in ("new", "in place"):
        paths = Paths()
        if restore == "new":
            value = paths.restore(tmp_path / "6" / "extra")["w"]
        else:
            value = paths.restore(tmp_path / "6" / "extra", {"w": torch.zeros(64, 64, dtype=torch.bfloat16)})["w"]
        assert torch.equal(value, _rl_weights(6))
        assert paths["ranged_reads"] == 1 and paths["ranged_read_bytes"] == frames  # the CHUNKS frames at once


def test_anchor_every_writes_a_full_step_and_frees_the_older_ones(tmp_path):
    """`anchor_every=3`: steps 1, 4 and 7 are full anchors (every chunk written, the frozen one too, nothing
    referenced), the others reference and delta on them; once step 7 is committed, retention lets every older
    step go."""
    frozen = torch.randn(32, 32)
    with xtc.CheckpointManager(tmp_path, _options(max_to_keep=1, delta=True, anchor_every=3)) as mgr:
        for step in range(1, 8):
            mgr.save(step, extra={"w": _rl_weights(step), "frozen": frozen})
            assert mgr.metadata(step).bases == (() if step in (1, 4, 7) else (3 * ((step - 1) // 3) + 1,))
            if step == 6:
                assert mgr.all_steps() == [4, 6]  # step 6 deltas on its anchor, 4
        assert mgr.all_steps() == [7]
        target = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "frozen": torch.zeros(32, 32)}
        assert mgr.restore(7, extra=target) == 7
    assert torch.equal(target["w"], _rl_weights(7)) and torch.equal(target["frozen"], frozen)
    with pytest.raises(ValueError, match="anchor_every"):
        xtc.CheckpointManagerOptions(anchor_every=0)


@pytest.mark.parametrize("changed", [3, 40, 800, 4096])  # sparse (long gaps), sparse, sparse, dense
def test_delta_encodings_round_trip_and_refuse_damage(changed):
    from xla_tensorstore_ckpt.arrays import zstd
    from xla_tensorstore_ckpt.incremental import deltas

    base = torch.randn(64, 64).to(torch.bfloat16).view(torch.int16).numpy()
    new = base.copy()
    new.reshape(-1)[torch.randperm(base.size)[:changed].numpy()] += 1
    frame = deltas.encode(new, base)
    assert frame[0] == (2 if changed * deltas.SPARSE_EVERY <= base.size else 0)
    assert (deltas.apply(base, frame) == new).all()
    # frames are written at `deltas.LEVEL`; those of zstd's default level (written before) apply alike
    assert (deltas.apply(base, deltas.encode(new, base, level=3)) == new).all()
    with pytest.raises(ValueError):
        deltas.apply(base, frame[:-3])
    # the sparse frames written before one-byte gaps (kind 1: uint32 gaps) still apply
    changed_at = np.flatnonzero(new.reshape(-1) != base.reshape(-1))
    payload = (np.diff(changed_at, prepend=0).astype(np.uint32).tobytes()
               + (new.reshape(-1) ^ base.reshape(-1))[changed_at].tobytes())
    old = bytes([1]) + struct.pack("<Q", len(changed_at)) + zstd.compress(memoryview(payload), 3)
    assert (deltas.apply(base, old) == new).all()



@pytest.mark.parametrize("loop", ["fused", "numpy"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.dtype("V3")])
def test_sparse_deltas_with_long_gaps_apply_in_reused_buffers_for_every_element_size(dtype, loop, monkeypatch):
    """Sparse frames of both kinds, with runs, short gaps and long ones (over 255, listed apart), apply back to
    exactly the new chunk, in place, for every element size (a 3-byte one as bytes), twice over on one thread
    (its buffers reused, the second frame longer than the first); a frame whose last position lies past the
    chunk is refused before anything is written out of it. Both apply loops of kind 2: the compiled one (built
    with the package: the test environment has a C compiler) and numpy's, where the package was built without."""
    from xla_tensorstore_ckpt.arrays import zstd
    from xla_tensorstore_ckpt.incremental import deltas

    if loop == "fused":
        assert deltas._fused_xor_at is not None, "the package was installed without its compiled delta loop (_xor_at.c)"
    else:
        monkeypatch.setattr(deltas, "_fused_xor_at", None)

    small = np.zeros(600, dtype=np.uint8).view(np.dtype(dtype)) if np.dtype(dtype).itemsize > 1 else None
    if small is not None:  # a short frame first: the buffers grow for the long one
        changed = small.copy()
        changed.view(np.uint8)[::97] = 1
        assert deltas.apply(small, deltas.encode(changed, small)).tobytes() == changed.tobytes()
    rng = np.random.default_rng(7)
    base = rng.integers(0, 255, (5000, np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype).reshape(-1)
    at = np.unique(np.concatenate([rng.choice(1200, 90, replace=False), [1499, 1500, 2100, 4999],
                                   np.arange(3000, 3040)]))  # runs, gaps of 1-299 and long ones
    new = base.copy()
    new.view(np.uint8).reshape(len(base), -1)[at, 0] ^= 0x5A
    frame = deltas.encode(new, base)
    assert frame[0] == 2 and struct.unpack_from("<QQ", frame, 1)[1] > 2  # sparse, with long gaps
    rebuilt = base.copy()
    assert deltas.apply(rebuilt, frame, in_place=True) is rebuilt
    assert rebuilt.tobytes() == new.tobytes() and deltas.apply(base, frame).tobytes() == new.tobytes()
    flat = base.view(np.uint8).reshape(-1).view(deltas._ELEMENT.get(base.itemsize, np.uint8))
    changed_at = np.flatnonzero(flat != new.view(np.uint8).reshape(-1).view(flat.dtype))
    old = (np.diff(changed_at, prepend=0).astype(np.uint32).tobytes()
           + (new.view(flat.dtype) ^ flat)[changed_at].tobytes())  # kind 1: uint32 steps, then the XORs
    kind1 = bytes([1]) + struct.pack("<Q", len(changed_at)) + zstd.compress(memoryview(old), 3)
    assert deltas.apply(base, kind1).tobytes() == new.tobytes()
    with pytest.raises(ValueError, match="past its chunk"):
        deltas.apply(base[:4000].copy(), frame, in_place=True)


@pytest.mark.xla
def test_spmd_sharded_chunks_referenced_and_restored_resharded(tmp_path, mesh_4x2, mesh_2x4):
    """torch_xla SPMD: each device's shard is a chunk; the unchanged ones are referenced, and the step restores
    in place onto another mesh, bit-exact (delta chunks included)."""
    from conftest import sharded

    full = torch.randn(64, 32).to(torch.bfloat16)
    changed = full.clone()
    changed[0, 0] += 1  # one chunk of eight
    with xtc.CheckpointManager(tmp_path, _options(max_to_keep=1, delta=True)) as mgr:
        mgr.save(1, extra={"w": sharded(full, mesh_4x2, ("x", "y"))})
        mgr.save(2, extra={"w": sharded(changed, mesh_4x2, ("x", "y"))})
        assert mgr.all_steps() == [1, 2] and mgr.metadata(2).bases == (1,)
        target = {"w": sharded(torch.zeros(64, 32, dtype=torch.bfloat16), mesh_2x4, ("b", "a"))}
        assert mgr.restore(2, extra=target) == 2
    assert torch.equal(target["w"].cpu(), changed)
    table = json.loads((tmp_path / "2" / "extra" / "_chunk_hashes.process_0.json").read_text())
    chunks = table["arrays"]["w"]["chunks"]
    assert sorted(k for k, (_, step, delta) in chunks.items() if step is None and delta is None) == []
    anchor, links, depth = chunks["0.0"][2]  # stored as a delta on step 1's chunk
    assert anchor == 1 and [link[0] for link in links] == [None] and depth == 1
    assert all(chunks[k][1] == 1 for k in chunks if k != "0.0")


def test_two_processes_reference_and_delta_their_own_chunks(tmp_path):
    """Each process of a job hashes, references and deltas the chunks it writes; the commit gathers their tables;
    the local tier of each process is incremental too."""
    from forked import launch_job

    script = os.path.join(os.path.dirname(__file__), "scripts", "incremental_job.py")
    sys.path.insert(0, os.path.dirname(script))
    from incremental_job import global_value

    results = launch_job(script, 2, str(tmp_path / "root"), str(tmp_path / "local"))
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
        # step 3: process 0's chunk a delta on its anchor, step 1 (as step 2's was), process 1's referenced from
        # step 1: retention lets step 2 go
        assert r["lines"][-1]["persistent"] == [1, 3] and r["lines"][-1]["bases"] == [1]
        # each local tier keeps its newest step and the anchor it references
        assert r["lines"][-1]["local"] == [1, 3]
    assert sorted(n for n in os.listdir(tmp_path / "root" / "3" / "model") if n.startswith("_chunk_hashes")) == [
        "_chunk_hashes.process_0.json", "_chunk_hashes.process_1.json"]
    for step in (1, 3):
        assert torch.equal(xtc.restore(tmp_path / "root" / str(step) / "model")["w"], global_value(step))


def test_frames_are_read_in_runs_of_nearby_frames():
    """`read_frame` reads a frame with the wanted frames of its file that lie within `FRAME_GAP` of each other,
    at most `FRAME_SPAN` bytes in all; a frame far away is read on its own."""
    from xla_tensorstore_ckpt.incremental import layered

    def link(at, length=100):
        return (None, "_chunk_deltas.process_0", at, length, 0)

    near = [link(0), link(100), link(200), link(300 + layered.FRAME_GAP)]
    far = link(400 + 3 * layered.FRAME_GAP)
    assert layered._span(near[2], set(near) | {far}) == near
    assert layered._span(far, set(near) | {far}) == [far]
    big = [link(i * layered.FRAME_SPAN // 2, layered.FRAME_SPAN // 2) for i in range(4)]
    run = layered._span(big[1], set(big))
    assert big[1] in run and len(run) == 2 and run == sorted(run, key=lambda x: x[2])
