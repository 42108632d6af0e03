"""One process of a simulated two-host job with a local tier per host (gloo on 127.0.0.1; RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment). The shards a process holds follow its host, not its rank, as
devices do on a pod: a restarted job may give the same host another process index.

usage: multitier.py save ROOT LOCAL_BASE HOST     -> saves steps 1-3 (persistent every 2, local every step)
       multitier.py restore ROOT LOCAL_BASE HOST [SHARD]  -> restore("latest") and checks every value against its
                                                   step; with SHARD, the process holds the rows of host SHARD's
                                                   shard (another device assignment) while it reads HOST's tier
       multitier.py resume_save ROOT LOCAL_BASE HOST -> restore("latest"), then saves the next steps up to 4
The local tier of HOST is LOCAL_BASE/host<HOST>. Prints one JSON line per event: {"rank", "host", ...}.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import torch

import xla_tensorstore_ckpt as xtc

SHAPE, SHARD = (64, 32), (32, 32)  # two row shards: host h holds rows h*32:(h+1)*32


def global_value(step: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(step))


def model_for(step: int | None, host: int) -> dict:
    index = ((host * SHARD[0], (host + 1) * SHARD[0]), (0, SHARD[1]))
    if step is None:
        return {"w": xtc.ShardedArray.target(SHAPE, torch.float32, SHARD, [index])}
    return {"w": xtc.ShardedArray.from_tensor(global_value(step), SHARD, [index])}


class Loader:
    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def main() -> None:
    mode, root, local_base, host = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    shard = int(sys.argv[5]) if len(sys.argv) > 5 else host
    rank = int(os.environ["RANK"])
    options = xtc.CheckpointManagerOptions(
        save_interval_steps=2, max_to_keep=2, local_directory=os.path.join(local_base, f"host{host}"),
        local_save_interval_steps=1, local_max_to_keep=2, coordination_timeout_s=120)
    manager = xtc.CheckpointManager(root, options)
    if mode in ("save", "resume_save"):
        start = 1
        if mode == "resume_save":
            start = manager.restore("latest", model=model_for(None, host), data_loader=Loader()) + 1
        for step in range(start, 4 if mode == "save" else 5):
            torch.manual_seed(100 * step + host)
            manager.save(step, model=model_for(step, host), data_loader=Loader(10 * step))
        manager.wait_until_finished()
        print(json.dumps({"rank": rank, "host": host, "local": manager.all_steps("local"),
                          "persistent": manager.all_steps("persistent")}), flush=True)
    else:
        logs: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("xla_tensorstore_ckpt").addHandler(handler)
        logging.getLogger("xla_tensorstore_ckpt").setLevel(logging.INFO)
        model, loader = model_for(None, shard), Loader()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = manager.restore("latest", model=model, data_loader=loader)
        (index, data), = model["w"].shards
        expected = global_value(step)[index[0][0]:index[0][1]]
        print(json.dumps({"rank": rank, "host": host, "step": step, "equal": bool(torch.equal(data, expected)),
                          "position": loader.position, "draw": torch.rand(1).item(), "logs": logs,
                          "warnings": [str(w.message) for w in caught]}), flush=True)
    manager.close()


if __name__ == "__main__":
    main()
