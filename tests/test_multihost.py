"""Multi-host saves and restores with several processes coordinated over gloo on 127.0.0.1, each holding a
disjoint part of the shards: 4 processes save → 2 processes restore another split, and 1 process restores onto
torch_xla SPMD on 8 CPU devices, bit for bit; replicated chunks are written once, spread over the processes; a
process killed mid-save means no commit and no hang."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import make_mesh, sharded
from forked import launch_job

import xla_tensorstore_ckpt as xtc

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "multihost.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import multihost  # noqa: E402


def launch(world: int, *args: str) -> list[dict]:
    return launch_job(SCRIPT, world, *args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    results = launch(4, "save", str(root))
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
    return root, [r["lines"][0] for r in results]


def test_records_gathered_from_every_process_arrive_whole_small_or_large(tmp_path):
    """The coordinator's all_gather: small records, large ones from every process, and one large among small;
    its `any`: true on every process when one process's flag is; `on_primary(share=True)`: the primary's result
    on every process, or its error (its own on the primary, a `CoordinationError` naming it elsewhere); a save's
    precondition failing on one process raised on every process by the planning's one agreement."""
    world = 3
    for rank, r in enumerate(launch(world, "gather", str(tmp_path))):
        assert r["returncode"] == 0, r["stderr"][-3000:]
        got = r["lines"][0]
        assert got["small"] == [{"rank": p, "name": f"p{p}"} for p in range(world)]
        assert got["large"] == [list(range(p, p + 3000)) for p in range(world)]
        assert got["mixed"] == ["x" * p for p in range(world - 1)] + ["x" * 9000]
        assert got["any"] == [True, False, True]
        assert got["max"] == [world - 1, 0, 7]
        assert got["told"] == [{"from": 0}, ["y" * 5000, 0]]  # (JSON lists: the line's encoding)
        assert got["shared"] == ["tmp", 0]  # the primary's result, on every process
        # the primary raises its own error; the others learn it from the same broadcast that carries a result
        name = "KeyError" if rank == 0 else "CoordinationError"
        assert got["failed"][0] == name, got["failed"]
        if name == "CoordinationError":
            assert got["failed"][1] == "preparing step 9 failed on process 0: KeyError: 'step 9'"
        assert got["planned"] == ["item"]
        # a save's precondition, checked in its planning's agreement: process 1's error, raised everywhere
        assert got["unmet"] == (["KeyError", "'root'"] if rank == 1 else [
            "CoordinationError", "taking the roots before step 3 failed on process 1: KeyError: 'root'"]), got["unmet"]


def assert_named_by_the_others(results: list[dict], stalled: int) -> None:
    """The stopped process was killed (by another once it was named); every other raised the error naming the
    phase and it, its other coordinator (a manager's background commits have their own) raised at once rather
    than wait a deadline of its own, and its manager closed."""
    assert results[stalled]["returncode"] == -9, results[stalled]["stderr"][-3000:]
    for rank, r in enumerate(results):
        if rank == stalled:
            continue
        assert r["returncode"] == 0, r["stderr"][-3000:]
        (line,) = r["lines"]
        assert line["error"] == "CoordinationTimeoutError" and line["missing"] == [stalled], line
        assert line["phase"] and f"{line['phase']}: process {stalled} died or did not answer" in line["message"], line
        assert line["then"]["missing"] == [stalled] and "found by another collective of this process" in \
            line["then"]["message"], line
        assert line["closed"], line


@pytest.mark.parametrize("when", ["save", "restore"])
def test_a_stopped_process_is_named_by_every_other_within_the_deadline(tmp_path, when):
    """Process 3 stops (SIGSTOP) before a save or a restore that the others enter: each of them raises,
    after the deadline (coordination_timeout_s=15), the error naming the phase and process 3, instead of
    waiting for it forever (then process 0 kills it: a hang would fail launch's timeout); their other
    coordinators then raise at once."""
    assert_named_by_the_others(launch(4, "stall", str(tmp_path / "root"), when, "3"), 3)


def test_a_stopped_process_0_hosting_the_side_channel_is_named_within_the_deadline(tmp_path):
    """Process 0, which hosts the side channel (a TCPStore), stops before a save: a TCPStore client waits
    without bound for a stopped host, so the others hung (found by the chaos run: seed 2, cycle 7; and in
    `close`, seed 96, cycle 3). Now each of them raises, by the deadline, the error naming the phase and
    process 0, and closes its manager."""
    assert_named_by_the_others(launch(4, "stall", str(tmp_path / "root"), "save", "0"), 0)


