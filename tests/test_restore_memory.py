"""Memory of restores: a restore in place releases each target's device data right before its new value is
placed (tied parameters included); data bound for the devices is read into two reused batch buffers (`core.buffers`);
`RestoreOptions.max_host_bytes` keeps the reads in flight within it, waits for each transfer to the devices, and
after each batch returns freed host memory to the OS unless the next batch fits beside it."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

import numpy as np
import pytest
import torch
from conftest import make_mesh, sharded
from xla_stack import sharding, torch_xla

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import host_memory
from xla_tensorstore_ckpt.core.events import (
    RESTORE_BATCH_ISSUED,
    RESTORE_BATCH_SETTLED,
    RESTORE_BUILT,
    RESTORE_FINISHED,
)

pytestmark = pytest.mark.xla  # every test here needs torch_xla


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models do


def _on_mesh(module, mesh):
    module = module.to("xla")
    module.head.weight = module.embed.weight  # moving to the device made two parameters of it
    for p in module.parameters():
        torch_xla.distributed.spmd.mark_sharding(p, mesh, ("x",) + (None,) * (p.dim() - 1))
    torch_xla.sync()
    return module


def _releases_and_replacements(calls: list) -> list[tuple[str, int]]:
    """From the torch_xla calls of a restore in place (`xla_calls`): ("release", id) where a target's device data
    was swapped for anything but a value placed from host shards, ("replace", id) where it was swapped for one."""
    placed, swaps = set(), []
    for name, args, result in calls:  # `calls` holds every tensor named: their ids are not reused meanwhile
        if name == "_global_tensor_from_cpu_shards":
            placed.add(id(result))
        elif name == "_replace_xla_tensor":
            swaps.append(("replace" if id(args[1]) in placed else "release", id(args[0])))
    return swaps


def test_restore_in_place_releases_each_target_before_placing_it(tmp_path, xla_calls):
    mesh = make_mesh((8,), ("x",))
    torch.manual_seed(0)
    saved = _on_mesh(Tied(), mesh)
    expected = {k: v.cpu() for k, v in saved.state_dict().items()}
    with xtc.CheckpointManager(tmp_path / "root", xtc.CheckpointManagerOptions(save_rng=False)) as manager:
        manager.save(1, model=saved, force=True)
        manager.wait_until_finished()
        torch.manual_seed(1)
        fresh = _on_mesh(Tied(), mesh)
        params = {name: p for name, p in fresh.named_parameters()}
        xla_calls.clear()
        assert manager.restore(1, model=fresh, restore_rng=False) == 1
        swaps = _releases_and_replacements(xla_calls)
    assert {name: p for name, p in fresh.named_parameters()} == params  # the same objects
    assert fresh.head.weight is fresh.embed.weight
    for key, value in fresh.state_dict().items():
        assert torch.equal(value.cpu(), expected[key]), key
        assert sharding.specs([value]) == sharding.specs([saved.state_dict()[key]]), key
    # Every target is released, then replaced, before the next one is touched (the tied weight twice over).
    assert len(swaps) == 2 * len(fresh.state_dict())
    assert all(a[0] == "release" and b[0] == "replace" and a[1] == b[1] for a, b in zip(swaps[::2], swaps[1::2]))


def _steps(heard: list) -> list[tuple]:
    """The steps of a restore, from its events and torch_xla calls in the one list `xla_calls` gives (a listener
    puts the events there): ("read", keys) where a batch's reads start, ("place", key) for a value built and
    placed, ("wait", tensor) where the restore waits for a transfer to the devices (torch_xla's ready callback),
    ("trim", returned) once a batch under a budget is settled and the freed memory was checked (returned or
    not)."""
    steps = []
    for entry in heard:
        if isinstance(entry, tuple):
            if entry[0] == "_on_ready_callback":
                steps.append(("wait", entry[1][0]))
        elif entry.kind == RESTORE_BATCH_ISSUED:
            steps.append(("read", tuple(entry.details["keys"])))
        elif entry.kind == RESTORE_BUILT:
            steps.append(("place", entry.details["key"]))
        elif entry.kind == RESTORE_BATCH_SETTLED:
            steps.append(("trim", entry.details["returned_memory"]))
    return steps


@pytest.mark.parametrize("budget", [None, (1 << 20) - 1], ids=["read-ahead", "within-budget"])
def test_max_host_bytes_limits_the_reads_in_flight(tmp_path, xla_calls, budget):
    mesh = make_mesh((4, 2), ("x", "y"))
    state = {f"w{i}": sharded(torch.randn(256, 512), mesh, ("x", "y")) for i in range(4)}  # 512 KiB each
    xtc.save(tmp_path / "ck", state)
    options = xtc.RestoreOptions(read_batch_bytes=512 << 10, max_host_bytes=budget, listeners=(xla_calls.append,))
    targets = {k: sharded(torch.zeros(256, 512), mesh, ("y", "x")) for k in state}
    xla_calls.clear()
    out = xtc.restore(tmp_path / "ck", targets, options=options)
    events = [step[:1] if step[0] in ("wait", "trim") else step for step in _steps(xla_calls)]
    for key, value in state.items():
        assert torch.equal(out[key].cpu(), value.cpu()), key
    reads = [e for e in events if e[0] == "read"]
    assert [r[1] for r in reads] == [("w0",), ("w1",), ("w2",), ("w3",)]
    if budget is None:  # the next tensor is read while this one is placed
        assert events[:3] == [("read", ("w0",)), ("read", ("w1",)), ("place", "w0")]
        assert ("trim",) not in events  # no budget, no page faults spent on keeping memory low
        # One transfer runs while the next tensor is copied (torch_xla's host copies stay bounded).
        assert [e[0] for e in events if e[0] != "read"] == ["place", "place", "wait", "place", "wait", "place", "wait"]
    else:  # two tensors (1 MiB) do not fit the budget: read, place, wait for the transfer (torch_xla's host
        # copy is freed then), return the freed memory, read, ...
        assert events == [e for k in range(4)
                          for e in (("read", (f"w{k}",)), ("place", f"w{k}"), ("wait",), ("trim",))]


def test_under_a_budget_one_transfer_runs_while_the_next_tensor_is_placed(tmp_path, xla_calls):
    mesh = make_mesh((4, 2), ("x", "y"))
    state = {f"w{i}": sharded(torch.randn(64, 256), mesh, ("x", "y")) for i in range(4)}  # 64 KiB each
    xtc.save(tmp_path / "ck", state)
    targets = {k: sharded(torch.zeros(64, 256), mesh, ("y", "x")) for k in state}
    xla_calls.clear()
    out = xtc.restore(tmp_path / "ck", targets, options=xtc.RestoreOptions(
        max_host_bytes=1 << 20, listeners=(xla_calls.append,)))  # a 256 KiB batch
    events = [e for e in _steps(xla_calls) if e[0] != "read"]
    for key, value in state.items():
        assert torch.equal(out[key].cpu(), value.cpu()), key
    placed = {key: out[key] for key in state}  # the values built, as the restore returns them
    # Each tensor's transfer is waited for once the next is placed; the last one's at the end of the batch.
    assert [e if e[0] == "place" else e[:1] for e in events] == [
        ("place", "w0"), ("place", "w1"), ("wait",), ("place", "w2"), ("wait",), ("place", "w3"), ("wait",),
        ("wait",), ("trim",)]
    waited = [e[1] for e in events if e[0] == "wait"]
    assert len(waited) == 4 and all(w is placed[f"w{i}"] for i, w in enumerate(waited))  # each once, in order


@pytest.mark.parametrize("spec", [("x", "y"), (None, None), None], ids=["tiled", "replicated", "unsharded"])
def test_wait_transferred_returns_once_the_placed_tensor_is_on_its_devices(spec):
    mesh = make_mesh((4, 2), ("x", "y"))
    value = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    target = sharded(torch.zeros(64, 32), mesh if spec else None, spec)
    lay = sharding.layouts([target])[0]
    shards = [value[tuple(slice(a, b) for a, b in s.index)].contiguous() for s in lay.shards]
    placed = sharding.place(target, lay, shards)
    sharding.wait_transferred(placed)
    sharding.wait_transferred(placed)  # already there: returns at once
    assert torch.equal(placed.cpu(), value)


def _paths_heard(into: list):
    """A listener putting each ``restore_finished``'s ``paths`` into `into`."""
    return lambda e: e.kind == RESTORE_FINISHED and into.append(e.details["paths"])


def test_device_data_is_read_into_two_reused_batch_buffers_and_host_results_own_theirs(tmp_path):
    mesh = make_mesh((4, 2), ("x", "y"))
    torch.manual_seed(0)
    state = {f"w{i}": sharded(torch.randn(64, 512), mesh, ("x", "y")) for i in range(8)}  # 128 KiB each
    state["replicated"] = sharded(torch.randn(64, 64), mesh, (None, None))
    state["unsharded"] = sharded(torch.randn(32, 32), None, None)
    cpu = {f"c{i}": torch.randn(64, 512) for i in range(4)}
    xtc.save(tmp_path / "ck", {**state, **cpu})
    heard = []
    target = {k: sharded(torch.zeros(tuple(v.shape)), mesh, ("y", "x") if k.startswith("w") else (None, None))
              if k != "unsharded" else sharded(torch.zeros(32, 32), None, None) for k, v in state.items()}
    out = xtc.restore(tmp_path / "ck", {**target, **{k: torch.zeros(64, 512) for k in cpu}},
                      options=xtc.RestoreOptions(read_batch_bytes=256 << 10, listeners=(_paths_heard(heard),)))
    for key, value in {**state, **cpu}.items():  # later batches reusing a buffer changed nothing restored before
        assert torch.equal(out[key].cpu(), value.cpu()), key
    (paths,) = heard
    assert paths["batches"] > 2 and paths["batch_buffer_allocations"] == 2  # two buffers, each allocated once
    assert paths["batch_buffer_frees"] == 0
    assert paths["batch_buffer_bytes"] == sum(v.numel() * 4 for v in state.values())  # all device data
    assert paths["own_buffer_bytes"] == sum(v.nbytes for v in cpu.values())  # CPU results: never batch buffers


def test_under_a_budget_a_tensor_larger_than_a_batch_is_read_alone_without_batch_buffers(tmp_path):
    mesh = make_mesh((4, 2), ("x", "y"))
    torch.manual_seed(0)
    state = {"a_small": torch.randn(64, 256), "b_big": torch.randn(512, 512), "c_small": torch.randn(64, 256)}
    xtc.save(tmp_path / "ck", {k: sharded(v, mesh, ("x", "y")) for k, v in state.items()})
    events, heard = [], []
    listeners = (lambda e: e.kind == RESTORE_BATCH_ISSUED and events.append(
        (e.details["keys"][0], e.details["buffers"] == "batch")), _paths_heard(heard))
    # Budget 1 MiB: batches of 256 KiB (64 KiB a small tensor); the 1 MiB tensor is a batch of its own.
    out = xtc.restore(tmp_path / "ck", {k: sharded(torch.zeros(tuple(v.shape)), mesh, ("y", "x"))
                                        for k, v in state.items()},
                      options=xtc.RestoreOptions(max_host_bytes=1 << 20, listeners=listeners))
    for key, value in state.items():
        assert torch.equal(out[key].cpu(), value), key
    # One at a time (a small batch, torch_xla's copy and the large tensor exceed the budget), the large one
    # into buffers of its own after both batch buffers were given up.
    assert events == [("a_small", True), ("b_big", False), ("c_small", True)]
    (paths,) = heard  # a_small's buffer given up for b_big, allocated again for c_small
    assert (paths["batch_buffer_allocations"], paths["batch_buffer_frees"]) == (2, 1), paths
    assert paths["own_buffer_bytes"] == state["b_big"].nbytes


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(sys.platform != "linux" or not ctypes.util.find_library("c"), reason="glibc only")
@pytest.mark.parametrize("give_back", [host_memory.return_free_memory, lambda: host_memory.keep_within(0, 1 << 20)],
                         ids=["return_free_memory", "keep_within-past-its-limit"])
def test_return_free_memory_gives_freed_heap_pages_back(give_back):
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 KiB blocks stay below glibc's mmap threshold: they live in the heap, as a restore's staging copies do.
    blocks = [libc.malloc(64 << 10) for _ in range(640)]
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)  # resident
    before = _resident_bytes()
    for block in blocks[:-1]:  # the last one pins the heap's top: glibc does not shrink it on its own
        libc.free(block)
    freed = _resident_bytes()
    give_back()
    after = _resident_bytes()
    libc.free(blocks[-1])
    assert before - freed < 8 << 20  # glibc kept the freed 40 MiB
    assert freed - after > 32 << 20  # and gave them back


