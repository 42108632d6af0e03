"""What a manager's local tier has that the persistent one does not: steps in its directory that are not this
run's (`foreign_reason`, shared with `xtckpt steps`; `ignore_foreign_steps`), and the steps a resumed job drops
because they are newer than the step it resumed from (`discard_steps_after`).

Each process runs these on its own local tier, alone. None of them raises for a storage failure: a warning names
the step and path instead, because a process raising where the others do not would leave them blocked in the
job's next collective (a step left behind is harmless: it is not a candidate, see `resume`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .. import storage
from ..core.records import StepMetadata

if TYPE_CHECKING:
    from .tier import Tier


def foreign_reason(marker: StepMetadata, persistent_root: str | storage.Location,
                   process_count: int | None) -> str | None:
    """Why the step of `marker`, found in a local directory, is not a local step of the run whose persistent
    tier is `persistent_root` and whose job has `process_count` processes (None: not judged), or None if it is
    one. Such a step is never resumed from, never counted as saved, and never deleted by retention."""
    if marker.writer is None:
        return "not written by a local tier (a plain manager's step, Orbax's, or format 1)"
    if not same_root(marker.persistent_root, persistent_root):
        return f"written for another persistent root ({marker.persistent_root})"
    if process_count is not None and marker.process_count != process_count:
        return f"written by a job of {marker.process_count} processes (this one has {process_count})"
    return None


def same_root(recorded: str | None, root: str | storage.Location) -> bool:
    """True if the root a marker recorded is `root`, both spelled through `storage.location` (so that
    ``/a/b/``, ``/a/./b`` and ``file:///a/b`` are one root)."""
    if recorded is None:
        return False
    try:
        return str(storage.location(recorded)) == str(storage.location(root))
    except ValueError:  # an unknown scheme or a malformed URL: not this run's root
        return False


def ignore_foreign_steps(tier: Tier, persistent_root: str | storage.Location, process_count: int) -> None:
    """Leave out of `tier`'s bookkeeping the steps that are not this run's local steps (`foreign_reason`), with
    a warning naming them, the directory and why. Their files stay (a save of the same step number replaces
    one). Does not block beyond what it was given."""
    reasons: dict[str, list[int]] = {}
    for step, marker in sorted(tier.committed().items()):
        reason = foreign_reason(marker, persistent_root, process_count)
        if reason is not None:
            tier.forget(step)
            reasons.setdefault(reason, []).append(step)
    for reason, steps in reasons.items():
        warnings.warn(f"ignoring steps {steps} of the local tier {tier.root}: {reason}; they are never resumed "
                      "from nor deleted by retention", stacklevel=4)


def discard_steps_after(tier: Tier, step: int | None, *, from_local: bool = True) -> None:
    """Delete this process's local steps newer than the step the job resumed from (all of them, if it resumed
    from nothing), and that step's local copy too if the job resumed from another tier (`from_local` False: the
    copy was damaged, or missing on another process), with a warning naming them: the run continues from there,
    and a step it saves again must not meet them (they are of the abandoned timeline, or damaged, or missing on
    another process; a damaged one must not be the base of the next incremental save). A step that cannot be
    deleted is forgotten with a warning naming its path; it is never raised (see the module docstring). Called by
    every process after the job agreed on `step`. Blocks."""
    newer = sorted(s for s in tier.committed() if step is None or s > step or (s == step and not from_local))
    if not newer:
        return
    warnings.warn(f"deleting steps {newer} of the local tier {tier.root}: the job resumed from "
                  f"{'nothing' if step is None else f'step {step}'}{'' if from_local else ' of another tier'}, "
                  "so they will be saved again", stacklevel=3)
    for old in newer:
        try:
            tier.delete(old)
        except OSError as exc:  # StorageError included; see the docstring for why it is not raised
            warnings.warn(f"could not delete step {old} of the local tier ({tier.index.location(old)}): {exc}; "
                          "it is ignored by this manager, and a save of that step replaces it", stacklevel=3)
