"""Offline work on checkpoints behind ``xtckpt`` (the command line itself is the top-level `cli`) and the views:
resolving checkpoints, steps, trees, slices and restore targets (`inspection`); chunk-by-chunk walks, diffs and
verification (`scans`); conversion into this library's format under a memory budget (`convert`); streaming
safetensors and torch exports (`export`); the command line's text helpers (`cli_text`).
"""
