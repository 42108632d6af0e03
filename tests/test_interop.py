"""Every array is an ordinary zarr v3 array with a CRC32C checksum per chunk: in an item of plain directories,
plain zarr-python (with the registered extra dtypes) and plain tensorstore read it; in an OCDBT store (the
default), plain tensorstore does, through its ``ocdbt`` kvstore."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr
from helpers import DTYPES, random_tensor

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.core import dtypes

PLAIN = xtc.SaveOptions(use_ocdbt=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_zarr_and_tensorstore_read_every_dtype(tmp_path, dtype):
    src = random_tensor((6, 4), dtype)
    xtc.save(tmp_path / "ck", {"w": src}, options=PLAIN)
    array_dir = tmp_path / "ck" / "w"
    z = zarr.open_array(str(array_dir), mode="r")
    assert z.shape == (6, 4)
    assert torch.equal(dtypes.numpy_to_tensor(np.ascontiguousarray(z[:])), src)
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(array_dir)}}).result()
    assert torch.equal(dtypes.numpy_to_tensor(store.read().result()), src)


def test_plain_tensorstore_reads_an_ocdbt_item_as_docs_format_md_shows(tmp_path):
    src = torch.arange(24.0).reshape(6, 4).to(torch.bfloat16)
    xtc.save(tmp_path / "ck", {"layers": [{"w": src}]})
    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{tmp_path / 'ck'}",
                                           "path": "layers.0.w/"}}
    store = ts.open(spec).result()
    assert torch.equal(dtypes.numpy_to_tensor(store.read().result()), src)
    codecs = [c["name"] for c in store.spec().to_json()["metadata"]["codecs"]]
    assert codecs == ["bytes", "crc32c"]


def test_zarr_json_declares_crc32c_and_the_shard_grid(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.zeros(4, 4)}, options=PLAIN)
    doc = json.loads((tmp_path / "ck" / "w" / "zarr.json").read_text())
    assert [c["name"] for c in doc["codecs"]] == ["bytes", "crc32c"]
    assert doc["chunk_grid"]["configuration"]["chunk_shape"] == [4, 4]
    assert doc["zarr_format"] == 3 and doc["data_type"] == "float32"


def test_zarr_python_verifies_checksums(tmp_path):
    xtc.save(tmp_path / "ck", {"w": torch.ones(4, 4)}, options=PLAIN)
    chunk = tmp_path / "ck" / "w" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        zarr.open_array(str(tmp_path / "ck" / "w"), mode="r")[:]


def test_the_documented_zarr_registration_works_without_this_package(tmp_path):
    import re
    import subprocess
    import sys

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "format.md")).read()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", doc, re.S) if "data_type_registry" in block)
    xtc.save(tmp_path / "ck", {"w": torch.arange(12.0).reshape(3, 4).to(torch.bfloat16)}, options=PLAIN)
    snippet = snippet.replace("/ckpt/100/model/layers.0.weight", str(tmp_path / "ck" / "w"))
    snippet += ("\nimport sys\nassert 'xla_tensorstore_ckpt' not in sys.modules\n"
                "print(z[:].astype('float32').tolist())\n")
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(torch.arange(12.0).reshape(3, 4).tolist())


def test_zarr_imported_after_this_package_reads_the_extra_dtypes(tmp_path):
    """Importing this package leaves zarr-python unimported (0.15 s a process); a zarr imported afterwards, after a
    mere probe for it, still knows bfloat16."""
    import subprocess
    import sys

    xtc.save(tmp_path / "ck", {"w": torch.arange(12.0).reshape(3, 4).to(torch.bfloat16)}, options=PLAIN)
    snippet = ("import importlib.util, sys\nimport xla_tensorstore_ckpt\nassert 'zarr' not in sys.modules\n"
               "importlib.util.find_spec('zarr')\nimport zarr\n"
               f"print(zarr.open_array({str(tmp_path / 'ck' / 'w')!r}, mode='r')[:].astype('float32').tolist())\n")
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(torch.arange(12.0).reshape(3, 4).tolist())
