"""When a tier saves and which of its steps it keeps, as small policy objects (in the manner of Orbax's
``SaveDecisionPolicy`` and ``PreservationPolicy``), each a pure function of what is committed: nothing here
touches storage, so the manager (and the tests) can reason about every combination without writing a step.

Save decisions (`SaveDecision`): `Interval`, `AtSteps`, `OnPreemption`, and `AnyOf` to combine them. Preservation
(`Preservation`): `LatestN`, `BestN` (by a metric), `EveryNSteps`, `KeepFor` (by commit time), and `AnyOf`. A tier
deletes, after each commit, every committed step its preservation policy does not keep, except the newest, which
is always kept (`steps_to_delete`). A user's own policy is any object with the method of the protocol.

`CheckpointManagerOptions` takes policy objects per tier (`save_decision`, `preservation`, `local_save_decision`,
`local_preservation`); its flat fields (`save_interval_steps`, `max_to_keep`, `keep_period`, `best_fn`, ...) are
shorthand for them, built in one place (`for_tiers`) and used only where no object is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.records import StepMetadata

if TYPE_CHECKING:
    from ..options import CheckpointManagerOptions

Committed = Mapping[int, StepMetadata]  # the committed steps of a tier and their markers (metrics, times)


@dataclass(frozen=True)
class SaveContext:
    """What a save decision sees: the newest step the tier has or is saving (None: none), and whether a
    preemption notice (SIGTERM, with ``save_on_preemption``) is pending."""

    last_saved: int | None
    preempted: bool = False


class SaveDecision(Protocol):
    def should_save(self, step: int, context: SaveContext) -> bool:
        """True if `step` is due. Never called for a step at or before `context.last_saved`."""


class Preservation(Protocol):
    def keep(self, committed: Committed) -> set[int]:
        """The committed steps this policy preserves (the others may be deleted)."""


# ------------------------------------------------------------------------------------------- save decisions


@dataclass(frozen=True)
class Interval:
    """Every `steps` steps (step % steps == 0)."""

    steps: int

    def should_save(self, step: int, context: SaveContext) -> bool:
        return step % self.steps == 0


@dataclass(frozen=True)
class AtSteps:
    """At each of `steps`."""

    steps: frozenset[int]

    def should_save(self, step: int, context: SaveContext) -> bool:
        return step in self.steps


@dataclass(frozen=True)
class OnPreemption:
    """The first step after a preemption notice, whatever else says."""

    def should_save(self, step: int, context: SaveContext) -> bool:
        return context.preempted


# ------------------------------------------------------------------------------------------ preservation


@dataclass(frozen=True)
class LatestN:
    """The newest `n` steps."""

    n: int

    def keep(self, committed: Committed) -> set[int]:
        return set(sorted(committed)[-self.n:])


@dataclass(frozen=True)
class BestN:
    """The best `n` steps (None: every scored step) by `score(metrics)`: lowest first with ``mode="min"``,
    highest with ``"max"`` (ties: the newer). Steps without metrics are kept with `keep_unscored`."""

    score: Callable[[Mapping[str, Any]], float]
    n: int | None = None
    mode: str = "min"
    keep_unscored: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")

    def ranked(self, committed: Committed) -> list[int]:
        """The scored steps, best first."""
        scored = [(self.score(m.metrics), s) for s, m in committed.items() if m.metrics is not None]
        return [s for _, s in sorted(scored, key=lambda p: (p[0] if self.mode == "min" else -p[0], -p[1]))]

    def keep(self, committed: Committed) -> set[int]:
        best = self.ranked(committed)
        kept = set(best if self.n is None else best[:self.n])
        if self.keep_unscored:
            kept.update(s for s, m in committed.items() if m.metrics is None)
        return kept


@dataclass(frozen=True)
class EveryNSteps:
    """Every step divisible by `n` (a permanent record every n steps)."""

    n: int

    def keep(self, committed: Committed) -> set[int]:
        return {s for s in committed if s % self.n == 0}


@dataclass(frozen=True)
class KeepFor:
    """Every step committed less than `seconds` ago (`clock`: the current time, in seconds since the epoch)."""

    seconds: float
    clock: Callable[[], float] = time.time

    def keep(self, committed: Committed) -> set[int]:
        now = self.clock()
        return {s for s, m in committed.items() if now - m.committed_at < self.seconds}


@dataclass(frozen=True)
class AnyOf:
    """A step is due (or kept) if any of `policies` says so."""

    policies: tuple[Any, ...] = field(default=())

    def should_save(self, step: int, context: SaveContext) -> bool:
        return any(p.should_save(step, context) for p in self.policies)

    def keep(self, committed: Committed) -> set[int]:
        return set().union(*(p.keep(committed) for p in self.policies)) if self.policies else set()


KEEP_ALL = AnyOf((EveryNSteps(1),))


def steps_to_delete(policy: Preservation, committed: Committed, pinned: Iterable[int] = ()) -> list[int]:
    """The committed steps `policy` lets go, oldest first; the newest step is always kept, and so is every step
    a kept step references (its `StepMetadata.bases`: an incremental step's chunks stored there) and every step
    in `pinned` (the bases of saves in flight)."""
    return retention(policy, committed, pinned)[0]


def retention(policy: Preservation, committed: Committed,
              pinned: Iterable[int] = ()) -> tuple[list[int], dict[int, list[int]]]:
    """`steps_to_delete`, and the steps kept only as bases: each with the kept steps that reference it (the
    manager tells this in ``save_committed``)."""
    if not committed:
        return [], {}
    # a user's policy may name steps that are not (or no longer) committed: only committed ones are kept
    keep = ((set(policy.keep(committed)) | set(pinned)) & set(committed)) | {max(committed)}
    as_bases = kept_as_bases(keep, committed)
    held = {b: sorted(s for s in keep | as_bases if b in committed[s].bases) for b in sorted(as_bases)}
    return [s for s in sorted(committed) if s not in keep and s not in as_bases], held


def kept_as_bases(keep: set[int], committed: Committed) -> set[int]:
    """The steps of `committed` outside `keep` that a step of `keep` references, directly or through another
    (references are flattened when saved, so one level suffices for our steps; the closure costs nothing)."""
    found: set[int] = set()
    todo = [s for s in keep if s in committed]
    while todo:
        for base in committed[todo.pop()].bases:
            if base in committed and base not in keep and base not in found:
                found.add(base)
                todo.append(base)
    return found


def best_step(policy: Preservation, committed: Committed) -> int | None:
    """The best committed step by the first `BestN` in `policy` (None without one, or without metrics)."""
    ranking = next(_best_n(policy), None)
    ranked = ranking.ranked(committed) if ranking is not None else []
    return ranked[0] if ranked else None


def _best_n(policy: Any) -> Iterable[BestN]:
    if isinstance(policy, BestN):
        yield policy
    for inner in getattr(policy, "policies", ()):
        yield from _best_n(inner)


# ------------------------------------------------------------------------------------------- shorthand


@dataclass(frozen=True)
class TierPolicies:
    """The save decision and the preservation policy of each tier of a manager."""

    save: SaveDecision
    preserve: Preservation
    local_save: SaveDecision
    local_preserve: Preservation


def for_tiers(options: CheckpointManagerOptions) -> TierPolicies:
    """The policies `options` give each tier: its policy objects where given, else those its flat fields
    spell (`save_interval_steps` and `save_on_steps`, then preemption; `max_to_keep` newest, or best by `best_fn`,
    `keep_period`; the local tier's `local_*` fields likewise, `local_max_to_keep` newest)."""
    save = options.save_decision or _decision(options.save_interval_steps, options.save_on_steps)
    if options.preservation is not None:
        preserve = options.preservation
    else:
        parts: list[Any] = []
        if options.best_fn is not None:
            parts.append(BestN(options.best_fn, options.max_to_keep, options.best_mode,
                               options.keep_checkpoints_without_metrics))
        elif options.max_to_keep is not None:
            parts.append(LatestN(options.max_to_keep))
        else:
            parts.append(KEEP_ALL)
        if options.keep_period is not None:
            parts.append(EveryNSteps(options.keep_period))
        preserve = parts[0] if len(parts) == 1 else AnyOf(tuple(parts))
    local_save = options.local_save_decision or _decision(options.local_save_interval_steps,
                                                          options.local_save_on_steps)
    local_preserve = options.local_preservation or (
        LatestN(options.local_max_to_keep) if options.local_max_to_keep is not None else KEEP_ALL)
    return TierPolicies(save, preserve, local_save, local_preserve)


def _decision(interval: int | None, steps: frozenset[int]) -> SaveDecision:
    parts: list[Any] = [Interval(interval)] if interval is not None else []
    if steps:
        parts.append(AtSteps(steps))
    return AnyOf((*parts, OnPreemption()))
