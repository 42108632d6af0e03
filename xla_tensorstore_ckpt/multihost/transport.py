"""How the processes of a job reach each other for agreements: the `Transport` protocol (a reduction, a gather
of fixed-size byte slots, a broadcast, each one collective with a deadline), its implementation over a gloo
group (`GlooTransport`), and how a missed deadline names the processes that did not arrive.

`Coordinator` (distributed.py) is the only user; benchmarks/sim_transport.py implements the same protocol to
count messages and bytes at a thousand processes. Messages per process of each collective over gloo: the
reduction takes log2(P) rounds (recursive doubling over point-to-point messages above `RING_MAX` processes;
gloo's own ring all-reduce, 2(P-1) small steps in C++, below), the broadcast a binomial tree (log2(P)), the
gather a ring (P-1: it carries every process's slot, so it is used only where every record is needed).

Deadlines: every collective waits at most `timeout_s`, in slices of `SLICE_S`; between slices a process looks
at the job's side channel (a `torch.distributed.TCPStore` hosted by process 0) for another process's alarm.
When the deadline passes, or gloo reports a peer gone, the process raises the alarm, marks itself arrived and
wakes every process's watcher thread (`_AlarmWatch`, blocked on the store), which answers for its process at
once, whatever the process's main thread is doing; it then waits (at most `GRACE_S`) for every answer. Those
that never answer are dead or stopped (SIGSTOP stops the watcher too), and every live process raises
`CoordinationTimeoutError` naming them; a process that runs but is slow to reach the collective (under load) is
not named, unless every process answered: then those that had not arrived (stuck elsewhere) are.

Processes found dead or stopped by one collective are not waited for by the others this process has under way
or starts later (a manager's background commits and its caller's saves run on coordinators of their own): each
live transport of the process learns of them (`_tell_live_transports`) and raises at once, naming them, so that
every thread of a process raises within one deadline of the failure rather than one deadline after another.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
import weakref
from typing import Any, Protocol

import numpy as np

from ..core.errors import CoordinationError, CoordinationTimeoutError

RING_MAX = 16  # at most this many processes, gloo's all-reduce (one call into C++) beats log2(P) Python rounds
SLICE_S = 0.5
GRACE_S = 5.0
_REDUCE_TAG = 2  # point-to-point messages of the reduction, apart from data (0) and status flags (1)
_LIVE: weakref.WeakSet[GlooTransport] = weakref.WeakSet()  # this process's transports, told of dead peers
_LIVE_LOCK = threading.Lock()


class Transport(Protocol):
    """One process's end of the collectives of a job of `count` processes. Every method is collective (every
    process calls it, in the same order) and blocks; raises `CoordinationError` (`CoordinationTimeoutError`
    naming the processes that did not arrive) if the collective does not finish by the deadline."""

    index: int
    count: int

    def reduce_max(self, values: np.ndarray, phase: str) -> np.ndarray:
        """The elementwise maximum of every process's int64 `values` (same length everywhere)."""

    def gather(self, slot: np.ndarray, phase: str) -> np.ndarray:
        """Every process's uint8 `slot` (same length everywhere), stacked in process order."""

    def broadcast(self, buffer: np.ndarray, phase: str) -> np.ndarray:
        """Process 0's uint8 `buffer` (same length everywhere)."""


