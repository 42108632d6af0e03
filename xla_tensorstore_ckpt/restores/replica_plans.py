"""The plan of single-replica reads (`replica_reads`), computed alike on every process: which processes need
which regions of each array (`Needs`: derived from the targets' shardings by `derived_needs`, or from a gather
by `gathered_needs`), the reader of each stored chunk anyone needs (the one process that needs it or, for a
chunk several need, the least loaded of them, largest chunks first: `balancing.balance`, as writers are
chosen on save), what this process reads, assembles and sends (`ArrayPlan`), the batches, and a `digest` of
the plan's inputs that the processes agree on to prove they planned alike.

Needs are grouped: the processes needing exactly the same regions of an array form one group (the replicas of
a data-parallel mesh dimension), so planning costs distinct regions times chunks, not processes times arrays.
Pure functions; no collectives.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..core import dtypes, grid, layout
from ..core.records import ArrayMetadata
from ..core.tensor_layout import Index
from ..multihost.balancing import balance
from ..targets import holdings
from . import read_jobs
from .read_jobs import ReadJob

Position = tuple[int, ...]  # a chunk's position in its array's grid
Group = holdings.Group  # (regions, in the order the processes read them; processes)
Needs = dict[layout.KeyPath, tuple[Group, ...]]  # per array (in job order), its groups sorted by regions


@dataclass(frozen=True)
class Geometry:
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class Piece:
    """A part of a region of this process, and where it comes from: a box read here (`box`) or another process
    (`source`)."""

    part: Index
    source: int
    box: Index | None


@dataclass(frozen=True)
class ArrayPlan:
    """What this process does for one array: the boxes it reads from storage (`reads`; those among its own
    regions are its data as they are), its other regions assembled from pieces (`assembled`), and the parts
    it sends: (process, box read here, part), each receiver's in the order it assembles them."""

    reads: tuple[Index, ...]
    direct: frozenset[Index]
    assembled: tuple[tuple[Index, tuple[Piece, ...]], ...]
    sends: tuple[tuple[int, Index, Index], ...]


def geometry_of(job: ReadJob) -> Geometry:
    return Geometry(job.meta.shape, job.meta.chunk_shape, dtypes.by_name(job.meta.dtype).itemsize)


def derived_needs(jobs: Sequence[ReadJob], count: int, me: int) -> Needs | None:
    """Every process's regions of each of `jobs`, from the targets alone (`Target.holding`, read as
    `read_jobs.read_regions` reads them). None if a target's layout does not tell the other processes' regions
    (a `ShardedArray` without a mesh), or if the regions derived for this process are not the ones it reads
    (then the plan is gathered)."""
    needs: Needs = {}
    for job in jobs:
        if job.reference is None or job.target.WHOLE_ON_EVERY_PROCESS:
            groups: tuple[Group, ...] = ((job.reads, tuple(range(count))),) if job.reads else ()
        else:
            held = job.target.holding(job.reference, job.layout, count)
            if held is None:
                return None
            groups = read_groups(holdings.by_process(held), job.meta.shape, job.meta.chunk_shape, job.meta.dtype,
                                 job.max_amplification)
        own = next((regions for regions, procs in groups if me in procs), ())
        if own != job.reads:
            return None
        needs[job.key_path] = groups
    return needs


@lru_cache(maxsize=1024)
def read_groups(held: holdings.Holding, shape: tuple[int, ...], chunk_shape: tuple[int, ...], dtype: str,
                amplification: float) -> tuple[Group, ...]:
    """A holding (`holdings.by_process`: one group per process's regions) as restore needs: each process's
    regions read as `read_jobs.read_regions` reads them. Cached, as the holdings are."""
    if all(len(regions) == 1 for regions, _ in held):  # one region is read as it is
        return held
    meta = ArrayMetadata("", shape, dtype, chunk_shape)
    by_reads: dict[tuple[Index, ...], list[int]] = {}
    for regions, procs in held:
        by_reads.setdefault(read_jobs.read_regions(regions, meta, amplification), []).extend(procs)
    return tuple(sorted((reads, tuple(sorted(procs))) for reads, procs in by_reads.items()))


def gathered_needs(entries: Sequence[Sequence[tuple[layout.KeyPath, Geometry, tuple[Index, ...]]]]) -> \
        tuple[dict[layout.KeyPath, Geometry], Needs]:
    """Geometry and needs from every process's (key, geometry, reads) entries, in process order."""
    geometry: dict[layout.KeyPath, Geometry] = {}
    grouped: dict[layout.KeyPath, dict[tuple[Index, ...], list[int]]] = {}
    for process, entry in enumerate(entries):
        for key, geo, reads in entry:
            geometry.setdefault(key, geo)
            by_reads = grouped.setdefault(key, {})
            if reads:
                by_reads.setdefault(tuple(reads), []).append(process)
    return geometry, {key: tuple(sorted((reads, tuple(procs)) for reads, procs in by_reads.items()))
                      for key, by_reads in grouped.items()}


def digest(where: str, geometry: Mapping[layout.KeyPath, Geometry], needs: Needs, batch_bytes: int) -> int:
    """A 62-bit digest of a plan's inputs (the plan is a function of them): equal on two processes iff, but for
    a collision, they plan alike. Each distinct groups object is hashed once (arrays share shardings)."""
    hasher = hashlib.blake2b(f"{where}\0{batch_bytes}".encode(), digest_size=8)
    seen: dict[int, bytes] = {}
    for key, groups in needs.items():
        hasher.update(repr((key, geometry[key])).encode())
        if id(groups) not in seen:
            seen[id(groups)] = holdings.fingerprint(groups)
        hasher.update(seen[id(groups)])
    return int.from_bytes(hasher.digest(), "little") >> 2


