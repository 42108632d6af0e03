"""Runs xtckpt commands in a process where importing torch_xla raises, to prove the offline tools never need it.

usage: no_xla_cli.py JSON_LIST_OF_ARGV_LISTS  -> prints one JSON line per command: {"status", "stdout", "stderr"}
"""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import json
import sys


class _BlockTorchXLA(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch_xla" or name.startswith("torch_xla."):
            raise ImportError(f"{name} is blocked in this process")
        return None


sys.meta_path.insert(0, _BlockTorchXLA())

from xla_tensorstore_ckpt import cli  # noqa: E402

for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    print(json.dumps({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(),
                      "torch_xla_imported": "torch_xla" in sys.modules}))
