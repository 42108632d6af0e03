"""Coordination without processes: the pickle-free record encoding, the rounds of the reduction, the single-replica
read plan derived from shardings (against the one gathered from every process), and the simulated transport the
scale benchmark counts messages with. Pure Python; the gloo side is tests/test_multihost.py's."""

from __future__ import annotations

import itertools
import math
import os
import sys

import pytest
from torch.distributed.tensor import Replicate, Shard

from xla_tensorstore_ckpt.checkpoint_manager.peer_copies import Holdings
from xla_tensorstore_ckpt.core import grid
from xla_tensorstore_ckpt.core.errors import CoordinationError, UsageError
from xla_tensorstore_ckpt.core.records import StepMetadata
from xla_tensorstore_ckpt.multihost import wire
from xla_tensorstore_ckpt.multihost.distributed import Coordinator
from xla_tensorstore_ckpt.multihost.transport import recursive_doubling
from xla_tensorstore_ckpt.options import RestoreOptions, SaveOptions
from xla_tensorstore_ckpt.restores import replica_plans
from xla_tensorstore_ckpt.saves import chunk_writers, writer_plans
from xla_tensorstore_ckpt.targets import dtensors, holdings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from sim_transport import SimulatedTransport  # noqa: E402


def test_records_travel_without_pickle_and_come_back_equal():
    value = ({1: StepMetadata(1, ("model",), 1.5, 2.5, metrics={"loss": 0.25})},
             Holdings(frozenset({(1, 2), (3, 4)}), {(1, 2): (("model", 1),)}),
             [None, True, "x", (1, (2, 3)), 2.0 ** 70], {"a": {(1,): frozenset()}, "b": set()})
    back = wire.decode(wire.encode(value))
    assert back == (value[0], value[1], value[2], {"a": {(1,): frozenset()}, "b": frozenset()})
    with pytest.raises(UsageError, match="cannot travel"):
        wire.encode({"f": object()})
    with pytest.raises(CoordinationError, match="not a record"):
        wire.decode(b'{"r": "os.system", "v": {}}')


@pytest.mark.parametrize("count", [*range(1, 20), 33, 100])
def test_recursive_doubling_gives_every_process_the_maximum(count):
    values = {p: [p, -p] for p in range(count)}
    plans = {p: recursive_doubling(p, count) for p in range(count)}
    assert max(len(r) for r in plans.values()) <= math.floor(math.log2(count)) + 2
    queues: dict[tuple[int, int], list] = {}  # messages in flight, matched in order per pair as gloo does
    done, sent = dict.fromkeys(plans, 0), set()
    while any(done[p] < len(r) for p, r in plans.items()):
        progress = False
        for p, rounds in plans.items():
            if done[p] == len(rounds):
                continue
            sends, receives = rounds[done[p]]
            if (p, done[p]) not in sent:
                for q in sends:
                    queues.setdefault((p, q), []).append(list(values[p]))
                sent.add((p, done[p]))
            if all(queues.get((q, p)) for q in receives):
                for q in receives:
                    values[p] = [max(a, b) for a, b in zip(values[p], queues[(q, p)].pop(0))]
                done[p] += 1
                progress = True
        assert progress, "the rounds deadlock"
    assert not any(queues.values())  # every message sent was received
    assert all(v == [count - 1, 0] for v in values.values())


def test_plain_regions_are_the_regions_of_the_general_rule():
    for shape, mesh in itertools.product([(10, 6), (7,), (0, 4), (1, 9)], [(2, 3), (4,), (3, 2, 2)]):
        for placements in itertools.product([Replicate(), Shard(0), Shard(len(shape) - 1)], repeat=len(mesh)):
            for point in itertools.product(*(range(n) for n in mesh)):
                assert dtensors._plain_box(shape, mesh, placements, point) == \
                    dtensors._indexed_box(shape, mesh, placements, point), (shape, mesh, placements, point)


SHAPES = {("w",): (24, 6), ("b",): (10,), ("e",): (5, 4)}


def derived(count, mesh, chunk_rows):
    ranks = tuple(range(count))
    needs = {key: holdings.dtensor_groups(shape, mesh, (Replicate(), Shard(0)), ranks, count)
             for key, shape in SHAPES.items()}
    geometry = {key: replica_plans.Geometry(shape, (chunk_rows, *shape[1:]), 4) for key, shape in SHAPES.items()}
    return geometry, needs


