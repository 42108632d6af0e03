"""Which step a manager with a local tier resumes from, the same on every process, and the fallback when a local
step turns out damaged.

Candidates, best first (`candidates`): the steps committed in the local tier of every process (written by a job
of as many processes as now), newest first, as long as they are at least as new as the persistent tier's
newest step; then that persistent step. A process whose local tier is empty (a replaced VM) therefore makes
every process use the persistent tier. `resume` tries them in order: a local step is used only if every process
restored it whole (every chunk it needs present, every checksum verified on read, the metadata's included);
otherwise all fall back together (`failures`) and restore every object again from the next one. The choice is
logged on the ``xla_tensorstore_ckpt`` logger. `redo_persistent_copy` saves a resumed local step to the
persistent tier again when the run that made it was killed while copying it there.

Everything here is collective with several processes (every process calls it, in the same order) and blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .. import formats
from ..core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    StorageError,
)
from ..core.records import StepMetadata
from ..multihost.distributed import Coordinator
from .managed_tier import LOCAL, PERSISTENT
from .peer_copies import Holdings, PeerCopies, source_of
from .tier import Tier

log = logging.getLogger("xla_tensorstore_ckpt")

# What makes a local step unusable for this process: damaged, malformed or missing data (CheckpointNotFoundError:
# an item its marker lists is not there), or metadata of a format this reader does not know. Anything else would
# fail on every tier alike and is raised: a target that does not match the checkpoint, or an object the step has
# no item for (ItemNotFoundError, a KeyMismatchError).
DAMAGE = (CorruptCheckpointError, StorageError, CheckpointNotFoundError, FormatVersionError)


@dataclass(frozen=True)
class Candidate:
    """A step to try: its tier, and for a local step whether its persistent copy is due but never committed (the
    save that made it was killed while copying), so that the restart redoes it."""

    tier: str
    step: int
    redo_persistent: bool = False
    fetch: tuple[tuple[int, int], ...] = ()  # (process, source): local steps a process gets from a peer first
    # (base step, its (process, source) pairs): the steps an incremental step references that a process lacks,
    # fetched before it, oldest first
    base_fetches: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()
    bases: tuple[int, ...] = ()  # every step it references, repaired from peer copies with it


def candidates(coordinator: Coordinator, local: Tier | None, persistent: Tier, wanted: int | None,
               peers: PeerCopies | None = None) -> tuple[list[Candidate], list[Holdings]]:
    """The steps to try, best first; `wanted` a given step (tried in the local tier first), or None for the
    newest; and what every process holds (its own local steps, and with `peers` its peer copies). `local`
    holds only this run's local steps (the manager leaves out the others). A local step is a candidate if every
    process has it, or (with `peers`) can get its own index's from another process, and the same holds for
    every step it references (an incremental step's bases, as the markers of the processes holding it name
    them): a process that lacks a base gets it first, and a base no process can serve leaves the step out, as a
    damaged copy would. Every process gets the same lists."""
    persistent_steps = persistent.committed()
    mine: list[tuple[int, bool, int | None, tuple[int, ...]]] = []
    if local is not None:
        mine = sorted((step, marker.persistent_copy, marker.writer, tuple(marker.bases))
                      for step, marker in local.committed().items())
    own = frozenset((step, writer) for step, _, writer, _ in mine if writer is not None)
    if local is None and peers is None:  # nothing to agree on: every process lists the same persistent tier
        gathered = [([], Holdings(frozenset()))] * coordinator.count
    else:
        gathered = coordinator.all_gather((mine, peers.holdings(own) if peers is not None else Holdings(own)),
                                          "agreeing on the step to resume from")
    everyone = [{step: flag for step, flag, _, _ in entries} for entries, _ in gathered]
    bases_of: dict[int, set[int]] = {}
    for entries, _ in gathered:
        for step, _, _, bases in entries:
            bases_of.setdefault(step, set()).update(bases)
    holdings = [held for _, held in gathered]

    def sources_for(step: int) -> tuple[tuple[int, int], ...] | None:
        """(process, source) for each process lacking `step`, or None if one has no source."""
        missing = [p for p, steps in enumerate(everyone) if step not in steps]
        sources = {p: source_of(holdings, p, step, p) if peers is not None else None for p in missing}
        return tuple(sorted(sources.items())) if all(s is not None for s in sources.values()) else None

    fetches: dict[int, tuple[tuple[int, int], ...]] = {}
    base_fetches: dict[int, tuple[tuple[int, tuple[tuple[int, int], ...]], ...]] = {}
    for step in set().union(*everyone):
        sources = sources_for(step)
        bases = {base: sources_for(base) for base in sorted(bases_of.get(step, ()))}
        if sources is not None and all(b is not None for b in bases.values()):
            fetches[step] = sources
            base_fetches[step] = tuple((base, b) for base, b in bases.items() if b)
    due_copy = {step for step in fetches if all(flags.get(step, True) for flags in everyone)}

    def local_candidate(step: int) -> Candidate:
        return Candidate(LOCAL, step, redo_persistent=step in due_copy and step not in persistent_steps,
                         fetch=fetches[step], base_fetches=base_fetches[step],
                         bases=tuple(sorted(bases_of.get(step, ()))))

    if wanted is not None:
        out = [local_candidate(wanted)] if wanted in fetches else []
        return out + ([Candidate(PERSISTENT, wanted)] if wanted in persistent_steps else []), holdings
    newest = max(persistent_steps, default=None)
    out = [local_candidate(step) for step in sorted(fetches, reverse=True) if newest is None or step >= newest]
    return out + ([Candidate(PERSISTENT, newest)] if newest is not None else []), holdings


def resume(coordinator: Coordinator, local: Tier | None, persistent: Tier, wanted: int | None,
           restore: Callable[[Candidate], None], peers: PeerCopies | None = None,
           fetched: Callable[[int, int, int, bool], None] | None = None) -> Candidate | None:
    """Restore the best intact candidate (`wanted`: a step, or None for the newest) with `restore`, which
    restores every requested object from a candidate on this process and raises what restoring raises; return
    the candidate every process restored, or None if there is none (nothing committed; a `wanted` step that is
    not committed anywhere falls back to the newest, with a warning).

    A local candidate that fails with damage on any process (`DAMAGE`) is skipped on every process with a
    warning naming the step, each failing process and its path, and the next candidate is restored, every
    object again. Any other failure, and any failure of the persistent candidate, is raised on every process.
    Raises `CorruptCheckpointError` if every candidate was damaged.

    With `peers` (local_replication), a process that lacks a local candidate gets its step from a peer first
    (`PeerCopies.fetch`), and processes that find it damaged replace the files that differ from a peer copy and
    restore again (`PeerCopies.repair`) before anyone falls back; `fetched(step, nbytes, source, repair)` is
    told of each step that came so."""
    choices, holdings = candidates(coordinator, local, persistent, wanted, peers)
    if wanted is not None and not choices:
        choices, holdings = candidates(coordinator, local, persistent, None, peers)
        newest = f"the newest committed step, {choices[0].step}" if choices else "nothing"
        warnings.warn(f"step {wanted} is not committed in the persistent tier {persistent.root}"
                      + (f" nor in every process's local tier ({local.root} here)" if local is not None else "")
                      + f"; resuming from {newest}", stacklevel=3)
        wanted = None
    for choice in choices:
        tier = persistent if choice.tier == PERSISTENT else local
        assert tier is not None  # a local candidate exists only with a local tier
        where = str(tier.index.location(choice.step))
        if choice.tier == PERSISTENT:  # the last candidate: nothing to fall back to
            coordinator.everywhere(f"restoring step {choice.step} from the persistent tier ({where})",
                                   lambda choice=choice: restore(choice))
        else:
            failed = _restore_local(coordinator, tier, peers, choice, where, holdings, restore, fetched)
            if failed:
                warnings.warn(f"skipping step {choice.step} of the local tier ({where} here): not intact on every "
                              f"process ({_reasons(failed)}); falling back to the next candidate", stacklevel=3)
                continue
        log.info("restored step %d from the %s tier (%s)", choice.step, choice.tier, where)
        return choice
    if not choices:
        return None
    damaged = [c.step for c in choices]
    assert local is not None  # only local candidates can be skipped
    if wanted is not None:
        raise CorruptCheckpointError(
            f"step {wanted} cannot be resumed: it is damaged or incomplete in the local tier ({local.root} here) "
            f"on some process (see the warnings) and not committed in the persistent tier {persistent.root}")
    raise CorruptCheckpointError(
        f"no intact step to resume from: the local steps {damaged} ({local.root} here) are damaged or incomplete "
        f"on some process (see the warnings), and the persistent tier {persistent.root} holds no committed step")


def _restore_local(coordinator: Coordinator, tier: Tier, peers: PeerCopies | None, choice: Candidate, where: str,
                   holdings: list[Holdings], restore: Callable[[Candidate], None],
                   fetched: Callable[[int, int, int, bool], None] | None) -> dict[int, str]:
    """Restore the local candidate `choice` (its step directory `where`) on every process, fetching its step and
    bases from peers where this process lacks them, and with `peers` replacing the files of the processes that
    found it damaged from peer copies, then restoring there again (`resume`); the processes where it is still
    damaged, each with its path and error (`failures`), the same on every process. Collective; blocks; raises
    what `failures` raises."""
    error = None
    try:
        for base, fetch in choice.base_fetches:  # an incremental step's bases first
            _fetch(coordinator, tier, peers, base, fetch, holdings, fetched)
        if choice.fetch:
            _fetch(coordinator, tier, peers, choice.step, choice.fetch, holdings, fetched)
        restore(choice)
    except Exception as exc:  # noqa: BLE001 - every process learns of it in `failures`
        error = exc
    failed = failures(coordinator, choice, where, error)
    sources = None if not failed or peers is None else _repair_sources(failed, holdings, choice.step,
                                                                       choice.fetch)
    if sources is not None:
        assert peers is not None
        warnings.warn(f"step {choice.step} of the local tier is damaged on process"
                      f"{'es' if len(failed) > 1 else ''} {sorted(failed)} ({_reasons(failed)}): "
                      f"replacing the damaged files from peer copies on {sorted(set(sources.values()))}",
                      stacklevel=4)
        error = None
        try:
            # The files of a step it references may be the damaged ones: each base too, where every
            # failed process's base has a copy on a peer (only files that differ travel).
            for base, fetch in ((b, dict(choice.base_fetches).get(b, ())) for b in choice.bases):
                base_sources = _repair_sources(failed, holdings, base, fetch)
                if base_sources is None:
                    continue
                nbytes = _repair(coordinator, tier, peers, base, fetch, base_sources, holdings)
                if coordinator.index in base_sources and nbytes and fetched is not None:
                    fetched(base, nbytes, base_sources[coordinator.index], True)
            nbytes = _repair(coordinator, tier, peers, choice.step, choice.fetch, sources, holdings)
            if coordinator.index in sources:
                if fetched is not None:
                    fetched(choice.step, nbytes, sources[coordinator.index], True)
                restore(choice)  # this process again; the others' restores stand
        except Exception as exc:  # noqa: BLE001 - every process learns of it below
            error = exc
        failed = failures(coordinator, choice, where, error)
    return failed


def failures(coordinator: Coordinator, candidate: Candidate, where: str, error: Exception | None) -> dict[int, str]:
    """After every process tried to restore a local `candidate` from its step directory `where` (`error`: how it
    failed here, or None): the processes where it failed with damage (`DAMAGE`), each with its path and error,
    the same on every process. A failure that is not damage is raised instead, on every process."""
    statuses = coordinator.statuses(None if error is None else (isinstance(error, DAMAGE), where,
                                                                f"{type(error).__name__}: {error}"),
                                    "agreeing on the restore of a local step")  # reasons travel only on failures
    failed = {process: status for process, status in enumerate(statuses) if status is not None}
    if error is not None and not isinstance(error, DAMAGE):
        raise error
    fatal = {process: (path, text) for process, (damage, path, text) in failed.items() if not damage}
    if fatal:
        raise CheckpointError(f"restoring step {candidate.step} from the local tier failed on other processes: "
                              + "; ".join(f"process {p} ({path}): {text}" for p, (path, text) in fatal.items()))
    return {process: f"({path}): {text}" for process, (_, path, text) in failed.items()}


def _reasons(failed: dict[int, str]) -> str:
    return "; ".join(f"process {p} {text}" for p, text in sorted(failed.items()))


def _writer(holdings: list[Holdings], process: int, step: int, fetch: tuple[tuple[int, int], ...]) -> int:
    """Who wrote the step `step` in `process`'s local tier (`fetch`: the processes that got it from a peer at
    this resume): itself if it got it from a peer."""
    if any(target == process for target, _ in fetch):
        return process
    return next((writer for held, writer in holdings[process].own if held == step), process)


def _repair(coordinator: Coordinator, local: Tier, peers: PeerCopies, step: int, fetch: tuple[tuple[int, int], ...],
            sources: dict[int, int], holdings: list[Holdings]) -> int:
    """Replace the damaged files of local step `step` on each process of `sources` from its source's peer copy
    (`fetch`: who got the step from a peer at this resume; collective, blocks); the bytes this process received."""
    writers = {p: _writer(holdings, p, step, fetch) for p in sources}
    return peers.repair(coordinator, step, local.index.location(step).name, writers, sources)


def _repair_sources(failed: dict[int, str], holdings: list[Holdings], step: int,
                    fetch: tuple[tuple[int, int], ...]) -> dict[int, int] | None:
    """For each process of `failed`, another that holds a peer copy of its step `step` (copies carry every file's
    CRC32C, so only the damaged files need to travel); None if one has none, or if one fetched the step at this
    resume (`fetch`: what it fetched was checked whole against the copy, or could not be written: a repair would
    move it again)."""
    if any(process in dict(fetch) for process in failed):
        return None
    sources = {}
    for process in failed:
        writer = _writer(holdings, process, step, fetch)
        source = next((h for h, held in enumerate(holdings)
                       if h != process and (writer, step) in held.copies), None)
        if source is None:
            return None
        sources[process] = source
    return sources


def _fetch(coordinator: Coordinator, local: Tier, peers: PeerCopies | None, step: int,
           fetch: tuple[tuple[int, int], ...], holdings: list[Holdings],
           fetched: Callable[[int, int, int, bool], None] | None) -> None:
    """Bring the local step `step` (a candidate, or a step it references) to the processes that lack it
    (`fetch`: (process, source) pairs; collective), and into their tier's bookkeeping."""
    assert peers is not None  # only peers make candidates with fetches
    sources = dict(fetch)
    own = {coordinator.index: local.marker(step).writer} if step in local.committed() else {}
    name = local.index.location(step).name
    nbytes = peers.fetch(coordinator, step, name, own, sources, holdings)
    if coordinator.index in sources:
        local.adopt(step)
        log.info("step %d of the local tier came from process %d (%d bytes)", step, sources[coordinator.index],
                 nbytes)
        if fetched is not None:
            fetched(step, nbytes, sources[coordinator.index], False)


