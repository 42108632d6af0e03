"""Agreement between the processes of a job: `Coordinator` (`distributed`: reductions, gathers and broadcasts of
records, one collective each; primary-acts/everyone-agrees; point-to-point exchanges), the arrays of an exchange
as messages (`messages`), one writer or reader per chunk several processes hold, alike on every process
(`balancing`), the `Transport` over a gloo group with per-collective deadlines and silent processes named
(`transport`), and the pickle-free encoding of the records processes exchange (`wire`).

Imports only `core`; the save and restore paths, the manager and `dcp_storage` build on it. Which process reads
or writes what is planned where it is used: `saves.writer_plans`, `restores.replica_plans`; peer copies of local
steps are the manager's (`checkpoint_manager.peer_copies`).
"""
