"""Incremental steps (issue 65): a save writes only the chunks that changed since its base step and records the
others as references to the step that stores their bytes. `tables`: the per-process chunk tables (content hashes);
`saving`: the save's decisions (`Recorder`) and the commit's record (`commit_refs`, `summarize`); `layered`: the
reader that follows references, and `reader`, the one picker every reader of items asks (an incremental step's
item or any other); `deltas`: the XOR delta encodings. What an item references, as its ``_METADATA`` records it,
is the format's (`formats.item_refs`). docs/incremental.md has the design.

Above `arrays/` and `formats/` in the order of folders: neither imports this one.
"""

from .layered import LayeredReader, reader

__all__ = ["LayeredReader", "reader"]
