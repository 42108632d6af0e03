"""Incremental steps (issue 65): a save writes only the chunks that changed since its base step and records the
others as references to the step that stores their bytes. `tables`: the per-process chunk tables (content hashes);
`saving`: the save's decisions (`Recorder`) and the commit's record (`commit_refs`); `refs`: what an item
references, in its ``_METADATA``; `layered`: the reader that follows references; `retention`: bases kept alive;
`materialize`: a standalone copy of a step. docs/incremental.md has the design. Nothing is imported here, so that
`formats.v2` may import `refs` without cycles.
"""