def redo_persistent_copy(step: int, marker: StepMetadata, restored: Collection[str], persistent: Tier,
                         save: Callable[[StepMetadata], None]) -> None:
    """Save the resumed local step `step` (its local marker `marker`) to the persistent tier again, whose copy a
    killed run never committed, if the items restored (`restored`, the RNG item included when it was) are all
    the step's items; else warn that the copy waits for the next persistent save. `save` saves the restored
    objects as that step, on top of a marker. A failure of the save only warns: the restore succeeded, and
    `save` raises on every process alike."""
    if set(marker.items) - set(restored):
        warnings.warn(f"step {step} was due for {persistent.root} but its copy never committed; it is not redone "
                      f"because the restore did not cover all its items ({sorted(marker.items)}, restored "
                      f"{sorted(restored)}): the next persistent save makes a new one", stacklevel=3)
        return
    log.info("saving step %d to %s again: its copy there never committed", step, persistent.root)
    base = dataclasses.replace(marker, items=(), created_at=time.time(), writer=None, persistent_copy=False,
                               persistent_root=None, versions=formats.writer_versions())
    try:
        save(base)
    except CheckpointError as exc:
        warnings.warn(f"step {step} was restored, but its copy to {persistent.index.location(step)}, which never "
                      f"committed, could not be redone ({exc}); the next persistent save makes a new one",
                      stacklevel=3)
