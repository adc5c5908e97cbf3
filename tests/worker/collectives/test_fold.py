"""Reductions fold straight out of per-pair shared memory: an in-place ring (all_reduce)
hands each slot to its fold as it arrives, and the result is still numpy's, bit for bit.

Groups on one node run on their node arena; rings over per-pair segments carry the
groups that have none (it could not be made) and the flat algorithms of unevenly laid
out groups, so they are tested here with the arena off."""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.worker.backends import ring
from shardwire.worker.collectives import ReduceOp
from shardwire.worker.transport import mailbox

from .worlds import group_world, on_all


@pytest.mark.parametrize("kind", ["pairs", "tcp"])
async def test_an_in_place_ring_folds_from_the_slots_only_over_shared_memory(
    kind: str, monkeypatch
) -> None:
    direct: list[int] = []
    real = mailbox.Inbound.foldable.fget
    assert real is not None

    def foldable(inbound: mailbox.Inbound) -> bool:
        yes = real(inbound)
        if yes:
            direct.append(inbound.array.nbytes)
        return yes

    monkeypatch.setattr(mailbox.Inbound, "foldable", property(foldable))
    folds = 0
    make = ring._folder

    def counting(*args):
        nonlocal folds
        folds += 1
        return make(*args)

    monkeypatch.setattr(ring, "_folder", counting)
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(3 << 20 >> 2).astype(np.float32) for _ in range(2)]  # 3 MiB
    want = data[0] + data[1]  # float32 addition commutes: one expected result
    async with group_world(kind, 2) as groups:
        got = await on_all(groups, lambda g: g.all_reduce(data[g.rank].copy(), op=ReduceOp.SUM))
    for array in got:
        np.testing.assert_array_equal(array, want)
    assert folds > 0  # the ring asked for folds
    if kind == "pairs":
        assert direct  # and shared memory applied them straight from the slots
    else:
        assert not direct
