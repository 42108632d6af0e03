"""Copies of each process's local steps on peer processes (``CheckpointManagerOptions(local_replication=k)``), so
that a host that lost its local disk resumes from its peers instead of the persistent tier. One module per idea:

- `placement`: which k - 1 peers hold a process's copies (`peers_of`: other failure domains);
- `sharing`: de-duplication, the keys of items a data-parallel replica holds identical (`item_keys`), not copied;
- `on_disk`: the copy as stored under ``<local root>/peer_copies/<writer>/`` and its marker (`StepFiles`,
  ``copy.json``: the writer, the step, every file's size and CRC32C), committed by a rename, so a copy cut short
  by a crash never looks committed;
- `file_transfer`: the engine that moves files over a gloo group, in rounds of at most ``peer_round_bytes``
  (`tunables`) per process, the next round read and started while the one before is in flight;
- `replicator`: after a local step commits on every process, each process sends it to its peers and commits the
  copies it receives, on a background thread of its own, over a group of its own (`PeerReplicator`);
- `recovery`: at a restart (`resume`), a process whose local tier lacks the chosen step fetches it from a
  process that holds it (`PeerCopies.fetch`), and one that finds its step damaged fetches the files that differ
  (`PeerCopies.repair`), verified against the copy's CRC32Cs before anything is committed.

The manager's local tier (`managed_tier`, `local_tier`) and `resume` use what is exported here. Everything here
needs the local tier on a file system (a local SSD or RAM disk); the collectives are called by every process in
the same order and block.
"""

from .file_transfer import Transfer, transfer
from .on_disk import COPIES_DIR, COPY_MARKER, StepFiles, copies_root, copy_dir, held_copies, list_files, read_copy
from .placement import peers_of
from .recovery import Holdings, PeerCopies, source_of
from .replicator import PeerReplicator
from .sharing import item_keys

__all__ = ["COPIES_DIR", "COPY_MARKER", "Holdings", "PeerCopies", "PeerReplicator", "StepFiles", "Transfer",
           "copies_root", "copy_dir", "held_copies", "item_keys", "list_files", "peers_of", "read_copy", "source_of",
           "transfer"]
