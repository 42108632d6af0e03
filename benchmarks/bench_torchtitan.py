"""torchtitan's own DCP checkpoint manager against this library's (`integrations.torchtitan.XtcCheckpointManager`),
on the same torchtitan job state, same job, side by side.

One job of `--processes` processes (4; gloo on 127.0.0.1) holds torchtitan's llama3 debug model (`--layers` of
its six layers; torchtitan's SDPA inner attention: FlexAttention has no backward on CPU) under FSDP2 over every
process, its AdamW `OptimizersContainer` (moments populated by one training step), its LR-scheduler container,
its `ParallelAwareDataloader` and a train state; each manager is built from its Config, as torchtitan's trainer
builds it, with ``interval=1`` and ``keep_latest_k=2``, once per contender and warmed up by an untimed save (a
training run keeps its manager: plans and process groups are reused). Contenders: ``dcp-sync``, ``dcp-async``,
``dcp-async-pinned`` (torchtitan's ``async_with_pinned_mem``; reported as not running where it cannot on CPU),
``xtc-async``, ``xtc-sync``. Per round (`--repeats`, at least 7 for a measurement; contenders in ABBA order):

- blocking: ``save(step)`` plus ``maybe_wait_for_staging()`` (what the training loop waits for);
- whole save: from ``save(step)`` until ``maybe_wait_for_saving()`` returns (the step is on disk);
- CPU seconds of the process over the whole save (threads included; DCP's pinned mode saves in another process,
  whose CPU is not counted);
- resume: a fresh manager of the same folder, the newest step evicted from the page cache
  (benchmarks/fresh_process.py), ``load()``;
- fresh memory: in a fresh job of its own per contender, the growth of the processes' peak RSS over ``load()``.

Then the newest step ``xtc-async`` wrote is opened by ``xtckpt`` (steps, verify) and restored by Orbax in a JAX
process of its own (benchmarks/orbax_open.py), its arrays compared with ``xtc.restore``'s byte for byte.

A round's time is the slowest process's; the table gives medians over rounds.

usage: python -m benchmarks torchtitan [--repeats 7] [--quick] [--set layers=6] [--set processes=4]
(with the newest stack's environment: torchtitan is in the `trainers` extra; `make bench` leaves it out)
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import harness  # noqa: E402

CONTENDERS = ("dcp-sync", "dcp-async", "dcp-async-pinned", "xtc-async", "xtc-sync")


def _job(layers: int):
    """The job's state, built the same way in every process and every run (seeded)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    class Tokens(IterableDataset):
        def __init__(self) -> None:
            self.position = 0

        def __iter__(self):
            while True:
                self.position += 1
                yield torch.randint(0, 2048, (17,), generator=torch.Generator().manual_seed(self.position))

        def state_dict(self) -> dict:
            return {"position": self.position}

        def load_state_dict(self, state: dict) -> None:
            self.position = state["position"]

    class TrainState:
        step = 1

        def state_dict(self) -> dict:
            return {"step": self.step}

        def load_state_dict(self, state: dict) -> None:
            self.step = state["step"]

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:layers]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_states()
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=100)
    loader = ParallelAwareDataloader(Tokens(), dp_rank=dist.get_rank(), dp_world_size=dist.get_world_size(),
                                     batch_size=2)
    tokens = next(iter(loader))
    logits = model(tokens[:, :-1], positions=torch.arange(16).repeat(2, 1))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizers.step()
    lr_schedulers.step()
    optimizers.zero_grad()
    nbytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) * 3
    return dict(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                states={"train_state": TrainState()}, sd_adapter=None), nbytes


