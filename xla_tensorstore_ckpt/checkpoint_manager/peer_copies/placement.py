"""Where the copies of a process's local steps go (`peers_of`): the k - 1 peers in other failure domains
(``CheckpointManagerOptions(local_replication=k, failure_domain=...)``). Called by `PeerReplicator`, alike on
every process, from the process count alone: no collective.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ...core.errors import UsageError


def peers_of(process: int, count: int, k: int, domain: Callable[[int], Hashable] | None = None) -> list[int]:
    """The k - 1 processes that hold copies of `process`'s local steps: by default ``process + j * count // k``
    (mod count) for j = 1 .. k - 1, the processes farthest from it in index order (whole slices, racks or pods
    apart when indices follow the topology); with `domain` (process index -> failure domain), the first
    processes after it in index order whose domains differ from its own and from each other's. Raises
    `UsageError` if there are not enough."""
    if k <= 1:
        return []
    if k > count:
        raise UsageError(f"local_replication={k} needs at least {k} processes (the job has {count})")
    if domain is None:
        peers = [(process + j * count // k) % count for j in range(1, k)]
        return list(dict.fromkeys(peers))
    used, peers = {domain(process)}, []
    for offset in range(1, count):
        other = (process + offset) % count
        if domain(other) not in used:
            used.add(domain(other))
            peers.append(other)
            if len(peers) == k - 1:
                return peers
    raise UsageError(f"local_replication={k}: process {process} finds only {len(peers)} processes in other failure "
                     f"domains than its own ({domain(process)!r}); {k - 1} are needed")
