"""Peer copies of the training state: a replaced rank takes its state from its holder's
memory and every rank rolls back to the same step, bit for bit; a copy that fails its
digest is refused and the next older step is used; the placement puts each copy on
another node."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol.errors import InvalidArgument, LeftJob
from shardwire.worker.fsdp import PeerCopies, Strategy
from shardwire.worker.fsdp.peercopy import choose, holder, pack, source

from .test_persist import _optimizer_state
from .training import STEPS, fsdp_world, train_rank


@pytest.mark.parametrize(("world", "per_node"), [(1, 1), (4, 1), (4, 4), (8, 2), (6, 3)])
def test_the_holder_is_on_another_node_and_source_inverts_it(world, per_node) -> None:
    for rank in range(world):
        held_by = holder(rank, world, per_node)
        assert source(held_by, world, per_node) == rank
        if world > per_node:  # more than one node: the copy leaves the node
            assert held_by // per_node != rank // per_node
    assert sorted(holder(r, world, per_node) for r in range(world)) == list(range(world))


def test_the_newest_step_every_rank_can_restore_is_chosen() -> None:
    def nxt(r: int) -> int:
        return (r + 1) % 3

    # rank 1 was replaced (no own snapshots); its holder, rank 2, has steps 4 and 8
    own, held = [[4, 8], [], [4, 8]], [[4, 8], [4, 8], [4, 8]]
    assert choose(own, held, nxt) == (8, [1])
    # the copy of step 8 never reached rank 2 (rank 1 died mid-copy): step 4
    assert choose(own, [[4, 8], [4, 8], [4]], nxt) == (4, [1])
    assert choose(own, held, nxt, refused={8}) == (4, [1])
    assert choose(own, held, nxt, refused={4, 8}) is None
    assert choose([[], [], []], [[], [], []], nxt) is None
    assert choose([[4], [4], [4]], [[], [], []], nxt) == (4, [])  # survivors only


def test_a_snapshot_round_trips_and_a_flipped_byte_is_caught() -> None:
    arrays = [("a", np.arange(6, dtype=np.float32).reshape(2, 3)), ("b", np.ones(3, np.int64))]
    snap = pack(arrays, {"step": 3})
    back = snap.arrays()
    for (_name, a), b in zip(arrays, back, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype and a.shape == b.shape
    back[0][0, 0] = 99  # copies: the snapshot stays as it was
    assert snap.arrays()[0][0, 0] == 0 and snap.intact() and snap.step == 3
    snap.data[5] ^= 1
    assert not snap.intact()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        PeerCopies(0)


async def _save(ranks, copies, step: int) -> None:
    await asyncio.gather(
        *(c.save(f, step, extra={"at": step}) for f, c in zip(ranks, copies, strict=True))
    )
    await asyncio.gather(*(c.wait() for c in copies))


async def _train_saving(ranks, copies, steps: int) -> None:
    """``steps`` steps on every rank, each followed by its copies' save."""
    for step in range(steps):
        await asyncio.gather(*(train_rank(f, r, len(ranks), steps=range(step, step + 1))
                               for r, f in enumerate(ranks)))  # fmt: skip
        await _save(ranks, copies, step + 1)


async def _params(ranks) -> dict:
    return (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]


async def _state(ranks) -> tuple[dict, dict]:
    return (await _params(ranks)), _optimizer_state(ranks)


async def _straight() -> dict:
    async with fsdp_world(4, Strategy.FULL_SHARD, "adam") as ranks:
        await asyncio.gather(*(train_rank(f, r, 4) for r, f in enumerate(ranks)))
        return await _params(ranks)


async def test_a_replaced_rank_and_the_survivors_roll_back_and_end_as_a_straight_run() -> None:
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with fsdp_world(4, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 4)
        at_four = await _state(ranks)
        await asyncio.gather(*(train_rank(f, r, 4, steps=range(4, 5)) for r, f in enumerate(ranks)))
    copies[1] = PeerCopies(2, ranks_per_node=2)  # rank 1's process died with its memory
    resumed = await _restore_and_finish(copies, at_four)
    assert {(r.step, r.extra["at"]) for r in resumed} == {(4, 4)}


