"""Soak: many save/restore cycles with retention and asynchronous saves on, and the saving process killed
(SIGKILL) at random moments. At the end the steps on disk are exactly what the retention policy keeps, no
temporary files are left, and every kept step verifies.

usage: soak.py ROOT [--cycles 200] [--crash-every 20] [--seed 0]
One cycle is one saved step; each (re)started saver first restores the newest step and checks it bit for bit.
Prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

import torch
from forking import run_child  # this directory's

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import layout
from xla_tensorstore_ckpt.tools import scans

MAX_TO_KEEP, KEEP_PERIOD = 3, 10


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 64, generator=g), "layers": [torch.randn(32, 32, generator=g) for _ in range(4)],
            "b": torch.randn(64, generator=g).to(torch.bfloat16)}


def options() -> xtc.CheckpointManagerOptions:
    return xtc.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=MAX_TO_KEEP, keep_period=KEEP_PERIOD,
                                        async_save=True, save_rng=False)


def child(root: str, last: int) -> None:
    with xtc.CheckpointManager(root, options()) as mgr:
        model = {"w": torch.zeros(128, 64), "layers": [torch.zeros(32, 32) for _ in range(4)],
                 "b": torch.zeros(64, dtype=torch.bfloat16)}
        extra = {"step": -1}
        start = mgr.restore("latest", model=model, extra=extra)
        if start is not None:
            expected = state_for(start)
            ok = extra["step"] == start and torch.equal(model["w"], expected["w"]) and all(
                torch.equal(a, b) for a, b in zip(model["layers"], expected["layers"]))
            print(json.dumps({"restored": start, "ok": bool(ok)}), flush=True)
            if not ok:
                sys.exit(3)
        for step in range((start or 0) + 1, last + 1):
            mgr.save(step, model=state_for(step), extra={"step": step})
            print(json.dumps({"cycle": step, "committed": mgr.all_steps()}), flush=True)
            time.sleep(random.random() * 0.02)


class Saver:
    """A saver (`child`) in a fork of this process, which has imported torch and this library but started
    nothing yet (no thread, no tensorstore context): a process of its own, as a subprocess would be, without
    paying for the imports at every restart. Its events come through a pipe (`stdout`)."""

    def __init__(self, root: str, last: int):
        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(read_end)
            random.seed()  # its own pauses between saves, not the ones every fork would inherit
            run_child(lambda: child(root, last), write_end)
        os.close(write_end)
        self.stdout = os.fdopen(read_end, "r")
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self) -> int:
        self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self.stdout.close()
        return self.returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--crash-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    committed: set[int] = set()
    crashes = restarts = 0
    while True:
        proc = Saver(args.root, args.cycles)
        restarts += 1
        kill_after = rng.randint(max(1, args.crash_every // 2), args.crash_every * 3 // 2)
        seen = 0
        killed = False
        for line in proc.stdout:
            event = json.loads(line)
            if event.get("ok") is False:
                raise SystemExit(f"restore of step {event['restored']} after a crash was not bit-exact")
            if "cycle" in event:
                committed.update(event["committed"])
                seen += 1
                if seen >= kill_after and event["cycle"] < args.cycles:
                    time.sleep(rng.random() * 0.05)  # somewhere inside the next save
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
        proc.wait()
        if killed:
            crashes += 1
            continue
        if proc.returncode != 0:
            raise SystemExit(f"saver failed with status {proc.returncode}")
        break
    # Retention runs at each commit: if the last kill interrupted the deletions of step `cycles`'s retention and
    # the restarted saver had nothing left to save, older steps remain until the next commit. One more save
    # (after the restart's cleanup of partial steps) makes the expected steps independent of when the kill came.
    final = args.cycles + 1
    with xtc.CheckpointManager(args.root, options()) as mgr:
        mgr.save(final, model=state_for(final), extra={"step": final})
    with xtc.CheckpointManager(args.root, options()) as mgr:
        on_disk = mgr.all_steps()
    everything = committed | set(on_disk) | {final}
    newest = sorted(everything)[-MAX_TO_KEEP:]
    expected = sorted({s for s in everything if s % KEEP_PERIOD == 0} | set(newest))
    names = sorted(os.listdir(args.root))
    leftovers = [os.path.join(r, n) for r, _, files in os.walk(args.root) for n in files
                 if n.endswith(".tmp") or "__lock" in n or n.startswith(layout.MANAGER_LOCK)]
    report = scans.verify(args.root)
    checked, problems = report.arrays, report.problems
    summary = {"cycles": args.cycles, "crashes": crashes, "restarts": restarts, "steps_on_disk": on_disk,
               "expected_steps": expected, "kept_steps_verified": on_disk if not problems else [],
               "arrays_verified": checked, "problems": [p.message for p in problems], "leftovers": leftovers}
    print(json.dumps(summary))
    if on_disk != expected or leftovers or problems or names != [str(s) for s in sorted(on_disk, key=str)]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
