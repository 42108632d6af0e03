"""The one exception hierarchy of the package.

Every error derives from `CheckpointError` and from the built-in exception a caller would naturally catch
(`FileNotFoundError`, `ValueError`, ...), so both `except xtc.CheckpointError` and `except ValueError` work.
Messages name the step, key and path involved wherever they are known.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by xla_tensorstore_ckpt."""


def with_context(error: CheckpointError, context: str) -> CheckpointError:
    """`error` with `context` before its message (``"writing step 2 at gs://b/run/2: <message>"``): an
    exception of the same type with the same attributes, so that callers catching it see no difference. Called
    by code that knows what a failing lower-level operation was for (a step, an item's final path, rather than
    the temporary name being written); raise it ``from error``. Does not block or raise."""
    wrapped = type(error).__new__(type(error))
    wrapped.__dict__.update(error.__dict__)
    wrapped.args = (f"{context}: {error}", *error.args[1:])
    return wrapped


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A path holds no checkpoint (or no committed checkpoint item)."""

    def __str__(self) -> str:  # FileNotFoundError formats (errno, strerror) pairs oddly; keep our message.
        return str(self.args[0]) if self.args else ""


class StepNotFoundError(CheckpointNotFoundError):
    """A requested step is not committed under the checkpoint root."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save would overwrite an existing checkpoint and overwriting was not requested."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class FormatVersionError(CheckpointError, ValueError):
    """The checkpoint was written in a format version this reader does not know."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored data or metadata is damaged, missing or malformed (checksums, missing chunks, bad JSON)."""


class KeyMismatchError(CheckpointError, KeyError):
    """Keys of the checkpoint and of the restore target differ."""

    def __init__(self, message: str, *, missing: tuple[str, ...] = (), unexpected: tuple[str, ...] = ()):
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected

    def __str__(self) -> str:  # KeyError would repr() the message.
        return str(self.args[0])


class ItemNotFoundError(KeyMismatchError):
    """A step holds no item for an object the restore asked for (``lr_scheduler=`` for a step saved without
    one): the request does not match the step, which is not damaged. `item` is the missing item, `items` those
    the step holds."""

    def __init__(self, message: str, *, step: int, item: str, items: tuple[str, ...]):
        super().__init__(message, missing=(item,))
        self.step, self.item, self.items = step, item, items


class ShapeMismatchError(CheckpointError, ValueError):
    """A stored array and its restore target have different shapes."""

    def __init__(self, message: str, *, key: str, saved_shape: tuple[int, ...], target_shape: tuple[int, ...]):
        super().__init__(message)
        self.key, self.saved_shape, self.target_shape = key, saved_shape, target_shape


class UnsupportedValueError(CheckpointError, TypeError):
    """A tree holds a value the checkpoint format cannot store (not a tensor, not a JSON scalar)."""


class StorageError(CheckpointError, OSError):
    """Reading or writing the underlying storage failed (permissions, full disk, network)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AsyncSaveError(CheckpointError, RuntimeError):
    """A background save failed; raised at the next call into the manager. `__cause__` holds the original."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


class CoordinationError(CheckpointError, RuntimeError):
    """Another process failed, died or did not answer in time; nothing was committed. `process` is the index
    of the process that failed, when known."""

    def __init__(self, message: str, *, process: int | None = None):
        super().__init__(message)
        self.process = process


class CoordinationTimeoutError(CoordinationError):
    """A collective phase of a save or restore missed its deadline (`coordination_timeout_s`), or a process left
    it: `phase` names it, `missing` the processes that did not arrive (every live process raises this)."""

    def __init__(self, message: str, *, phase: str, missing: tuple[int, ...]):
        super().__init__(message, process=missing[0] if missing else None)
        self.phase, self.missing = phase, missing


class UsageError(CheckpointError, ValueError):
    """A request is malformed (unknown item or key, bad slice); distinct from damaged data."""
