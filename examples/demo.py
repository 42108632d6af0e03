"""The main job (`make demo`): train a small decoder-only transformer with torch_xla SPMD on 8 CPU devices and
asynchronous checkpoints, kill it (a simulated preemption), resume from the latest step in a fresh process with
the loss curve continuing exactly, restore the checkpoint onto 4 devices with another partition spec and get the
same evaluation loss, inspect it with `xtckpt`, and export it to safetensors.

    python examples/demo.py [--checkpoint-dir ./checkpoints] [--steps 40] [--save-steps 10] [--kill-at 27]

`--checkpoint-dir gs://bucket/prefix` or `s3://bucket/prefix` works as well. The demo owns the checkpoint directory
and the export directory: it clears the first at the start and replaces the second's earlier export at the end, so it
runs any number of times in a row.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")


def section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 74 - len(title)), flush=True)


def environment(devices: int) -> dict:
    """The training processes' environment: `devices` virtual CPU devices. XLA's CPU backend would spend three
    quarters of a run optimizing the compiled graphs with LLVM (20 s of 25 for the small model), for code that runs
    a few dozen steps: level 0 compiles 4x faster and computes the same losses run after run. A caller's own
    XLA_FLAGS win."""
    return dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="3",
                PYTHONWARNINGS="ignore", XLA_FLAGS=os.environ.get("XLA_FLAGS", "--xla_backend_optimization_level=0"))


def train(args, extra: list[str], devices: int = 8, kill_at: int | None = None) -> list[dict]:
    """Run train.py, print its steps as they come, optionally SIGKILL it once it has reached step `kill_at` and
    reported at least one committed step (a commit lands in the background, after its step: how many steps
    later depends on the machine, so the kill waits for the event rather than counting steps)."""
    cmd = [sys.executable, TRAIN, "--json", "--checkpoint-dir", args.checkpoint_dir, "--steps", str(args.steps),
           "--save-steps", str(args.save_steps), "--max-to-keep", str(args.max_to_keep), *args.model_args, *extra]
    proc = subprocess.Popen(cmd, env=environment(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = []
    committed: list[int] = []
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        events.append(event)
        if "step" in event and "loss" in event:
            print(f"  step {event['step']:3d}  loss {event['loss']:.4f}  step time {1000 * event['step_s']:5.0f} ms"
                  f"  checkpoint stall {1000 * event['stall_s']:4.0f} ms{'  (saved)' if event['saved'] else ''}",
                  flush=True)
        elif "committed" in event:
            committed.append(event["committed"])
            print(f"  step {event['committed']} committed (reported by the manager's on_commit callback)", flush=True)
        elif "restored" in event:
            print(f"  restored step {event['restored']} in {event['seconds']:.2f} s", flush=True)
        elif "eval_loss" in event:
            print(f"  evaluation loss at step {event['step']} on {event['devices']} devices (mesh {event['mesh']}):"
                  f" {event['eval_loss']:.6f}", flush=True)
        reached = max((e["step"] for e in events if "loss" in e), default=0)
        if kill_at is not None and reached >= kill_at and committed:
            proc.send_signal(signal.SIGKILL)
            print(f"  -- SIGKILL sent to the training process (pid {proc.pid}) after step {reached}; committed so "
                  f"far: {committed} --", flush=True)
            break
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0 and proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"training failed:\n{err[-3000:]}")
    if kill_at is not None and proc.returncode == 0:
        print(f"  the run finished before a commit was reported after step {kill_at}: nothing to kill", flush=True)
    return events


def run_cli(*argv: str) -> str:
    """What ``xtckpt ARGV`` prints; run in this process (which imported the library already), not a new one."""
    from xla_tensorstore_ckpt import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(list(argv))
        except SystemExit as exc:  # a usage error: argparse exits
            status = exc.code
    if status != 0:
        raise SystemExit(f"xtckpt {' '.join(argv)} failed: {err.getvalue()}")
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--max-to-keep", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=27)
    parser.add_argument("--small", action="store_true", help="a tiny model (for the test suite)")
    parser.add_argument("--export-dir", default=None, help="default: <checkpoint-dir>-export (local only)")
    args = parser.parse_args()
    args.model_args = ["--dim", "64", "--layers", "1", "--seq", "16", "--batch", "8"] if args.small else []
    if args.kill_at <= args.save_steps or args.kill_at >= args.steps:
        raise SystemExit("--kill-at must fall after the first save and before the last step")
    started = time.perf_counter()

    sys.path.insert(0, os.path.join(HERE, ".."))
    from xla_tensorstore_ckpt import storage

    storage.location(args.checkpoint_dir).delete_tree()

    section(f"1. training on 8 devices (mesh 4x2, FSDP-style 2D sharding), checkpoint every {args.save_steps} "
            "steps, async")
    first = train(args, ["--resume-from-checkpoint", "null"], kill_at=args.kill_at)
    losses_before = {e["step"]: e["loss"] for e in first if "loss" in e}

    section("2. simulated preemption: the process was killed; what is on disk")
    print(run_cli("steps", args.checkpoint_dir), end="")

    section("3. resume from the latest step in a fresh process (resume_from_checkpoint=latest)")
    second = train(args, ["--resume-from-checkpoint", "latest"])
    restored = next((e["restored"] for e in second if "restored" in e), None)
    if restored is None:
        print("  nothing was committed before the kill: the run started again from scratch")
    losses_after = {e["step"]: e["loss"] for e in second if "loss" in e}
    overlap = [s for s in losses_after if s in losses_before]
    exact = all(losses_after[s] == losses_before[s] for s in overlap)
    ran_twice = f"steps {overlap[0]}-{overlap[-1]} ran twice" if overlap else "no step ran twice"
    print(f"  resumed at step {restored or 0}; {ran_twice} (before the kill and after the resume): losses "
          f"identical to the last bit: {exact}")
    if not exact:
        raise SystemExit("the resumed loss curve differs")
    eval_8 = next(e["eval_loss"] for e in second if "eval_loss" in e)

    section("4. the same checkpoint on 4 devices, mesh 2x2, partition specs with the axes' roles swapped")
    third = train(args, ["--resume-from-checkpoint", "latest", "--eval-only", "--mesh", "2x2", "--swap-spec"],
                  devices=4)
    eval_4 = next(e["eval_loss"] for e in third if "eval_loss" in e)
    difference = abs(eval_4 - eval_8)
    print(f"  evaluation loss: 8 devices {eval_8:.6f}, 4 devices {eval_4:.6f} (difference {difference:.2e})")
    if difference > 1e-4:
        raise SystemExit("the evaluation loss on the other mesh differs")

    section("5. offline inspection: xtckpt steps / xtckpt tree")
    print(run_cli("steps", args.checkpoint_dir), end="")
    latest = args.steps
    tree = run_cli("tree", f"{args.checkpoint_dir.rstrip('/')}/{latest}", "model").splitlines()
    print("\n".join(tree[:8] + ["  ..."] + tree[-2:]))

    section("6. export to safetensors (Hugging Face layout), streaming tensor by tensor")
    export_dir = args.export_dir or (args.checkpoint_dir.rstrip("/") + "-export")
    if "://" not in export_dir:
        for line in run_cli("export", f"{args.checkpoint_dir.rstrip('/')}/{latest}", export_dir, "--format",
                            "safetensors", "--max-file-size", "4MB", "--overwrite").splitlines():
            print(f"  {line}  ({os.path.getsize(line) / 2**20:.1f} MiB)")
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(export_dir) if f.endswith(".safetensors"))
        loaded = {}
        for name in files:
            loaded.update(load_file(os.path.join(export_dir, name)))
        print(f"  {len(loaded)} tensors, {sum(t.numel() for t in loaded.values()) / 1e6:.2f}M parameters, "
              f"loadable with safetensors.torch.load_file")

    print(f"\nall checks passed in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
