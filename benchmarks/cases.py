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
)}
