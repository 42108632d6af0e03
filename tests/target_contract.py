"""The contract every target (tensor kind, `xla_tensorstore_ckpt.targets`) keeps, as a test class to subclass (in
the manner of backend_contract.py). A subclass names its target (`NAME`) and provides three hooks: `make` (a value
of its kind holding a whole CPU tensor), `empty` (a restore target of that kind, shape and dtype) and `whole` (a
value's data as one CPU tensor). Every rule is checked through the real save and restore paths, in process, on
one small array."""

from __future__ import annotations

import pytest
import torch

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt import targets
from xla_tensorstore_ckpt.checkpoint_manager import training_state
from xla_tensorstore_ckpt.restores import restoring
from xla_tensorstore_ckpt.saves.save_plan import PlanCache, plan_save

SHAPE = (8, 6)


def full(offset: float = 0.0) -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(SHAPE) + offset


class TargetContract:
    NAME = ""
    IN_PLACE = True  # restored values can be assigned into an existing value of the kind

    def make(self, data: torch.Tensor):
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype):
        raise NotImplementedError

    def whole(self, value) -> torch.Tensor:
        raise NotImplementedError

    @property
    def target(self) -> targets.Target:
        return targets.named(self.NAME)

    def test_it_claims_its_values_first(self):
        value = self.make(full())
        assert targets.of(value) is self.target
        assert not any(self.target.claims(other) for other in (3, "x", None, [1]))

    def test_a_good_value_is_saveable(self):
        assert self.target.unsaveable(self.make(full())) is None

    def test_signatures_tell_layouts_apart(self):
        a, b, c = self.make(full()), self.make(full(1.0)), self.make(torch.zeros(4, 6))
        sig_a, sig_b, sig_c = self.target.signatures([a, b, c])
        assert sig_a == sig_b and sig_a != sig_c
        assert hash(sig_a) == hash(sig_b)

    def test_layouts_name_the_target_and_its_shards_fetch_exactly(self):
        value = self.make(full())
        lay = self.target.layouts([value], self.target.signatures([value]))[0]
        assert lay.target == self.NAME and lay.shape == SHAPE
        assert self.target.layouts([value])[0] == lay  # a restore's references: no signatures
        shards = lay.distinct_shards()
        assert shards and all(0 <= a <= b <= n for s in shards for (a, b), n in zip(s.index, SHAPE))
        for copy in (False, True):
            fetched = self.target.fetch([value], [lay], [shards], copy=copy)[0]
            assert len(fetched) == len(shards)
            for shard, data in zip(shards, fetched):
                assert torch.equal(data, full()[shard.region]), shard
        assert self.target.fetched_elements(lay, shards) >= sum(s.size for s in shards)
        assert self.target.placing_elements(lay) >= 0 and isinstance(self.target.is_global(lay), bool)

    def test_saved_values_restore_and_plan_exactly(self, tmp_path):
        xtc.save(tmp_path / "ck", {"a": self.make(full()), "n": 3})
        out = xtc.restore(tmp_path / "ck", {"a": self.empty(SHAPE, torch.float32), "n": 0})
        assert out["n"] == 3 and targets.of(out["a"]) is self.target
        assert torch.equal(self.whole(out["a"]), full())
        cast = xtc.restore(tmp_path / "ck", {"a": self.empty(SHAPE, torch.float64), "n": 0})["a"]
        assert torch.equal(self.whole(cast), full().double())
        plan = xtc.plan_restore(tmp_path / "ck", {"a": self.empty(SHAPE, torch.float32), "n": 0})
        assert not plan.problems and plan.read_bytes >= full().nbytes // max(1, self._processes())

    def test_restore_in_place_keeps_the_value(self, tmp_path):
        if not self.IN_PLACE:
            pytest.skip("restored as new values only")
        xtc.save(tmp_path / "ck", {"a": self.make(full(2.0))})
        kept = self.empty(SHAPE, torch.float32)
        tree = {"a": kept}
        training_state.assign_in_place(tree, restoring.read_item(tmp_path / "ck", tree))
        assert tree["a"] is kept and torch.equal(self.whole(kept), full(2.0))

    def test_a_plan_is_reused_for_values_of_the_same_layout(self):
        cache = PlanCache()
        first = plan_save({"a": self.make(full())}, cache=cache)
        second = plan_save({"a": self.make(full(1.0))}, cache=cache)
        assert second.arrays[0].layout is first.arrays[0].layout  # the cached plan, not a new one
        third = plan_save({"a": self.make(torch.zeros(4, 6))}, cache=cache)
        assert third.arrays[0].layout.shape == (4, 6)

    def _processes(self) -> int:
        return 1
