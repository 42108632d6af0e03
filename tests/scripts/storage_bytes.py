"""Restore one item and print what its restore_finished event says was fetched from storage (one JSON line): run
by tests/test_storage_bytes.py in a process whose object-store clients go through a counting proxy.

usage: storage_bytes.py PATH
"""

from __future__ import annotations

import json
import sys

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import events

finished = []
xtc.restore(sys.argv[1], options=xtc.RestoreOptions(listeners=(lambda e: e.kind == events.RESTORE_FINISHED
                                                                and finished.append(e),)))
print(json.dumps({"storage_bytes": finished[0].details["storage_bytes"]}))
