"""An in-process `transport.Transport` for one process of a simulated job of `count` processes: it answers each
collective as the other processes would if they passed the same values (the agreements of a healthy save or
restore are symmetric: every process agrees to the same flags and digests), and counts, per collective, the
messages this process sends and receives, their bytes, and the time of the collective's critical path under a
latency-bandwidth model (`alpha_s` per message hop, `bandwidth` bytes/s), by the algorithm the gloo transport
uses at that process count (`transport.traffic`): the reduction by recursive doubling above `RING_MAX` processes
(gloo's ring all-reduce below), the gather a ring, the broadcast a binomial tree. A broadcast's value is the
primary's: simulate process 0 where one is broadcast.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from xla_tensorstore_ckpt.multihost.transport import traffic


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

    def _count(self, kind: str, nbytes: int) -> None:
        messages, total, rounds = traffic(kind, self.index, self.count, nbytes)
        self.tally.add(kind, messages, total, rounds * self._hop(total // messages if messages else 0))

    def reduce_max(self, values: np.ndarray, phase: str) -> np.ndarray:
        self._count("reduce", values.nbytes)
        return values.copy()

    def gather(self, slot: np.ndarray, phase: str) -> np.ndarray:
        self._count("gather", slot.nbytes)
        return np.tile(slot, (self.count, 1))

    def broadcast(self, buffer: np.ndarray, phase: str) -> np.ndarray:
        self._count("broadcast", buffer.nbytes)
        return buffer.copy()
