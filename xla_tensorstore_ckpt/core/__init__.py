"""The vocabulary every other folder shares; nothing here imports another part of the package.

The exception hierarchy (`errors`); torch / zarr / numpy dtypes (`dtypes`) and bfloat16 and float8 registered with
zarr-python (`zarr_dtypes`); what metadata read from a checkpoint may declare and the bounded JSON decoder every
reader uses (`bounds`); the restricted unpicklers that read other tools' pickles and run nothing (`torch_pickle`);
regular chunk grids and size-bounded batches (`grid`); state trees flattened into key paths and back (`tree`); the
names on disk every format shares and the one validator of names read from files (`layout`); the neutral records
formats read and write (`records`); shard layouts (`tensor_layout`); `ShardedArray`, host shards of a global array
(`sharded_array`); what saves and restores do, told to listeners (`events`); and process-wide helpers: pausing the
garbage collector (`gc_pause`), returning freed host memory to the OS (`host_memory`), facts about this host's
processes (`processes`), the I/O sizes read through one function that tests override (`tunables`), how many
threads each kind of work runs on (`threads`), and the reusable host buffers, made, sized and kept in one place
(`buffers`).
"""
