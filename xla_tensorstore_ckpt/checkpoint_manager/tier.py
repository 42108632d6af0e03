"""One place where a manager keeps steps: a root with its step index, its lock, its retention policy, and the
steps committed there as this process knows them. The manager composes tiers; a tier knows nothing of devices,
training objects or background threads.

Methods that take a `Coordinator` are collective when it spans several processes (the primary acts, every
process learns the outcome). `committed()` and friends are thread-safe: a background commit updates them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import formats
from ..core import layout
from ..core.errors import StepNotFoundError, UsageError
from ..core.records import StepMetadata
from ..incremental import saving as incremental_saving
from ..multihost.distributed import Coordinator
from ..saves import commit, save_plan, writing
from ..storage import Location
from . import policies
from .root_lock import RootLock
from .steps import StepEntry, StepIndex

logger = logging.getLogger("xla_tensorstore_ckpt")


@dataclass(frozen=True)
class PendingSave:
    """A save between staging and commit: where it is written (`location`; a temporary name where the storage
    renames) and where it ends (`final`), what it holds, and how to start its writes."""

    step: int
    location: Location
    final: Location
    plans: Mapping[str, save_plan.SavePlan]
    start: Callable[[], writing.Writes]
    marker: StepMetadata  # committed_at is set at commit time
    base: int | None = None  # an incremental save (`incremental`): the step it references; -1 for none

    @property
    def write_bytes(self) -> int:
        """Bytes of the chunks this process writes for the save."""
        return sum(plan.write_bytes for plan in self.plans.values())


class Tier:
    """The steps under one root."""

    def __init__(self, root: Location, *, step_prefix: str | None, preservation: policies.Preservation,
                 lock_timeout_s: float):
        self.root = root
        self.index = StepIndex(root, step_prefix)
        self.preservation = preservation
        self.lock = RootLock(root, lock_timeout_s)
        self._guard = threading.Lock()
        self._steps: dict[int, StepMetadata] = {}
        self._pins: list[int] = []  # bases of incremental saves in flight: retention keeps them
        self._held: set[int] = set()  # steps retention keeps only as bases (logged when one joins)

    # ------------------------------------------------------------------------------------------ state

    def committed(self) -> dict[int, StepMetadata]:
        """The committed steps and their markers (a copy)."""
        with self._guard:
            return dict(self._steps)

    def marker(self, step: int) -> StepMetadata:
        """The marker of a committed step; `StepNotFoundError` naming the root if it is not committed."""
        with self._guard:
            marker = self._steps.get(step)
        if marker is None:
            raise StepNotFoundError(f"step {step} is not committed under {self.root} (committed: "
                                    f"{sorted(self.committed()) or 'none'})", step=step)
        return marker

    def adopt(self, step: int) -> StepMetadata:
        """Count the step committed in its directory (one that arrived from elsewhere: a peer) and return its
        marker. Raises `StepNotFoundError` if it has none. Blocks (a read)."""
        marker = formats.read_step(self.index.location(step), step)
        if marker is None:
            raise StepNotFoundError(f"step {step} has no marker under {self.root}", step=step)
        with self._guard:
            self._steps[step] = marker
        return marker

    def base_for(self, step: int, anchor_every: int | None = None) -> incremental_saving.BaseStep:
        """The base of an incremental save of `step`: the newest committed step before it (pinned against
        retention until `Tier.commit` of the save ends; never a later one, of a timeline a rewound run abandons),
        or none (a full anchor step): the tier's first step, or, with `anchor_every`, the save that many saves
        after the last full anchor (`StepMetadata.since_anchor`)."""
        with self._guard:
            earlier = frozenset(s for s in self._steps if s < step)
            if not earlier:
                return incremental_saving.BaseStep()
            base = max(earlier)
            if anchor_every is not None and self._steps[base].since_anchor + 1 >= anchor_every:
                return incremental_saving.BaseStep()
            self._pins.append(base)
        return incremental_saving.BaseStep(base, self.index.location(base), present=earlier)

    def check_unreferenced(self, step: int, what: str) -> None:
        """Raise `UsageError` if a committed step or a save in flight (its pinned base) references `step`'s chunks:
        deleting or replacing it (`what`) would break that step, or make it restore the new values."""
        with self._guard:
            users = sorted(s for s, m in self._steps.items() if step in m.bases and s != step)
            in_flight = step in self._pins
        if users or in_flight:
            who = f"steps {users} reference" if users else "a save in flight references"
            raise UsageError(f"cannot {what} step {step} of {self.root}: {who} its chunks (delete them first, or "
                             f"make them standalone with xtckpt convert)")

    def unpin(self, base: int | None) -> None:
        """The save whose base was `base` (`base_for`) committed or failed."""
        with self._guard:
            if base in self._pins:
                self._pins.remove(base)

    def forget(self, step: int) -> None:
        with self._guard:
            self._steps.pop(step, None)

    # ----------------------------------------------------------------------------------- collectives

    def reload(self, coordinator: Coordinator) -> None:
        """Re-read the committed steps; unless another live manager owns the root, remove partial steps (with a
        warning naming them; one that cannot be removed is only warned about)."""
        def scan() -> dict[int, StepMetadata]:
            entries = self.index.scan()
            for entry in entries:
                if entry.status == "invalid":
                    warnings.warn(f"ignoring step {entry.step}: {entry.problem}", stacklevel=5)
            if self.lock.holder is None:
                self.root.remove_stale_temporaries()  # of the lock and the index, by a writer killed mid-write
                removed, failed = self.index.remove_partial(entries)
                if removed:
                    warnings.warn(f"removed partial steps {removed} of {self.root}: saves that never committed "
                                  f"(or deletions cut short)",
                                  stacklevel=5)
                for name, problem in failed.items():
                    warnings.warn(f"could not remove the partial step {self.root.child(name)} (a save that never "
                                  f"committed, or a deletion cut short): {problem}; it is never listed as committed",
                                  stacklevel=5)
                self._finish_commits(entries)
            return {e.step: e.marker for e in entries if e.marker is not None}

        if coordinator.is_primary:
            self.lock.holder = self.lock.live_holder()
        steps = coordinator.on_primary(f"listing the steps of {self.root}", scan, share=True)
        with self._guard:
            self._steps = steps

    def _finish_commits(self, entries: list[StepEntry]) -> None:
        """Write Orbax's completion mark into this library's committed steps that lack it, on storage that cannot
        rename (object stores), with a warning naming them. There our marker is the commit point and
        ``commit_success.txt``, Orbax's, is written after it: a save killed between the two left a step that
        is complete and committed for us but that Orbax never lists. Primary only; blocks (a read per step)."""
        if self.root.capabilities.renames:
            return  # the step was renamed into place with both files inside: nothing can be missing
        finished = []
        for entry in entries:
            if entry.status != "committed" or entry.marker is None or \
                    not formats.step_format(entry.marker).COMPLETION_MARK:
                continue  # Orbax's own steps are committed by the mark itself; format 1 never wrote it
            loc = self.root.child(entry.name)
            if loc.read(layout.COMMIT_SUCCESS) is None:
                mark = dict(formats.step_files(entry.marker))[layout.COMMIT_SUCCESS]
                loc.write(layout.COMMIT_SUCCESS, mark, fsync=True)
                finished.append(entry.name)
        if finished:
            warnings.warn(f"finished the commit of steps {finished} of {self.root} for Orbax: their "
                          f"{layout.COMMIT_SUCCESS} was missing (a save killed right after its marker)", stacklevel=6)

    def prepare(self, coordinator: Coordinator, step: int) -> tuple[Location, Location]:
        """Clear the way for `step` (a committed one being replaced, a crashed save's leftovers); return where
        to write it and where it ends: a temporary directory renamed into place at the commit where the storage
        renames (so that no reader, Orbax included, ever sees a partial step under its name), else the step
        directory itself, whose marker is written last. Collective (one broadcast)."""
        final = self.index.location(step)
        self.forget(step)
        stamp = coordinator.on_primary(f"preparing step {step} at {final}", lambda: self.clear(step), share=True)
        return self.places(step, stamp)

    def clear(self, step: int) -> int:
        """`prepare`'s part on the primary: clear the step's directory and return the stamp of its temporary
        name (0: none, the storage cannot rename), which every process passes to `places`. Primary only."""
        final = self.index.location(step)
        if step in self.committed():
            self.index.delete(step)
        if not final.is_empty():
            final.delete_tree()
        return time.time_ns() if self.root.capabilities.renames else 0

    def places(self, step: int, stamp: int) -> tuple[Location, Location]:
        """Where `step` is written and where it ends, from the stamp `clear` returned on the primary."""
        final = self.index.location(step)
        return (self.root.child(layout.tmp_step_name(final.name, stamp)) if stamp else final), final

    def commit(self, coordinator: Coordinator, save: PendingSave, *, fsync: bool, committed_at: float,
               on_written: Callable[[writing.Writes], None] | None = None) -> list[int]:
        """Finish the writes of `save` (then call `on_written` with them), write its manifests and marker, put it
        in place, refresh the lock; return the steps retention lets go (not deleted yet: see `delete`) and the
        steps it keeps only as bases of kept steps (`policies.retention`)."""
        what = f"step {save.step} at {save.final}"
        try:
            writes = commit.finish_writes(coordinator, save.location, save.start, fsync=fsync, what=what)
            if on_written is not None:
                on_written(writes)
            marker = dataclasses.replace(save.marker, committed_at=committed_at)
            plans = save.plans
            if save.base is not None:  # incremental: the items' references and the step's bases, from its tables
                plans, marker = incremental_saving.commit_refs(coordinator, save.location, dict(plans), marker,
                                                               lambda s: self.index.location(s).name)
                with self._guard:  # the base is pinned: still listed
                    base = self._steps.get(save.base)
                marker = dataclasses.replace(marker, since_anchor=0 if base is None else base.since_anchor + 1)
            final = formats.step_files(marker)
            publish = None if save.location == save.final else lambda: save.location.rename_to(save.final)
            commit.commit(coordinator, save.location, plans, final, fsync=fsync, what=what, publish=publish)
        except BaseException:
            if save.location != save.final and coordinator.is_primary:
                commit.discard(save.location, what)
            raise
        finally:
            self.unpin(save.base)

        def retain() -> tuple[list[int], dict[int, list[int]]]:
            self.lock.heartbeat()
            with self._guard:  # and unlisted at once: no save in flight can take a doomed step as its base
                found = policies.retention(self.preservation, {**self._steps, save.step: marker}, list(self._pins))
                for old in found[0]:
                    self._steps.pop(old, None)
            return found

        doomed, held = coordinator.on_primary(f"retention after step {save.step}", retain, share=True)
        with self._guard:
            self._steps[save.step] = marker
            for old in doomed:
                self._steps.pop(old, None)
            newly = sorted(set(held) - self._held)
            self._held = set(held)
        if newly and coordinator.is_primary:  # once per step, not at every commit that still keeps it
            logger.info("retention of %s keeps steps %s only as bases of steps %s (their chunks are referenced)",
                        self.root, newly, sorted({u for s in newly for u in held[s]}))
        return doomed, held

    def delete(self, step: int) -> None:
        """Delete a step's files (marker first). Primary only; not collective."""
        self.forget(step)
        self.index.delete(step)

