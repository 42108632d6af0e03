"""The background half of asynchronous saves: one thread finishing saves in order, with bounded concurrency and
errors that are never lost.

The manager stages a save on the caller's thread (device → host copies, chunk writes started), then hands the
rest (wait for the writes, sync, manifests, commit marker, retention) to `BackgroundCommitter.submit`. A slot is
reserved before staging, so at most `max_pending` saves hold host memory at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..core import threads
from ..core.errors import AsyncSaveError


class BackgroundCommitter:
    """Runs submitted save tails on one background thread, in submission order. Thread-safe.

    The first error of a background save is kept and re-raised as `AsyncSaveError` (naming what failed: the
    step, and where; the original is its ``__cause__``) by the next `check`, `wait` or `close`, then forgotten.
    """

    def __init__(self, max_pending: int):
        self._slots = threading.Semaphore(max_pending)
        self._executor = threads.pool("ordered", "xtc-commit")
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._error: AsyncSaveError | None = None

    def reserve(self) -> None:
        """Block until fewer than `max_pending` saves are in flight, and take a slot for the next one."""
        self._slots.acquire()

    def release(self) -> None:
        """Give back a reserved slot that will not be submitted (staging failed)."""
        self._slots.release()

    def submit(self, what: str, step: int, tail: Callable[[], None]) -> None:
        """Run `tail` in the background using the slot taken by `reserve`. Does not block. `what` names the save
        in its error (step, tier, root)."""
        self._run(what, step, tail, release=True)

    def defer(self, what: str, step: int, work: Callable[[], None]) -> None:
        """Run `work` (e.g. retention deletes) in the background after what is already queued, without taking
        a slot: it never delays the staging of the next save. Does not block."""
        self._run(what, step, work, release=False)

    def _run(self, what: str, step: int, work: Callable[[], None], *, release: bool) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the caller's thread
                with self._lock:
                    if self._error is None:
                        error = AsyncSaveError(f"{what} failed: {exc}", step=step)
                        error.__cause__ = exc
                        self._error = error
            finally:
                if release:
                    self._slots.release()

        with self._lock:
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self._executor.submit(run))

    def busy(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._futures)

    def check(self) -> None:
        """Raise (once) the error of a failed background save, if any. Does not block."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self) -> None:
        """Block until every submitted save has finished, then `check`."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.result()
        self.check()

    def close(self) -> None:
        """`wait`, then stop the thread (also when `wait` raises)."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