@pytest.mark.parametrize("mesh,chunk_rows", [((2, 4), 3), ((2, 4), 2), ((4, 2), 5)])
def test_a_plan_derived_from_shardings_is_the_gathered_one_and_every_part_sent_is_received(mesh, chunk_rows):
    count = math.prod(mesh)
    geometry, needs = derived(count, mesh, chunk_rows)
    own = {p: [(key, geometry[key], next((r for r, procs in groups if p in procs), ()))
               for key, groups in needs.items()] for p in range(count)}
    gathered_geometry, gathered = replica_plans.gathered_needs([own[p] for p in range(count)])
    assert gathered == needs
    assert replica_plans.digest("x", gathered_geometry, gathered, 64) == replica_plans.digest("x", geometry, needs, 64)
    assert replica_plans.digest("x", geometry, needs, 64) != replica_plans.digest("y", geometry, needs, 64)
    plans = {p: replica_plans.plan_arrays(p, count, geometry, needs, 64) for p in range(count)}
    assert len({batches for _, batches in plans.values()}) == 1
    for key, shape in SHAPES.items():
        read = [box for p in range(count) for box in plans[p][0][key].reads]
        assert sum(math.prod(b - a for a, b in box) for box in read) >= math.prod(shape)  # all of it, once
        for sender, receiver in itertools.permutations(range(count), 2):
            sent = [part for to, _, part in plans[sender][0][key].sends if to == receiver]
            expected = [piece.part for _, pieces in plans[receiver][0][key].assembled for piece in pieces
                        if piece.source == sender]
            assert sent == expected, (key, sender, receiver)


def test_the_simulated_transport_counts_log2_messages_per_agreement_at_a_thousand_processes():
    transport = SimulatedTransport(1023, 1024)
    coordinator = Coordinator(index=1023, count=1024, transport=transport)
    assert coordinator.statuses(None) == [None] * 1024
    assert transport.tally.messages == 2 * 10  # a send and a receive in each of log2(1024) rounds
    assert coordinator.all_gather({"p": 1}) == [{"p": 1}] * 1024
    assert transport.tally.collectives == {"reduce": 1, "gather": 1}
    primary = SimulatedTransport(0, 1024)  # a broadcast's value is the primary's: the simulation runs it there
    assert Coordinator(index=0, count=1024, transport=primary).broadcast({"plan": 1}) == {"plan": 1}
    assert primary.tally.messages == 10  # the root of a binomial tree sends log2(P) times


@pytest.mark.parametrize("mesh,placements", [((2, 4), (Replicate(), Shard(0))), ((2, 2), (Shard(0), Shard(1))),
                                             ((3,), (Shard(0),))], ids=["dp-fsdp", "two-dims", "uneven"])
def test_the_writers_derived_from_shardings_are_those_the_gathered_chunk_lists_give(mesh, placements):
    shape, count = (10, 6), math.prod(mesh)
    groups = holdings.dtensor_groups(shape, mesh, placements, tuple(range(count)), count)
    chunk_shape = dtensors.geometry(shape, mesh, placements, (0,) * len(mesh))[0]
    regions = dict(dtensors.rank_regions(shape, mesh, placements, tuple(range(count))))
    own = {p: tuple(c for c in grid.regions(shape, chunk_shape) if grid.contains(regions[p], c)) for p in regions}
    (gathered,) = chunk_writers.gathered_holders([[("w", shape, "float32", chunk_shape, own[p])] for p in range(count)])
    derived = writer_plans.chunk_holders(shape, chunk_shape, groups)
    assert derived == {chunk: tuple(procs) for chunk, procs in gathered.items()}
    assert all(writer_plans.holds_own(derived, p, own[p]) for p in range(count))
    assert not writer_plans.holds_own(derived, 0, own[count - 1])
    entry = ("w", shape, "float32", chunk_shape)
    assert writer_plans.digest([(*entry, groups)]) == writer_plans.digest([(*entry, tuple(groups))])
    assert writer_plans.digest([(*entry, groups)]) != writer_plans.digest([(*entry, None)])


