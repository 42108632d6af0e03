#!/usr/bin/env bash
# Writes tests/golden/orbax-0.11: an item and a CheckpointManager root written by orbax-checkpoint 0.11.24 (the
# test environment has 0.12), from the trees of tests/orbax_trees.py, with tests/scripts/orbax_tool.py. Run once,
# from the repository root; test_orbax_interop.py reads the result. Needs the package registry.
set -euo pipefail
venv=$(mktemp -d)/orbax-0.11
python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet "orbax-checkpoint==0.11.24" "jax[cpu]==0.10.2"
rm -rf tests/golden/orbax-0.11
mkdir -p tests/golden/orbax-0.11
"$venv/bin/python" tests/scripts/orbax_tool.py write tests/golden/orbax-0.11/item --ocdbt 1 --zarr3 1
"$venv/bin/python" tests/scripts/orbax_tool.py manager tests/golden/orbax-0.11/root
