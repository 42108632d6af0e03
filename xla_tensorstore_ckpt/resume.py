"""Which step a manager with a local tier resumes from, the same on every process.

Candidates, best first: the steps committed in the local tier of every process (written by a job of as many
processes as now), newest first, as long as they are at least as new as the persistent tier's newest step; then
that persistent step. A process whose local tier is empty (a replaced VM) therefore makes every process use the
persistent tier. The manager tries the candidates in order: a local step is used only if every process restored
it whole (every chunk it needs present, every checksum verified on read); otherwise all fall back together.
Pure bookkeeping plus one exchange between processes (`candidates`, `agree`); no reads of array data.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from .distributed import Coordinator
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .tier import Tier

log = logging.getLogger("xla_tensorstore_ckpt")

LOCAL, PERSISTENT = "local", "persistent"

# What makes a local step unusable for this process: damaged or missing data. Anything else (a target that does
# not match the checkpoint) would fail on every tier alike, and is raised.
DAMAGE = (CorruptCheckpointError, StorageError, CheckpointNotFoundError)


@dataclass(frozen=True)
class Candidate:
    """A step to try: its tier, and for a local step whether its persistent copy is due but never committed (the
    save that made it was killed while copying), so that the restart redoes it."""

    tier: str
    step: int
    redo_persistent: bool = False


def candidates(coordinator: Coordinator, local: Tier | None, persistent: Tier, wanted: int | None) -> list[Candidate]:
    """The steps to try, best first; `wanted` a given step (tried in the local tier first), or None for the
    newest. `local` holds only this run's local steps (the manager leaves out the others). Collective with
    several processes (every process gets the same list). Blocks."""
    persistent_steps = persistent.committed()
    mine: list[tuple[int, bool]] = []
    if local is not None:
        mine = sorted((step, marker.persistent_copy) for step, marker in local.committed().items())
    everyone = [dict(entries) for entries in coordinator.all_gather(mine)]
    common = set(everyone[0]).intersection(*everyone[1:])
    due_copy = {step for step in common if all(flags[step] for flags in everyone)}

    def local_candidate(step: int) -> Candidate:
        return Candidate(LOCAL, step, redo_persistent=step in due_copy and step not in persistent_steps)

    if wanted is not None:
        out = [local_candidate(wanted)] if wanted in common else []
        return out + ([Candidate(PERSISTENT, wanted)] if wanted in persistent_steps else [])
    newest = max(persistent_steps, default=None)
    out = [local_candidate(step) for step in sorted(common, reverse=True) if newest is None or step >= newest]
    return out + ([Candidate(PERSISTENT, newest)] if newest is not None else [])


def agree(coordinator: Coordinator, candidate: Candidate, where: str, error: Exception | None) -> bool:
    """After every process tried to restore a local `candidate` (`error`: how it failed here, or None): True if
    every process succeeded. Otherwise each process learns why, a warning names the step and the failures, and
    the caller falls back; a failure that is not damage (`DAMAGE`) is raised instead, on every process.
    Collective with several processes."""
    statuses = coordinator.all_gather(None if error is None else (isinstance(error, DAMAGE),
                                                                  f"{type(error).__name__}: {error}"))
    failed = {process: status for process, status in enumerate(statuses) if status is not None}
    if not failed:
        return True
    if error is not None and not isinstance(error, DAMAGE):
        raise error
    fatal = {process: text for process, (damage, text) in failed.items() if not damage}
    if fatal:
        raise CheckpointError(f"restoring step {candidate.step} from the local tier failed on other processes: "
                              + "; ".join(f"process {p}: {text}" for p, text in fatal.items()))
    reasons = "; ".join(f"process {p}: {text}" for p, (_, text) in failed.items())
    warnings.warn(f"skipping step {candidate.step} of the local tier ({where}): not intact on every process "
                  f"({reasons}); falling back to the next candidate", stacklevel=4)
    return False