def test_four_processes_save_one_checkpoint(saved):
    root, lines = saved
    info = xtc.metadata(root / "item")
    assert info["meta"] == {"step": 7, "note": "multi-host"}
    expected = {name: multihost.global_value(name) for name in multihost.ARRAYS}
    restored = xtc.restore(root / "item")
    for name, value in expected.items():
        assert torch.equal(restored[name], value), name
    assert info["tiled"].chunk_shape == (4, 8) and info["replicated"].chunk_shape == (256, 512)


def test_replicated_chunks_are_written_once_and_spread(saved):
    _, lines = saved
    per_process = [line["bytes"] for line in sorted(lines, key=lambda x: x["rank"])]
    total = sum(multihost.global_value(n).numel() * multihost.global_value(n).element_size()
                for n in multihost.ARRAYS)
    assert sum(per_process) == total + 8  # every chunk written exactly once; meta.step: a 0-d int64 for Orbax
    assert max(per_process) <= 1.25 * (total / 4), per_process  # no process writes much more than its share


def test_restore_in_two_processes_with_another_split(saved, tmp_path):
    root, _ = saved
    results = launch(2, "restore", str(root), str(tmp_path))
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
    covered = {name: set() for name in multihost.ARRAYS}
    for rank in range(2):
        out = xtc.restore(tmp_path / f"rank{rank}")
        assert out["meta"] == {"step": 7, "note": "multi-host"}
        for name, shards in out["shards"].items():
            full = multihost.global_value(name)
            for index_text, data in shards.items():
                index = tuple(tuple(x) for x in json.loads(index_text))
                assert torch.equal(data, full[tuple(slice(a, b) for a, b in index)]), (name, index)
                covered[name].add(index)
    for name, (shape, _, _, restore_shards) in multihost.ARRAYS.items():
        assert covered[name] == set(xtc.ShardedArray.grid(shape, restore_shards))  # the two split it all


@pytest.mark.xla
def test_restore_in_one_process_onto_torch_xla_spmd(saved):
    root, _ = saved
    mesh = make_mesh((2, 4), ("a", "b"))
    target = {name: sharded(torch.zeros(shape, dtype=dtype), mesh, ("b", "a"))
              for name, (shape, dtype, _, _) in multihost.ARRAYS.items()}
    target["meta"] = {"step": 0, "note": ""}
    out = xtc.restore(root / "item", target)
    for name in multihost.ARRAYS:
        assert torch.equal(out[name].cpu(), multihost.global_value(name)), name


def test_a_process_killed_mid_save_means_no_commit_and_no_hang(tmp_path):
    results = launch(4, "manager", str(tmp_path / "root"), "2")  # a hang would fail launch's timeout
    assert results[2]["returncode"] == -9
    for rank in (0, 1, 3):
        r = results[rank]
        assert r["returncode"] == 0, r["stderr"][-3000:]
        step2 = next(line for line in r["lines"] if "step2" in line)
        assert step2["step2"] == "CoordinationTimeoutError", step2  # a CoordinationError naming the dead process
        assert "process 2 died or did not answer" in step2["error"], step2
        assert next(line for line in r["lines"] if "steps" in line)["steps"] == [1]
    with xtc.CheckpointManager(tmp_path / "root", xtc.CheckpointManagerOptions(save_interval_steps=1)) as mgr:
        assert mgr.all_steps() == [1]
    restored = xtc.restore(tmp_path / "root" / "1" / "model")
    for name in multihost.ARRAYS:
        assert torch.equal(restored[name], multihost.global_value(name)), name


def test_each_process_gets_its_own_rng_states_back_and_new_processes_derive_theirs(tmp_path):
    saved = launch(2, "rng_save", str(tmp_path))
    restored = launch(4, "rng_restore", str(tmp_path))
    for r in saved + restored:
        assert r["returncode"] == 0, r["stderr"][-3000:]
    after_save = {r["lines"][0]["rank"]: r["lines"][0] for r in saved}
    after_restore = {r["lines"][0]["rank"]: r["lines"][0] for r in restored}
    assert after_save[0]["draws"] != after_save[1]["draws"]  # the processes had streams of their own
    for rank in (0, 1):  # the same index: exactly the stream that process had
        assert after_restore[rank]["draws"] == after_save[rank]["draws"] and not after_restore[rank]["warnings"]
    for rank in (2, 3):  # no state of its own: derived from process rank % 2, re-seeded, with a warning
        assert any(f"process {rank} of 4 takes those of process {rank % 2}" in w
                   for w in after_restore[rank]["warnings"])
    streams = [tuple(map(str, after_restore[rank]["draws"])) for rank in range(4)]
    assert len(set(streams)) == 4
