"""Random generator states of every process of a job, as one state tree.

Each generator (torch CPU, Python, numpy, torch_xla's seed when torch_xla is in use, and the current CUDA
device's generator when the process has initialised CUDA: a DTensor job on GPUs, one device per process) becomes
a global array with one row per process; process ``i`` holds row ``i`` (a `ShardedArray` shard), so a save of several
processes writes each process's state once, by that process, and a restore gives each process its own row back.

When a run restores with more processes than saved, process ``i`` has no row of its own: it takes row
``i % saved`` and re-seeds every generator from a hash of that row and ``i``, so its stream is deterministic and
differs from every other process's; a warning says so. With fewer processes, the rows beyond the count are
unused. Checkpoints of format version 1 held one unsharded state (that of process 0); it is read as row 0.

Called by the manager on every process; blocks; not thread-safe (generators are process-global).
"""

from __future__ import annotations

import hashlib
import random
import sys
import warnings
from typing import Any

import numpy as np
import torch

from .. import checkpointer
from ..core.errors import CheckpointError
from ..core.events import Emitter
from ..core.sharded_array import ShardedArray
from ..options import RestoreOptions
from ..storage import Location

_LAYOUT = "rows per process"


def capture(index: int, count: int) -> dict:
    """This process's generator states as row `index` of `count` (a tree of `ShardedArray`s and a layout tag)."""
    python_version, python_words, python_gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    rows: dict[str, torch.Tensor] = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([python_version, *python_words], dtype=torch.int64),
        "python_gauss": _optional_float(python_gauss),
        "numpy_key": torch.from_numpy(numpy_state["state"]["key"].astype(np.uint32)),
        "numpy_pos": torch.tensor([int(numpy_state["state"]["pos"])], dtype=torch.int64),
        "numpy_gauss": _optional_float(float(numpy_state["gauss"]) if numpy_state["has_gauss"] else None),
    }
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        rows["xla_seed"] = torch.tensor([int(xm.get_rng_state())], dtype=torch.uint64)
    if _cuda_in_use():
        rows["cuda"] = torch.cuda.get_rng_state()
    tree: dict[str, Any] = {name: _row(value, index, count) for name, value in rows.items()}
    tree["layout"] = _LAYOUT
    tree["numpy_bit_generator"] = str(numpy_state["bit_generator"])
    return tree


def restore(loc: Location, index: int, count: int, *, options: RestoreOptions,
            events: Emitter | None = None) -> None:
    """Set this process's generators from the item at `loc` (written by `capture`, or by format version 1);
    `events` hears of the reads."""
    apply(checkpointer.restore_item(loc, options=options, events=events), index, count, where=str(loc))


def apply(saved: Any, index: int, count: int, *, where: str) -> None:
    """Set this process's generators from a tree read back from `capture` (CPU tensors of every row), or from
    a version-1 state. Raises `CheckpointError` naming `where` if the tree is malformed."""
    try:
        if isinstance(saved, dict) and saved.get("layout") == _LAYOUT:
            saved_count = int(saved["torch"].shape[0])
            row = {name: value[index % saved_count] for name, value in saved.items()
                   if isinstance(value, torch.Tensor)}
            _set(row, str(saved["numpy_bit_generator"]))
            if index >= saved_count:
                seed = _derived_seed(row["torch"], index)
                warnings.warn(f"{where} holds the random generator states of {saved_count} processes; process "
                              f"{index} of {count} takes those of process {index % saved_count}, re-seeded with "
                              f"{seed} (derived from them and its index)", stacklevel=4)
                _reseed(seed)
        else:
            _set_version_1(saved)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise CheckpointError(f"the random generator states at {where} are malformed: {exc}") from exc


def _row(value: torch.Tensor, index: int, count: int) -> ShardedArray:
    row = value.reshape(1, -1).contiguous()
    width = row.shape[1]
    shard_index = ((index, index + 1), (0, width))
    return ShardedArray((count, width), row.dtype, (1, width), ((shard_index, row),), mesh=((count,), (0,)))


def _optional_float(value: float | None) -> torch.Tensor:
    """[present, value]: Python's and numpy's cached normal variate, which may be absent."""
    return torch.tensor([0.0 if value is None else 1.0, 0.0 if value is None else value], dtype=torch.float64)


def _from_optional(row: torch.Tensor) -> float | None:
    return float(row[1]) if float(row[0]) else None


def _set(row: dict[str, torch.Tensor], bit_generator: str) -> None:
    torch.set_rng_state(row["torch"].to(torch.uint8).clone())  # a row view with an offset crashes torch 2.9
    words = [int(v) for v in row["python"]]
    random.setstate((words[0], tuple(words[1:]), _from_optional(row["python_gauss"])))
    gauss = _from_optional(row["numpy_gauss"])
    np.random.set_state({"bit_generator": bit_generator,
                         "state": {"key": row["numpy_key"].numpy().astype(np.uint32), "pos": int(row["numpy_pos"][0])},
                         "has_gauss": int(gauss is not None), "gauss": gauss or 0.0})
    if "xla_seed" in row and "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(row["xla_seed"].numpy()[0]))  # int() of a torch uint64 goes through int64
    if "cuda" in row and torch.cuda.is_available():  # set when CUDA initialises, if it has not yet
        torch.cuda.set_rng_state(row["cuda"].to(torch.uint8).clone())


def _cuda_in_use() -> bool:
    """Whether this process has initialised CUDA (a process that never touched it is not made to: that takes
    seconds and device memory, and its CUDA generator holds nothing of the run)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _derived_seed(torch_state: torch.Tensor, index: int) -> int:
    digest = hashlib.sha256(torch_state.to(torch.uint8).numpy().tobytes() + index.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds are < 2**63


def _reseed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)


def _set_version_1(state: Any) -> None:
    """The single state written by format version 1 (that of process 0)."""
    torch.set_rng_state(state["torch"].to(torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state({"bit_generator": numpy_state["bit_generator"],
                         "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
                         "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]})
    if "xla_seed" in state and "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla_seed"]))
