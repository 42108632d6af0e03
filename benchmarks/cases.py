"""The registry of benchmark cases: one `harness.Case` per result set family, in the order `make bench` runs them.
Adding a benchmark: a module with ``run(settings) -> harness.Result`` and one line here."""

from __future__ import annotations

from harness import Case

CASES: dict[str, Case] = {case.name: case for case in (
    Case("chunk-hashes", "bench_chunk_hashes", "content hashes against CRC32C, CPU seconds per GiB",
         options={"save_cpu_per_gib": "0.67", "path": ""}),
    Case("direct-writes", "bench_direct_writes", "saves around the page cache (O_DIRECT) or through it, ABBA",
         options={"workloads": "large,model"}, quick_options={"workloads": "large"}, quick_repeats=2,
         quick_scale=0.02),
    Case("cold-chunk-reads", "bench_cold_chunk_reads", "evicted restores read direct or buffered, ABBA",
         quick_repeats=2, quick_scale=0.02),
    Case("item-cpu", "bench_item_cpu", "item save/restore CPU seconds, one or several checkouts ABBA", scale=0.1,
         quick_scale=0.01, options={"workload": "small", "per_process": "7", "trees": ""},
         quick_options={"per_process": "1"}),
    Case("restore-memory", "bench_restore_memory", "the restore plan's predicted peak host memory against the measured",
         options={"workloads": "large,small,model", "max_host_mib": "0"}, quick_options={"workloads": "large"},
         quick_scale=0.02),
    Case("small-arrays", "bench_small_arrays", "2,000 small tensors: one OCDBT store against a directory per array",
         repeats=5, options={"storage": "local,gcs"}, quick_options={"storage": "local"}, quick_scale=0.02),
    Case("commit-latency", "bench_commit_latency", "a small synchronous save's latency, quiet and beside a writer",
         repeats=15, options={"interval": "2.0", "dir": ""}, quick_repeats=2, quick_options={"interval": "0.1"}),
    Case("coordination", "bench_coordination", "the Coordinator's collectives at 1-8 processes, gloo",
         repeats=200, quick_repeats=5, options={"processes": "1,2,4,8"}, quick_options={"processes": "1,2"}),
    Case("manager", "bench_manager", "the manager's own cost over an item save; latest_step() over 1,000 steps",
         quick_repeats=2, quick_scale=0.02),
    Case("views", "bench_views", "xtckpt stats and report against the cold-read floor, ABBA", scale=0.4,
         quick_scale=0.01, options={"dir": ""}),
    Case("async", "bench_async", "how long save() blocks, async and sync, against torch_xla's save_async; a loop",
         repeats=5, options={"workloads": "large", "loop_steps": "20", "width": "2048", "batch": "2048"},
         quick_repeats=2, quick_scale=0.02, quick_options={"loop_steps": "2", "width": "256", "batch": "256"}),
    Case("async-reads", "bench_async_reads", "cold O_DIRECT reads by threads or AIO, alone and beside a GIL holder",
         options={"depth": "16", "dir": ""}, quick_repeats=1, quick_scale=0.05),
    Case("placement", "bench_placement", "host data placed on torch_xla tensors: cpu-shards against from-aten",
         quick_scale=0.02),
    Case("first-restore", "bench_first_restore", "the first restore in a process against the later ones (evicted)",
         repeats=3, options={"workloads": "large,model", "restores": "4"},
         quick_options={"workloads": "large", "restores": "2"}, quick_scale=0.02),
    Case("orbax-interop", "bench_orbax_interop", "a step Orbax wrote, restored by Orbax in JAX and by this library",
         quick_scale=0.02),
    Case("hf-import", "bench_hf_import", "Hugging Face safetensors onto an FSDP mesh: the usual path against ours",
         options={"warm_memory": "0"}, quick_scale=0.02),
    Case("dtensor", "bench_dtensor", "DTensor state (4 gloo processes) against torch.distributed.checkpoint",
         options={"workloads": "large,model", "warm_memory": "0"}, quick_options={"workloads": "large"},
         quick_repeats=2, quick_scale=0.01),
)}
