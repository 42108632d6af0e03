#!/usr/bin/env bash
# Writes tests/golden/torch_xla-2.9: "root", a root torch_xla 2.9's own CheckpointManager wrote (the run of
# tests/scripts/torch_xla_manager.py: its model, AdamW and StepLR, on a 1x2 mesh of 2 CPU devices), kept to its
# newest step, 6 (steps 2 and 4 deleted: the root stays one torch_xla's manager reads, a few tens of KiB), and
# "expected", the model and optimizer state after step 6 saved by this library. Run once on the XLA stack, from
# the repository root; test_torchtitan_config.py starts a torchtitan job from it on the newest stack (no torch_xla
# there).
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
rm -rf tests/golden/torch_xla-2.9
mkdir -p tests/golden/torch_xla-2.9
CPU_NUM_DEVICES=2 RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29517} PYTHONPATH=$PWD \
  "$python" tests/scripts/torch_xla_manager.py tests/golden/torch_xla-2.9/root tests/golden/torch_xla-2.9/expected \
  --devices 2
rm -r tests/golden/torch_xla-2.9/root/2 tests/golden/torch_xla-2.9/root/4
