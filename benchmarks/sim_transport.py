"""An in-process `transport.Transport` for one process of a simulated job of `count` processes: it answers each
collective as the other processes would if they passed the same values (the agreements of a healthy save or
restore are symmetric: every process agrees to the same flags and digests), and counts, per collective, the
messages this process sends and receives, their bytes, and the time of the collective's critical path under a
latency-bandwidth model (`alpha_s` per message hop, `bandwidth` bytes/s), by the algorithm the gloo transport
uses at that process count (transport.py): the reduction by recursive doubling above `RING_MAX` processes
(gloo's ring all-reduce below), the gather a ring, the broadcast a binomial tree. A broadcast's value is the
primary's: simulate process 0 where one is broadcast.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from xla_tensorstore_ckpt.transport import RING_MAX, recursive_doubling


@dataclass
class Tally:
    messages: int = 0  # sent + received by this process
    nbytes: int = 0  # sent + received by this process
    seconds: float = 0.0  # modelled critical path of the collectives
    collectives: Counter = field(default_factory=Counter)  # kind -> count

    def add(self, kind: str, messages: int, nbytes: int, seconds: float) -> None:
        self.messages += messages
        self.nbytes += nbytes
        self.seconds += seconds
        self.collectives[kind] += 1


class SimulatedTransport:
    """See the module. Blocking only in name: every call returns at once."""

    def __init__(self, index: int, count: int, alpha_s: float = 1e-4, bandwidth: float = 12.5e9):
        self.index, self.count, self.alpha_s, self.bandwidth = index, count, alpha_s, bandwidth
        self.tally = Tally()

    def _hop(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bandwidth

    def reduce_max(self, values: np.ndarray, phase: str) -> np.ndarray:
        n = values.nbytes
        if self.count <= RING_MAX:  # ring: reduce-scatter then all-gather, 2 (P - 1) steps of a piece each
            steps = 2 * (self.count - 1)
            piece = math.ceil(n / self.count)
            self.tally.add("reduce", 2 * steps, 2 * steps * piece, steps * self._hop(piece))
        else:
            rounds = recursive_doubling(self.index, self.count)
            messages = sum(len(sends) + len(receives) for sends, receives in rounds)
            self.tally.add("reduce", messages, messages * n, len(rounds) * self._hop(n))
        return values.copy()

    def gather(self, slot: np.ndarray, phase: str) -> np.ndarray:
        steps = self.count - 1  # ring: each step passes one process's slot on
        self.tally.add("gather", 2 * steps, 2 * steps * slot.nbytes, steps * self._hop(slot.nbytes))
        return np.tile(slot, (self.count, 1))

    def broadcast(self, buffer: np.ndarray, phase: str) -> np.ndarray:
        depth = math.ceil(math.log2(self.count)) if self.count > 1 else 0
        children = _binomial_children(self.index, self.count)
        received = 1 if self.index else 0
        self.tally.add("broadcast", children + received, (children + received) * buffer.nbytes,
                       depth * self._hop(buffer.nbytes))
        return buffer.copy()


def _binomial_children(index: int, count: int) -> int:
    """How many processes `index` sends to in a binomial-tree broadcast from process 0."""
    lowest = index & -index if index else 1 << max(0, (count - 1).bit_length())
    children, step = 0, 1
    while step < lowest and index + step < count:
        children += 1
        step <<= 1
    return children
