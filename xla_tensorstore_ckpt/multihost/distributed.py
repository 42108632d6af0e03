"""Coordination of the processes of one job over torch.distributed (gloo on the host network).

A `Coordinator` knows this process's index and the process count and runs the few collectives a checkpoint
needs: gathering small Python records, broadcasting the primary's decision, and agreeing on success. With one
process everything is local. With several, the library uses its own gloo group (created from the default
process group, which the library also initializes from the environment — MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE — when the user has not), so users need not set one up, and every collective fails with an error
naming the cause within `timeout` instead of hanging when a process dies.

Collectives must be called by every process in the same order; each `Coordinator` has its own group, so the
manager uses one on the caller's thread and another on its background thread.

Groups are destroyed by `Coordinator.close` and, for those still open, at interpreter exit, together with the
default group if this library created it. A gloo worker thread releases the tensors of its last collective
after the caller has its result; if the interpreter is already finalizing then, that thread cannot take the GIL
and the process aborts ("terminate called without an active exception"). Destroying a group joins its workers.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ..core.errors import CoordinationError
from . import wire
from .messages import copy_into, message_buffers
from .transport import GlooTransport, Transport, create_store, traffic

DEFAULT_TIMEOUT_S = 600.0
SLOT_BYTES = 1024  # a gathered record's slot: most records fit, longer ones take a second gather
T = TypeVar("T")


class Coordinator:
    """Collectives over a dedicated gloo group (or trivial ones for a single process). Blocking.

    Agreements take one collective each, over a `transport.Transport`: flags and digests a reduction of a few
    integers (log2(P) messages per process), records one gather of fixed-size slots holding their `wire`
    encoding (a second only for records longer than a slot), the primary's decisions a broadcast. Each has a
    deadline (`timeout_s`) after which every live process raises `CoordinationTimeoutError` naming the phase and
    the processes that did not arrive (at most `deadline`'s seconds within one). `take_costs` gives what each
    phase cost this process: seconds, collectives, rounds, messages and bytes (`transport.traffic`)."""

    def __init__(self, group: Any = None, index: int = 0, count: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
                 transport: Transport | None = None):
        self._group, self.index, self.count, self.timeout_s = group, index, count, timeout_s
        self.transport = transport or (GlooTransport(group, index, count, timeout_s) if group is not None else None)
        self._costs: dict[str, dict[str, float]] = {}
        # The first collective of this coordinator that failed because a peer died or did not answer: a peer known
        # to have failed is not waited for again (`CheckpointManager.close`).
        self.peer_failure: CoordinationError | None = None
        if group is not None:
            _track(self)

    @classmethod
    def single(cls) -> Coordinator:
        """A coordinator of this process alone."""
        return cls()

    @classmethod
    def from_environment(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> Coordinator:
        """A coordinator of every process of the job: torch.distributed's world, initialized here (gloo, from
        MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE) if the user has not, with a new gloo group of its own and a
        side channel (a TCPStore process 0 hosts) that names silent processes. A single process gets `single()`.
        Collective when there are several processes."""
        import torch.distributed as dist

        if not dist.is_available():
            return cls.single()
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
            _state.owns_default_group = True
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls.single()
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        index, count = dist.get_rank(), dist.get_world_size()
        store = create_store(group, index, timeout_s, os.environ.get("MASTER_ADDR", "127.0.0.1"))
        return cls(group, index, count, timeout_s, GlooTransport(group, index, count, timeout_s, store))

    @property
    def is_primary(self) -> bool:
        return self.index == 0

    def close(self) -> None:
        """Destroy this coordinator's group (joining its gloo worker threads). Local, not collective; idempotent.
        A closed coordinator of several processes must not be used again."""
        group, self._group = self._group, None
        if group is None:
            return
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()
        with _state.lock:
            _state.open.discard(self)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(group)

    @property
    def distributed(self) -> bool:
        return self.count > 1

    def take_costs(self) -> dict[str, dict[str, float]]:
        """What this process's collectives cost since the last call, per phase: ``seconds`` in them,
        ``collectives``, ``rounds`` (message steps on its critical path), ``messages`` and ``bytes`` it sent and
        received (modelled from the algorithm: `transport.traffic`). For events; local."""
        costs, self._costs = self._costs, {}
        return costs

    @contextlib.contextmanager
    def deadline(self, timeout_s: float | None) -> Iterator[None]:
        """Within the block, each collective waits at most `timeout_s` (None: this coordinator's own
        `timeout_s`, which also bounds it: its process group's timeout). Not thread-safe: one caller at a time
        uses a coordinator."""
        if timeout_s is None or self.transport is None or not hasattr(self.transport, "timeout_s"):
            yield
            return
        before = self.transport.timeout_s
        self.transport.timeout_s = min(float(timeout_s), self.timeout_s)
        try:
            yield
        finally:
            self.transport.timeout_s = before

    def _timed(self, phase: str, kind: str, nbytes: int, run: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return run()
        except CoordinationError as exc:
            self.peer_failure = self.peer_failure or exc
            raise
        finally:
            messages, total, rounds = traffic(kind, self.index, self.count, nbytes)
            cost = self._costs.setdefault(phase, dict.fromkeys(
                ("seconds", "collectives", "rounds", "messages", "bytes"), 0))
            cost["seconds"] += time.perf_counter() - start
            cost["collectives"] += 1
            cost["rounds"] += rounds
            cost["messages"] += messages
            cost["bytes"] += total

    def reduce_max(self, values: Sequence[int], phase: str = "agreeing") -> list[int]:
        """The elementwise maximum of every process's `values` (64-bit integers, as many everywhere): one
        reduction. Collective."""
        if not self.distributed:
            return list(values)
        array = np.asarray(values, dtype=np.int64)
        return [int(v) for v in self._timed(phase, "reduce", array.nbytes,
                                                              lambda: self.transport.reduce_max(array, phase))]

    def any(self, flag: bool, phase: str = "agreeing") -> bool:
        """Whether `flag` is true on any process: a one-element reduction. Collective."""
        return bool(self.reduce_max([int(flag)], phase)[0])

    def all_gather(self, value: Any, phase: str = "gathering records") -> list[Any]:
        """Every process's `value` (a small record `wire` encodes: no pickle), in process order: one gather of
        fixed-size slots, a second for the ends of records longer than a slot. Collective."""
        if not self.distributed:
            return [value]
        data = wire.encode(value)
        rows = self._timed(phase, "gather", SLOT_BYTES, lambda: self.transport.gather(_slot(data), phase))
        lengths = [int(n) for n in rows[:, :8].copy().view(np.int64)[:, 0]]
        longest = max(lengths)
        rest = None
        if longest > SLOT_BYTES - 8:
            tail = np.zeros(longest - (SLOT_BYTES - 8), dtype=np.uint8)
            tail[:max(0, len(data) - (SLOT_BYTES - 8))] = np.frombuffer(data[SLOT_BYTES - 8:], dtype=np.uint8)
            rest = self._timed(phase, "gather", tail.nbytes, lambda: self.transport.gather(tail, phase))
        return [wire.decode(_joined(row, None if rest is None else rest[p], lengths[p]))
                for p, row in enumerate(rows)]

    def broadcast(self, value: Any, phase: str = "hearing from the primary") -> Any:
        """The primary's `value` (a record `wire` encodes) on every process: one broadcast of a slot, a second
        for the end of a longer record. Collective."""
        if not self.distributed:
            return value
        data = wire.encode(value) if self.is_primary else b""
        head = self._timed(phase, "broadcast", SLOT_BYTES, lambda: self.transport.broadcast(_slot(data), phase))
        length = int(head[:8].copy().view(np.int64)[0])
        rest = None
        if length > SLOT_BYTES - 8:
            tail = np.zeros(length - (SLOT_BYTES - 8), dtype=np.uint8)
            if self.is_primary:
                tail[:] = np.frombuffer(data[SLOT_BYTES - 8:], dtype=np.uint8)
            rest = self._timed(phase, "broadcast", tail.nbytes, lambda: self.transport.broadcast(tail, phase))
        return wire.decode(_joined(head, rest, length))

    def statuses(self, status: Any, phase: str = "agreeing on the outcome") -> list[Any]:
        """Every process's `status` (None: all is well; else a small record), in process order, like
        `all_gather`, in one reduction of a flag when all is well (the records travel only if one is not).
        Raises `CoordinationTimeoutError` naming the processes that died or did not arrive by the deadline.
        Collective."""
        if not self.distributed:
            return [status]
        if not self.any(status is not None, phase):
            return [None] * self.count
        return self.all_gather(status, phase)

    def exchange(self, sends: Mapping[int, Sequence[np.ndarray]], receives: Mapping[int, Sequence[np.ndarray]],
                 what: Callable[[int], str]) -> None:
        """Point to point: send each list of arrays to its process, and receive each list from its process into the
        arrays given (the sender's shapes and dtypes, in the sender's order). Arrays of at least
        `messages.DIRECT_BYTES` travel as messages of their own (without a copy where contiguous); smaller ones are
        packed into one message per pair. Blocks until every transfer has finished. `what(process)` describes what
        comes from `process`, for the error (`CoordinationError` naming it) if it dies or times out meanwhile. Only
        the processes named take part."""
        self.start_exchange(sends, receives, what).wait()

    def start_exchange(self, sends: Mapping[int, Sequence[np.ndarray]], receives: Mapping[int, Sequence[np.ndarray]],
                       what: Callable[[int], str]) -> Exchange:
        """`exchange` without the wait: the transfers are started and the returned `Exchange` waits for them.
        Exchanges started one after another between the same processes pair up in the same order on both sides,
        so a caller can prepare the next one while this one is in flight (the arrays must stay untouched until
        its `wait` returns). Raises `CoordinationError` as `exchange` does."""
        works: list[tuple[int, Any]] = []
        unpack: list[tuple[np.ndarray, np.ndarray]] = []  # (received into, destination) copied after the wait
        if not sends and not receives:
            return Exchange(self, works, unpack, receives, what)
        import torch
        import torch.distributed as dist

        peer = None
        try:
            for peer, arrays in sends.items():
                for message in message_buffers(arrays, copy=True)[0]:
                    works.append((peer, dist.isend(torch.from_numpy(message), peer, group=self._group)))
            for peer, arrays in receives.items():
                messages, pending = message_buffers(arrays, copy=False)
                unpack += pending
                for message in messages:
                    works.append((peer, dist.irecv(torch.from_numpy(message), peer, group=self._group)))
        except RuntimeError as exc:
            raise self._transfer_error(peer, receives, what, exc) from exc
        return Exchange(self, works, unpack, receives, what)

    def _transfer_error(self, peer: int | None, receives: Mapping[int, Sequence[np.ndarray]],
                        what: Callable[[int], str], exc: Exception) -> CoordinationError:
        receiving = f" while receiving {what(peer)}" if peer in receives and what(peer) else ""
        error = CoordinationError(f"process {self.index}: transfer with process {peer} failed (it died or timed "
                                  f"out after {self.timeout_s:g} s){receiving}: {exc}", process=peer)
        self.peer_failure = self.peer_failure or error
        return error

    def on_primary(self, what: str, action: Callable[[], T], *, share: bool = False) -> T | None:
        """The primary runs `action`; then every process learns whether it succeeded and raises if not (the
        primary its own error, the others `CoordinationError` naming `what`). Returns the action's result on the
        primary, and with `share` on every process (one broadcast carrying the result or the error); otherwise
        None elsewhere. Collective."""
        result, error = None, None
        if self.is_primary:
            try:
                result = action()
            except Exception as exc:  # noqa: BLE001 - shared with every process, then raised
                error = exc
        if not share or not self.distributed:
            self.raise_unless_ok(error, what)
            return result
        ok, shared = self.broadcast((True, result) if error is None else (False, f"{type(error).__name__}: {error}"),
                                    what)
        if error is not None:
            raise error
        if not ok:
            raise CoordinationError(f"{what} failed on process 0: {shared}", process=0)
        return shared

    def everywhere(self, what: str, action: Callable[[], T]) -> T:
        """Every process runs `action`; if any failed, every process raises (a failed one its own error, the
        others `CoordinationError` naming `what` and the failed process). Collective."""
        result, error = None, None
        try:
            result = action()
        except Exception as exc:  # noqa: BLE001 - shared with every process, then raised
            error = exc
        self.raise_unless_ok(error, what)
        return result  # type: ignore[return-value]

    def raise_unless_ok(self, error: BaseException | None, what: str) -> None:
        """Raise on every process if `error` is set on any: this process its own error, the others
        `CoordinationError` naming `what` and the failed process (`everywhere` for an action already run, e.g.
        by a caller that learnt from another agreement that one failed). Collective."""
        try:
            statuses = self.statuses(None if error is None else f"{type(error).__name__}: {error}", what)
        except CoordinationError:
            if error is not None:  # this process's own failure says more than a peer's silence about it
                raise error from None
            raise
        if error is not None:
            raise error
        for process, status in enumerate(statuses):
            if status is not None:
                raise CoordinationError(f"{what} failed on process {process}: {status}", process=process)


def _slot(data: bytes) -> np.ndarray:
    """The fixed-size slot a record travels in: its length (8 bytes), then its first bytes."""
    slot = np.zeros(SLOT_BYTES, dtype=np.uint8)
    slot[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
    head = data[:SLOT_BYTES - 8]
    slot[8:8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    return slot


def _joined(slot: np.ndarray, rest: np.ndarray | None, length: int) -> bytes:
    data = slot[8:8 + min(length, SLOT_BYTES - 8)].tobytes()
    return data if rest is None else data + rest[:length - len(data)].tobytes()


class Exchange:
    """Point-to-point transfers in flight (`Coordinator.start_exchange`)."""

    def __init__(self, coordinator: Coordinator, works: list, unpack: list, receives: Mapping, what: Callable):
        self._coordinator, self._works, self._unpack = coordinator, works, unpack
        self._receives, self._what = receives, what

    def wait(self) -> None:
        """Block until every transfer has finished, then unpack what was received. Raises `CoordinationError`
        naming the peer that died or timed out."""
        timeout = datetime.timedelta(seconds=self._coordinator.timeout_s)
        for peer, work in self._works:
            try:
                work.wait(timeout)
            except RuntimeError as exc:
                raise self._coordinator._transfer_error(peer, self._receives, self._what, exc) from exc
        for message, destination in self._unpack:
            copy_into(destination, message.view(destination.dtype).reshape(destination.shape))


class _State:
    """Coordinators whose groups are still open, and whether this library created the default group."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: set[Coordinator] = set()
        self.owns_default_group = False
        self.registered = False


_state = _State()


def _track(coordinator: Coordinator) -> None:
    with _state.lock:
        _state.open.add(coordinator)
        if not _state.registered:
            _state.registered = True
            atexit.register(close_all)


def close_all() -> None:
    """Destroy every group this library created, the default group included if the library created it. Runs at
    interpreter exit (before finalization, while gloo's worker threads can still take the GIL)."""
    with _state.lock:
        coordinators = list(_state.open)
    for coordinator in coordinators:
        coordinator.close()
    if _state.owns_default_group:
        import torch.distributed as dist

        _state.owns_default_group = False
        if dist.is_initialized():
            dist.destroy_process_group()


_default: Coordinator | None = None


def default_coordinator() -> Coordinator:
    """The coordinator of the item-level `save` (created on first use; collective on several processes)."""
    global _default
    if _default is None:
        _default = Coordinator.from_environment()
    return _default
