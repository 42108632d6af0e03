"""torch.distributed.checkpoint (DCP) directories, as torch's ``FileSystemWriter`` writes them (also through
torch_xla's CheckpointManager and its SPMD planners): read as an item whose arrays are the saved tensors.

A DCP directory holds ``.metadata`` (a pickle of DCP's ``Metadata``: per key either a tensor's dtype, global
size and chunks — the regions each saving rank wrote — or a bytes entry; per chunk and bytes entry the file,
offset and length it was written at; and how the flattened keys nest) and the ``__<rank>_<n>.distcp`` files.
Each tensor chunk is a ``torch.save`` blob of that region; each bytes entry (a learning rate, the betas) a
``torch.save`` blob of a plain value.

Read without running code from the checkpoint: ``.metadata`` through `core.torch_pickle`'s restricted unpickler, the
bytes entries likewise (plain values only: any other entry is left out of the tree, and a warning names its
key), and tensor chunks as raw bytes at the storage record `arrays.torch_zip` finds (`arrays.pieces` reads them). Every
chunk is checked before anything is read: the chunks of a tensor must tile it (inside it, no overlaps, nothing
uncovered), each must have a storage entry inside a plain file name of the directory, no extension
(compression) is supported. The tree nests keys as DCP's planner recorded (``optim.state.0.exp_avg`` under
``optim`` / ``state`` / ``"0"``); a restore matches the target's keys by dotted name, as DCP does, so a
``state_dict`` with integer keys restores too.
"""

from __future__ import annotations

import io
import math
import warnings
import zipfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..arrays import torch_zip
from ..core import bounds, dtypes, layout, threads, torch_pickle, tree
from ..core.errors import CorruptCheckpointError, UnsupportedValueError
from ..core.records import ArrayStore, ItemManifest, PieceMetadata, PiecesArrayMetadata
from ..storage import Location, RangeNotSatisfiableError
from .safetensors import row_block

NAME = "dcp"
DESCRIPTION = "torch.distributed.checkpoint"
FILE_SUFFIX = None
METADATA = ".metadata"
STORE = ArrayStore(kind="dcp", zarr_format=0, checksums=False)
MAX_METADATA_BYTES = 1 << 30
MAX_VALUE_BYTES = 16 << 20  # a bytes entry that is a plain value is a few KiB
MATCH_BY_NAME = True  # restores match a target's keys by dotted name (DCP's own keys are flattened names)


def claims_item(loc: Location, doc: dict | None) -> bool:
    """A directory with a ``.metadata`` that is a pickle (and no ``_METADATA`` of ours or Orbax's)."""
    if doc is not None:
        return False
    try:
        head = loc.read_range(METADATA, 0, 1).result()
    except RangeNotSatisfiableError:
        return False
    return head == b"\x80"


def array_names(paths: list[tuple[str | int, ...]]) -> list[str]:
    """A tensor's name is its flattened key, as DCP spells it."""
    return [".".join(str(k) for k in p) for p in paths]


def decode_item(loc: Location, _doc: dict | None, *, where: str) -> ItemManifest:
    """The manifest of the DCP directory at `loc`. Blocks on reading ``.metadata`` and the bytes entries (a few
    at a time). Raises `CorruptCheckpointError` naming the file and key for anything inconsistent (see the
    module), `UnsupportedValueError` for a dtype this library cannot hold or an extension it cannot read."""
    where = str(loc.child(METADATA))
    head = loc.read_range(METADATA, 0, 0).result()
    data = loc.read(METADATA) if head is not None else None
    if data is None:
        raise CorruptCheckpointError(f"{where}: missing")
    if len(data) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes exceed the limit of {MAX_METADATA_BYTES}")
    meta = torch_pickle.load_dcp_metadata(data, where)
    entries = _field(meta, "state_dict_metadata", dict, where)
    storage = _storage_index(_field(meta, "storage_data", dict, where), where)
    planner = meta.get("planner_data")
    leaves: dict[tuple, Any] = {}
    values: list[tuple[tuple, str, tuple[str, int, int]]] = []
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: a key {str(fqn)[:100]!r} that is not a string")
        path = key_path(fqn, planner, where)
        kind = getattr(entry, "kind", None)
        if kind == "TensorStorageMetadata":
            leaves[path] = _tensor(fqn, entry, storage, where)
        elif kind == "BytesStorageMetadata":
            if (fqn, None) not in storage:
                raise CorruptCheckpointError(f"{where}: {fqn!r} has no storage entry")
            values.append((path, fqn, storage[(fqn, None)]))
        else:
            raise CorruptCheckpointError(f"{where}: {fqn!r} is neither a tensor nor a bytes entry")
    skipped = []
    for (path, fqn, _), value in zip(values, _read_values(loc, [v[2] for v in values], [v[1] for v in values])):
        if isinstance(value, _Skipped):
            skipped.append(f"{fqn} ({value.reason})")
        else:
            leaves[path] = value
    if skipped:
        warnings.warn(f"{loc}: left out bytes entries that are not plain values (loading them could run code "
                      f"from the checkpoint): {'; '.join(skipped[:10])}"
                      + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""), stacklevel=4)
    return ItemManifest(nest(leaves, where), format=NAME, store=STORE)


