"""Incremental and delta steps against full steps (issue 65, item 5): bytes written per step, save wall and CPU
seconds, and restore time, on two real training workloads at small scale (CPU tensors, no torch_xla):

(a) LoRA: a decoder (frozen) with rank-8 adapters on its fused q/k/v projections, AdamW on the adapters only;
    each step saves model + optimizer. Goal: an incremental step writes <= 2 % of a full step's bytes.
(b) RL: a bf16 decoder trained at a small learning rate (AdamW, bf16 parameters, as RL post-training runs);
    the fraction of weight elements that changed is measured at every step; each step saves the model.
    Goal: a delta step writes <= 10 % of a full step's bytes, and a restore through 4 deltas costs <= 1.5x a
    full restore (chains 0/1/4/8 are measured, those the steps reach).

Both decoders have 4 layers of width 512 x `--scale` (a multiple of 16). Each variant (full, incremental,
incremental + delta) runs in a fresh process the same training from the same seed with a CheckpointManager of its
own (synchronous saves, fsync on: the library's defaults otherwise), ``--set steps`` steps, one save each; figures
are medians over the steps after the first (>= 7 with the default 9 steps). Restores read the step into new CPU
tensors (`xtc.restore`), `--repeats` rounds of them, every variant's of a workload in one fresh process, one after
the other in each round (so that they find the allocator alike), with the page cache warm, then cold (every step
evicted before each restore: a restart on a fresh host). On local disk (``--set dir``: where, default
the harness's temporary directory), or with ``--set storage=gcs`` on the persistent tier in the GCS emulator the
tests use (fake-gcs-server on 127.0.0.1, started here; result set ``incremental-gcs``): the manager's root is then
``gs://bench/<workload>/<variant>``, a step's bytes are the sizes of its objects as the emulator lists them, and the
restores are `--repeats` reads over HTTP from the emulator's memory (mode ``network``: there is no page cache to
warm or evict).

    python -m benchmarks incremental [--repeats 7] [--scale 1] [--set steps=9] [--set dir=DIR]
    python -m benchmarks incremental --set storage=gcs [--scale 0.5] [--repeats 7] [--set steps=9]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
from fresh_process import evict  # noqa: E402

import xla_tensorstore_ckpt as xtc  # noqa: E402
from xla_tensorstore_ckpt import storage  # noqa: E402

VARIANTS = (("lora", ("full", "incremental")), ("rl", ("full", "incremental", "delta")))
CHAINS = (0, 1, 4, 8)

VOCAB = 256
RL_LR = 5e-6  # RL post-training learning rates are 1e-6 to 1e-5


class Block(torch.nn.Module):
    def __init__(self, dim: int, rank: int | None):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim, bias=False), torch.nn.Linear(4 * dim, dim, bias=False)
        self.lora = None
        if rank is not None:  # LoRA on the q/k/v projection: B starts at zero, as LoRA does
            self.lora = torch.nn.ParameterDict({
                "qkv_a": torch.nn.Parameter(torch.randn(rank, dim) * 0.01),
                "qkv_b": torch.nn.Parameter(torch.zeros(3 * dim, rank))})

    def _lin(self, layer: torch.nn.Linear, name: str, x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        if self.lora is not None and f"{name}_a" in self.lora:
            out = out + (x @ self.lora[f"{name}_a"].T) @ self.lora[f"{name}_b"].T
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self._lin(self.qkv, "qkv", self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, 4, d // 4).transpose(1, 2) for y in (q, k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self._lin(self.proj, "proj", attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(torch.nn.Module):
    def __init__(self, dim: int, layers: int, rank: int | None = None):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, rank) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, 65), generator=torch.Generator().manual_seed(step))


def _train_step(model: Decoder, optimizer: torch.optim.Optimizer, step: int) -> None:
    tokens = _tokens(step)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()



def _dir_bytes(path: str) -> int:
    """The bytes stored under `path`: a directory's files, or (``gs://bucket/prefix``) the objects the GCS
    emulator named by STORAGE_EMULATOR_HOST lists under that prefix."""
    if not path.startswith("gs://"):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    bucket, _, prefix = path.removeprefix("gs://").partition("/")
    total, token = 0, ""
    while True:
        query = urllib.parse.urlencode({"prefix": prefix.rstrip("/") + "/", **({"pageToken": token} if token else {})})
        url = f"{os.environ['STORAGE_EMULATOR_HOST']}/storage/v1/b/{bucket}/o?{query}"
        with urllib.request.urlopen(url, timeout=60) as response:
            page = json.loads(response.read())
        total += sum(int(item["size"]) for item in page.get("items", []))
        token = page.get("nextPageToken", "")
        if not token:
            return total


def _join(root: str, *names: str) -> str:
    return "/".join((root.rstrip("/"), *names)) if "://" in root else os.path.join(root, *names)


def _restores(paths: dict[str, dict[str, str]], repeats: int, roots: list[str]) -> dict:
    """`repeats` rounds of restores into new tensors of every path (`paths`: variant -> chain -> the step's item),
    one after the other in each round, with the page cache warm, then as many with every step under `roots`
    evicted before each restore (cold: the restore of a restart on a fresh host); on ``gs://``, rounds of
    restores over HTTP (``network``). In one process, round by round, so that each variant's restore finds the
    allocator and the page cache as the others' do: restores in a process of each variant's own differed by 2x in
    CPU seconds with how much freed memory its training had left for the new tensors. Wall and CPU seconds (this
    process, all its threads: under a loaded machine CPU is the steadier), each run and their medians, by variant
    and chain."""
    out: dict = {variant: {chain: {} for chain in chains} for variant, chains in paths.items()}
    for mode in ("network",) if any("://" in root for root in roots) else ("warm", "cold"):
        runs = {(variant, chain): ([], []) for variant, chains in paths.items() for chain in chains}
        for _ in range(repeats):
            for (variant, chain), (walls, cpus) in runs.items():
                if mode == "cold":
                    for root in roots:
                        evict(root)
                begun, cpu = time.perf_counter(), time.process_time()
                xtc.restore(paths[variant][chain])
                walls.append(time.perf_counter() - begun)
                cpus.append(time.process_time() - cpu)
        for (variant, chain), (walls, cpus) in runs.items():
            out[variant][chain][mode] = {"wall": harness.median(walls), "cpu": harness.median(cpus), "walls": walls,
                                         "cpus": cpus}
    return out


def train(workload: str, variant: str, root: str, steps: int, width: int) -> list[dict]:
    """Train `steps` steps, saving every step under `root`; per-step bytes, wall and CPU seconds (and for RL the
    fraction of weight elements changed)."""
    torch.manual_seed(0)
    if workload == "lora":
        model = Decoder(width, 4, rank=8)
        for name, p in model.named_parameters():
            p.requires_grad_("lora" in name)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    else:
        model = Decoder(width, 4).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=RL_LR, weight_decay=0.0)
    options = xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None, async_save=False,
                                           save_rng=False, incremental=variant != "full", delta=variant == "delta",
                                           max_chain=8)
    rows = []
    with xtc.CheckpointManager(root, options) as mgr:
        for step in range(1, steps + 1):
            before = {k: v.clone() for k, v in model.state_dict().items()} if workload == "rl" else None
            _train_step(model, optimizer, step)
            changed = None
            if before is not None:
                after = model.state_dict()
                changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum())
                              for k in before) / sum(v.numel() for v in before.values())
            objects = {"model": model} if workload == "rl" else {"model": model, "optimizer": optimizer}
            wall, cpu = time.perf_counter(), time.process_time()
            mgr.save(step, **objects)
            rows.append({"step": step, "bytes": _dir_bytes(_join(root, str(step))),
                         "save_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                         "changed": changed})
    return rows


def worker(task: str, workload: str, *args: str) -> dict:
    """In a fresh process (`harness.fresh`): ``train`` one variant's run (args: VARIANT ROOT STEPS WIDTH; its
    steps' figures), or ``restore`` the steps of every variant's run of `workload` (args: ROOTS, a JSON object
    variant -> root, STEPS, REPEATS; `_restores`; then the roots on an object store are deleted): RL by the delta
    chain's length, step k+1 of a run having chain k; LoRA the last step."""
    if task == "train":
        variant, root, steps, width_ = args
        return {"rows": train(workload, variant, root, int(steps), int(width_))}
    roots, steps, repeats = json.loads(args[0]), int(args[1]), int(args[2])
    chains = ({str(chain): str(chain + 1) for chain in CHAINS if chain + 1 <= steps} if workload == "rl"
              else {"last": str(steps)})
    paths = {variant: {chain: _join(root, step, "model") for chain, step in chains.items()}
             for variant, root in roots.items()}
    out = _restores(paths, repeats, list(roots.values()))
    for root in roots.values():
        if "://" in root:  # the emulator keeps every object in memory: the next workload starts without these
            storage.location(root).delete_tree()
    return out


def _median(rows: list[dict], key: str) -> float:
    return harness.median(r[key] for r in rows[1:])


def _network_table(results: dict) -> list[str]:
    """`table` of a run on ``gs://``: save wall and CPU against the full variant's too, and each restore's wall
    and CPU over HTTP against the full variant's of the same chain."""
    lines = [f"{'workload/variant':22} {'bytes/step':>12} {'vs full':>8} {'save s':>8} {'x full':>7} {'CPU s':>7} "
             f"{'x full':>7} {'changed':>8}  restore (chain: wall s, x full; CPU s, x full)"]
    for name, out in results.items():
        full = results[f"{name.split('/')[0]}/full"]
        rows = out["rows"]
        changed = [r["changed"] for r in rows[1:] if r["changed"] is not None]
        restore = ", ".join(
            f"{k}: {v['network']['wall']:.4f} ({v['network']['wall'] / f[k]['network']['wall']:.2f}x); "
            f"{v['network']['cpu']:.4f} ({v['network']['cpu'] / f[k]['network']['cpu']:.2f}x)"
            for k, v in out["restore_s"].items() for f in [full["restore_s"]])
        ratio = {key: _median(rows, key) / _median(full["rows"], key) for key in ("bytes", "save_s", "cpu_s")}
        lines.append(f"{name:22} {_median(rows, 'bytes'):>12,.0f} {ratio['bytes']:>8.4f} "
                     f"{_median(rows, 'save_s'):>8.4f} {ratio['save_s']:>6.2f}x {_median(rows, 'cpu_s'):>7.4f} "
                     f"{ratio['cpu_s']:>6.2f}x {(f'{harness.median(changed):.4f}' if changed else '-'):>8}  {restore}")
    return lines


def table(results: dict) -> list[str]:
    """The lines of the result set's own table: per variant bytes per step, their share of the full variant's,
    save wall and CPU seconds, the fraction of elements changed, and the restores against the full variant's."""
    if any("network" in modes for out in results.values() for modes in out["restore_s"].values()):
        return _network_table(results)
    lines = [f"{'workload/variant':22} {'bytes/step':>12} {'vs full':>8} {'save s':>8} {'CPU s':>7} "
             f"{'changed':>8}  restore (chain: warm wall s, CPU s, CPU x full; cold wall s, x full)"]
    for name, out in results.items():
        full = results[f"{name.split('/')[0]}/full"]
        rows = out["rows"]
        changed = [r["changed"] for r in rows[1:] if r["changed"] is not None]
        restore = ", ".join(
            f"{k}: {v['warm']['wall']:.4f} {v['warm']['cpu']:.4f} ({v['warm']['cpu'] / f[k]['warm']['cpu']:.2f}x); "
            f"{v['cold']['wall']:.4f} ({v['cold']['wall'] / f[k]['cold']['wall']:.2f}x)"
            for k, v in out["restore_s"].items() for f in [full["restore_s"]])
        share = _median(rows, "bytes") / _median(full["rows"], "bytes")
        lines.append(f"{name:22} {_median(rows, 'bytes'):>12,.0f} {share:>8.4f} "
                     f"{_median(rows, 'save_s'):>8.4f} {_median(rows, 'cpu_s'):>7.4f} "
                     f"{(f'{harness.median(changed):.4f}' if changed else '-'):>8}  {restore}")
    return lines


def result(results: dict, note: str = "") -> harness.Result:
    """The result set of the variants' answers (`worker`'s, by ``workload/variant``): a row per variant of its
    steps after the first (bytes, save wall and CPU, percent of elements changed), a row per restore (warm and
    cold wall and CPU, or over the network) with its ratios to the full variant's; the text is `table`'s, after
    `note`."""
    rows = []
    for name, out in results.items():
        full, steps = results[f"{name.split('/')[0]}/full"], out["rows"][1:]
        metrics = {"step_bytes": harness.series([r["bytes"] for r in steps], "B"),
                   "save_s": harness.series([r["save_s"] for r in steps], "s"),
                   "save_cpu_s": harness.series([r["cpu_s"] for r in steps], "s")}
        if any(r["changed"] is not None for r in steps):
            metrics["changed"] = harness.series([100 * r["changed"] for r in steps], "%")
        rows.append(harness.Row(name, metrics, "steps after the first", {
            "of_full": _median(out["rows"], "bytes") / _median(full["rows"], "bytes"),
            "save_s_x_full": _median(out["rows"], "save_s") / _median(full["rows"], "save_s"),
            "save_cpu_x_full": _median(out["rows"], "cpu_s") / _median(full["rows"], "cpu_s")}))
    for name, out in results.items():
        full = results[f"{name.split('/')[0]}/full"]["restore_s"]
        for chain, modes in out["restore_s"].items():
            metrics = {f"{mode}_{what}_s": harness.series(modes[mode][what + "s"], "s")
                       for mode in modes for what in ("wall", "cpu")}
            if "network" in modes:
                ratios = {f"network_{what}_x_full": modes["network"][what] / full[chain]["network"][what]
                          for what in ("wall", "cpu")}
            else:
                ratios = {"warm_cpu_x_full": modes["warm"]["cpu"] / full[chain]["warm"]["cpu"],
                          "cold_wall_x_full": modes["cold"]["wall"] / full[chain]["cold"]["wall"]}
            label = f"{name} " + ("last step" if chain == "last" else f"chain {chain}")
            rows.append(harness.Row(label, metrics, "restores", ratios))
    return harness.Result(rows, "\n".join(([note] if note else []) + table(results)), results)


def width(scale: float) -> int:
    """The decoders' width at `scale`: 512 at 1, a multiple of 16 (4 heads), at least 32."""
    return max(32, round(512 * scale / 16) * 16)


def run(settings: harness.Settings) -> harness.Result:
    """The case `incremental`: each workload's variants one after the other, each in a fresh process; with
    ``--set storage=gcs``, on the GCS emulator (started here, stopped at the end)."""
    from object_stores import start_object_store

    steps, store = settings.option("steps", 9), settings.option("storage", "local")
    if store not in ("local", "gcs"):
        raise ValueError(f"incremental: storage must be local or gcs, not {store!r}")
    server, bucket = start_object_store(store)
    env = server.environment if server is not None else {}
    base = tempfile.mkdtemp(prefix="xtc-incremental-", dir=settings.option("dir", "") or settings.workdir)
    results = {}
    try:
        for workload, variants in VARIANTS:
            roots = {variant: os.path.join(base, workload, variant) if bucket is None
                     else f"{bucket}/{workload}/{variant}" for variant in variants}
            for variant, root in roots.items():
                results[f"{workload}/{variant}"] = harness.fresh(
                    __file__, "train", workload, variant, root, steps, width(settings.scale), env=env,
                    what=f"the {variant} run of {workload}")
            restores = harness.fresh(__file__, "restore", workload, json.dumps(roots), steps, settings.repeats,
                                     env=env, what=f"the restores of {workload}")
            for variant, root in roots.items():
                results[f"{workload}/{variant}"]["restore_s"] = restores[variant]
                if bucket is None:
                    shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if server is not None:
            server.stop()
    where = "" if bucket is None else (", the persistent tier on gs:// (fake-gcs-server on 127.0.0.1, in memory); "
                                       "restores over HTTP")
    note = (f"decoders of width {width(settings.scale)}, {steps} steps{where}; medians of the {steps - 1} steps after "
            f"the first (bytes, save), of {settings.repeats} restores (every variant's in one process, round by round)")
    return result(results, note)


if __name__ == "__main__":
    harness.worker_main(worker)
