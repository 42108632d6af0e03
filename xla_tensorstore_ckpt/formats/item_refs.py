"""What an item of an incremental step references, as its ``_METADATA`` records it (`ItemRefs`, `decode`); the
commit learns it from the writing processes' chunk tables (`incremental.saving.summarize`).

In the item's ``_METADATA``, under our object (`formats.v2`), ``"incremental": {"tables": [<the chunk tables of
the item>], "bases": [[<step>, "<its directory name>"], ...], "arrays": [<names of arrays with chunks stored in a
base>], "chain": <the most saves since a delta chunk's anchor>}``. Every save of a manager with ``incremental``
on records it, anchors included (``bases`` empty), so that the next save finds the tables. A reader wraps its
reader of such an item in `incremental.layered.LayeredReader` when ``arrays`` is not empty. Decoded by `v2`;
here, below `incremental/`, so that the format does not import the folder that builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import layout
from ..core.errors import CorruptCheckpointError


@dataclass(frozen=True)
class ItemRefs:
    """An item's references: its chunk tables (file names in the item), the steps holding chunks it references
    (step number, directory name beside the item's step: ``<root>/<name>/<item>``), the arrays concerned, and
    the deepest delta of its chunks (saves since its anchor)."""

    tables: tuple[str, ...]
    bases: tuple[tuple[int, str], ...] = ()
    arrays: frozenset[str] = frozenset()
    chain: int = 0

    def to_json(self) -> dict:
        return {"tables": list(self.tables), "bases": [[s, n] for s, n in self.bases], "arrays": sorted(self.arrays),
                "chain": self.chain}

    def base_dir(self, step: int) -> str:
        """The directory name of base `step`; `CorruptCheckpointError` if the item does not name it."""
        for s, name in self.bases:
            if s == step:
                return name
        raise CorruptCheckpointError(f"a chunk table references step {step}, which the item's bases "
                                     f"{[s for s, _ in self.bases]} do not name")


def decode(value: object, where: str) -> ItemRefs | None:
    """The `ItemRefs` of an item's ``_METADATA`` (`where` names the file), None if it has none. Raises
    `CorruptCheckpointError` for a malformed entry (names are validated as single path components)."""
    if value is None:
        return None
    try:
        tables = tuple(layout.relative_path(t, where=where, what="chunk table", single=True)
                       for t in value["tables"])
        bases = tuple((_step(s), layout.relative_path(n, where=where, what="base step", single=True))
                      for s, n in value["bases"])
        arrays = frozenset(value["arrays"])
        chain = _step(value.get("chain", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed incremental entry ({exc!r})") from None
    if not all(isinstance(a, str) for a in arrays):
        raise CorruptCheckpointError(f"{where}: malformed incremental entry (array names)")
    return ItemRefs(tables, bases, arrays, chain)


def _step(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value
