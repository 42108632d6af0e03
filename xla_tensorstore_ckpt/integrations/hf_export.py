"""A step's model exported as Hugging Face safetensors to any location we write (local, ``gs://``, ``s3://``), for
the trainers' "last save in HF" options (`integrations.torchtitan`). `export.export_safetensors` writes local
directories; a remote destination gets that export staged in a local temporary directory, then uploaded file by
file (an earlier export there deleted first), the index last. Called by one process; blocks; raises what the
export and the storage raise.
"""

from __future__ import annotations

import os
import tempfile

from .. import storage
from ..formats import safetensors
from ..tools import export, inspection

MAX_FILE_BYTES = 5 << 30  # Hugging Face's usual shard size


def export_model(step: str | storage.Location, out: str) -> list[str]:
    """Export the ``model`` item of the step at `step` to the directory `out`, replacing an earlier export there;
    returns the file names written."""
    checkpoint = inspection.open_checkpoint(step)
    destination = storage.location(out)
    local = destination.local_file("")
    if local is not None:
        return [os.path.basename(f) for f in export.export_safetensors(
            checkpoint, ("model",), local, max_file_bytes=MAX_FILE_BYTES, overwrite=True)]
    with tempfile.TemporaryDirectory(prefix="xtc-hf-export-") as staging:
        written = sorted(os.path.basename(f) for f in export.export_safetensors(
            checkpoint, ("model",), staging, max_file_bytes=MAX_FILE_BYTES))
        if not destination.is_empty():
            destination.delete_tree()
        # The index names the shards: it goes last, so a reader never finds one naming a missing file.
        for name in sorted(written, key=lambda n: n == safetensors.INDEX_NAME):
            with open(os.path.join(staging, name), "rb") as f:
                destination.write(name, f.read())
    return written
