"""An item's restore: what each array reads and in which batches, with the host memory they need (`read_jobs`); match,
plan, read, place (`restoring`), the reads batch by batch and the values built (`read_batches`); the two reused batch
buffers device-bound data is read into (`core.buffers`); single-replica reads, their plan derived alike on every process
(`replica_plans`) and the reads and broadcasts (`replica_reads`); and the dry run from metadata alone
(`restore_plan`: ``xtc.plan_restore``, ``xtckpt plan``).

Called by `checkpointer.restore` (``xtc.restore``), by the manager (`checkpoint_manager.training_state`) and by
the tools.
"""