def plan_arrays(me: int, count: int, geometry: Mapping[layout.KeyPath, Geometry], needs: Needs,
                batch_bytes: int) -> tuple[dict[layout.KeyPath, ArrayPlan], tuple[tuple[layout.KeyPath, ...], ...]]:
    """This process's plan of every array, and the batches (keys of every array, in the same order on every
    process)."""
    boxes, readers, users = _assign(geometry, needs, count)
    plans = {}
    for key, groups in needs.items():
        own = next((regions for regions, procs in groups if me in procs), ())
        plans[key] = _array_plan(me, own, geometry[key], boxes[key], readers[key], users[key])
    largest: dict[int, int] = {}  # elements of the largest needs of each distinct groups object
    for groups in needs.values():
        if id(groups) not in largest:
            largest[id(groups)] = max((_bytes(regions, 1) for regions, _ in groups), default=0)
    sizes = {key: largest[id(groups)] * geometry[key].itemsize for key, groups in needs.items()}
    batches = tuple(tuple(group) for group in grid.batches(list(needs), sizes.__getitem__, batch_bytes))
    return plans, batches


def _assign(geometry: Mapping[layout.KeyPath, Geometry], needs: Needs, count: int) -> tuple[dict, dict, dict]:
    """Per array: each needed chunk's box (the bounding box of every part anyone needs of it), its reader, and
    its users: (processes, the region's place in their regions, region)."""
    boxes: dict[layout.KeyPath, dict[Position, Index]] = {}
    users: dict[layout.KeyPath, dict[Position, list]] = {}
    holders = []
    for key, groups in needs.items():
        geo = geometry[key]
        chunk_boxes: dict[Position, Index] = {}
        used: dict[Position, list] = {}
        for regions, procs in groups:
            for order, region in enumerate(regions):
                for position, chunk in _chunks_in(region, geo):
                    part = chunk if grid.contains(region, chunk) else grid.intersection(region, chunk)
                    old = chunk_boxes.get(position)
                    chunk_boxes[position] = part if old is None else tuple(
                        (min(a, c), max(b, d)) for (a, b), (c, d) in zip(old, part))
                    used.setdefault(position, []).append((procs, order, region))
        boxes[key], users[key] = chunk_boxes, used
        for position, box in chunk_boxes.items():
            groups_of = used[position]
            needers = groups_of[0][0] if len(groups_of) == 1 else sorted({p for g in groups_of for p in g[0]})
            holders.append(((key, position), math.prod(b - a for a, b in box) * geo.itemsize, needers))
    chosen = balance(holders, count)
    readers: dict[layout.KeyPath, dict[Position, int]] = {key: {} for key in needs}
    for (key, position), process in chosen.items():
        readers[key][position] = process
    return boxes, readers, users


def _array_plan(me: int, own: tuple[Index, ...], geo: Geometry, boxes: Mapping[Position, Index],
                readers: Mapping[Position, int], users: Mapping[Position, list]) -> ArrayPlan:
    def chunks(region: Index):
        return [position for position, _ in _chunks_in(region, geo)]

    # A region of mine is read at once if every chunk in it is mine and nobody needs any of them outside it.
    direct = [region for region in own if all(
        readers[p] == me and grid.contains(region, boxes[p]) for p in chunks(region))]
    source: dict[Position, Index] = {}
    for region in direct:
        for position in chunks(region):
            source.setdefault(position, region)
    mine = sorted(p for p, reader in readers.items() if reader == me and p not in source)
    for position in mine:
        source[position] = boxes[position]
    reads = (*direct, *(boxes[p] for p in mine))
    assembled = []
    for region in own:
        if region in direct or math.prod(b - a for a, b in region) == 0:
            continue
        pieces = []
        for position, chunk in grid.chunks_in(region, geo.chunk_shape, geo.shape):
            reader = readers[position]
            pieces.append(Piece(grid.intersection(region, chunk), reader, source[position] if reader == me else None))
        assembled.append((region, tuple(pieces)))
    sends = []  # each receiver's parts in its own order: its regions, chunks in C order
    for position in sorted(source):
        chunk = tuple((k * c, min((k + 1) * c, n)) for k, c, n in zip(position, geo.chunk_shape, geo.shape))
        for procs, order, region in users[position]:
            part = grid.intersection(region, chunk)
            sends += [((process, order, position), (process, source[position], part))
                      for process in procs if process != me]
    return ArrayPlan(tuple(reads), frozenset(direct), tuple(assembled), tuple(send for _, send in sorted(sends)))


def _chunks_in(region: Index, geo: Geometry) -> Iterable[tuple[Position, Index]]:
    """`grid.chunks_in`, at once for the common region that is exactly one chunk (a shard on its save's grid)."""
    if all(b > a and a % c == 0 and (b - a == c or b == n > a + c - 1 and b - a < c)
           for (a, b), c, n in zip(region, geo.chunk_shape, geo.shape)):
        return ((tuple(a // c for (a, _), c in zip(region, geo.chunk_shape)), region),)
    return grid.chunks_in(region, geo.chunk_shape, geo.shape)


def _bytes(regions: Sequence[Index], itemsize: int) -> int:
    return sum(math.prod(b - a for a, b in region) for region in regions) * itemsize
