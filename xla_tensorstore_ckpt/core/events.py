"""What saves and restores do, phase by phase, told to listeners: metrics, logs, dashboards and tests read the
same events.

A listener is any callable taking an `Event`; pass them as ``CheckpointManagerOptions(listeners=...)`` (every
phase of the manager's saves and restores) or ``SaveOptions(listeners=...)`` / ``RestoreOptions(listeners=...)``
(`xtc.save` / `xtc.restore`). Events of a save, in order:

* ``save_started``: the step is due (`details["tiers"]`: the tiers it goes to).
* ``save_staged`` (asynchronous saves): the shards are off the devices and the caller may go on (`seconds`:
  the time `save` blocked for; `nbytes`: host bytes this process staged).
* ``save_written`` (per tier): this process's writes are durable (`seconds` since staging; `nbytes` written
  by this process, as chunk bytes before any compression; `files`: files it created, or OCDBT stores;
  `details["chunks"]` and `details["chunk_bytes"]`: the chunks whose writes it issued and their bytes before
  compression (an incremental save's only those it wrote, not those the base holds);
  `details["peak_staged_bytes"]`: where staging and writing interleave (synchronous saves, asynchronous ones
  with `max_host_bytes`), the most staged bytes whose writes were not yet waited for, else 0; for an
  incremental save, `details["written_whole"]`: ``"<item>/<array>"`` -> why, each array this process wrote whole
  although the base step has it, such as a dtype or chunk shape change).
* ``save_committed`` (per tier): the step is committed (`seconds`: the commit itself; `details["total_seconds"]`
  from the start of the save; `details["agreements"]`: what each collective phase of the save cost this process,
  by phase name: ``seconds``, ``collectives``, ``rounds``, ``messages`` and ``bytes`` sent and received,
  `Coordinator.take_costs`; empty with one process);
  for an incremental step `details["bases"]`, the steps holding chunks it
  references; `details["kept_as_bases"]`: step -> the kept steps referencing it, for each step retention keeps
  only because kept steps reference it).
* ``retention_removed`` (per tier): steps retention deleted after a commit (`details["steps"]`).
* ``peer_copies_started`` (local tier, with `local_replication`; on the replication thread): the files of a
  committed local step start moving between the peers (`nbytes`: bytes this process is to receive;
  `details["sent_bytes"]`: bytes it is to send).
* ``peer_copies_committed`` (local tier, with `local_replication`; on the replication thread): the copies of a
  local step are committed on the peers that got them (`nbytes`: bytes this process received;
  `details["sent_bytes"]`, `details["holders"]`: writer -> the processes now holding its copy).

and of a restore (per item): ``restore_planned`` (`nbytes` this process will read, `details["arrays"]`,
`details["chunks"]`: stored chunks its reads touch), ``restore_batch_issued`` when the reads of a batch start (`nbytes`;
`details`: ``batch``, ``keys``, ``buffers``: ``"batch"`` or ``"own"``, ``into_targets``: the keys read straight into
their target's memory), ``restore_built`` as each array's value is built and placed (`nbytes` read for it; `details`:
``key``, ``batch``, ``target``: its tensor kind), under `max_host_bytes` ``restore_batch_settled`` once a batch is built
and its transfers to the devices are waited for (`details`: ``batch``, ``returned_memory``: whether the freed host
memory was then returned to the OS, `core.host_memory.keep_within`), and ``restore_finished`` (`seconds`, `nbytes` read;
`details["paths"]`: which paths the reads took — ``batches``, ``read_ahead``, ``batch_buffer_bytes`` (read into the two
reused batch buffers, `buffers.Carved`), ``batch_buffer_allocations`` and ``batch_buffer_frees`` (their buffers
allocated and freed), ``own_buffer_bytes``, ``into_target_bytes``, ``memory_returns`` (batches after which freed host
memory was returned to the OS), and of this process's array reads meanwhile (`arrays.base.PathCounts`) ``cache_probes``,
``cached_probes``, ``nowait_probes`` (probes that read one byte with ``RWF_NOWAIT``, where ``cachestat`` could not count
the cached pages), ``direct_reads``/``direct_bytes`` (local reads around the page cache),
``buffered_reads``/``buffered_bytes`` (through it), ``chunks_inline`` and ``chunks_on_workers`` (chunks this library
read from local files itself, on the restoring thread or on its reading threads), ``tensorstore_regions`` (regions read
through tensorstore), ``files_opened``/``files_closed`` (data files those chunk reads opened and closed), and of its
storage calls (`storage.CALLS`) ``whole_reads``/``whole_read_bytes`` (whole files, `Location.read`) and
``ranged_reads``/``ranged_read_bytes`` (byte ranges, `Location.read_range`); `details["storage_bytes"]`: what the reader
fetched from storage for them, None where it cannot tell; with single-replica reads also `details["plan"]`,
``"derived"`` from the shardings or ``"gathered"``, and `details["agreements"]`: each collective phase's cost, as for
``save_committed``); with `local_replication`, ``peer_fetched`` when a local step (or its damaged files) came from a
peer before the restore (`nbytes` received, `details["source"]`: the process it came from, `details["repair"]`).

Listeners are called on the thread doing the work (a background commit thread for asynchronous saves), one
event at a time per save or restore. A listener that raises fails what it listens to, like any error of that
phase: at once for a blocking call, at the next call into the manager for a background commit (the step stays
committed: listeners run after the commit point). Built in: `LogListener`, `JsonLinesListener`,
`TensorBoardListener` (needs the ``tensorboard`` package: ``pip install xla_tensorstore_ckpt[tensorboard]``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

SAVE_STARTED = "save_started"
SAVE_STAGED = "save_staged"
SAVE_WRITTEN = "save_written"
SAVE_COMMITTED = "save_committed"
RETENTION_REMOVED = "retention_removed"
RESTORE_PLANNED = "restore_planned"
RESTORE_FINISHED = "restore_finished"
RESTORE_BATCH_ISSUED = "restore_batch_issued"
RESTORE_BUILT = "restore_built"
RESTORE_BATCH_SETTLED = "restore_batch_settled"
PEER_COPIES_STARTED = "peer_copies_started"
PEER_COPIES_COMMITTED = "peer_copies_committed"
PEER_FETCHED = "peer_fetched"
KINDS = (SAVE_STARTED, SAVE_STAGED, SAVE_WRITTEN, SAVE_COMMITTED, RETENTION_REMOVED, RESTORE_PLANNED,
         RESTORE_BATCH_ISSUED, RESTORE_BUILT, RESTORE_BATCH_SETTLED, RESTORE_FINISHED, PEER_COPIES_STARTED,
         PEER_COPIES_COMMITTED,
         PEER_FETCHED)
PER_ARRAY_KINDS = frozenset({RESTORE_BUILT})  # one per array: `LogListener` logs them at DEBUG


@dataclass(frozen=True)
class Event:
    """One phase of a save or restore on this process. `tier` is ``"local"`` or ``"persistent"`` for a
    manager's, None for `xtc.save` / `xtc.restore`; `item` names the item (None: the whole step); `path` is
    where (the step or item directory); `time` is when it was emitted (seconds since the epoch)."""

    kind: str
    step: int | None = None
    tier: str | None = None
    item: str | None = None
    path: str | None = None
    seconds: float | None = None
    nbytes: int | None = None
    files: int | None = None
    process: int = 0
    time: float = 0.0
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        """`nbytes` per `seconds`, in GB/s (10^9 bytes), where both are known."""
        if self.nbytes is None or not self.seconds:
            return None
        return self.nbytes / self.seconds / 1e9

    def to_json(self) -> dict:
        doc = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v != {}}
        if self.gbps is not None:
            doc["gbps"] = self.gbps
        return doc


class Listener(Protocol):
    def __call__(self, event: Event) -> None: ...


@dataclass(frozen=True)
class Emitter:
    """The listeners of one operation, with what its events share (step, tier, item, path, process). Free when
    nobody listens; immutable (`bound` gives a copy with more fields set)."""

    listeners: tuple[Listener, ...] = ()
    step: int | None = None
    tier: str | None = None
    item: str | None = None
    path: str | None = None
    process: int = 0

    def bound(self, **fields: Any) -> Emitter:
        return dataclasses.replace(self, **fields)

    def emit(self, kind: str, **fields: Any) -> None:
        """Tell every listener. Raises what a listener raises."""
        if not self.listeners:
            return
        shared = {"step": self.step, "tier": self.tier, "item": self.item, "path": self.path,
                  "process": self.process}
        event = Event(kind, **{**shared, **fields}, time=time.time())
        for listener in self.listeners:
            listener(event)


def check_listeners(value: Any, where: str) -> None:
    """`ValueError` naming `where` unless `value` is a tuple of listeners (callables); for the options."""
    if not isinstance(value, tuple) or not all(callable(listener) for listener in value):
        raise ValueError(f"{where} must be a tuple of listeners (callables taking an Event), got {value!r}"[:300])


class CommitCallback:
    """Calls `callback(step)` for each step committed in `tier` (what ``on_commit`` / ``on_local_commit`` are)."""

    def __init__(self, callback: Callable[[int], None], tier: str):
        self.callback, self.tier = callback, tier

    def __call__(self, event: Event) -> None:
        if event.kind == SAVE_COMMITTED and event.tier == self.tier and event.step is not None:
            self.callback(event.step)


class LogListener:
    """One log line per event on `logger` (``xla_tensorstore_ckpt`` by default) at `level`."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO):
        self.logger = logger or logging.getLogger("xla_tensorstore_ckpt")
        self.level = level

    def __call__(self, event: Event) -> None:
        level = logging.DEBUG if event.kind in PER_ARRAY_KINDS else self.level
        if not self.logger.isEnabledFor(level):
            return
        parts = [event.kind]
        for name in ("step", "tier", "item"):
            value = getattr(event, name)
            if value is not None:
                parts.append(f"{name}={value}")
        if event.seconds is not None:
            parts.append(f"{event.seconds:.3f}s")
        if event.nbytes is not None:
            parts.append(f"{event.nbytes}B")
        if event.gbps is not None:
            parts.append(f"{event.gbps:.2f}GB/s")
        if event.files is not None:
            parts.append(f"files={event.files}")
        parts += [f"{k}={v}" for k, v in event.details.items()]
        self.logger.log(level, " ".join(parts))


class JsonLinesListener:
    """Appends each event as one JSON object per line to the local file `path` (created if missing), flushed
    line by line; thread-safe. `close` closes the file (it reopens on the next event)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._file = None

    def __call__(self, event: Event) -> None:
        line = json.dumps(event.to_json(), default=str) + "\n"
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across events
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class TensorBoardListener:
    """Scalars in a TensorBoard log directory: per event kind and tier, ``seconds``, ``bytes`` and ``GB/s`` at
    the event's step (``checkpoint/persistent/save_committed/seconds``). Needs the ``tensorboard`` package;
    `ImportError` naming it otherwise."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("TensorBoardListener needs the tensorboard package: "
                              "pip install 'xla_tensorstore_ckpt[tensorboard]'") from exc
        self._writer = SummaryWriter(log_dir)
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        prefix = f"checkpoint/{event.tier or 'item'}/{event.kind}"
        values = {"seconds": event.seconds, "bytes": event.nbytes, "GB_per_s": event.gbps}
        with self._lock:
            for name, value in values.items():
                if value is not None:
                    self._writer.add_scalar(f"{prefix}/{name}", value, global_step=event.step or 0)
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()