def test_keep_within_returns_free_memory_only_past_the_limit():
    assert not host_memory.past_limit(60 << 20, 100 << 20, 40 << 20)  # grown by exactly the limit: the next fits
    assert host_memory.past_limit(60 << 20, (100 << 20) + 1, 40 << 20)
    assert host_memory.past_limit(None, 100 << 20, 1 << 30)  # resident memory unknown: always return it
    assert host_memory.past_limit(60 << 20, None, 1 << 30)
    now = host_memory.resident_bytes()
    if now is None:
        pytest.skip("no /proc/self/statm here")
    assert not host_memory.keep_within(now, 1 << 40)  # the process's own memory decides
    assert host_memory.keep_within(now - (64 << 20), 32 << 20)
    assert host_memory.keep_within(None, 1 << 40)


def test_resident_bytes_sees_memory_being_touched():
    before = host_memory.resident_bytes()
    if before is None:
        pytest.skip("no /proc/self/statm here")
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, written: resident
    assert host_memory.resident_bytes() - before > 48 << 20
    del block


def test_max_host_bytes_is_validated():
    with pytest.raises(ValueError, match="max_host_bytes"):
        xtc.RestoreOptions(max_host_bytes=0)


def _high_water_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.skipif(sys.platform != "linux" or not ctypes.util.find_library("c"), reason="glibc only")
def test_the_planned_peak_host_memory_is_within_10_percent_of_the_measured_one(tmp_path):
    # Like the benchmarks' `large` workload (benchmarks/bench_restore_memory.py checks those): 2D-sharded
    # matrices restored onto another mesh, several tensors per batch.
    mesh = make_mesh((4, 2), ("x", "y"))
    torch.manual_seed(0)
    state = {f"w{i}": sharded(torch.randn(1024, 2048), mesh, ("x", "y")) for i in range(12)}  # 8 MiB each
    xtc.save(tmp_path / "ck", state)
    options = xtc.RestoreOptions(read_batch_bytes=32 << 20)
    other = make_mesh((2, 4), ("x", "y"))

    def target() -> dict:
        return {k: sharded(torch.zeros(1024, 2048), other, ("y", "x")) for k in state}

    def settled() -> int:
        gc.collect()
        torch_xla.core.xla_model.wait_device_ops()
        host_memory.return_free_memory()
        return host_memory.resident_bytes()

    restored = xtc.restore(tmp_path / "ck", target(), options=options)  # warm: buffers readers keep
    measured, planned = [], []
    for _ in range(3):
        fresh = target()
        del restored
        settled()
        planned.append(xtc.plan_restore(tmp_path / "ck", fresh, options=options).peak_host_bytes)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the resident memory now
        restored = xtc.restore(tmp_path / "ck", fresh, options=options)
        peak = _high_water_bytes()
        measured.append(peak - settled())  # beyond the results (and what torch_xla keeps with them)
    for key, value in state.items():
        assert torch.equal(restored[key].cpu(), value.cpu()), key
    assert len(set(planned)) == 1
    assert abs(sorted(measured)[1] / planned[0] - 1) <= 0.10, (measured, planned)