def _manager(contender: str, folder: str, parts: dict):
    from torchtitan.components.checkpointer import CheckpointManager

    from xla_tensorstore_ckpt.integrations.torchtitan import XtcCheckpointManager

    common = dict(enable=True, folder=folder, interval=1, keep_latest_k=2)
    if contender.startswith("dcp"):
        mode = {"dcp-sync": "disabled", "dcp-async": "async", "dcp-async-pinned": "async_with_pinned_mem"}[contender]
        config = CheckpointManager.Config(**common, async_mode=mode)
    else:
        config = XtcCheckpointManager.Config(**common, async_mode={"xtc-async": "async", "xtc-sync": "disabled"}[
            contender])
    return config.build(**{**parts, "states": dict(parts["states"])}, base_folder="")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(mode: str, directory: str, layers: str, arg: str) -> dict:
    """One process of a job (``bench_torchtitan.py --worker MODE DIR LAYERS ARG``, run by `jobs.run_job`):
    ``measure`` (ARG: the rounds) or ``fresh`` (ARG: the contender); its answer."""
    if mode == "fresh":
        return fresh_memory(directory, int(layers), arg)
    return measure_in_job(directory, int(layers), int(arg))


def measure_in_job(directory: str, layers: int, repeats: int) -> dict:
    """One process of the measuring job: every contender's manager built once and warmed up by an untimed save
    (as a training run keeps one), then `repeats` rounds, ABBA."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    parts, nbytes = _job(layers)
    out: dict = {"rank": dist.get_rank(), "state_bytes": nbytes, "rounds": {c: [] for c in CONTENDERS},
                 "errors": {}}
    managers = {}
    for contender in CONTENDERS:
        try:
            managers[contender] = _manager(contender, os.path.join(directory, contender), parts)
            managers[contender].save(1)
            managers[contender].maybe_wait_for_staging()
            managers[contender].maybe_wait_for_saving()
        except Exception as exc:  # noqa: BLE001 - a contender that cannot run here is reported, not fatal
            out["errors"][contender] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        dist.barrier()
    for round_index, contender in enumerate(harness.alternate(CONTENDERS, repeats)):
        if contender not in out["errors"]:
            out["rounds"][contender].append(_round(contender, managers[contender], os.path.join(directory, contender),
                                                   parts, round_index + 2))
        dist.barrier()
    for manager in managers.values():
        manager.close()
    dist.destroy_process_group()
    return out


def _round(contender: str, manager, folder: str, parts: dict, step: int) -> dict:
    import torch.distributed as dist
    from fresh_process import evict

    dist.barrier()
    cpu, started = _cpu(), time.perf_counter()
    manager.save(step)
    manager.maybe_wait_for_staging()
    blocking = time.perf_counter() - started
    manager.maybe_wait_for_saving()
    whole, cpu = time.perf_counter() - started, _cpu() - cpu
    dist.barrier()
    if dist.get_rank() == 0:  # the step alone: retention may be deleting older ones in the background
        evict(os.path.join(folder, f"step_{step}" if contender.startswith("xtc") else f"step-{step}"))
    dist.barrier()
    loader = _manager(contender, folder, parts)
    started = time.perf_counter()
    loader.load(step=step)
    resume = time.perf_counter() - started
    loader.close()
    return {"blocking": blocking, "whole": whole, "cpu": cpu, "resume": resume}


def fresh_memory(directory: str, layers: int, contender: str) -> dict:
    """One process of a fresh job: the growth of its peak RSS over one `load()` of the contender's newest step."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    parts, _ = _job(layers)
    manager = _manager(contender, os.path.join(directory, contender), parts)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    manager.load()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    manager.close()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, "peak_rss_growth_kib": grown}


def run(settings: harness.Settings) -> harness.Result:
    """The case `torchtitan`: one measuring job of every contender, then a fresh job per contender for its
    memory (blocks)."""
    from jobs import run_job

    layers, processes = settings.option("layers", 6), settings.option("processes", 4)
    script = os.path.abspath(__file__)
    answers = run_job([script, "--worker", "measure", settings.workdir, layers, settings.repeats], processes)
    memory = {}
    for contender in CONTENDERS:
        if contender not in answers[0]["errors"]:
            fresh = run_job([script, "--worker", "fresh", settings.workdir, layers, contender], processes)
            memory[contender] = max(a["peak_rss_growth_kib"] for a in fresh) / 1024
    opened = opened_elsewhere(os.path.join(settings.workdir, "xtc-async"))
    rows, text = report(answers, memory, layers, processes, settings.repeats, opened)
    return harness.Result(rows, text, {"answers": answers, "fresh_peak_rss_growth_mib": memory, "opened": opened})


