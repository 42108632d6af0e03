"""Files as a user expects them: every file and directory a save creates (metadata, chunk files, OCDBT stores, the
manager's markers, both tiers) has the mode the process's umask gives a new file (0666 & ~umask) or directory
(0777 & ~umask), so other users of a shared checkpoint directory read what the umask lets them read. Saved in a
fresh process (the umask is the process's), once per umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

_SAVE = textwrap.dedent("""
    import json, os, sys
    import torch
    import xla_tensorstore_ckpt as xtc

    base = sys.argv[1]
    for umask in (0o022, 0o002, 0o027):
        os.umask(umask)
        out = os.path.join(base, f"{umask:03o}")
        state = {"w": torch.arange(48.0).reshape(6, 8), "s": "text", "n": 3}
        xtc.save(os.path.join(out, "ocdbt"), state)
        xtc.save(os.path.join(out, "dirs"), state, options=xtc.SaveOptions(use_ocdbt=False))
        options = xtc.CheckpointManagerOptions(local_directory=os.path.join(out, "local"),
                                               local_save_interval_steps=1, save_interval_steps=2)
        with xtc.CheckpointManager(os.path.join(out, "persistent"), options) as manager:
            for step in range(3):
                manager.save(step, model={"w": torch.full((4, 4), float(step))}, metrics={"loss": 1.0 / (step + 1)})
    print(json.dumps("done"))
""")


def _modes(root: str) -> dict[str, int]:
    """The permission bits of every entry below `root` (not following links)."""
    out = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(parent, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    base = str(tmp_path_factory.mktemp("modes"))
    done = subprocess.run([sys.executable, "-c", _SAVE, base], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == "done"
    return base


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o027], ids=lambda u: f"umask-{u:03o}")
def test_saved_files_honour_the_umask(saved, umask):
    root = os.path.join(saved, f"{umask:03o}")
    modes = _modes(root)
    files = {p: m for p, m in modes.items() if os.path.isfile(os.path.join(root, p))}
    dirs = {p: m for p, m in modes.items() if os.path.isdir(os.path.join(root, p))}
    # Everything the save writes is there: metadata, chunks, OCDBT stores, both tiers' steps and markers.
    names = {os.path.basename(p) for p in files}
    assert {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "zarr.json"} <= names, sorted(names)
    assert any(p.startswith("local/") for p in files) and any(p.startswith("persistent/") for p in files)
    assert any("/c/" in p for p in files) and any("/d/" in p for p in files)
    wrong = {p: f"{m:o}" for p, m in files.items() if m != 0o666 & ~umask}
    wrong.update({p: f"{m:o}" for p, m in dirs.items() if m != 0o777 & ~umask})
    assert not wrong, f"modes other than {0o666 & ~umask:o} (files) and {0o777 & ~umask:o} (directories): {wrong}"
