"""Both stacks read and write the same checkpoints: torch_xla SPMD state saved here (torch 2.9 + torch_xla) is
restored as DTensors by a job on the newest stack (torch 2.14, no torch_xla), whose DTensor save comes back
onto torch_xla SPMD tensors; an FSDP2 model trained and saved on the newest stack is restored here onto SPMD
tensors. Bit for bit: the jobs report SHA-256 digests of every array, compared with this process's.

The newest stack's interpreter is `$XTC_NEWEST_PYTHON`, else `.venv-newest/bin/python` (`make test` makes it);
without either these tests are skipped with that reason."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from conftest import make_mesh, sharded
from forked import launch_job

import xla_tensorstore_ckpt as xtc

pytestmark = pytest.mark.xla

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "dtensor_job.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import dtensor_job  # noqa: E402

NEWEST = os.environ.get("XTC_NEWEST_PYTHON") or os.path.join(HERE, "..", ".venv-newest", "bin", "python")
# `make test` installs the newest stack while this suite runs: its stamp, written once the install is done (the
# stamp's ".failed" if the install failed).
NEWEST_READY = os.environ.get("XTC_NEWEST_READY")
INSTALL_WAIT_S = 1800


@pytest.fixture(scope="module")
def newest() -> str:
    """The newest stack's interpreter, checked to be that stack (a newer torch, no torch_xla); once installed,
    where `make test` is installing it."""
    if NEWEST_READY:
        waited = time.monotonic()
        while not os.path.exists(NEWEST_READY):
            if os.path.exists(NEWEST_READY + ".failed"):
                pytest.fail("the newest stack's install failed (make test prints its log)")
            if time.monotonic() - waited > INSTALL_WAIT_S:
                pytest.fail(f"the newest stack was not installed after {INSTALL_WAIT_S} s ({NEWEST_READY})")
            time.sleep(1)  # the install's end is the event: its stamp appears
    if not os.path.exists(NEWEST):
        pytest.skip(f"no newest-stack interpreter at {NEWEST} (make test creates it)")
    return NEWEST


def launch(python: str, world: int, *args) -> list[dict]:
    results = launch_job(SCRIPT, world, *map(str, args), python=python)
    for r in results:
        assert r["returncode"] == 0, r["stderr"][-3000:]
        stack = next(line for line in r["lines"] if "torch" in line)
        assert stack["torch"] != torch.__version__ and not stack["torch_xla"], stack  # the other stack
    return results


def reported(results: list[dict], field: str) -> list:
    return [next(line[field] for line in r["lines"] if field in line) for r in results]


def test_spmd_save_restores_as_dtensors_on_the_newest_stack_and_their_save_back_onto_spmd(tmp_path, newest):
    mesh = make_mesh((4, 2), ("a", "b"))
    values = {name: dtensor_job.global_value(name) for name in ("even", "uneven", "two_dims", "bf16")}
    xtc.save(tmp_path / "spmd", {name: sharded(v, mesh, ("a", "b")) for name, v in values.items()})
    expected = {name: dtensor_job.digest(v) for name, v in values.items()}
    assert reported(launch(newest, 2, "from_spmd", tmp_path), "digests") == [expected, expected]
    # the newest stack's DTensor save ("back"), onto SPMD tensors of another mesh here
    target = {name: sharded(torch.zeros_like(v), make_mesh((2, 4), ("x", "y")), ("y", None))
              for name, v in values.items()}
    back = xtc.restore(tmp_path / "back", target)
    for name, value in values.items():
        assert torch.equal(back[name].cpu(), value), name


def test_fsdp2_training_saved_on_the_newest_stack_restores_onto_spmd_tensors(tmp_path, newest):
    digests = reported(launch(newest, 2, "train", tmp_path / "run", 2), "digests")
    assert digests[0] == digests[1]
    item = tmp_path / "run" / "2" / "model"
    mesh = make_mesh((4, 2), ("a", "b"))
    target = {name: sharded(torch.zeros(meta.shape, dtype=meta.torch_dtype), mesh,
                            ("a", "b") if len(meta.shape) == 2 else ("a",))
              for name, meta in xtc.metadata(item).items()}
    restored = xtc.restore(item, target)
    assert all(tuple(t.shape) == tuple(target[k].shape) and t.device.type == "xla" for k, t in restored.items())
    assert {f"model.{k}": dtensor_job.digest(t.cpu()) for k, t in restored.items()} == \
        {k: v for k, v in digests[0].items() if k.startswith("model.")}
