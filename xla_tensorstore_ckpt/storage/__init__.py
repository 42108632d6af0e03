"""Where checkpoints live. `location(url)` turns a user path into a `Location`: a directory on a `Backend`.

Backends: local file systems (``/path``, ``file:///path``), ``gs://bucket/prefix``, ``s3://bucket/prefix`` and
``memory://name``. Array
data never passes through Python here: arrays are opened by tensorstore on `Location.kvstore_spec()` with the
shared `context()`. See `base` for the protocol and how to add a backend.

Writing a destination without losing what was there (`outputs`): one inside or around its source refused, an
existing one kept unless replaced, the new one written beside it and swapped in at the end.
"""

from __future__ import annotations

import os

from ..core.errors import CorruptCheckpointError
from .base import CALLS, Backend, Capabilities, Counts, Location, PendingBytes, RangeNotSatisfiableError
from .gcs import GcsBackend
from .kvstore import context, operation_context, without_spec
from .local import LocalBackend, absolute, check_tree
from .memory import MemoryBackend
from .s3 import S3Backend

__all__ = ["CALLS", "Backend", "Capabilities", "Counts", "Location", "PendingBytes", "RangeNotSatisfiableError",
           "check_regular_files",
           "context", "is_location", "location", "operation_context", "register_backend", "without_spec"]

_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(backend: type[Backend]) -> None:
    """Make URLs of `backend.scheme` resolve to `backend` (replacing an earlier registration)."""
    _BACKENDS[backend.scheme] = backend


for _backend in (LocalBackend, MemoryBackend, GcsBackend, S3Backend):
    register_backend(_backend)


def location(path: str | os.PathLike | Location) -> Location:
    """Parse a user path: a local path, or ``<scheme>://...`` of a registered backend. `ValueError` for an
    unknown scheme or a malformed URL."""
    if isinstance(path, Location):
        return path
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return Location(LocalBackend(), absolute(text))
    backend = _BACKENDS.get(scheme)
    if backend is None:
        known = ", ".join(f"{s}://" for s in sorted(_BACKENDS) if s != "file")
        raise ValueError(f"unsupported storage scheme {scheme!r} in {text!r}; use a local path or {known}")
    return Location(*backend.parse(rest))


def is_location(path: str | os.PathLike | Location) -> bool:
    """Whether `location(path)` would succeed: a local path or a URL of a registered scheme. Never raises."""
    try:
        location(path)
    except (ValueError, TypeError):
        return False
    return True


def check_regular_files(loc: Location) -> None:
    """`CorruptCheckpointError` if the local directory `loc` holds, anywhere below it, anything but regular files
    and directories (a FIFO, a socket, a device, or a symbolic link to one): called before tensorstore opens
    files there itself (an OCDBT store's manifest and data files, zarr chunk files), which it would block on.
    Never opens a file (`local.check_tree`); nothing to do on other backends. Blocks on a listing."""
    path = loc.local_file("")
    if path is None:
        return
    try:
        check_tree(path)
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {loc}: {exc.strerror or exc}") from None