def test_tiles_of_an_hlo_sharding_are_held_by_the_processes_of_their_devices():
    # {devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}: rows split in two, each half on two devices
    processes = (0, 0, 1, 1)  # devices 0, 1 on process 0; 2, 3 on process 1
    halves = holdings.tiled_groups((8, 4), (2, 1), (0, 2, 1, 3), 2, processes)
    assert halves == (((((0, 4), (0, 4)),), (0, 1)), ((((4, 8), (0, 4)),), (0, 1)))
    quarters = holdings.tiled_groups((7, 4), (4, 1), (0, 1, 2, 3), 1, processes)
    assert quarters == (((((0, 2), (0, 4)),), (0,)), ((((2, 4), (0, 4)),), (0,)), ((((4, 6), (0, 4)),), (1,)),
                        ((((6, 7), (0, 4)),), (1,)))
    assert writer_plans.chunk_holders((7, 4), (2, 4), quarters)[((6, 7), (0, 4))] == (1,)
    assert writer_plans.chunk_holders((7, 4), (3, 4), quarters) is None  # a chunk inside no tile: gathered


def test_a_sharded_arrays_mesh_gives_every_process_its_shard():
    # DP=2 x FSDP=2 over dimension 0 of 7 rows in shards of 4: processes 0 and 2 hold rows 0-4, 1 and 3 rows 4-7
    assert holdings.mesh_groups((7, 3), (4, 3), (2, 2), (None, 0), 4) == \
        (((((0, 4), (0, 3)),), (0, 2)), ((((4, 7), (0, 3)),), (1, 3)))
    # two dimensions split by two axes; a fifth process beyond the mesh holds nothing
    grid_2x2 = holdings.mesh_groups((4, 6), (2, 3), (2, 2), (1, 0), 5)
    assert grid_2x2 == (((((0, 2), (0, 3)),), (0,)), ((((0, 2), (3, 6)),), (2,)), ((((2, 4), (0, 3)),), (1,)),
                        ((((2, 4), (3, 6)),), (3,)))
    # a mesh too small for the grid leaves chunks without a holder: those arrays are gathered instead
    rows = holdings.mesh_groups((8, 2), (2, 2), (2,), (0,), 2)
    assert writer_plans.chunk_holders((8, 2), (2, 2), rows) is None


def test_the_tiles_of_an_xla_target_are_read_by_the_processes_of_their_devices_as_each_reads_them():
    # rows in 4 tiles, devices 0-1 on process 0, 2-3 on process 1: each process reads its two tiles as one box
    def read_by(order):
        held = holdings.by_process(holdings.tiled_groups((8, 4), (4, 1), order, 1, (0, 0, 1, 1)))
        return replica_plans.read_groups(held, (8, 4), (2, 4), "float32", 2.0)

    halves = read_by((0, 1, 2, 3))
    top, bottom = ((0, 4), (0, 4)), ((4, 8), (0, 4))
    assert halves == (((top,), (0,)), ((bottom,), (1,)))
    # tiles on devices 0, 2, 1, 3: process 0 holds tiles 0 and 2, which tile no box, so it reads them one by one
    strided = read_by((0, 2, 1, 3))
    rows = [((a, a + 2), (0, 4)) for a in (0, 2, 4, 6)]
    assert strided == (((rows[0], rows[2]), (0,)), ((rows[1], rows[3]), (1,)))


def test_a_phase_deadline_from_the_options_bounds_each_collective_within_the_coordinators_own():
    for options in (SaveOptions, RestoreOptions):
        assert options(coordination_timeout_s=2.5).coordination_timeout_s == 2.5
        for bad in (0, -1, True, "5"):
            with pytest.raises(ValueError, match="coordination_timeout_s"):
                options(coordination_timeout_s=bad)
    transport = SimulatedTransport(0, 4)
    transport.timeout_s = 600.0
    coordinator = Coordinator(index=0, count=4, transport=transport, timeout_s=600.0)
    with coordinator.deadline(5):
        assert transport.timeout_s == 5
        coordinator.any(False, "agreeing")
    with coordinator.deadline(10 ** 6), coordinator.deadline(None):
        assert transport.timeout_s == 600  # the coordinator's own (its process group's) bounds it
    assert transport.timeout_s == 600
    costs = coordinator.take_costs()
    assert costs["agreeing"]["collectives"] == 1 and costs["agreeing"]["rounds"] == 2 * 3  # gloo's ring at 4
    assert costs["agreeing"]["messages"] == 12 and coordinator.take_costs() == {}
