"""Events: every phase of a save and a restore is told to the listeners, in order, with the step, tier, item,
durations and the bytes this process wrote or read; the built-in listeners log, write JSON lines, and refuse
cleanly without tensorboard."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import Recorder

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import events


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(16, generator=g).to(torch.bfloat16)}


STATE_BYTES = 64 * 32 * 4 + 16 * 2


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_manager_tells_every_phase_of_its_saves_and_restores(tmp_path, async_save):
    recorder, committed = Recorder(), []
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=1, async_save=async_save, save_rng=False, listeners=(recorder,),
        local_directory=str(tmp_path / "local"), local_save_interval_steps=1, local_max_to_keep=1,
        on_commit=committed.append)
    with xtc.CheckpointManager(tmp_path / "root", options) as manager:
        for step in (1, 2):
            manager.save(step, model=state(step))
    staged = [events.SAVE_STAGED] if async_save else []
    for step in (1, 2):
        assert recorder.kinds(step=step, tier=None) == [events.SAVE_STARTED, *staged]
        for tier in ("local", "persistent"):
            kinds = recorder.kinds(step=step, tier=tier)
            assert kinds[:2] == [events.SAVE_WRITTEN, events.SAVE_COMMITTED], (step, tier, kinds)
            assert kinds[2:] == ([events.RETENTION_REMOVED] if step == 2 else [])
    written = [e for e in recorder.events if e.kind == events.SAVE_WRITTEN]
    assert all(e.nbytes == STATE_BYTES and e.files and e.seconds >= 0 for e in written)
    committed_events = [e for e in recorder.events if e.kind == events.SAVE_COMMITTED]
    assert all(e.details["total_seconds"] >= e.seconds and e.path.endswith(f"/{e.step}") for e in committed_events)
    removed = [e for e in recorder.events if e.kind == events.RETENTION_REMOVED]
    assert sorted((e.tier, e.details["steps"]) for e in removed) == [("local", [1]), ("persistent", [1])]
    assert committed == [1, 2]  # on_commit is a listener of the persistent tier's commits
    if async_save:
        stage = next(e for e in recorder.events if e.kind == events.SAVE_STAGED)
        assert stage.nbytes == STATE_BYTES and stage.seconds >= 0

    recorder.events.clear()
    model = {"w": torch.zeros(64, 32), "b": torch.zeros(16, dtype=torch.bfloat16)}
    with xtc.CheckpointManager(tmp_path / "root", options) as manager:
        assert manager.restore("latest", model=model) == 2
    assert torch.equal(model["w"], state(2)["w"])
    phases = [e for e in recorder.events if e.kind in (events.RESTORE_PLANNED, events.RESTORE_FINISHED)]
    assert [(e.kind, e.step, e.tier, e.item) for e in phases] == [
        (events.RESTORE_PLANNED, 2, "local", "model"), (events.RESTORE_FINISHED, 2, "local", "model")]
    planned, finished = phases
    assert planned.nbytes == finished.nbytes == STATE_BYTES and planned.details["arrays"] == 2
    assert planned.details["chunks"] == 2 and finished.seconds >= 0 and finished.gbps is not None


def test_item_saves_and_restores_tell_their_listeners(tmp_path):
    recorder = Recorder()
    xtc.save(tmp_path / "item", state(1), options=xtc.SaveOptions(listeners=(recorder,)))
    assert recorder.kinds() == [events.SAVE_STARTED, events.SAVE_WRITTEN, events.SAVE_COMMITTED]
    assert recorder.events[1].nbytes == STATE_BYTES and recorder.events[1].path == str(tmp_path / "item")
    assert recorder.events[1].details["chunk_bytes"] == STATE_BYTES and recorder.events[1].details["chunks"] >= 2
    recorder.events.clear()
    xtc.restore(tmp_path / "item", options=xtc.RestoreOptions(listeners=(recorder,)))
    assert recorder.kinds() == [events.RESTORE_PLANNED, events.RESTORE_BATCH_ISSUED, events.RESTORE_BUILT,
                                events.RESTORE_BUILT, events.RESTORE_FINISHED]
    issued, built, finished = recorder.events[1], recorder.events[2:4], recorder.events[4]
    assert finished.nbytes == STATE_BYTES and finished.step is None
    assert sorted(issued.details["keys"]) == ["b", "w"] and issued.details["buffers"] == "batch"
    assert sorted(e.details["key"] for e in built) == ["b", "w"] and {e.details["target"] for e in built} == {"cpu"}
    paths = finished.details["paths"]  # a restore that is not in place: CPU results own their buffers
    assert (paths["batches"], paths["own_buffer_bytes"], paths["batch_buffer_bytes"]) == (1, STATE_BYTES, 0)
    assert {"read_ahead", "into_target_bytes", "cache_probes", "direct_bytes", "buffered_bytes", "chunks_inline",
            "chunks_on_workers", "tensorstore_regions", "whole_reads", "ranged_read_bytes"} <= set(paths)


def test_json_lines_and_log_listeners(tmp_path, caplog):
    lines = events.JsonLinesListener(str(tmp_path / "events.jsonl"))
    with caplog.at_level(logging.INFO, logger="xla_tensorstore_ckpt"):
        xtc.save(tmp_path / "item", state(1), options=xtc.SaveOptions(listeners=(lines, events.LogListener())))
    lines.close()
    docs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [d["kind"] for d in docs] == [events.SAVE_STARTED, events.SAVE_WRITTEN, events.SAVE_COMMITTED]
    assert docs[1]["nbytes"] == STATE_BYTES and "gbps" in docs[1] and docs[1]["time"] > 0
    logged = [r.getMessage() for r in caplog.records if r.name == "xla_tensorstore_ckpt"]
    assert any(m.startswith("save_written") and f"{STATE_BYTES}B" in m for m in logged), logged


def test_listeners_are_checked_and_a_failing_one_fails_its_phase(tmp_path):
    with pytest.raises(ValueError, match="listeners"):
        xtc.CheckpointManagerOptions(listeners=[print])  # a list, not a tuple
    with pytest.raises(ValueError, match="listeners"):
        xtc.SaveOptions(listeners=("not callable",))

    def fail(event):
        if event.kind == events.SAVE_COMMITTED:
            raise RuntimeError("dashboard down")

    options = xtc.CheckpointManagerOptions(save_interval_steps=1, save_rng=False, listeners=(fail,))
    with xtc.CheckpointManager(tmp_path / "root", options) as manager:
        manager.save(1, model=state(1))
        with pytest.raises(xtc.AsyncSaveError, match="step 1") as error:
            manager.wait_until_finished()
        assert "dashboard down" in str(error.value.__cause__) and manager.all_steps() == [1]  # still committed


def test_the_tensorboard_listener_writes_scalars_per_phase(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = events.TensorBoardListener(str(tmp_path / "tb"))
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, save_rng=False, async_save=False,
                                           listeners=(board,))
    with xtc.CheckpointManager(tmp_path / "root", options) as manager:
        for step in (3, 4):
            manager.save(step, model=state(step))
    board.close()
    log = EventAccumulator(str(tmp_path / "tb"))
    log.Reload()
    written = log.Scalars("checkpoint/persistent/save_written/bytes")
    assert [(s.step, s.value) for s in written] == [(3, STATE_BYTES), (4, STATE_BYTES)]
    assert len(log.Scalars("checkpoint/persistent/save_committed/seconds")) == 2
