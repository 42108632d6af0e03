"""How many threads each kind of work runs on: decided here and nowhere else. Modules ask for a long-lived pool
(`pool`) or for a count (`count`, for a pool that lives as long as one call); none sizes a thread pool itself.

The kinds, by what their threads mostly wait for:

* ``storage_requests`` (16): requests that wait on a server or on the disk's queue — object-store round trips,
  fsyncs (many at once let the file system commit its journal once), copies between locations, a foreign
  format's many small files (Orbax arrays opened, DCP values, safetensors headers);
* ``local_reads`` (4): reads of local chunk files or byte ranges that checksum or copy what they read (numpy and
  CRC32C release the GIL): two for the checksums of a 2-core host, two more to keep the disk busy;
* ``dcp_pieces`` (8): a DCP item's pieces, located, read and copied into place (a mix of the two above);
* ``cpu`` (2): numpy work on data already read (delta frames rebuilt with zstd): the cores;
* ``binning`` (1): numpy work beside the reads that feed it (`views.histogram` bins chunks as the next ones are
  read): the reads bound it, and their checksums need a core of the two (`stats` over the 2.42 GiB model: 2.4-2.5 s
  with one binning thread, 2.8-2.9 s with two);
* ``ordered`` (1): work whose order is its meaning — commits of asynchronous saves, write-back of finished chunk
  files, a direct store's batches.

The numbers are the ones docs/performance.md measured each kind with; change them here, where the others show.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

COUNTS = {"storage_requests": 16, "local_reads": 4, "dcp_pieces": 8, "cpu": 2, "binning": 1, "ordered": 1}


def count(kind: str, items: int | None = None) -> int:
    """How many threads work of `kind` (a key of `COUNTS`) runs on; with `items`, no more than there are items
    (at least one). Called anywhere; never blocks; raises KeyError for an unknown kind (a programming error)."""
    threads = COUNTS[kind]
    return threads if items is None else max(1, min(threads, items))


def pool(kind: str, name: str) -> ThreadPoolExecutor:
    """A new pool of `count(kind)` threads named `name`-N, for a module that keeps it for the process's life.
    Called at import; never blocks."""
    return ThreadPoolExecutor(count(kind), thread_name_prefix=name)