async def _restore_and_finish(copies: list[PeerCopies], at_four: tuple[dict, dict]) -> list:
    """The next generation of 4 ranks restores from ``copies``: the state of step 4 bit
    for bit, and training to the end gives the straight run's parameters."""
    async with fsdp_world(4, Strategy.FULL_SHARD, "adam") as ranks:
        resumed = await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
        params, optim = await _state(ranks)
        for name, value in at_four[0].items():
            np.testing.assert_array_equal(params[name], value)  # bit for bit
        for key, value in at_four[1].items():
            np.testing.assert_array_equal(optim[key], value)
        assert {f.optimizer.steps for f in ranks} == {4}
        await asyncio.gather(*(train_rank(f, r, 4, steps=range(4, STEPS))
                               for r, f in enumerate(ranks)))  # fmt: skip
        final = await _params(ranks)
    for name, value in (await _straight()).items():
        np.testing.assert_array_equal(final[name], value)
    return resumed


async def test_a_copy_that_fails_its_digest_is_refused_and_an_older_step_used() -> None:
    copies = [PeerCopies(1, ranks_per_node=1) for _ in range(3)]
    async with fsdp_world(3, Strategy.SHARD_GRAD_OP, "adam") as ranks:
        await _train_saving(ranks, copies, 2)
    copies[0] = PeerCopies(1, ranks_per_node=1)  # rank 0 replaced; rank 1 holds its copies
    copies[1]._held[2].data[0] ^= 0xFF  # its copy of step 2 went bad in memory
    async with fsdp_world(3, Strategy.SHARD_GRAD_OP, "adam") as ranks:
        resumed = await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
        assert {r.step for r in resumed} == {1}
        assert "rank 0's state at step 2" in copies[0].refused[0]
        assert not copies[1].refused and not copies[2].refused


async def test_copies_of_another_layout_are_not_restored() -> None:
    copies = [PeerCopies(1) for _ in range(2)]
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await asyncio.gather(*(train_rank(f, r, 2, steps=range(1)) for r, f in enumerate(ranks)))
        await _save(ranks, copies, 1)
    async with fsdp_world(2, Strategy.NO_SHARD, "adam") as ranks:  # whole, not halves
        assert (
            await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
            == [None] * 2
        )


async def test_only_the_newest_keep_steps_are_kept() -> None:
    one, two = PeerCopies(1, keep=1), PeerCopies(1, keep=2)
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, [one, two], 3)
        assert sorted(one._own) == [3] and sorted(one._held) == [3]
        assert sorted(two._own) == [2, 3] and sorted(two._held) == [2, 3]
        assert one.state_bytes == two.state_bytes > 0


class _Notice:
    def __init__(self) -> None:
        self.requested = False


async def test_a_rank_told_to_leave_hands_over_at_the_next_copy_step_and_nothing_is_lost() -> None:
    """Rank 1 is told to leave between copy steps: at the next one (step 4) every copy
    lands, rank 1 raises LeftJob naming its holder, the others go on; its replacement and
    the survivors restore step 4 (nothing before it is redone) and end as a straight run."""
    notices = [_Notice() for _ in range(4)]
    copies = [PeerCopies(2, ranks_per_node=2, leave=n) for n in notices]
    async with fsdp_world(4, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 3)
        notices[1].requested = True  # SIGTERM during step 4
        await asyncio.gather(*(train_rank(f, r, 4, steps=range(3, 4)) for r, f in enumerate(ranks)))
        at_four = await _state(ranks)
        saved = await asyncio.gather(
            *(c.save(f, 4) for f, c in zip(ranks, copies, strict=True)), return_exceptions=True
        )
        assert [type(s).__name__ for s in saved] == ["NoneType", "LeftJob", "NoneType", "NoneType"]
        left = saved[1]
        assert isinstance(left, LeftJob) and (left.rank, left.step, left.holder) == (1, 4, 3)
        assert 4 in copies[3]._held  # landed before rank 1 left
    copies[1] = PeerCopies(2, ranks_per_node=2, leave=_Notice())  # its replacement
    resumed = await _restore_and_finish(copies, at_four)
    assert {r.step for r in resumed} == {4}


async def test_ranks_not_told_to_leave_go_on_through_copy_steps() -> None:
    notices = [_Notice(), _Notice()]
    copies = [PeerCopies(1, leave=n) for n in notices]
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 2)  # nobody told: nobody leaves
        assert sorted(copies[0]._held) == [1, 2]


async def test_a_group_of_one_never_leaves_by_its_notice() -> None:
    notice = _Notice()
    notice.requested = True  # nobody to hand its state to
    copies = PeerCopies(1, leave=notice)
    async with fsdp_world(1, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, [copies], 2)
        assert sorted(copies._own) == [1, 2]
