"""Saving on preemption: a SIGTERM handler that asks the manager to commit the next save before the process is
killed, and tells the training loop when it may exit. Installed by the manager (on the main thread); the
previous handler is chained and restored."""

from __future__ import annotations

import signal
import threading
from typing import Any


class PreemptionWatch:
    """Set by SIGTERM; then the next save is committed before `save` returns (`saved_on_notice`), and
    `reached(step)` turns true."""

    def __init__(self, enabled: bool):
        self._notice = threading.Event()
        self.step: int | None = None  # the step committed after the notice
        self._enabled = enabled
        self._previous: Any = signal.signal(signal.SIGTERM, self._on_sigterm) if enabled else None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._notice.set()
        if callable(self._previous):
            self._previous(signum, frame)

    @property
    def pending(self) -> bool:
        """A notice arrived and no step has been committed since."""
        return self._notice.is_set() and self.step is None

    def saved_on_notice(self, step: int) -> None:
        self.step = step

    def reached(self, step: int) -> bool:
        """True once the state up to `step` is committed after a notice: the loop should exit now."""
        return self.step is not None and step >= self.step

    def close(self) -> None:
        """Put the previous SIGTERM handler back."""
        if self._enabled:
            self._enabled = False
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
