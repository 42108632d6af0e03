"""Frozen, keyword-only option records. They validate in ``__post_init__`` and never rewrite their fields."""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import formats
from .arrays import zstd
from .core import layout
from .core.events import Listener, check_listeners

_MiB = 1 << 20


def _check_int(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How an item is written.

    use_ocdbt: keep an item's arrays in one OCDBT key-value store (Orbax's default): a few large files per
        process instead of one or more per array, which is what makes thousands of small tensors cheap on
        object stores. Off: one zarr directory per array (also readable by Orbax, with ``use_ocdbt=False``).
    fsync: sync every chunk file, metadata file and directory to stable storage before the save returns
        (local disk; object stores are durable once a write returns). Off trades crash durability for speed.
    direct_io: on a local file system, with OCDBT, write the chunk data around the page cache (``O_DIRECT``,
        `arrays.direct_ocdbt`; data files under 8 MiB stay buffered): no copy into the page cache and no fresh
        memory for it (1 GiB saved here in 1.4 s instead of 4.5 s). Off: through tensorstore and the page
        cache, which keeps a just-saved checkpoint cached for a read right after it.
    page_cache: with `direct_io`, write the chunk data through the page cache instead (the same writing lanes,
        buffered writes): a restore right after the save, or a restart on the same host, reads it from memory,
        for the copy into the page cache (and the writeback an fsync then waits for). A manager sets it for its
        local tier (`CheckpointManagerOptions.local_page_cache`); off by default (docs/multi-tier.md).
    host_batch_bytes: device bytes fetched to host per torch_xla call; writes of one batch overlap the fetch
        of the next. Bounds the replicas held at once when a tensor is partially replicated.
    single_file_max_bytes: without OCDBT, an array of at most this size whose chunks are all written by this
        process is stored as one file (zarr's sharding codec, a checksum per chunk still). Larger arrays keep
        one file per chunk, which tensorstore writes without assembling the whole array in memory.
    split_bytes: in a job of several processes, a tensor of at least this size that every process holds whole
        (unsharded or replicated) is cut into one chunk per process along its first dimension, so that all
        processes share its writing instead of one writing it all.
    listeners: told of each phase of a save (`events`: what `xtc.save`, or a manager with these options, does).
    format: the on-disk format written (`formats.WRITERS`; "v2", Orbax's schema with this library's inside, is
        the only one today). A manager's steps are written in its `save_options`' format.
    compression: None (chunks stored raw) or "zstd": every chunk compressed by zstd, the codec chain Orbax writes
        (``bytes`` little endian, ``zstd`` without its own checksum), followed by this library's ``crc32c``, which
        then covers the compressed bytes (`arrays.zstd`). Orbax, tensorstore and zarr-python read it; this
        library's own direct chunk reads decompress it (`arrays.local_chunks`). Off by default: trained float32
        weights and AdamW moments shrink only to 0.87-0.93 of their size (bfloat16 weights to 0.78), for 2-2.4x a
        save's CPU time and more for a warm restore's (docs/compression.md).
    compression_level: zstd's level, 1-22 (3, tensorstore's default, is what Orbax writes); only with
        compression="zstd".
    coordination_timeout_s: in a job of several processes (`xtc.save`), the deadline of each collective phase
        of the save (choosing the writers, finishing the writes, the commit): past it every live process raises
        `CoordinationTimeoutError` naming the phase and the processes that did not arrive (a dead process is
        usually named at once, through its closed connection). None: the coordinator's own (600 s for the one
        `xtc.save` creates), which also bounds it. A manager's saves take its
        `CheckpointManagerOptions.coordination_timeout_s`.
    incremental: set per save by a manager with ``incremental`` on (`incremental.saving.BaseStep`): chunks
        unchanged since that base step are referenced, not written. None (the default): a standalone item.
    """

    use_ocdbt: bool = True
    fsync: bool = True
    direct_io: bool = True
    page_cache: bool = False
    host_batch_bytes: int = 64 * _MiB
    single_file_max_bytes: int = 4 * _MiB
    split_bytes: int = 16 * _MiB
    listeners: tuple[Listener, ...] = ()
    format: str = formats.WRITE_FORMAT
    compression: str | None = None
    compression_level: int = zstd.DEFAULT_LEVEL
    coordination_timeout_s: float | None = None
    incremental: Any = None

    @property
    def zstd_level(self) -> int | None:
        """The zstd level chunks are compressed at; None: stored raw."""
        return self.compression_level if self.compression == zstd.NAME else None

    def __post_init__(self) -> None:
        check_listeners(self.listeners, "SaveOptions.listeners")
        if self.compression not in (None, zstd.NAME):
            raise ValueError(f"compression must be None or {zstd.NAME!r}, got {self.compression!r}")
        level = self.compression_level
        if isinstance(level, bool) or not isinstance(level, int) or level not in zstd.LEVELS:
            raise ValueError(f"compression_level must be an integer from {zstd.LEVELS.start} to "
                             f"{zstd.LEVELS.stop - 1}, got {level!r}")
        if self.compression is None and level != zstd.DEFAULT_LEVEL:
            raise ValueError(f"compression_level={level} needs compression={zstd.NAME!r}")
        formats.writer(self.format)  # raises ValueError naming the formats written
        for name in ("use_ocdbt", "fsync", "direct_io", "page_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("host_batch_bytes", self.host_batch_bytes)
        _check_int("single_file_max_bytes", self.single_file_max_bytes, minimum=0)
        _check_int("split_bytes", self.split_bytes)
        _check_timeout(self.coordination_timeout_s)


@dataclass(frozen=True, kw_only=True)
class RestoreOptions:
    """How an item is read.

    read_batch_bytes: bytes read per batch (a tensor larger than this is a batch of its own); the reads of one
        batch overlap placing the previous one on the devices, so host memory holds about two batches beyond
        the restored tensors (data bound for XLA devices is read into two buffers of this size, reused batch
        after batch: `core.buffers`). Smaller batches overlap better (a 1 GiB resume: 1.11-1.25 s with 256 MiB,
        1.03 s with 64 MiB, on 2 cores).
    max_host_bytes: if set, host memory stays within it (or within twice one tensor's local shards, if
        larger): batches are at most a quarter of it, and the next is read ahead only while two batches and
        torch_xla's copies of two tensors (one being placed, one on its way) fit; a tensor larger than a batch
        is read into buffers of its own, with the batch buffers given up meanwhile; each tensor's transfer to its
        devices is waited for before the one after the next is placed (torch_xla holds a host copy until
        then); after a batch the freed host memory is returned to the OS if the process has grown too much for
        the next one, so that its resident memory stays within the budget too, short of the restore's own
        bookkeeping (a 2.4 GiB model onto CPU devices with 256 MiB: +266 MiB instead of +846 MiB, medians;
        benchmarks/bench_hf_import.py).
    single_replica_reads: in a job of several processes restoring the same item together (every process must
        then call the restore), each stored chunk is read from storage by one process only, the processes that
        need it balanced by bytes, and sent to the others that need parts of it over the job's process group
        (`replica_reads`): a job of R data-parallel replicas fetches its checkpoint once instead of R times.
        Errors (a damaged chunk, a process that dies) are raised on every process. Processes restoring from
        places of their own (their local tiers) read on their own, as without it.
    broadcast_max_bytes: with single-replica reads, the most bytes of data a batch holds on a process while its
        parts travel (batches are at most this and `read_batch_bytes`).
    listeners: told of each restore's plan and end (`events`).
    coordination_timeout_s: with single-replica reads in a job of several processes, the deadline of each
        collective phase of the restore (the plan's agreement, each batch's, the last): past it every live
        process raises `CoordinationTimeoutError` naming the phase and the processes that did not arrive (a
        dead process is usually named at once). None: the coordinator's own (600 s by default; a manager's
        `coordination_timeout_s`), which also bounds it.
    """

    read_batch_bytes: int = 64 * _MiB
    max_host_bytes: int | None = None
    single_replica_reads: bool = False
    broadcast_max_bytes: int = 256 * _MiB
    listeners: tuple[Listener, ...] = ()
    coordination_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_listeners(self.listeners, "RestoreOptions.listeners")
        _check_timeout(self.coordination_timeout_s)
        _check_int("read_batch_bytes", self.read_batch_bytes)
        _optional_int("max_host_bytes", self.max_host_bytes, 1)
        _check_int("broadcast_max_bytes", self.broadcast_max_bytes)
        if not isinstance(self.single_replica_reads, bool):
            raise TypeError(f"single_replica_reads must be a bool, got {self.single_replica_reads!r}")


def _check_timeout(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"coordination_timeout_s must be None or a positive number of seconds, got {value!r}")


def _optional_int(name: str, value: object, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be None or an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
    """How a `CheckpointManager` decides, keeps and writes steps.

    save_interval_steps: `should_save(step)` is true every N steps (what a trainer's `save_steps` maps to);
        None saves only on `save_on_steps`, on `force=True` or on preemption.
    save_on_steps: further steps to save at.
    max_to_keep, keep_period, best_fn, best_mode, keep_checkpoints_without_metrics: retention (`policies`:
        `LatestN`, or `BestN` by `best_fn`, any of them with `EveryNSteps`); the newest committed step is never
        deleted.
    step_prefix: step directories are named ``<prefix>_<step>`` instead of ``<step>``.
    create: create the root on the first save; if False the root must exist.
    async_save: `save` returns once shards are copied off the devices; the rest runs in the background.
    max_pending_saves: saves in flight at once; a new save waits for the oldest before staging.
    max_host_bytes: cap on staged host memory per save; a larger state is streamed (the save blocks longer).
    save_rng: save the torch, Python, numpy and XLA RNG states with each step (restored by `restore`).
    save_on_preemption: install a SIGTERM handler (the manager must be created on the main thread); after a
        SIGTERM the next `save` call saves whatever the interval says and waits for the commit, and
        `reached_preemption(step)` tells the training loop to exit.
    coordination_timeout_s: in a job of several processes, the deadline of each collective phase of a save or
        restore (the timeout of the manager's process groups): past it every live process raises
        `CoordinationTimeoutError` naming the phase and the processes that did not arrive (a dead process is
        usually named at once, through its closed connection). `restore_options.coordination_timeout_s`, if
        set, shortens it for the reads of a restore.
    lock_timeout_s: a manager owns its root through ``<root>/_MANAGER_LOCK`` (refreshed at every commit). Another
        manager finding a live owner's lock only reads (restores, lists) and refuses to save. A lock is stale —
        taken over — when its process is gone (same host) or it has not been refreshed for this long (other hosts).
    on_commit: called with the step number once a step is committed (its marker durable), on every process;
        in async mode on the background thread. What it raises is reported like a failed background save (the
        step stays committed). `all_steps()` and `latest_step()` show the same commits. A trainer that must
        know what survives a kill waits for this, or calls `wait_until_finished()`, before it exits.
    local_directory: a second, fast tier on each host (local SSD, RAM disk; one directory per process): steps
        are also saved there, every `local_save_interval_steps`, and kept `local_max_to_keep` at a time; the
        root given to the manager (`directory`) is then the persistent tier. Each process writes every shard it
        holds into its own local directory and commits it on its own; `restore("latest")` takes the newest step
        every process has intact locally if it is at least as new as the persistent tier's newest, else the
        persistent one. A step due for both tiers is copied off the devices once. See docs/multi-tier.md.
    local_save_interval_steps: the local tier's save interval (None: only `local_save_on_steps`, `force=True`
        and preemption saves).
    local_save_on_steps: further steps to save to the local tier.
    local_max_to_keep: how many local steps each process keeps (None: all).
    on_local_commit: like `on_commit`, for a step committed in this process's local tier (on the local tier's
        background thread in async mode).
    local_replication: k > 1 keeps each local step on k processes: after it commits, each process sends its
        step's files to k - 1 peers in the background (never in `save()`), which commit them as peer copies
        (a marker of their own, every file's CRC32C); `restore("latest")` then brings a wiped or damaged host's
        step from a peer instead of falling back to the persistent tier. Needs a local tier on a file system
        and at least k processes. See docs/multi-tier.md.
    local_page_cache: the local tier writes its steps through the page cache (`SaveOptions.page_cache`), so that
        a restart on the same host, or a restore right after a save, reads its newest step from memory; the
        persistent tier writes around it (``direct_io``). On by default (docs/multi-tier.md).
    local_failure_domain: with local_replication, the failure domain of a process (index -> any hashable: a
        host, rack, slice); peers are chosen in other domains than a process's own and each other's. None: the
        processes ``index + j * count // k``.
    save_decision, preservation, local_save_decision, local_preservation: policy objects (`policies`) for when
        each tier saves and which of its steps it keeps, your own included; where given they replace the flat
        fields above for that tier (`save_interval_steps`, `save_on_steps`; `max_to_keep`, `keep_period`,
        `best_fn`, `best_mode`, `keep_checkpoints_without_metrics`; the `local_*` ones), which are shorthand.
    listeners: told of every phase of the manager's saves and restores, on both tiers (`events`); those of
        `save_options` and `restore_options` are told too. `on_commit` and `on_local_commit` are two such
        listeners (`events.CommitCallback`).
    save_options, restore_options: item-level I/O options.
    incremental: each step stores only the chunks that changed since the tier's newest committed step and
        references the others (docs/incremental.md); retention keeps every step a kept step references. Off by
        default: every step standalone, which Orbax reads whole (`xtckpt convert --to step` makes an
        incremental step standalone). With ``local_replication > 1`` a step's peer copies are its own files
        only; the peers keep its bases' copies (docs/multi-tier.md).
    delta: with ``incremental``, a changed chunk is stored as the zstd frame of its bitwise XOR with the chunk's
        anchor (the step that last wrote it whole) where that is at most half its size (lossless: RL-style steps
        that change a few percent of bf16 weights); a restore reads the anchor's chunk and applies that one
        frame. Off by default.
    max_chain: with ``delta``, a chunk whose anchor lies this many saves back is written whole again (a new
        anchor for that chunk): bounds how far a delta's frame grows and how long its anchor is kept. Default 8
        (an RL-style frame after 8 saves: 1.34x the first's; docs/incremental.md).
    anchor_every: with ``incremental``, every this many saves of a tier is a full anchor step: every chunk
        written, nothing referenced, so retention can let every older step go. None (the default): no full
        anchor beyond the first; a frozen chunk stays referenced from the step that wrote it (a restore reads it
        from there at no extra cost) and `max_chain` bounds the deltas.
    """

    save_interval_steps: int | None = 100
    save_on_steps: frozenset[int] = field(default_factory=frozenset)
    max_to_keep: int | None = 3
    keep_period: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: str = "min"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = None
    create: bool = True
    async_save: bool = True
    max_pending_saves: int = 1
    max_host_bytes: int | None = None
    save_rng: bool = True
    save_on_preemption: bool = False
    coordination_timeout_s: float = 600.0
    lock_timeout_s: float = 1800.0
    on_commit: Callable[[int], None] | None = None
    local_directory: str | os.PathLike | None = None
    local_save_interval_steps: int | None = None
    local_save_on_steps: frozenset[int] = field(default_factory=frozenset)
    local_max_to_keep: int | None = 2
    on_local_commit: Callable[[int], None] | None = None
    local_replication: int = 1
    local_page_cache: bool = True
    local_failure_domain: Callable[[int], Hashable] | None = None
    save_options: SaveOptions = field(default_factory=SaveOptions)
    restore_options: RestoreOptions = field(default_factory=RestoreOptions)
    save_decision: Any = None
    preservation: Any = None
    local_save_decision: Any = None
    local_preservation: Any = None
    listeners: tuple[Listener, ...] = ()
    incremental: bool = False
    delta: bool = False
    max_chain: int = 8
    anchor_every: int | None = None

    def __post_init__(self) -> None:
        check_listeners(self.listeners, "CheckpointManagerOptions.listeners")
        for name, method in (("save_decision", "should_save"), ("preservation", "keep"),
                             ("local_save_decision", "should_save"), ("local_preservation", "keep")):
            value = getattr(self, name)
            if value is not None and not callable(getattr(value, method, None)):
                raise ValueError(f"{name} must be a policy with a {method}() method (see policies), got {value!r}")
        _optional_int("save_interval_steps", self.save_interval_steps, 1)
        _optional_int("max_to_keep", self.max_to_keep, 1)
        _optional_int("keep_period", self.keep_period, 1)
        _optional_int("max_host_bytes", self.max_host_bytes, 1)
        _optional_int("max_pending_saves", self.max_pending_saves, 1)
        _optional_int("local_save_interval_steps", self.local_save_interval_steps, 1)
        _optional_int("local_max_to_keep", self.local_max_to_keep, 1)
        if self.local_directory is not None and (not isinstance(self.local_directory, (str, os.PathLike))
                                                 or not os.fspath(self.local_directory)):
            raise ValueError(f"local_directory must be a path or URL, got {self.local_directory!r}")
        if self.local_directory is None and (self.local_save_interval_steps is not None or self.local_save_on_steps):
            raise ValueError("local_save_interval_steps and local_save_on_steps need local_directory")
        if self.local_replication is None:
            raise ValueError("local_replication must be an integer >= 1, got None")
        _optional_int("local_replication", self.local_replication, 1)
        if self.max_chain is None:
            raise ValueError("max_chain must be an integer >= 1, got None")
        _optional_int("max_chain", self.max_chain, 1)
        _optional_int("anchor_every", self.anchor_every, 1)
        if self.delta is True and not self.incremental:
            raise ValueError("delta needs incremental")
        if self.local_replication > 1 and self.local_directory is None:
            raise ValueError("local_replication needs local_directory")
        if self.local_failure_domain is not None and not callable(self.local_failure_domain):
            raise ValueError("local_failure_domain must be callable (process index -> failure domain)")
        for name in ("coordination_timeout_s", "lock_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("save_on_steps", "local_save_on_steps"):
            steps = getattr(self, name)
            if not isinstance(steps, frozenset) or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
                raise ValueError(f"{name} must be a frozenset of step numbers, got {steps!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        for name in ("best_fn", "on_commit", "on_local_commit"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable")
        if self.step_prefix is not None and not layout.is_safe_relative_path(self.step_prefix,
                                                                                       single=True):
            raise ValueError(f"step_prefix {self.step_prefix!r} is not a plain name")
        for name in ("create", "async_save", "save_rng", "save_on_preemption", "keep_checkpoints_without_metrics",
                     "incremental", "delta", "local_page_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