def _field(record: Any, name: str, kind: type, where: str) -> Any:
    value = record.get(name) if isinstance(record, torch_pickle.Record) else None
    if not isinstance(value, kind):
        raise CorruptCheckpointError(f"{where}: {name} is missing or malformed")
    return value


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= bounds.MAX_ARRAY_BYTES


def _storage_index(data: dict, where: str) -> dict[tuple[str, tuple | None], tuple[str, int, int]]:
    """(key, chunk offsets or None) -> (file, start, length), every entry checked."""
    out = {}
    for index, info in data.items():
        fqn, offset = getattr(index, "get", dict().get)("fqn"), getattr(index, "get", dict().get)("offset")
        file, start, length = (info.get(n) if isinstance(info, torch_pickle.Record) else None
                               for n in ("relative_path", "offset", "length"))
        if not isinstance(fqn, str) or not (offset is None or isinstance(offset, tuple)):
            raise CorruptCheckpointError(f"{where}: a malformed storage index {str(index)[:200]}")
        layout.relative_path(file, where=f"{where} [{fqn[:200]!r}]", what="file name", single=True)
        if not (_count(start) and _count(length)):
            raise CorruptCheckpointError(f"{where}: {fqn!r} has offset {start!r} and length {length!r}, not byte "
                                         f"counts"[:300])
        if info.get("transform_descriptors"):
            raise UnsupportedValueError(f"{where}: {fqn!r} was written through the extensions "
                                        f"{info.get('transform_descriptors')!r}, which this library does not read")
        out[(fqn, offset)] = (file, start, length)
    return out


def key_path(fqn: str, planner: Any, where: str) -> tuple:
    """The key path of DCP's flattened key `fqn` as its planner recorded it (`planner`: Metadata.planner_data, a
    dict), or ``(fqn,)``; shared with `dcp_storage`. Raises `CorruptCheckpointError` for a malformed path."""
    path = planner.get(fqn) if isinstance(planner, dict) else None
    if path is None:
        return (fqn,)
    if not isinstance(path, tuple) or not path or not all(
            isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and k >= 0) for k in path):
        raise CorruptCheckpointError(f"{where}: the key path of {fqn!r} is malformed")
    bounds.check_key_path(len(path), where)
    return path


def _tensor(fqn: str, entry: Any, storage: dict, where: str) -> PiecesArrayMetadata:
    properties = entry.get("properties")
    dtype = getattr(properties, "get", dict().get)("dtype")
    state = getattr(properties, "get", dict().get)("state")
    if dtype is None and isinstance(state, tuple) and state:
        dtype = state[0]  # TensorProperties pickles as (dtype, layout, requires_grad, memory format, pinned)
    if not isinstance(dtype, torch_pickle.DType):
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has no dtype")
    try:
        row = dtypes.by_name(dtype.name)
    except UnsupportedValueError:
        raise UnsupportedValueError(f"{where}: tensor {fqn!r} has dtype {dtype.name}, which this library cannot "
                                    f"hold") from None
    shape = entry.get("size")
    if not isinstance(shape, tuple) or not all(_count(n) for n in shape) or len(shape) > bounds.MAX_RANK:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has a malformed size {str(shape)[:100]}")
    bounds.check_shape(shape, f"{where}: tensor {fqn!r}")
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or len(chunks) > bounds.MAX_CHUNKS:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has malformed chunks")
    pieces = []
    for chunk in chunks:
        offsets, sizes = (getattr(chunk, "get", dict().get)(n) for n in ("offsets", "sizes"))
        if not (isinstance(offsets, tuple) and isinstance(sizes, tuple) and len(offsets) == len(sizes) == len(shape)
                and all(_count(n) for n in offsets + sizes)
                and all(o + n <= dim for o, n, dim in zip(offsets, sizes, shape))):
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r} of shape {shape} has a chunk at {offsets} of "
                                         f"size {sizes}, outside it"[:300])
        found = storage.get((fqn, offsets))
        if found is None:
            raise CorruptCheckpointError(f"{where}: the chunk of tensor {fqn!r} at {offsets} has no storage entry")
        pieces.append(PieceMetadata(offsets, sizes, *found))
    _check_tiling(fqn, shape, pieces, where)
    return PiecesArrayMetadata(path=fqn, shape=shape, dtype=dtype.name, chunk_shape=row_block(shape, row.itemsize),
                               pieces=tuple(pieces))


