"""Single-replica reads (`RestoreOptions.single_replica_reads`): in a restore run by every process of a job, each
stored chunk is read from storage by one process, and the others that need parts of it receive those parts
from that one over the job's process group.

Planning (`plan`, collective): every process derives the regions of each array every process needs from the
targets' shardings (or, where they do not tell, the processes gather their `ReadJob.reads`), and computes the
same answer (`replica_plans`): for each stored chunk anyone needs, the box of it that anyone needs and its
reader, and batches of arrays in which the processes read, exchange and build in step. One reduction of the
plan's digest proves every process derived the same plan.

Reading (`Exchange`, driven by `read_batches.read_arrays`): a process reads from storage the chunks it is the
reader of (a region of its own at once where every part anyone needs of its chunks lies within it, else each
chunk's box), checksums verified as they are read. Then, batch by batch, every process learns whether every
read succeeded (a reader's damaged chunk raises the same error class on every process, naming that process
and the chunk), each sends the others their parts of its chunks and receives its own, and the regions are
assembled. The transport is `Coordinator.exchange` (gloo over the host network here).

Lockstep: every process runs the same collectives in the same order: the plan's agreement, one agreement per
batch followed by its transfers, one agreement at the end. A process that fails in between joins the next
agreement with its error (`Exchange.abandon`, `tell_failure`), so no process is left waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import arrays, storage
from ..core import dtypes, errors, grid, layout, tree
from ..core.errors import CheckpointError, CoordinationError
from ..core.tensor_layout import Index
from ..multihost.distributed import Coordinator
from ..multihost.messages import copy_into
from . import replica_plans
from .read_jobs import ReadJob
from .replica_plans import ArrayPlan

PLAN_PHASE = "agreeing on the plan of the single-replica reads"


def tell_failure(coordinator: Coordinator, error: BaseException) -> None:
    """Join the plan's agreement with `error` (this process failed before it could plan the restore), so that the
    others raise too instead of waiting. Collective; never raises."""
    try:
        coordinator.reduce_max([1, 0, 0, 0], PLAN_PHASE)
        coordinator.all_gather(_status(error), PLAN_PHASE)
    except CoordinationError:
        pass  # another process is gone: the others learn that from the group


def plan(coordinator: Coordinator, loc: storage.Location, jobs: Sequence[ReadJob], batch_bytes: int) -> Exchange | None:
    """Plan the single-replica reads of `jobs` with every other process (collective; blocks). Each process
    derives every process's needs from the targets' shardings (`replica_plans.derived_needs`) and the processes
    agree, in one reduction, on the digest of what they derived; where a target's layout does not tell the
    others' regions, or the digests differ, they gather their needs instead. None if the processes restore
    from different places (each its own local tier): they read on their own. Raises `CoordinationError` (or
    the failed process's error class) if another process failed before planning."""
    geometry = {job.key_path: replica_plans.geometry_of(job) for job in jobs}
    needs = replica_plans.derived_needs(jobs, coordinator.count, coordinator.index)
    digest = 0 if needs is None else replica_plans.digest(str(loc), geometry, needs, batch_bytes)
    failed, underived, high, low = coordinator.reduce_max([0, int(needs is None), digest, -digest], PLAN_PHASE)
    if failed:
        for process, status in enumerate(coordinator.all_gather(None, PLAN_PHASE)):
            if status is not None:
                raise _remote_error(process, tuple(status), f"planning the restore of {loc}")
    derived = needs is not None and not underived and high == -low
    if not derived:
        mine = (str(loc), tuple((job.key_path, geometry[job.key_path], job.reads) for job in jobs))
        everyone = coordinator.all_gather(mine, "gathering the needs of the single-replica reads")
        if len({entry[0] for entry in everyone}) > 1:
            return None
        geometry, needs = replica_plans.gathered_needs([entry[1] for entry in everyone])
    plans, batches = replica_plans.plan_arrays(coordinator.index, coordinator.count, geometry, needs, batch_bytes)
    return Exchange(coordinator, loc, plans, batches, derived=derived)


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
                 batches: tuple[tuple[layout.KeyPath, ...], ...], *, derived: bool = False):
        self._coordinator, self._loc, self._plans = coordinator, loc, plans
        self.derived = derived  # planned from the shardings (True) or from every process's gathered needs
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
            self._coordinator.statuses(_status(error), "abandoning the restore")
        except CoordinationError:
            pass

    def _agree(self, error: BaseException | None, what: str, expected: Callable[[int], str] | None = None) -> None:
        try:
            statuses = self._coordinator.statuses(None if error is None else _status(error), what) \
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
