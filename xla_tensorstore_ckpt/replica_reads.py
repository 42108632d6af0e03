"""Single-replica reads (`RestoreOptions.single_replica_reads`): in a restore run by every process of a job, each
stored chunk is read from storage by one process, and the others that need parts of it receive those parts
from that one over the job's process group.

Planning (`plan`, collective): every process tells the others the regions of each array it needs (its
`ReadJob.reads`); from these, every process computes the same answer: for each stored chunk anyone needs, the
box of it that anyone needs and its reader (the one process that needs it or, for a chunk several need, the
least loaded of them, largest chunks first: `distributed.balance`, as writers are chosen on save), and batches
of arrays in which the processes read, exchange and build in step.

Reading (`Exchange`, driven by `restoring.read_arrays`): a process reads from storage the chunks it is the
reader of (a region of its own at once where every part anyone needs of its chunks lies within it, else each
chunk's box), checksums verified as they are read. Then, batch by batch, every process learns whether every
read succeeded (a reader's damaged chunk raises the same error class on every process, naming that process
and the chunk), each sends the others their parts of its chunks and receives its own, and the regions are
assembled. The transport is `Coordinator.exchange` (gloo over the host network here).

Lockstep: every process runs the same collectives in the same order: the plan's exchange, one agreement per
batch followed by its transfers, one agreement at the end. A process that fails in between joins the next
agreement with its error (`Exchange.abandon`, `tell_failure`), so no process is left waiting for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, dtypes, errors, grid, layout, storage, tree
from .distributed import Coordinator, balance, copy_into
from .errors import CheckpointError, CoordinationError
from .read_jobs import ReadJob
from .tensor_layout import Index

Position = tuple[int, ...]  # a chunk's position in its array's grid


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
    it sends: (process, box read here, part)."""

    reads: tuple[Index, ...]
    direct: frozenset[Index]
    assembled: tuple[tuple[Index, tuple[Piece, ...]], ...]
    sends: tuple[tuple[int, Index, Index], ...]


@dataclass(frozen=True)
class Geometry:
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    itemsize: int


def tell_failure(coordinator: Coordinator, error: BaseException) -> None:
    """Join the plan's exchange with `error` (this process failed before it could plan the restore), so that the
    others raise too instead of waiting. Collective; never raises."""
    try:
        coordinator.all_gather(("failed", _status(error)))
    except CoordinationError:
        pass  # another process is gone: the others learn that from the group


def plan(coordinator: Coordinator, loc: storage.Location, jobs: Sequence[ReadJob], batch_bytes: int) -> Exchange | None:
    """Plan the single-replica reads of `jobs` with every other process (collective; blocks). None if the
    processes restore from different places (each its own local tier): they read on their own. Raises
    `CoordinationError` (or the failed process's error class) if another process failed before planning."""
    mine = ("needs", str(loc), tuple((job.key_path, Geometry(job.meta.shape, job.meta.chunk_shape,
                                                              dtypes.by_name(job.meta.dtype).itemsize), job.reads)
                                     for job in jobs))
    everyone = coordinator.all_gather(mine)
    for process, entry in enumerate(everyone):
        if isinstance(entry, tuple) and entry[0] == "failed":
            raise _remote_error(process, entry[1], f"planning the restore of {loc}")
        if not (isinstance(entry, tuple) and entry[0] == "needs"):  # it is in another collective: a bug's sign
            raise CoordinationError(f"process {process} is not restoring {loc} with the others (every process "
                                    f"must restore the item together with single-replica reads)", process=process)
    if len({entry[1] for entry in everyone}) > 1:
        return None
    geometry: dict[layout.KeyPath, Geometry] = {}
    needs: dict[layout.KeyPath, dict[int, tuple[Index, ...]]] = {}
    for process, (_, _, entries) in enumerate(everyone):
        for key, geo, reads in entries:
            geometry.setdefault(key, geo)
            needs.setdefault(key, {})[process] = reads
    boxes, readers = _assign(geometry, needs, coordinator.count)
    me = coordinator.index
    plans = {key: _array_plan(me, needs[key], geometry[key], boxes[key], readers[key])
             for key in needs if me in needs[key]}
    sizes = {key: max(_bytes(reads, geometry[key].itemsize) for reads in by_process.values())
             for key, by_process in needs.items()}
    batches = tuple(tuple(group) for group in grid.batches(list(needs), sizes.__getitem__, batch_bytes))
    return Exchange(coordinator, loc, plans, batches)


