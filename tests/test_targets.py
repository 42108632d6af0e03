"""Tensor kinds behind the `targets` registry: the target contract (target_contract.py) on every target — CPU
tensors, `ShardedArray`s, DTensors (one process, gloo on 127.0.0.1), XLA tensors (marker `xla`) and a toy kind
plugged in by this test alone, which is saved, restored, planned and shown by ``xtckpt`` with no library file
knowing of it."""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass

import pytest
import torch
from conftest import make_mesh, sharded
from gcs_emulator import free_port
from target_contract import SHAPE, TargetContract, full

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import cli, targets
from xla_tensorstore_ckpt.core.tensor_layout import LocalShard, TensorLayout
from xla_tensorstore_ckpt.targets.base import copy_host, host_tensor


@dataclass(eq=False)
class Rows:
    """The toy kind: a 2-D array held as one CPU tensor per row."""

    rows: list[torch.Tensor]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), self.rows[0].numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.rows[0].dtype


def _toy_layouts(values, signatures=None):
    return [TensorLayout(v.shape, "rows", (1, v.shape[1]),
                         tuple(LocalShard(i, "cpu", ((i, i + 1), (0, v.shape[1])), 0) for i in range(v.shape[0])))
            for v in values]


def _toy_fetch(values, layouts, wanted, *, copy):
    return [[(v.rows[s.position].clone() if copy else v.rows[s.position]).reshape(1, -1) for s in shards]
            for v, shards in zip(values, wanted)]


def _toy_build(job, regions, *, release):
    return Rows([host_tensor(job, s.index, regions).reshape(-1).clone() for s in job.layout.shards])


def _toy_assign(kept, values):
    for target, value in zip(kept, values):
        for row, new in zip(target.rows, value.rows):
            copy_host(row, new)


TOY = types.SimpleNamespace(
    NAME="rows", DEVICE_BOUND=False, SHARDS_ARE_CHUNKS=True, WHOLE_ON_EVERY_PROCESS=True, ASSIGNS_IN_PLACE=True,
    claims=lambda value: isinstance(value, Rows),
    unsaveable=lambda value: None if len({r.numel() for r in value.rows}) == 1 else "its rows differ in length",
    signatures=lambda values: [("rows", v.shape, v.dtype) for v in values],
    layouts=_toy_layouts, fetch=_toy_fetch, build=_toy_build, assign=_toy_assign,
    fetched_elements=lambda layout, wanted: sum(s.size for s in wanted),
    placing_elements=lambda layout: 0, settle=lambda value: None, local_memory=lambda value: None,
    is_global=lambda layout: False, holding=lambda value, layout, count: None)


@pytest.fixture
def toy():
    targets.register(TOY)
    yield TOY
    targets.unregister(TOY.NAME)


def rows_of(data: torch.Tensor) -> Rows:
    return Rows([row.clone() for row in data])


class TestToyTarget(TargetContract):
    NAME = "rows"

    @pytest.fixture(autouse=True)
    def _registered(self, toy):
        pass

    def make(self, data):
        return rows_of(data)

    def empty(self, shape, dtype):
        return rows_of(torch.zeros(shape, dtype=dtype))

    def whole(self, value):
        return torch.stack(value.rows)