def _check_tiling(fqn: str, shape: tuple[int, ...], pieces: list[PieceMetadata], where: str) -> None:
    """The pieces cover the tensor exactly once: no two overlap, and their volumes add up to the tensor's."""
    filled = [p for p in pieces if math.prod(p.sizes)]
    if sum(math.prod(p.sizes) for p in filled) != math.prod(shape):
        raise CorruptCheckpointError(f"{where}: the chunks of tensor {fqn!r} do not cover its shape {shape} "
                                     f"exactly")
    if not shape:
        if len(filled) > 1:
            raise CorruptCheckpointError(f"{where}: scalar {fqn!r} has several chunks")
        return
    filled.sort(key=lambda p: p.offsets)
    for i, a in enumerate(filled):  # sorted by the first offset: only pieces starting before a ends can overlap
        for b in filled[i + 1:]:
            if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if all(bo < ao + an and ao < bo + bn for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise CorruptCheckpointError(f"{where}: the chunks of tensor {fqn!r} at {a.offsets} and {b.offsets} "
                                             f"overlap")


class _Skipped:
    def __init__(self, reason: str):
        self.reason = reason


def _read_values(loc: Location, entries: list[tuple[str, int, int]], keys: list[str]) -> list[Any]:
    """The plain value of each bytes entry (or why it is left out), a few read at a time."""
    if not entries:
        return []
    workers = threads.count("storage_requests", len(entries))
    out: list[Any] = []
    with ThreadPoolExecutor(workers) as pool:
        window: deque = deque()
        for entry, key in zip(entries, keys):
            window.append(pool.submit(_value, loc, *entry, key))
            if len(window) >= 2 * workers:
                out.append(window.popleft().result())
        out.extend(f.result() for f in window)
    return out


def _value(loc: Location, file: str, start: int, length: int, key: str) -> Any:
    where = f"{loc.child(file)} [{key}]"
    if length > MAX_VALUE_BYTES:
        return _Skipped(f"{length} bytes, not a plain value")
    try:
        data = loc.read_range(file, start, start + length).result()
    except RangeNotSatisfiableError:
        raise CorruptCheckpointError(f"{where}: truncated: the entry ends past the end of the file") from None
    if data is None:
        raise CorruptCheckpointError(f"{where}: the file is missing")
    if len(data) != length:
        raise CorruptCheckpointError(f"{where}: truncated: the entry ends past the end of the file")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1 or len(archive.namelist()) > 16:
            return _Skipped("not a torch.save blob of a value")
        record = archive.read(pickles[0])
    except torch_zip.ZIP_ERRORS:
        return _Skipped("raw bytes, not a torch.save blob")
    try:
        value = torch_pickle.load_value(record, where)
    except CorruptCheckpointError as exc:
        return _Skipped(str(exc).split(": ", 1)[-1][:200])
    if not _plain(value):
        return _Skipped(f"a {type(value).__name__}")
    return value


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > tree.MAX_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v, depth + 1) for k, v in value.items())
    return False


class _Node(dict):
    """A dict `_nest` made (not a value that happens to be a dict)."""


def nest(leaves: dict[tuple, Any], where: str) -> dict:
    """The tree of `leaves` by key path: integer keys are list positions (dense from 0), as DCP flattens
    lists; a path that is also the prefix of another is an error."""
    root = _Node()
    for path, leaf in leaves.items():
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, _Node())
            if not isinstance(child, _Node):
                raise CorruptCheckpointError(f"{where}: {tree.format_key_path(path)} lies inside another value")
            node = child
        if path[-1] in node:
            raise CorruptCheckpointError(f"{where}: two entries at {tree.format_key_path(path)}")
        node[path[-1]] = leaf
    return _plain_tree(root, where)


def _plain_tree(node: _Node, where: str) -> dict | list:
    converted = {k: _plain_tree(v, where) if isinstance(v, _Node) else v for k, v in node.items()}
    keys = list(converted)
    if keys and all(isinstance(k, int) for k in keys):
        if sorted(keys) != list(range(len(keys))):
            raise CorruptCheckpointError(f"{where}: list positions {sorted(keys)[:10]} are not 0 to {len(keys) - 1}")
        return [converted[i] for i in range(len(keys))]
    if any(isinstance(k, int) for k in keys):
        raise CorruptCheckpointError(f"{where}: a node mixing list positions and names ({keys[:5]})")
    return converted
