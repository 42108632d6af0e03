"""An item's save, phase by phase: which chunks exist and who writes each (`save_plan`; the writers chosen by
`chunk_writers`, from holders derived alike on every process from the shardings, `writer_plans`), the shards
copied off the devices batch by batch (`staging`), arrays created and chunk writes issued, interleaved with
staging or after it (`writing`), the commit protocol: writes durable everywhere, then the stores merged and the
final files (`commit`), and the background committer of asynchronous saves: ordered, bounded, errors re-raised
(`async_save`).

Called by `checkpointer.save` (``xtc.save``), by the manager for each tier a step is due for
(`checkpoint_manager.step_save`), by `dcp_storage` and `tools.convert`.
"""
