"""How arrays travel between two processes (`Coordinator.exchange`): the flat byte buffers a list of arrays is sent and
received in (`message_buffers`: the small ones packed into one, each large one on its own, received into directly
where it is contiguous), and the raw copy out of them (`copy_into`). Both sides cut alike, by sizes alone. Called by
`distributed` and by single-replica reads (`restores.replica_reads`); no collective here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Arrays of at least this size go between processes as messages of their own; smaller ones share one.
DIRECT_BYTES = 1 << 20


def copy_into(destination: np.ndarray, source: np.ndarray) -> None:
    """Copy the elements of `source` into `destination` (same shape and dtype) as raw integers of their width:
    numpy copies ml_dtypes' types (bfloat16, float8) element by element otherwise."""
    raw = np.dtype(f"u{source.dtype.itemsize}") if source.dtype.itemsize in (1, 2, 4, 8) else source.dtype
    destination.view(raw)[...] = source.view(raw)


def message_buffers(arrays: Sequence[np.ndarray], *, copy: bool) -> tuple[list[np.ndarray], list]:
    """The flat byte buffers `arrays` travel in: the small ones packed into one (first), then each large one.
    Sending (`copy`): the buffers hold the data. Receiving: large contiguous arrays are received into
    directly; the rest into new buffers, returned with their destinations to copy into after the wait.
    Both sides cut alike: by sizes alone."""
    arrays = [a for a in arrays if a.nbytes]
    small = [a for a in arrays if a.nbytes < DIRECT_BYTES]
    messages, pending = [], []
    if small:
        packed = np.empty(sum(a.nbytes for a in small), dtype=np.uint8)
        offset = 0
        for a in small:
            part = packed[offset:offset + a.nbytes]
            if copy:
                copy_into(part.view(a.dtype).reshape(a.shape), a)
            else:
                pending.append((part, a))
            offset += a.nbytes
        messages.append(packed)
    for a in arrays:
        if a.nbytes < DIRECT_BYTES:
            continue
        if a.flags.c_contiguous:
            messages.append(a.reshape(-1).view(np.uint8))
        elif copy:
            messages.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        else:
            buffer = np.empty(a.nbytes, dtype=np.uint8)
            pending.append((buffer, a))
            messages.append(buffer)
    return messages, pending
