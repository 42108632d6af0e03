"""Checkpoint diffs per tensor and per layer, over `scans.diff` (which reads each chunk of both sides once):
the 2-norm of the change, the change relative to the first checkpoint's norm, the share of elements that
differ, the max |Δ|; sorted by key, by change, or grouped by layer; `key_map` to compare checkpoints whose
formats name keys otherwise (an Orbax/JAX item against a step of ours). Used by ``xtckpt diff``, the report and
`views.diff_tensors`; blocks; no torch_xla.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..core.errors import UsageError
from ..tools import scans
from ..tools.inspection import Checkpoint, Progress

KeyMap = Mapping[str, str | None] | Callable[[str], str | None]
SORTS = ("key", "change", "layer")
# A layer is the key up to its block number (``model/layers.3``, ``transformer.h.11``); else the key's parent.
_LAYER = re.compile(r"^(.*?(?:^|[./])(?:layers?|h|blocks?|block|encoder\.layer|decoder\.layers?)[./_](\d+))(?:[./]|$)")


@dataclass(frozen=True)
class TensorDiff:
    """One key of a diff. For ``values``: the norms, the differing share and max |Δ|; other changes (added,
    removed, shape, dtype, value, equal) carry `detail` only."""

    key: str
    change: str
    group: str
    delta_l2: float = 0.0
    a_l2: float = 0.0
    differing: int = 0
    elements: int = 0
    max_abs: float = 0.0
    detail: tuple[tuple[str, object], ...] = ()

    @property
    def relative(self) -> float:
        """|Δ|₂ / |a|₂ (inf where a is all zeros and b is not)."""
        if not self.delta_l2:
            return 0.0
        return self.delta_l2 / self.a_l2 if self.a_l2 else math.inf

    @property
    def differ_fraction(self) -> float:
        return self.differing / self.elements if self.elements else 0.0

    def detail_text(self) -> str:
        info = dict(self.detail)
        return f"{info['a']} -> {info['b']}" if "a" in info and "b" in info else ""

    def to_json(self) -> dict:
        out = {"key": self.key, "change": self.change, "group": self.group}
        if self.change in ("values", "equal"):
            out.update(delta_l2=self.delta_l2, a_l2=self.a_l2, relative_l2=_finite(self.relative),
                       differing=self.differing, elements=self.elements, differ_fraction=self.differ_fraction,
                       max_abs_diff=self.max_abs)
        out.update(dict(self.detail))
        return out


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def layer_of(key: str) -> str:
    """The layer a key belongs to: up to its block number, or its parent (``model/layers.3``, ``model/norm``)."""
    match = _LAYER.match(key)
    if match:
        return match.group(1)
    for separator in (".", "/"):
        if separator in key:
            return key.rsplit(separator, 1)[0]
    return key


@dataclass(frozen=True)
class LayerDiff:
    """A layer's change: the 2-norm of its tensors' changes over the 2-norm of their first values."""

    group: str
    tensors: int
    changed: int
    delta_l2: float
    a_l2: float
    differing: int
    elements: int

    @property
    def relative(self) -> float:
        return self.delta_l2 / self.a_l2 if self.a_l2 else (math.inf if self.delta_l2 else 0.0)

    def to_json(self) -> dict:
        return {"group": self.group, "tensors": self.tensors, "changed": self.changed, "delta_l2": self.delta_l2,
                "a_l2": self.a_l2, "relative_l2": _finite(self.relative), "differing": self.differing,
                "elements": self.elements}


def key_map_from(spec: str | Mapping[str, str | None] | None) -> Callable[[str], str | None] | None:
    """A key map from a JSON object, or a path to a file holding one: ``{"old": "new", "old2": null}``, where a
    key ending in ``*`` is a prefix rule (``{"params.*": "model/*"}``: the rest of the key carried over); exact
    names win over prefixes, longer prefixes over shorter. Keys the map does not name stay as they are.
    Raises `UsageError` for anything else."""
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str):
        text = spec
        if not spec.lstrip().startswith("{"):
            try:
                with open(os.path.expanduser(spec), encoding="utf-8") as f:
                    text = f.read(1 << 24)
            except OSError as exc:
                raise UsageError(f"cannot read the key map {spec!r}: {exc.strerror or exc}") from None
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"the key map is not JSON: {exc}") from None
    if not isinstance(spec, Mapping) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in spec.items()):
        raise UsageError('a key map is a JSON object of names to names or null, e.g. {"params.*": "model/*"}')
    exact = {k: v for k, v in spec.items() if not k.endswith("*")}
    prefixes = sorted(((k[:-1], v) for k, v in spec.items() if k.endswith("*")), key=lambda kv: -len(kv[0]))

    def rename(key: str) -> str | None:
        if key in exact:
            return exact[key]
        for prefix, new in prefixes:
            if key.startswith(prefix):
                return None if new is None else new.removesuffix("*") + key[len(prefix):]
        return key

    return rename


def diff_tensors(a: Checkpoint, b: Checkpoint, *, key_map: KeyMap | str | None = None, sort: str = "key",
                 include_equal: bool = False, progress: Progress | None = None,
                 observe_b: Callable[[str, np.ndarray], None] | None = None) -> list[TensorDiff]:
    """Every key that differs from `a` to `b` (every common key with `include_equal`), sorted by key, by
    relative change (largest first), or by layer then key; `observe_b` as `scans.diff` takes it. Blocks;
    raises `UsageError` for a bad sort or key map, `CorruptCheckpointError` for damaged data."""
    if sort not in SORTS:
        raise UsageError(f"unknown sort {sort!r}: one of {', '.join(SORTS)}")
    rename = key_map_from(dict(key_map) if isinstance(key_map, Mapping) else key_map)
    entries = scans.diff(a, b, progress, key_map=rename, include_equal=include_equal, observe_b=observe_b)
    out = []
    for e in entries:
        d = e.detail
        if e.change in ("values", "equal"):
            out.append(TensorDiff(e.key, e.change, layer_of(e.key), d.get("delta_l2", 0.0), d.get("a_l2", 0.0),
                                  d.get("differing", 0), d.get("elements", 0), d.get("max_abs_diff", 0.0)))
        else:
            out.append(TensorDiff(e.key, e.change, layer_of(e.key), detail=tuple(d.items())))
    if sort == "change":
        return sorted(out, key=lambda t: (-t.relative if t.change == "values" else 1.0, t.key))
    if sort == "layer":
        return sorted(out, key=lambda t: (_natural(t.group), _natural(t.key)))
    return sorted(out, key=lambda t: _natural(t.key))


def _natural(text: str) -> tuple:
    """Sort key ordering ``layers.2`` before ``layers.10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", text))


def by_layer(diffs: list[TensorDiff]) -> list[LayerDiff]:
    """The per-layer totals of a diff's array entries (``values``, and ``equal`` arrays), in natural layer
    order."""
    groups: dict[str, list[TensorDiff]] = {}
    for d in diffs:
        if d.change == "values" or (d.change == "equal" and d.elements):
            groups.setdefault(d.group, []).append(d)
    return [LayerDiff(g, len(ds), sum(d.change == "values" for d in ds),
                      math.sqrt(sum(d.delta_l2 ** 2 for d in ds)), math.sqrt(sum(d.a_l2 ** 2 for d in ds)),
                      sum(d.differing for d in ds), sum(d.elements for d in ds))
            for g, ds in sorted(groups.items(), key=lambda kv: _natural(kv[0]))]
