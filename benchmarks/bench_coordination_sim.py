"""Coordination and planning as the process count P grows to 1,024 (issue 66), simulated in one process: the
library's `Coordinator` runs a save's and a restore's agreements against `sim_transport.SimulatedTransport`
(messages, bytes and a modelled critical path per process), and the single-replica read planner
(`replica_plans`: needs derived from DTensor shardings, digest, reader assignment, batches) runs on the shardings
of Llama-3-70B's training state (80 layers, hidden 8192, FFN 28672, vocab 128256, GQA with 8 KV heads of 128;
fp32 parameters and two AdamW moments: 2,169 arrays, 847 GB) on an FSDP x DP mesh (FSDP = min(32, P), DP =
P / FSDP; placements [Replicate(), Shard(0)]), restored from a checkpoint saved with FSDP 32 (its chunk grid).

Per P: messages and bytes per process per save (the first, which chooses the writers of the chunks from the
shardings with one reduction of a digest, and a later one, whose plan is cached) and per restore (its agreements,
per batch, and the point-to-point data messages of the exchange); planning CPU seconds per process
(`time.process_time`, median of --repeats, caches cleared; the first and the last process), of the restore's plan
and of the first save's writers (`chunk_writers.assign`); the modelled seconds of a restore's agreements at
`alpha` 0.1 ms and 0.25 ms per message hop (the second is this machine's measured cost of one point-to-point
operation, Python included). For comparison, what the code before issue 66 did: `statuses` all-to-all, 2 (P - 1)
messages per batch, a gather of every process's needs, and on a first save a gather of every process's chunk list.

    python -m benchmarks coordination-sim [--repeats 7] [--quick] [--set processes=16,32,...,1024]
writes benchmarks/results/coordination-sim.{json,txt} and the plots coordination-sim-*.svg beside them.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

import numpy as np
from torch.distributed.tensor import Replicate, Shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import svg_plot  # noqa: E402
from sim_transport import SimulatedTransport  # noqa: E402

from xla_tensorstore_ckpt.core.records import ArrayMetadata  # noqa: E402
from xla_tensorstore_ckpt.core.tensor_layout import LocalShard, TensorLayout  # noqa: E402
from xla_tensorstore_ckpt.multihost import wire  # noqa: E402
from xla_tensorstore_ckpt.multihost.distributed import Coordinator  # noqa: E402
from xla_tensorstore_ckpt.multihost.transport import RING_MAX  # noqa: E402
from xla_tensorstore_ckpt.options import SaveOptions  # noqa: E402
from xla_tensorstore_ckpt.restores import replica_plans  # noqa: E402
from xla_tensorstore_ckpt.saves import chunk_writers, writer_plans  # noqa: E402
from xla_tensorstore_ckpt.targets import dtensors, holdings  # noqa: E402

SAVED_FSDP = 32
BATCH_BYTES = 256 << 20  # broadcast_max_bytes' default
PLACEMENTS = (Replicate(), Shard(0))


def llama3_70b() -> list[tuple[str, tuple[int, ...]]]:
    hidden, ffn, vocab, kv = 8192, 28672, 128256, 8 * 128
    shapes = [("tok_embeddings", (vocab, hidden))]
    for layer in range(80):
        p = f"layers.{layer}."
        shapes += [(p + "attention.wq", (hidden, hidden)), (p + "attention.wk", (kv, hidden)),
                   (p + "attention.wv", (kv, hidden)), (p + "attention.wo", (hidden, hidden)),
                   (p + "feed_forward.w1", (ffn, hidden)), (p + "feed_forward.w3", (ffn, hidden)),
                   (p + "feed_forward.w2", (hidden, ffn)), (p + "attention_norm", (hidden,)),
                   (p + "ffn_norm", (hidden,))]
    return shapes + [("norm", (hidden,)), ("output", (vocab, hidden))]


def state() -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    params = llama3_70b()
    return [((group, name), shape) for group in ("model", "exp_avg", "exp_avg_sq") for name, shape in params]


def chunk_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (-(-shape[0] // SAVED_FSDP), *shape[1:])


def fsdp_index(shape: tuple[int, ...], fsdp: int, f: int) -> tuple[tuple[int, int], ...]:
    """The region FSDP shard `f` of `fsdp` holds (dimension 0 split as torch.chunk splits it)."""
    rows = -(-shape[0] // fsdp)
    return ((min(f * rows, shape[0]), min((f + 1) * rows, shape[0])), *((0, n) for n in shape[1:]))


def plan(count: int, me: int) -> tuple[float, dict, tuple, int]:
    """One process's planning from the shardings, timed cold: (CPU seconds, plans, batches, digest)."""
    dtensors.rank_regions.cache_clear()
    holdings.dtensor_groups.cache_clear()
    fsdp = min(SAVED_FSDP, count)
    mesh = (count // fsdp, fsdp)
    start = time.process_time()
    needs, geometry = {}, {}
    ranks = tuple(range(count))
    for key, shape in state():  # what `replica_plans.derived_needs` does with each DTensor target
        needs[key] = holdings.dtensor_groups(shape, mesh, PLACEMENTS, ranks, count)
        geometry[key] = replica_plans.Geometry(shape, chunk_shape(shape), 4)
    digest = replica_plans.digest("gs://bucket/run/1000/model", geometry, needs, BATCH_BYTES)
    plans, batches = replica_plans.plan_arrays(me, count, geometry, needs, BATCH_BYTES)
    return time.process_time() - start, plans, batches, digest


def restore_agreements(count: int, me: int, batches: int, digest: int, alpha: float) -> SimulatedTransport:
    transport = SimulatedTransport(me, count, alpha_s=alpha)
    c = Coordinator(index=me, count=count, transport=transport)
    c.everywhere("finishing earlier saves", lambda: None)
    c.reduce_max([0, 0, digest, -digest], "agreeing on the plan")
    for _ in range(batches):
        c.statuses(None, "reading its chunks")
    c.statuses(None, "placing the restored arrays")
    c.everywhere("restoring the step", lambda: None)
    return transport


def save_layouts(count: int, me: int) -> list[tuple[ArrayMetadata, TensorLayout, tuple]]:
    """Process `me`'s (metadata, layout, DTensor sharding) of every array of the state on the DP x FSDP mesh, as
    `save_plan` builds them (`targets.dtensor.layouts`)."""
    fsdp = min(SAVED_FSDP, count)
    mesh = (count // fsdp, fsdp)
    point = (me // fsdp, me % fsdp)
    out = []
    for key, shape in state():
        chunks, index, replica, sharding = dtensors.geometry(shape, mesh, PLACEMENTS, point)
        lay = TensorLayout(shape, "dtensor", chunks, (LocalShard(0, "cpu", index, replica),), sharding)
        out.append((ArrayMetadata("/".join(key), shape, "float32", lay.chunk_shape, sharding), lay,
                    (shape, mesh, PLACEMENTS, tuple(range(count)))))
    return out


def first_save_plan(count: int, me: int, transport: SimulatedTransport) -> float:
    """CPU seconds of process `me`'s writer assignment of a first save (`chunk_writers.assign`, the
    holdings derived from the DTensor shardings as `writer_plans.holding` derives them), caches cleared."""
    dtensors.rank_regions.cache_clear()
    holdings.dtensor_groups.cache_clear()
    writer_plans.chunk_holders.cache_clear()
    local = save_layouts(count, me)
    c = Coordinator(index=me, count=count, transport=transport)
    start = time.process_time()
    held = [holdings.dtensor_groups(*sharding, count) for _, _, sharding in local]
    chunk_writers.assign([(meta, lay) for meta, lay, _ in local], held, SaveOptions(), c)
    return time.process_time() - start


def save_agreements(count: int, me: int, first: bool) -> SimulatedTransport:
    """The manager's agreements of a synchronous save to one tier, in the order of its call sites (manager.py,
    step_save.py, save_plan.py, tier.py, commit.py); the first save chooses the writers of the chunks (one
    reduction of the digest of what it derived from the shardings). Run as the primary (`me` 0): a broadcast's
    value is the primary's."""
    transport = SimulatedTransport(me, count)
    c = Coordinator(index=me, count=count, transport=transport)
    c.any(not first, "taking the roots; checking the cached save plans")  # one agreement (save_plan.Precondition)
    c.everywhere("staging", lambda: None)
    if first:
        first_save_plan(count, me, transport)
    c.on_primary("preparing the step", lambda: "tmp-name", share=True)
    c.everywhere("writing", lambda: None)
    c.on_primary("committing", lambda: None)
    c.on_primary("retention", lambda: [], share=True)
    c.everywhere("committing the step", lambda: None)
    return transport


def data_messages(plans: dict, batches: tuple) -> int:
    """Point-to-point data messages of this process's exchange over the restore (a message per peer and batch
    for the small parts, one per large part: counted here as one per peer and batch)."""
    total = 0
    for batch in batches:
        peers = {send[0] for key in batch for send in plans[key].sends}
        peers |= {piece.source for key in batch for _, pieces in plans[key].assembled for piece in pieces}
        total += len(peers)
    return total


def gathered_chunk_lists_bytes(count: int, me: int) -> int:
    """Bytes per process of the first save's gather of every process's chunk list (before: every save's first)."""
    transport = SimulatedTransport(me, count)
    fsdp = min(SAVED_FSDP, count)
    record = [("/".join(key), shape, "float32", chunk_shape(shape), (fsdp_index(shape, fsdp, me % fsdp),))
              for key, shape in state()]
    Coordinator(index=me, count=count, transport=transport).all_gather(record, "choosing the writers of the chunks")
    return transport.tally.nbytes


def gathered_needs_bytes(count: int, me: int) -> int:
    """Bytes per process of the plan's gather before issue 66: every process's needs record, P times."""
    fsdp = min(SAVED_FSDP, count)
    entries = tuple((key, replica_plans.Geometry(shape, chunk_shape(shape), 4), (fsdp_index(shape, fsdp, me % fsdp),))
                    for key, shape in state())
    return count * len(wire.encode(("gs://bucket/run/1000/model", entries)))


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2)."""
    b, a = np.polyfit(xs, ys, 1)
    predicted = [a + b * x for x in xs]
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys) or 1.0
    return a, b, 1 - sum((y - p) ** 2 for y, p in zip(ys, predicted)) / total


def simulate(count: int, repeats: int) -> dict:
    """One process count: planning CPU seconds (first and last process), messages and bytes of the agreements."""
    row: dict = {"processes": count, "mesh": [count // min(SAVED_FSDP, count), min(SAVED_FSDP, count)]}
    for me in (0, count - 1):
        times = []
        for _ in range(repeats):
            seconds, plans, batches, digest = plan(count, me)
            times.append(seconds)
        row[f"planning_cpu_s_p{'first' if me == 0 else 'last'}"] = harness.median(times)
        row[f"planning_cpu_s_p{'first' if me == 0 else 'last'}_runs"] = times
    row["batches"] = len(batches)
    for alpha in (1e-4, 2.5e-4):
        t = restore_agreements(count, count - 1, len(batches), digest, alpha).tally
        row[f"restore_agreement_s_alpha{alpha * 1e3:g}ms"] = t.seconds
    t = restore_agreements(count, count - 1, len(batches), digest, 1e-4).tally
    per_batch = restore_agreements(count, count - 1, 1, digest, 1e-4).tally.messages - \
        restore_agreements(count, count - 1, 0, digest, 1e-4).tally.messages
    row.update(restore_messages=t.messages, restore_bytes=t.nbytes, restore_messages_per_batch=per_batch,
               restore_data_messages=data_messages(plans, batches),
               before_restore_messages_per_batch=2 * 2 * (count - 1),  # isend + irecv to and from every peer
               before_plan_gather_bytes=gathered_needs_bytes(count, count - 1))
    for first in (True, False):
        s = save_agreements(count, 0, first).tally  # the primary: it broadcasts (the others only receive)
        row[f"save_{'first' if first else 'later'}_messages"] = s.messages
        row[f"save_{'first' if first else 'later'}_bytes"] = s.nbytes
    for me in (0, count - 1):
        times = [first_save_plan(count, me, SimulatedTransport(me, count)) for _ in range(repeats)]
        row[f"save_planning_cpu_s_p{'first' if me == 0 else 'last'}"] = harness.median(times)
        row[f"save_planning_cpu_s_p{'first' if me == 0 else 'last'}_runs"] = times
    row["before_save_first_gather_bytes"] = gathered_chunk_lists_bytes(count, 0)
    return row


def run(settings: harness.Settings) -> harness.Result:
    """The case `coordination-sim`: every process count in turn, in this process (blocks)."""
    processes = settings.option("processes", ("16", "32", "64", "128", "256", "512", "1024"))
    results = []
    for count in (int(p) for p in processes):
        print(f"simulating {count} processes ...", file=sys.stderr, flush=True)
        results.append(simulate(count, settings.repeats))
    fitted = [r for r in results if r["processes"] > RING_MAX]  # recursive doubling (gloo's ring below)
    fits = {}
    if len(fitted) > 1:
        per_batch = [r["restore_messages_per_batch"] for r in fitted]
        fits = {"fit_log2": fit([math.log2(r["processes"]) for r in fitted], per_batch),
                "fit_linear": fit([r["processes"] for r in fitted], per_batch)}
    plots(results, settings.beside(""))
    rows = [harness.Row(f"P={r['processes']}", {
        "planning_cpu_s_first": harness.series(r["planning_cpu_s_pfirst_runs"], "s"),
        "planning_cpu_s_last": harness.series(r["planning_cpu_s_plast_runs"], "s"),
        "save_planning_cpu_s_first": harness.series(r["save_planning_cpu_s_pfirst_runs"], "s"),
        "save_planning_cpu_s_last": harness.series(r["save_planning_cpu_s_plast_runs"], "s")},
        params={k: v for k, v in r.items() if "planning_cpu_s" not in k}) for r in results]
    files = [settings.beside(f"-{name}.svg") for name in ("messages", "planning", "bytes")]
    return harness.Result(rows, text(results, ",".join(processes), settings.repeats, fits), {"rows": results, **fits},
                          files)


def text(rows: list[dict], processes: str, repeats: int, fits: dict) -> str:
    head = ("Coordination and planning simulated at P processes (benchmarks/bench_coordination_sim.py): Llama-3-70B "
            "training state (2,169 fp32 arrays), mesh DP x FSDP, saved with FSDP 32; per process\n"
            f"python -m benchmarks coordination-sim --set processes={processes} --repeats {repeats}\n\n"
            "    P  mesh     plan CPU s  batches  msgs/batch  (before)  restore msgs  restore B  data msgs  "
            "agree s@0.1ms  @0.25ms  save1 msgs  save1 B     save msgs  plan gather B before  "
            "save1 plan CPU s  save1 gather B before\n")
    body = "".join(
        f"{r['processes']:5d}  {r['mesh'][0]:3d}x{r['mesh'][1]:<3d} "
        f"{max(r['planning_cpu_s_pfirst'], r['planning_cpu_s_plast']):10.3f}  {r['batches']:7d}  "
        f"{r['restore_messages_per_batch']:10d}  {r['before_restore_messages_per_batch']:8d}  "
        f"{r['restore_messages']:12d}  {r['restore_bytes']:9d}  {r['restore_data_messages']:9d}  "
        f"{r['restore_agreement_s_alpha0.1ms']:13.3f}  {r['restore_agreement_s_alpha0.25ms']:7.3f}  "
        f"{r['save_first_messages']:10d}  {r['save_first_bytes']:10d}  {r['save_later_messages']:9d}  "
        f"{r['before_plan_gather_bytes']:20d}  "
        f"{max(r['save_planning_cpu_s_pfirst'], r['save_planning_cpu_s_plast']):16.3f}  "
        f"{r['before_save_first_gather_bytes']:21d}\n" for r in rows)
    if not fits:
        return head + body
    a, b, r2 = fits["fit_log2"]
    la, lb, lr2 = fits["fit_linear"]
    return head + body + (f"\nmessages per process per restore batch, P > {RING_MAX}: {a:.2f} + {b:.2f} log2(P) "
                          f"(R^2 {r2:.4f}); a linear fit in P: {la:.2f} + {lb:.4f} P (R^2 {lr2:.4f}). Up to "
                          f"{RING_MAX} processes the reduction is gloo's ring all-reduce: 4 (P - 1) messages.\n")


def plots(rows: list[dict], base: str) -> None:
    ps = [r["processes"] for r in rows]
    svg_plot.write(base + "-messages.svg", "messages per process per restore batch", ps,
                   {"reduction (now)": [r["restore_messages_per_batch"] for r in rows],
                    "all-to-all statuses (before)": [r["before_restore_messages_per_batch"] for r in rows]})
    svg_plot.write(base + "-planning.svg", "planning CPU seconds per process (70B state)", ps,
                   {"restore plan, derived from shardings": [
                       max(r["planning_cpu_s_pfirst"], r["planning_cpu_s_plast"]) for r in rows],
                    "first save's writers, derived from shardings": [
                        max(r["save_planning_cpu_s_pfirst"], r["save_planning_cpu_s_plast"]) for r in rows]})
    svg_plot.write(base + "-bytes.svg", "bytes per process", ps,
                   {"restore agreements": [r["restore_bytes"] for r in rows],
                    "first save agreements": [r["save_first_bytes"] for r in rows],
                    "later save agreements": [r["save_later_bytes"] for r in rows],
                    "restore plan gather before": [r["before_plan_gather_bytes"] for r in rows],
                    "first save gather before": [r["before_save_first_gather_bytes"] for r in rows]})


if __name__ == "__main__":
    harness.worker_main()
