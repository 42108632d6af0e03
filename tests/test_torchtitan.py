"""torchtitan selects this library by config (`integrations.torchtitan.XtcCheckpointManager`): jobs of the real
torchtitan 0.3.0 on CPU over gloo (tests/scripts/titan_job.py: its llama3 debug model under FSDP2, its optimizer
and LR-scheduler containers, its data loader), killed, resumed on other process counts, and started from
torchtitan's own DCP checkpoints and Hugging Face exports."""

from __future__ import annotations

import os

import pytest
from forked import launch_job

pytestmark = pytest.mark.trainers

JOB = os.path.join(os.path.dirname(__file__), "scripts", "titan_job.py")


def _run(world: int, *args: str) -> list[dict]:
    results = launch_job(JOB, world, *args)
    for rank, result in enumerate(results):
        assert result["returncode"] == 0, f"rank {rank}:\n{result['stderr'][-3000:]}"
    return results


def _losses(results: list[dict]) -> dict[tuple[int, int], str]:
    return {(rank, line["step"]): line["loss"] for rank, result in enumerate(results)
            for line in result["lines"] if "loss" in line}


def _state(results: list[dict]) -> dict:
    states = [line["state"] for line in results[0]["lines"] if "state" in line]
    assert len(states) == 1
    return states[0]


def _loaded(results: list[dict]) -> list[dict]:
    return [next(line for line in result["lines"] if "loaded" in line) for result in results]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[str, list[dict]]:
    """Two processes, six steps, a save every two steps (asynchronous), the full state printed after step 4."""
    dump = str(tmp_path_factory.mktemp("titan") / "full")
    return dump, _run(2, "train", dump, "6", "--interval", "2", "--state-at", "4")


def test_killed_after_a_commit_resumes_bit_for_bit(full_run, tmp_path):
    _, full = full_run
    dump = str(tmp_path / "killed")
    killed = launch_job(JOB, 2, "train", dump, "6", "--interval", "2", "--kill-at", "4")
    assert any(result["returncode"] == -9 for result in killed), [r["stderr"][-2000:] for r in killed]
    assert os.path.isdir(os.path.join(dump, "checkpoint", "step_4"))
    resumed = _run(2, "train", dump, "6", "--interval", "2")
    assert [line["start"] for line in _loaded(resumed)] == [4, 4]
    after = _losses(resumed)
    assert sorted(after) == [(rank, step) for rank in (0, 1) for step in (5, 6)]
    full_losses = _losses(full)
    assert after == {key: full_losses[key] for key in after}  # float.hex: bit for bit
    # The saves split torchtitan's fused QKV weights from each process's shard (no gather), checked at the first
    # save against torchtitan's own split, value for value.
    assert [line["qkv_split_locally"] for result in full for line in result["lines"]
            if "qkv_split_locally" in line] == [True, True]


def test_resume_onto_four_processes_restores_every_state_exactly(full_run):
    dump, full = full_run
    # The data loader's position belongs to two data-parallel ranks; torchtitan cannot reshard it.
    restored = _run(4, "state", dump, "6", "--load-step", "4", "--exclude", "dataloader")
    assert _loaded(restored)[0]["loaded"] is True
    assert _state(restored) == _state(full)


def test_initial_load_from_torchtitans_own_dcp_checkpoint(tmp_path):
    dcp_dump = str(tmp_path / "dcp")
    written = _run(2, "train", dcp_dump, "4", "--manager", "dcp", "--interval", "4", "--async-mode", "disabled",
                   "--state-at", "4")
    source = os.path.join(dcp_dump, "checkpoint", "step-4")
    full = _run(2, "state", str(tmp_path / "ours_full"), "--initial", source, "--full-initial")
    assert _state(full) == _state(written)
    model_only = _state(_run(2, "state", str(tmp_path / "ours_model"), "--initial", source))
    assert model_only["model"] == _state(written)["model"]
    assert model_only["train_step"] == 0 and model_only["lr"] != _state(written)["lr"]


def test_hugging_face_exports_both_ways(tmp_path):
    # torchtitan's DCP manager exports the last step in HF safetensors; we start from that directory.
    dcp_dump = str(tmp_path / "dcp")
    written = _run(2, "train", dcp_dump, "2", "--manager", "dcp", "--async-mode", "disabled", "--last-hf",
                   "--state-at", "2")
    ours = _state(_run(2, "state", str(tmp_path / "ours"), "--initial", os.path.join(dcp_dump, "checkpoint",
                                                                                     "step-2")))
    assert ours["model"] == _state(written)["model"]
    # Our manager exports its last step as HF safetensors; torchtitan's DCP manager starts from that.
    our_dump = str(tmp_path / "ours_hf")
    exported = _run(2, "train", our_dump, "2", "--last-hf", "--state-at", "2")
    theirs = _state(_run(2, "state", str(tmp_path / "theirs"), "--manager", "dcp", "--initial-hf", "--initial",
                         os.path.join(our_dump, "checkpoint", "step_2-hf")))
    assert theirs["model"] == _state(exported)["model"]