def opened_elsewhere(root: str) -> list[str]:
    """The newest step of our contender's root opened by `xtckpt` (steps, verify: every chunk's checksum) and
    restored by Orbax in a JAX process of its own (benchmarks/orbax_open.py), its arrays compared with
    `xtc.restore`'s byte for byte. Returns the table's lines."""
    import hashlib
    import subprocess

    import torch

    import xla_tensorstore_ckpt as xtc
    from xla_tensorstore_ckpt.core import tree

    xtckpt = os.path.join(os.path.dirname(sys.executable), "xtckpt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                                     os.environ.get("PYTHONPATH")]))}
    steps = json.loads(subprocess.run([xtckpt, "steps", "--json", root], capture_output=True, text=True, check=True,
                                      env=env).stdout)
    step = max(s["step"] for s in steps if s["status"] == "committed")
    verify = subprocess.run([xtckpt, "verify", os.path.join(root, f"step_{step}")], capture_output=True, text=True,
                            env=env)
    lines = [f"xtckpt: {len(steps)} steps listed; verify step {step}: {verify.stdout.strip().splitlines()[-1]}"]
    items = ("model", "optimizer")
    answer = subprocess.run([sys.executable, os.path.join(HERE, "orbax_open.py"), root, *items, "--prefix", "step"],
                            capture_output=True, text=True, env=env)
    if answer.returncode != 0:
        return [*lines, f"Orbax: failed: {answer.stderr.strip().splitlines()[-1]}"]
    orbax = json.loads(answer.stdout.strip().splitlines()[-1])
    for item in items:
        got = orbax["items"][item]
        if "error" in got:
            lines.append(f"Orbax: step {orbax['step']} item {item}: {got['error']}")
            continue
        ours = {".".join(map(str, path)): hashlib.sha256(value.contiguous().reshape(-1).view(torch.uint8)
                                                         .numpy().tobytes()).hexdigest()
                for path, value in tree.flatten(xtc.restore(os.path.join(root, f"step_{orbax['step']}", item)))
                if hasattr(value, "dtype")}
        lines.append(f"Orbax (JAX, own process): step {orbax['step']} item {item}: {got['arrays']} arrays, "
                     f"{got['bytes'] / 2**20:.1f} MiB restored; identical to xtc.restore: {got['digests'] == ours}")
    return lines


def report(answers: list[dict], memory: dict, layers: int, processes: int, repeats: int,
           opened: list[str]) -> tuple[list, str]:
    """The rows (each round: the slowest process) and the prose of the answers, with `opened_elsewhere`'s lines."""
    rows, medians, table = [], {}, []
    for contender in CONTENDERS:
        if contender in answers[0]["errors"]:
            table.append(f"{contender:18s} does not run here: {answers[0]['errors'][contender]}")
            continue
        rounds = zip(*(a["rounds"][contender] for a in answers))
        slowest = [{k: max(r[k] for r in per_rank) for k in per_rank[0]} for per_rank in rounds]
        medians[contender] = {k: harness.median(r[k] for r in slowest) for k in slowest[0]}
        rows.append(harness.Row(contender, {f"{k}_s": harness.series((r[k] for r in slowest), "s")
                                            for k in slowest[0]},
                                params={"fresh_peak_rss_growth_mib": memory.get(contender)}))
    if "dcp-async" in medians and "xtc-async" in medians:
        blocking = medians["xtc-async"]["blocking"] / medians["dcp-async"]["blocking"]
        resume = medians["dcp-async"]["resume"] / medians["xtc-async"]["resume"]
        table.append(f"blocking per save, xtc-async / dcp-async: {blocking:.2f}x; resume {resume:.2f}x faster than "
                     "DCP's")
    text = (f"torchtitan job state: llama3 debug model, {layers} layers, FSDP2 over {processes} processes, "
            f"{answers[0]['state_bytes'] / 2**20:.1f} MiB of parameters and AdamW moments per process; medians of "
            f"{repeats} rounds (fresh MiB: peak RSS growth over load() in a fresh job: "
            + ", ".join(f"{c} {m:.1f}" for c, m in memory.items()) + ")\n" + "\n".join(table + opened))
    return rows, text


if __name__ == "__main__":
    harness.worker_main(worker)