def traffic(kind: str, index: int, count: int, nbytes: int) -> tuple[int, int, int]:
    """(messages, bytes, rounds) of one collective on process `index` of `count`, by the algorithm the gloo
    transport runs (a model of gloo's own ring algorithms where it calls them): `kind` "reduce" (`nbytes` per
    process), "gather" (a slot of `nbytes`) or "broadcast" (`nbytes`). Messages and bytes are those this process
    sends and receives; rounds, the message steps on its critical path. Events report them per phase
    (`Coordinator.take_costs`); benchmarks/sim_transport.py counts with them."""
    if count <= 1:
        return 0, 0, 0
    if kind == "reduce":
        if count <= RING_MAX:  # ring: reduce-scatter then all-gather, 2 (P - 1) steps of a piece each
            steps = 2 * (count - 1)
            return 2 * steps, 2 * steps * -(-nbytes // count), steps
        rounds = recursive_doubling(index, count)
        messages = sum(len(sends) + len(receives) for sends, receives in rounds)
        return messages, messages * nbytes, len(rounds)
    if kind == "gather":  # ring: each step passes one process's slot on
        return 2 * (count - 1), 2 * (count - 1) * nbytes, count - 1
    lowest = index & -index if index else 1 << (count - 1).bit_length()  # binomial tree from process 0
    children, step = 0, 1
    while step < lowest and index + step < count:
        children, step = children + 1, step << 1
    messages = children + (1 if index else 0)
    return messages, messages * nbytes, (count - 1).bit_length()


def create_store(group: Any, index: int, timeout_s: float, host: str) -> Any:
    """The side channel of a group: a TCPStore process 0 hosts on a free port, announced to the others over the
    group. Collective."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=max(timeout_s, GRACE_S) + GRACE_S)
    port = torch.zeros(1, dtype=torch.int64)
    store = None
    if index == 0:
        store = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        port[0] = store.port
    dist.broadcast(port, 0, group=group)
    return store if store is not None else dist.TCPStore(host, int(port[0]), None, False, timeout)


class GlooTransport:
    """`Transport` over a gloo group, with `store` (`create_store`) to name silent processes."""

    def __init__(self, group: Any, index: int, count: int, timeout_s: float, store: Any = None):
        self.group, self.index, self.count, self.timeout_s, self._store = group, index, count, timeout_s, store
        self._sequence = 0  # collectives so far: the same on every process, it keys the side channel
        self.broken: CoordinationError | None = None  # after a missed deadline the group is unusable
        self._watch = _AlarmWatch(store, index) if store is not None else None
        self._store_silent = False  # the side channel's host stopped answering: it is not asked again
        # Processes another collective of this process found dead or stopped (`_tell_live_transports`).
        self.dead_elsewhere: CoordinationTimeoutError | None = None
        with _LIVE_LOCK:
            _LIVE.add(self)

    def close(self) -> None:
        """Stop answering alarms (the group is being destroyed). Local; idempotent. Where the side channel's host
        (process 0) is known to be dead or stopped, its watcher is not woken (a request to it would only wait)."""
        if self._watch is None:
            return
        failures = (self.broken, self.dead_elsewhere)
        host_gone = self._store_silent or any(
            isinstance(f, CoordinationTimeoutError) and 0 in f.missing for f in failures)
        self._watch.close(wake=not host_gone)

    def reduce_max(self, values: np.ndarray, phase: str) -> np.ndarray:
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64).copy())
        if self.count <= RING_MAX:
            self._run(phase, lambda: [dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group,
                                                      async_op=True)])
            return tensor.numpy()
        for sends, receives in recursive_doubling(self.index, self.count):
            incoming = [torch.empty_like(tensor) for _ in receives]
            self._run(phase, functools.partial(self._round, tensor, sends, incoming, receives), count=False)
            for t in incoming:  # max is idempotent: a process receiving the final result may take it in too
                tensor = torch.maximum(tensor, t)
        self._sequence += 1
        return tensor.numpy()

    def _round(self, tensor: Any, sends: list[int], incoming: list, receives: list[int]) -> list:
        import torch.distributed as dist

        return [*(dist.isend(tensor, p, group=self.group, tag=_REDUCE_TAG) for p in sends),
                *(dist.irecv(t, p, group=self.group, tag=_REDUCE_TAG) for t, p in zip(incoming, receives))]

    def gather(self, slot: np.ndarray, phase: str) -> np.ndarray:
        import torch
        import torch.distributed as dist

        mine = torch.from_numpy(np.ascontiguousarray(slot))
        out = torch.empty((self.count, slot.size), dtype=torch.uint8)
        self._run(phase, lambda: [dist.all_gather(list(out.unbind(0)), mine, group=self.group, async_op=True)])
        return out.numpy()

    def broadcast(self, buffer: np.ndarray, phase: str) -> np.ndarray:
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(np.ascontiguousarray(buffer).copy())
        self._run(phase, lambda: [dist.broadcast(tensor, 0, group=self.group, async_op=True)])
        return tensor.numpy()

    def _run(self, phase: str, start: Any, count: bool = True) -> None:
        """Start a collective's works and wait for them by the deadline (`count`: it is a whole collective)."""
        if self.broken is not None:
            raise CoordinationError(f"process {self.index}: {phase}: the process group is unusable since an "
                                    f"earlier failure ({self.broken})", process=self.broken.process)
        if self.dead_elsewhere is not None:
            raise self._found_dead_elsewhere(phase)
        sequence = self._sequence
        if count:
            self._sequence += 1
        deadline = time.monotonic() + self.timeout_s
        try:
            works = start()
        except RuntimeError as exc:
            raise self._named(phase, sequence, exc) from exc
        for work in works:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    work.wait(datetime.timedelta(seconds=max(0.001, min(SLICE_S, remaining))))
                    break
                except RuntimeError as exc:
                    timed_out = "timed out" in str(exc).lower()
                    if timed_out and self.dead_elsewhere is not None:
                        raise self._found_dead_elsewhere(phase) from exc
                    if not timed_out or remaining <= SLICE_S or self._alarmed(sequence, remaining):
                        raise self._named(phase, sequence, exc) from exc

    def _alarmed(self, sequence: int, remaining: float) -> bool:
        """Whether another process raised the alarm of collective `sequence`; True also if the side channel's
        host (process 0, part of every collective) does not answer before the deadline, `remaining` seconds
        away."""
        if self._store is None or self._store_silent:
            return False
        try:
            return bool(self._ask(lambda: self._store.check(["alarm"]), remaining))  # any collective's
        except RuntimeError:  # the store's host is gone or stopped: so is the collective
            return True

    def _ask(self, call: Any, seconds: float) -> Any:
        """`call` (one request to the side channel) answered within `seconds`, or RuntimeError. A TCPStore
        client waits without bound for a host that is stopped (SIGSTOP, a stalled VM) rather than gone, whatever
        its timeout: the request runs on a thread of its own, left behind if it never returns, and the host is
        not asked again."""
        if self._store_silent:
            raise RuntimeError("process 0, the side channel's host, stopped answering earlier")
        answer: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                answer["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                answer["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name="xtc-side-channel", daemon=True).start()
        if not done.wait(max(seconds, 0.001)):
            self._store_silent = True
            raise RuntimeError(f"process 0, the side channel's host, did not answer within {seconds:.1f} s")
        if "error" in answer:
            raise answer["error"]
        return answer["value"]

    def _named(self, phase: str, sequence: int, cause: Exception) -> CoordinationTimeoutError:
        """Raise the alarm of collective `sequence`, wait for the live processes to answer it, and the error
        naming those that did not."""
        silent, how = self._silent(sequence)
        names = ", ".join(map(str, silent)) if silent else "unknown"
        error = CoordinationTimeoutError(
            f"process {self.index}: {phase}: process{'es' if len(silent) != 1 else ''} {names} {how} within "
            f"{self.timeout_s:g} s (coordination_timeout_s): {cause}",
            phase=phase, missing=tuple(silent))
        self.broken = error
        if silent and how == _DEAD:
            _tell_live_transports(self, error)
        return error

    def _found_dead_elsewhere(self, phase: str) -> CoordinationTimeoutError:
        """The error for a collective that will not wait for the processes another collective of this process
        found dead or stopped (`dead_elsewhere`); the group is unusable after it, as after a missed deadline."""
        found = self.dead_elsewhere
        names = ", ".join(map(str, found.missing))
        error = CoordinationTimeoutError(
            f"process {self.index}: {phase}: process{'es' if len(found.missing) != 1 else ''} {names} died or did "
            f"not answer (found by another collective of this process: {found.phase})",
            phase=phase, missing=found.missing)
        self.broken = error
        return error

    def _silent(self, sequence: int) -> tuple[list[int], str]:
        """The processes to name for the alarm of collective `sequence`, and how they failed: those whose
        watcher did not answer (dead or stopped), else, if every process runs, those that had not arrived."""
        silent, how = self._find_silent(sequence)
        if self._store is not None and not self._store_silent:
            self._conclude(sequence, silent)
        return silent, how

    def _conclude(self, sequence: int, silent: list[int]) -> None:
        """Tell the others that this process has named the silent ones of alarm `sequence`. The store's host
        (process 0) then waits, at most the grace period, until every process it did not name has done so: a
        process 0 that raised and exited at once took the store with it, and a process still asking was left to
        name process 0 instead of the one that died."""
        grace = min(self.timeout_s, GRACE_S)
        try:
            self._ask(lambda: self._store.set(f"concluded/{sequence}/{self.index}", b"1"), grace)
            if self.index != 0:
                return
            waiting = [f"concluded/{sequence}/{p}" for p in range(1, self.count) if p not in silent]
            until = time.monotonic() + grace
            while waiting and not self._ask(lambda: self._store.check(waiting), grace):
                if time.monotonic() > until:
                    return
                time.sleep(0.05)
        except RuntimeError:  # the store does not answer: there is nobody to wait for
            return

    def _find_silent(self, sequence: int) -> tuple[list[int], str]:
        dead, late = _DEAD, "ran but had not arrived"
        if self._store is None:
            return [], dead
        others = [p for p in range(self.count) if p != self.index]
        answers = [f"answered/{p}" for p in others]
        grace = min(self.timeout_s, GRACE_S)
        try:
            first = self._ask(lambda: self._store.add("alarm", 1), grace) == 1
            self._ask(lambda: self._store.set(f"arrived/{sequence}/{self.index}", b"1"), grace)
            self._ask(lambda: self._store.set(f"answered/{self.index}", b"1"), grace)
            if first:  # wake every process's watcher, whatever it is doing (the failure path only)
                self._ask(lambda: self._store.multi_set([f"wake/{p}" for p in others],
                                                        [str(sequence).encode()] * len(others)), grace)
            # Looked at, not waited for: a store wait that outlasts the store's own timeout breaks its connection.
            until = time.monotonic() + grace
            while not self._ask(lambda: self._store.check(answers), grace):
                if time.monotonic() > until:  # someone did not answer: ask key by key
                    return [p for p in others
                            if not self._ask(lambda p=p: self._store.check([f"answered/{p}"]), grace)], dead
                time.sleep(0.05)
            return [p for p in others
                    if not self._ask(lambda p=p: self._store.check([f"arrived/{sequence}/{p}"]), grace)], late
        except RuntimeError:  # the store itself does not answer: its host, process 0, is the silent one
            return [0], dead


_DEAD = "died or did not answer"


def _tell_live_transports(origin: GlooTransport, error: CoordinationTimeoutError) -> None:
    """Tell every other live transport of this process that `error.missing` are dead or stopped; their
    collectives under way raise at their next slice, later ones at once. Called by the transport that found
    them; does not block."""
    with _LIVE_LOCK:
        transports = list(_LIVE)
    for transport in transports:
        if transport is not origin and transport.dead_elsewhere is None and transport.count == origin.count:
            transport.dead_elsewhere = error


class _AlarmWatch:
    """Answers the alarm for this process from a thread of its own, on a store connection of its own, whatever
    its main thread is doing: a process that runs is not named silent because it was slow to reach the
    collective (under load, reading its chunks); one that is dead or stopped (SIGSTOP) does not answer. The
    thread blocks on the store until its wake key is set: by the process raising the alarm, or by `close`."""

    def __init__(self, store: Any, index: int):
        self._store, self._host, self._port, self._index = store, store.host, store.port, index
        self._thread = threading.Thread(target=self._run, name=f"xtc-alarm-watch-{index}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch.distributed as dist

        wake = f"wake/{self._index}"
        try:
            store = dist.TCPStore(self._host, self._port, None, False, datetime.timedelta(hours=1))
            while True:
                try:
                    store.wait([wake], datetime.timedelta(hours=1))
                    break
                except dist.DistStoreError as exc:  # an hour without news; anything else: the store is gone
                    if "timeout" not in str(exc).lower():
                        return
            if store.get(wake) != b"closed":
                store.set(f"answered/{self._index}", b"1")
        except RuntimeError:  # the store's host is gone: there is nobody left to answer
            return

    def close(self, *, wake: bool = True) -> None:
        """Wake the thread and let it end (it answers nothing then); with `wake` False (the store's host is
        known gone), leave it blocked: it is a daemon thread. Idempotent; never raises; blocks at most twice
        `GRACE_S`: the store's host may be stopped (SIGSTOP), and a TCPStore request to a stopped host waits
        without bound (found by the chaos run: seed 96, cycle 3, every live process hung in `close` after naming
        a stopped process 0), so the wake-up is sent from a thread left behind if it never returns."""
        if not wake or not self._thread.is_alive():
            return
        sent = threading.Event()

        def wake() -> None:
            try:
                self._store.set(f"wake/{self._index}", b"closed")
            except RuntimeError:  # the store's host is gone: the thread ends on its own
                return
            sent.set()

        threading.Thread(target=wake, name="xtc-side-channel", daemon=True).start()
        if sent.wait(GRACE_S):
            self._thread.join(GRACE_S)


def recursive_doubling(index: int, count: int) -> list[tuple[list[int], list[int]]]:
    """The rounds of an all-reduce by recursive doubling among `count` processes, for process `index`: per
    round, the processes it sends to and receives from. The processes above the largest power of two fold into
    their partners first and get the result from them last: at most log2(count) + 2 rounds."""
    power = 1 << (count.bit_length() - 1)
    extra = count - power
    if index >= power:  # send, then receive the result
        return [([index - power], []), ([], [index - power])]
    rounds: list[tuple[list[int], list[int]]] = []
    if index < extra:
        rounds.append(([], [index + power]))
    mask = 1
    while mask < power:
        rounds.append(([index ^ mask], [index ^ mask]))
        mask <<= 1
    if index < extra:
        rounds.append(([index + power], []))
    return rounds