def test_a_toy_target_is_saved_restored_planned_and_shown_by_the_tools(tmp_path, toy, capsys):
    """A tensor kind added as one entry of the registry, by this test alone."""
    with pytest.raises(xtc.UnsupportedValueError, match="cannot save r: its rows differ in length"):
        xtc.save(tmp_path / "bad", {"r": Rows([torch.zeros(2), torch.zeros(3)])})
    xtc.save(tmp_path / "ck", {"r": rows_of(full()), "step": 4})
    out = xtc.restore(tmp_path / "ck", {"r": rows_of(torch.zeros(SHAPE)), "step": 0})
    assert isinstance(out["r"], Rows) and torch.equal(torch.stack(out["r"].rows), full()) and out["step"] == 4
    assert xtc.metadata(tmp_path / "ck")["r"].shape == SHAPE
    plan = xtc.plan_restore(tmp_path / "ck", {"r": rows_of(torch.zeros(SHAPE)), "step": 0})
    assert plan.ok and plan.read_bytes == full().nbytes
    assert cli.main(["tree", str(tmp_path / "ck"), "--json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["r"]["shape"] == list(SHAPE)
    assert cli.main(["show", str(tmp_path / "ck"), "r[1]", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == full()[1].tolist()


class TestCpuTarget(TargetContract):
    NAME = "cpu"

    def make(self, data):
        return data.clone()

    def empty(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    def whole(self, value):
        return value

    def test_sparse_tensors_are_refused(self):
        assert "convert to dense" in self.target.unsaveable(torch.zeros(2).to_sparse())


class TestHostTarget(TargetContract):
    NAME = "host"
    IN_PLACE = False
    GRID = (3, 4)  # uneven: the last shards are short

    def make(self, data):
        return xtc.ShardedArray.from_tensor(data, self.GRID, xtc.ShardedArray.grid(data.shape, self.GRID))

    def empty(self, shape, dtype):
        return xtc.ShardedArray.target(shape, dtype, self.GRID, xtc.ShardedArray.grid(shape, self.GRID))

    def whole(self, value):
        out = torch.empty(value.shape, dtype=value.dtype)
        for index, data in value.shards:
            out[tuple(slice(a, b) for a, b in index)] = data
        return out


@pytest.fixture(scope="module")
def one_process_group():
    """A torch.distributed world of this process alone (gloo on 127.0.0.1), for DTensors."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class TestDTensorTarget(TargetContract):
    NAME = "dtensor"

    @pytest.fixture(autouse=True)
    def _world(self, one_process_group):
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))

    def make(self, data):
        from torch.distributed.tensor import Shard, distribute_tensor

        return distribute_tensor(data, self.mesh, [Shard(0)])

    def empty(self, shape, dtype):
        return self.make(torch.zeros(shape, dtype=dtype))

    def whole(self, value):
        return value.to_local()

    def test_partial_sums_are_refused(self):
        from torch.distributed.tensor import DTensor, Partial

        partial = DTensor.from_local(full(), self.mesh, [Partial()])
        assert "partial sums" in self.target.unsaveable(partial)


@pytest.mark.xla
class TestXlaTarget(TargetContract):
    NAME = "xla"

    def make(self, data):
        return sharded(data, make_mesh((4, 2), ("x", "y")), ("x", "y"))

    def empty(self, shape, dtype):
        return self.make(torch.zeros(shape, dtype=dtype))

    def whole(self, value):
        return value.cpu()

    def test_sharding_kinds_are_its_own(self):
        mesh = make_mesh((4, 2), ("x", "y"))
        tiled, replicated, unsharded = (sharded(full(), mesh, ("x", "y")), sharded(full(), mesh, (None, None)),
                                        sharded(full(), None, None))
        lays = self.target.layouts([tiled, replicated, unsharded])
        assert [lay.target for lay in lays] == ["xla"] * 3
        assert [self.target.is_global(lay) for lay in lays] == [True, True, False]
        assert [self.target.placing_elements(lay) for lay in lays] == [8 * 2 * 3, 8 * 48, 48]
        assert self.target.fetched_elements(lays[0], lays[0].distinct_shards()[:1]) == 8 * 2 * 3


def test_every_registered_target_has_a_contract_here():
    tested = {cls.NAME for cls in TargetContract.__subclasses__()}
    assert {t.NAME for t in targets.TARGETS} <= tested


def test_registering_a_kind_twice_or_removing_an_unknown_one_is_refused(toy):
    with pytest.raises(xtc.UsageError, match="'rows' is already registered"):
        targets.register(toy)
    with pytest.raises(xtc.UsageError, match="no tensor kind 'tiles'"):
        targets.unregister("tiles")
    assert targets.of(rows_of(torch.zeros(2, 3))) is toy
