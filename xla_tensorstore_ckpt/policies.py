"""Save decisions and retention as small, pure functions of the committed steps.

`should_save` decides whether a step is due; `steps_to_delete` decides which committed steps a retention
configuration lets go. Nothing here touches storage, so the manager (and the tests) can reason about every
combination of rules without writing a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class SavePolicy:
    """When a step is due: every `interval` steps (None: never by interval) and at each of `steps`."""

    interval: int | None = None
    steps: frozenset[int] = field(default_factory=frozenset)

    def should_save(self, step: int, last_saved: int | None) -> bool:
        if last_saved is not None and step <= last_saved:
            return False
        if step in self.steps:
            return True
        return self.interval is not None and step % self.interval == 0


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which committed steps to keep.

    max_to_keep: keep the newest N (None: keep all). With `best_fn`, keep the best N by metric instead.
    keep_period: also keep every step divisible by it.
    best_fn / best_mode: score a step's metrics; "min" or "max" is best.
    keep_checkpoints_without_metrics: with `best_fn`, keep steps that have no metrics (else they may go).
    The newest committed step is always kept.
    """

    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: str = "min"
    keep_checkpoints_without_metrics: bool = True

    def steps_to_delete(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, Any] | None]) -> list[int]:
        """The committed `steps` (any order) that retention removes, oldest first."""
        ordered = sorted(steps)
        if not ordered:
            return []
        keep = {ordered[-1]}
        if self.keep_period is not None:
            keep.update(s for s in ordered if s % self.keep_period == 0)
        if self.best_fn is None:
            newest = ordered if self.max_to_keep is None else ordered[max(0, len(ordered) - self.max_to_keep):]
            keep.update(newest)
        else:
            scored = [(self.best_fn(metrics[s]), s) for s in ordered if metrics.get(s) is not None]
            unscored = [s for s in ordered if metrics.get(s) is None]
            if self.keep_checkpoints_without_metrics:
                keep.update(unscored)
            best_first = sorted(scored, key=lambda pair: (pair[0] if self.best_mode == "min" else -pair[0], -pair[1]))
            limit = len(best_first) if self.max_to_keep is None else self.max_to_keep
            keep.update(s for _, s in best_first[:limit])
        return [s for s in ordered if s not in keep]

    def best_step(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, Any] | None]) -> int | None:
        """The best committed step by `best_fn` (ties: the newest), or None without `best_fn` or metrics."""
        if self.best_fn is None:
            return None
        scored = [(self.best_fn(metrics[s]), s) for s in steps if metrics.get(s) is not None]
        if not scored:
            return None
        return min(scored, key=lambda pair: (pair[0] if self.best_mode == "min" else -pair[0], -pair[1]))[1]