def _assign(geometry: Mapping[layout.KeyPath, Geometry], needs: Mapping[layout.KeyPath, Mapping[int, tuple]],
            count: int) -> tuple[dict, dict]:
    """Per array, each needed chunk's box (the bounding box of every part anyone needs of it) and its reader."""
    boxes: dict[layout.KeyPath, dict[Position, Index]] = {}
    holders = []
    for key, by_process in needs.items():
        geo = geometry[key]
        chunk_boxes: dict[Position, Index] = {}
        needers: dict[Position, set[int]] = {}
        for process, reads in by_process.items():
            for region in reads:
                for position, chunk in grid.chunks_in(region, geo.chunk_shape, geo.shape):
                    part = grid.intersection(region, chunk)
                    old = chunk_boxes.get(position)
                    chunk_boxes[position] = part if old is None else tuple(
                        (min(a, c), max(b, d)) for (a, b), (c, d) in zip(old, part))
                    needers.setdefault(position, set()).add(process)
        boxes[key] = chunk_boxes
        holders += [((key, position), _bytes((box,), geo.itemsize), sorted(needers[position]))
                    for position, box in chunk_boxes.items()]
    chosen = balance(holders, count)
    readers: dict[layout.KeyPath, dict[Position, int]] = {key: {} for key in needs}
    for (key, position), process in chosen.items():
        readers[key][position] = process
    return boxes, readers


def _array_plan(me: int, needs: Mapping[int, tuple[Index, ...]], geo: Geometry, boxes: Mapping[Position, Index],
                readers: Mapping[Position, int]) -> ArrayPlan:
    def chunks(region: Index):
        return [position for position, _ in grid.chunks_in(region, geo.chunk_shape, geo.shape)]

    # A region of mine is read at once if every chunk in it is mine and nobody needs any of them outside it.
    direct = [region for region in needs[me] if all(
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
    for region in needs[me]:
        if region in direct or math.prod(b - a for a, b in region) == 0:
            continue
        pieces = []
        for position, chunk in grid.chunks_in(region, geo.chunk_shape, geo.shape):
            reader = readers[position]
            pieces.append(Piece(grid.intersection(region, chunk), reader, source[position] if reader == me else None))
        assembled.append((region, tuple(pieces)))
    sends = []
    for process in sorted(needs):  # each receiver's parts in its own order: its regions, chunks in C order
        if process == me:
            continue
        for region in needs[process]:
            for position, chunk in grid.chunks_in(region, geo.chunk_shape, geo.shape):
                if readers[position] == me:
                    sends.append((process, source[position], grid.intersection(region, chunk)))
    return ArrayPlan(tuple(reads), frozenset(direct), tuple(assembled), tuple(sends))


def _bytes(regions: Sequence[Index], itemsize: int) -> int:
    return sum(math.prod(b - a for a, b in region) for region in regions) * itemsize


class _Slot:
    """A region's data once its batch is settled, shaped like a pending read."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: np.ndarray | None = None

    def result(self) -> np.ndarray:
        if self.value is None:  # its batch failed before it was settled (`restoring` drains it then)
            raise CoordinationError("the region was never assembled: the restore failed first")
        return self.value


class Exchange:
    """The single-replica reads of one restore on this process (see the module). Used on one thread."""

    def __init__(self, coordinator: Coordinator, loc: storage.Location, plans: Mapping[layout.KeyPath, ArrayPlan],
                 batches: tuple[tuple[layout.KeyPath, ...], ...]):
        self._coordinator, self._loc, self._plans = coordinator, loc, plans
        self.batches = batches  # keys of every process's arrays, batch by batch, in the same order everywhere
        self._reads: dict[layout.KeyPath, tuple[dict, Callable, np.dtype, dict[Index, _Slot]]] = {}
        self._done = False  # every process knows how this restore ended (or the group is broken)
        self.sent_bytes = 0
        self.received_bytes = 0

    def read(self, job: ReadJob, stored: arrays.StoredArray, empty: arrays.Empty) -> dict[Index, _Slot]:
        """Start this process's storage reads of `job`'s array; its regions, filled when its batch settles."""
        array = self._plans[job.key_path]
        own = [box for box in array.reads if box in array.direct]
        others = [box for box in array.reads if box not in array.direct]  # chunks read for others: temporary
        pending = {**(stored.read(own, empty) if own else {}), **(stored.read(others) if others else {})}
        slots = {region: _Slot() for region in job.reads}
        self._reads[job.key_path] = (pending, empty, dtypes.by_name(stored.dtype_name).numpy, slots)
        return slots

    def settle(self, k: int) -> None:
        """Finish batch k: wait for this process's reads of it, agree with every process that all succeeded,
        exchange the parts, assemble the regions. Collective; raises the first failed read's error (the failed
        process's own, elsewhere of the same class naming it) or `CoordinationError` if a process died."""
        keys = [key for key in self.batches[k] if key in self._reads]
        pending = [(key, box, read) for key in keys for box, read in self._reads[key][0].items()]
        def expected(process: int) -> str:  # what comes from `process`, for errors only
            return _described([f"{tree.format_key_path(key)}[{', '.join(f'{a}:{b}' for a, b in piece.part)}]"
                               for key in keys for _, pieces in self._plans[key].assembled for piece in pieces
                               if piece.source == process])

        error = None
        results: list = []
        try:
            results = arrays.wait_all([read for _, _, read in pending])
        except CheckpointError as exc:
            error = exc
        self._agree(error, "reading its chunks", expected)
        data = {(key, box): value for (key, box, _), value in zip(pending, results)}
        sends: dict[int, list[np.ndarray]] = {}
        receives: dict[int, list[np.ndarray]] = {}
        for key in keys:
            array = self._plans[key]
            _, empty, dtype, slots = self._reads.pop(key)
            for region in array.direct:
                slots[region].value = data[(key, region)]
            for region, pieces in array.assembled:
                shape = tuple(b - a for a, b in region)
                out = empty(shape, dtype)
                for piece in pieces:
                    into = out[grid.within(piece.part, region)]
                    if piece.source == self._coordinator.index:
                        copy_into(into, data[(key, piece.box)][grid.within(piece.part, piece.box)])
                    else:
                        receives.setdefault(piece.source, []).append(into)
                slots[region].value = out
            for process, box, part in array.sends:
                sends.setdefault(process, []).append(data[(key, box)][grid.within(part, box)])
        try:
            self._coordinator.exchange(sends, receives, expected)
        except CoordinationError:
            self._done = True
            raise
        self.sent_bytes += sum(a.nbytes for parts in sends.values() for a in parts)
        self.received_bytes += sum(a.nbytes for parts in receives.values() for a in parts)

    def drain(self) -> None:
        """Wait for this process's storage reads still in flight (after an error)."""
        arrays.drain([read for pending, *_ in self._reads.values() for read in pending.values()])
        self._reads.clear()

    def finish(self) -> None:
        """After the last batch is built: every process learns that every other succeeded. Collective."""
        self._agree(None, "placing the restored arrays")
        self._done = True

    def abandon(self, error: BaseException) -> None:
        """This process failed outside an agreement: join the next one with `error` so that the others raise
        too. Never raises."""
        if self._done:
            return
        self._done = True
        try:
            self._coordinator.statuses(_status(error))
        except CoordinationError:
            pass

    def _agree(self, error: BaseException | None, what: str, expected: Callable[[int], str] | None = None) -> None:
        try:
            statuses = self._coordinator.statuses(None if error is None else _status(error)) \
                if not self._done else [None]
        except CoordinationError as exc:
            self._done = True
            awaited = expected(exc.process) if expected and exc.process is not None else ""
            raise CoordinationError(f"{exc}, in the restore of {self._loc} ({what})"
                                    + (f"; it was to send this process {awaited}" if awaited else ""),
                                    process=exc.process) from exc
        if error is not None:
            self._done = True
            raise error
        for process, status in enumerate(statuses):
            if status is not None:
                self._done = True
                raise _remote_error(process, status, f"{what} for the restore of {self._loc}")


def _status(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


def _remote_error(process: int, status: tuple[str, str], what: str) -> CheckpointError:
    """Another process's failure, raised here: of its class where that is one of this library's plain errors
    (damage, storage), else a `CoordinationError`."""
    name, text = status
    cls: Any = getattr(errors, name, None)
    message = f"process {process} failed {what}: {name}: {text}"
    if cls in (errors.CorruptCheckpointError, errors.StorageError):
        return cls(message)
    return CoordinationError(message, process=process)


def _described(parts: list[str]) -> str:
    if not parts:
        return ""
    more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    return f"{len(parts)} parts of the chunks it reads ({', '.join(parts[:3])}{more})"
