"""Peer copies of the training state: a replaced rank takes its state from its holder's
memory and every rank rolls back to the same step, bit for bit; a group of another size
or strategy restores from the copies exactly what the disk checkpoint of that step
gives it; a copy that fails its digest is refused and the next older step is used; the
placement puts each copy on another node."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol.errors import InvalidArgument, LeftJob
from shardwire.worker.fsdp import PeerCopies, Strategy, copywire
from shardwire.worker.fsdp.copyplan import Have, holder, pack, source, sources, span

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


def _have(
    rank: int, world: int, shards: int | None = None, shard: int | None = None, streams: str = "s"
) -> Have:
    shards = world if shards is None else shards
    return Have(rank, world, shards, rank if shard is None else shard, streams)


def _pairs(plan) -> list:
    return None if plan is None else [source.pairs for source in plan]


def test_a_kept_rank_reads_itself_and_a_replaced_one_its_holder() -> None:
    # rank 1 was replaced (no own snapshots); rank 2 holds its copy, rank 1's replacement
    # holds nothing, rank 0's copy went with rank 1's memory
    have = [[_have(0, 3)], [], [_have(2, 3), _have(1, 3)]]
    want = [(3, 0), (3, 1), (3, 2)]
    plan = sources(have, want, [10, 7])
    assert _pairs(plan) == [[(0, 0)], [(2, 1)], [(2, 2)]]
    assert plan is not None and [s.meta for s in plan] == [0, 1, 2]
    assert sources([[_have(0, 3)], [], [_have(2, 3)]], want, [10]) is None  # 1's part lost
    assert sources([[_have(0, 2)], [_have(1, 3)]], want[:2], [10]) is None  # two worlds


def test_a_shrink_spreads_the_lost_ranks_parts_over_the_survivors() -> None:
    # 4 ranks on 2 nodes; node b (ranks 2, 3) lost; ranks 0 and 1 held their copies
    have = [[_have(0, 4), _have(2, 4)], [_have(1, 4), _have(3, 4)]]
    assert [span(10, 4, k) for k in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert _pairs(sources(have, [(2, 0), (2, 1)], [10])) == [
        [(0, 0), (1, 1)],  # values 0..5: its own, and rank 1's 3..5
        [(0, 2), (1, 1), (1, 3)],  # 5..10: its own 5, rank 2's from rank 0, rank 3's
    ]
    # the whole buffer (NO_SHARD) needs every part; new ranks take a part's meta
    assert _pairs(sources(have, [(1, 0)], [10])) == [[(0, 0), (0, 2), (1, 1), (1, 3)]]
    grown = sources(have + [[], []], [(6, k) for k in range(6)], [12])
    assert _pairs(grown)[4:] == [[(0, 2), (1, 3)], [(1, 3)]]  # values 8..10 and 10..12
    assert grown is not None and [s.meta for s in grown] == [0, 1, 2, 3, 2, 3]


def test_a_replica_s_part_serves_when_its_own_rank_is_gone() -> None:
    # HYBRID_SHARD, 2 replicas of 2 shards: rank 1 (shard 1 of replica 0) is gone with its
    # copies; rank 3 holds the same part, and every rank's generators are alike
    have = [[_have(0, 4, 2, 0)], [], [_have(2, 4, 2, 0)], [_have(3, 4, 2, 1)]]
    want = [(2, 0), (2, 1), (2, 0), (2, 1)]
    plan = sources(have, want, [9])
    assert _pairs(plan) == [[(0, 0)], [(3, 3)], [(2, 2)], [(3, 3)]]
    assert plan is not None and plan[1].meta == 3  # rank 3's streams are rank 1's too
    # each rank's own generators (dropout, say): rank 1's are gone, so is the step
    apart = [[_have(r, 4, 2, r % 2, streams=f"s{r}") for r in held] for held in [[0], [], [2], [3]]]
    assert sources(apart, want, [9]) is None
    # the whole buffer (NO_SHARD): any rank's serves every rank
    whole = [[_have(0, 3, 1, 0)], [], [_have(2, 3, 1, 0)]]
    assert _pairs(sources(whole, [(1, 0)] * 3, [9])) == [[(0, 0)], [(0, 0)], [(2, 2)]]


def test_replicas_that_train_apart_restore_only_from_their_own_family() -> None:
    # DiLoCo, 2 replicas (families) of 2 shards: rank 1 (replica 0, shard 1) replaced;
    # rank 2 (replica 1) holds its copy; rank 3 holds shard 1 too, but of replica 1
    def have(rank: int, family: int) -> Have:
        return Have(rank, 4, 2, rank % 2, "s", family)

    held = [[have(0, 0)], [], [have(2, 1), have(1, 0)], [have(3, 1)]]
    want, families = [(2, 0), (2, 1)] * 2, [0, 0, 1, 1]
    plan = sources(held, want, [9], families)
    assert _pairs(plan) == [[(0, 0)], [(2, 1)], [(2, 2)], [(3, 3)]]
    lost = [[have(0, 0)], [], [have(2, 1)], [have(3, 1)]]  # rank 1's copy gone too
    assert sources(lost, want, [9], families) is None  # replica 1's shard 1 is not it
    same = [[Have(h.rank, 4, 2, h.shard, "s") for h in r] for r in lost]  # HYBRID_SHARD
    assert _pairs(sources(same, want, [9])) == [[(0, 0)], [(3, 3)], [(2, 2)], [(3, 3)]]


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
        await asyncio.gather(
            *(
                train_rank(f, r, len(ranks), steps=range(step, step + 1))
                for r, f in enumerate(ranks)
            )
        )
        await _save(ranks, copies, step + 1)


async def _params(ranks) -> dict:
    return (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]


async def _state(ranks) -> tuple[dict, dict]:
    return (await _params(ranks)), _optimizer_state(ranks)


async def _straight(strategy: Strategy = Strategy.FULL_SHARD, **options) -> dict:
    async with fsdp_world(4, strategy, "adam", **options) as ranks:
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
        await asyncio.gather(
            *(train_rank(f, r, 4, steps=range(4, STEPS)) for r, f in enumerate(ranks))
        )
        final = await _params(ranks)
    for name, value in (await _straight()).items():
        np.testing.assert_array_equal(final[name], value)
    return resumed


async def test_a_rank_and_its_holder_both_lost_restore_nothing_and_say_which_copies_were_left(
    caplog,
) -> None:
    copies = [PeerCopies(2, ranks_per_node=1) for _ in range(3)]
    async with fsdp_world(3, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 4)
    # rank 0 and rank 1 (which held rank 0's copies) replaced: no step has rank 0's part
    copies[0], copies[1] = PeerCopies(2, ranks_per_node=1), PeerCopies(2, ranks_per_node=1)
    with caplog.at_level("WARNING", logger="shardwire.worker.fsdp.peercopy"):
        async with fsdp_world(3, Strategy.FULL_SHARD, "adam") as ranks:
            got = await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
    assert got == [None, None, None]
    said = [r.getMessage() for r in caplog.records if "no step can be restored" in r.getMessage()]
    assert said == [
        "no step can be restored from the peers' copies (the old ranks each step's copies "
        "are held of: {2: [1, 2], 4: [1, 2]}; steps every group of the mesh can restore: [])"
    ]


async def test_a_copy_that_fails_its_digest_is_refused_and_an_older_step_used() -> None:
    copies = [PeerCopies(1, ranks_per_node=1) for _ in range(3)]
    async with fsdp_world(3, Strategy.SHARD_GRAD_OP, "adam") as ranks:
        await _train_saving(ranks, copies, 2)
    copies[0] = PeerCopies(1, ranks_per_node=1)  # rank 0 replaced; rank 1 holds its copies
    copies[1]._held[2].data[0] ^= 0xFF  # its copy of step 2 went bad in memory
    async with fsdp_world(3, Strategy.SHARD_GRAD_OP, "adam") as ranks:
        resumed = await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
        assert {r.step for r in resumed} == {1}
        assert copies[1].refused == [
            "the copy of rank 0's state at step 2 (held) does not match its digest: refused"
        ]
        assert not copies[0].refused and not copies[2].refused


async def test_pieces_damaged_on_the_wire_are_refused_and_an_older_step_used(monkeypatch) -> None:
    copies = [PeerCopies(1, ranks_per_node=1) for _ in range(2)]
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 2)
    copies[1] = PeerCopies(1, ranks_per_node=1)  # rank 1 replaced; rank 0 holds its copies
    real, damaged = copywire.bytes_pieces, []

    def damage(table, data):
        if not damaged:  # the first message only: step 2's
            data[len(data) // 2] ^= 0xFF
            damaged.append(True)
        return real(table, data)

    monkeypatch.setattr(copywire, "bytes_pieces", damage)
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        resumed = await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
        assert {r.step for r in resumed} == {1}
        assert copies[1].refused == [
            "the copy of rank 1's state at step 2 (from rank 0) does not match its digest: refused"
        ]


async def _disk_state(root, world: int, strategy: Strategy, **options) -> tuple[dict, dict]:
    """The state a group of ``world`` loads from the checkpoint in ``root``."""
    async with fsdp_world(world, strategy, "adam", **options) as ranks:
        await asyncio.gather(*(f.load(root) for f in ranks))
        return await _state(ranks)


async def _restored(
    copies: list[PeerCopies], strategy: Strategy, steps: int = 4, *, finish: bool = False, **options
) -> tuple:
    """What a group of ``len(copies)`` ranks restores from ``copies``, and its state (with
    ``finish``, after training on to the end: its parameters then)."""
    async with fsdp_world(len(copies), strategy, "adam", **options) as ranks:
        resumed = await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
        assert {f.optimizer.steps for f in ranks} == {steps}
        if finish:
            await asyncio.gather(
                *(train_rank(f, r, 4, steps=range(steps, STEPS)) for r, f in enumerate(ranks))
            )
            return resumed, await _params(ranks)
        await asyncio.gather(*(c.wait() for c in copies))  # the restored step's copies
        return resumed, await _state(ranks)


@pytest.mark.parametrize("survivors", [(0, 1), (2, 3)])
async def test_a_shrink_restores_from_copies_what_the_checkpoint_gives(tmp_path, survivors) -> None:
    """4 ranks on 2 nodes; one node is lost and the other's two ranks go on alone (as
    ranks 0 and 1): they restore the lost ranks' parts from the copies they held, the
    same state, bit for bit, as loading the checkpoint of that step at 2 ranks."""
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with fsdp_world(4, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 4)
        await asyncio.gather(*(f.save(tmp_path, step=4, extra={"at": 4}) for f in ranks))
    kept = [copies[r] for r in survivors]
    resumed, state = await _restored(kept, Strategy.FULL_SHARD)
    assert {(r.step, r.extra["at"]) for r in resumed} == {(4, 4)}
    _assert_same(state, await _disk_state(tmp_path, 2, Strategy.FULL_SHARD))
    # the restored step was copied again in the smaller group: a second loss rolls back
    # to it, not past it
    assert all(c._own[4].meta["world"] == c._held[4].meta["world"] == 2 for c in kept)


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        (Strategy.FULL_SHARD, {}),
        (Strategy.NO_SHARD, {}),
        (Strategy.HYBRID_SHARD, {"shard_size": 2}),
    ],
)
async def test_a_grow_or_another_strategy_restores_what_the_checkpoint_gives(
    tmp_path, strategy, options
) -> None:
    copies = [PeerCopies(2) for _ in range(2)]
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 4)
        await asyncio.gather(*(f.save(tmp_path, step=4) for f in ranks))
    grown = [*copies, PeerCopies(2), PeerCopies(2)]  # two new ranks, nothing in memory
    _resumed, state = await _restored(grown, strategy, **options)
    _assert_same(state, await _disk_state(tmp_path, 4, strategy, **options))


def _assert_same(state: tuple[dict, dict], oracle: tuple[dict, dict]) -> None:
    for got, want in zip(state, oracle, strict=True):
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)  # bit for bit


async def test_a_replica_s_copy_restores_a_replaced_rank_under_hybrid_shard() -> None:
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with fsdp_world(4, Strategy.HYBRID_SHARD, "adam", shard_size=2) as ranks:
        await _train_saving(ranks, copies, 4)
        at_four = await _state(ranks)
    copies[1] = PeerCopies(2, ranks_per_node=2)
    _resumed, state = await _restored(copies, Strategy.HYBRID_SHARD, shard_size=2)
    _assert_same(state, at_four)


REPLICATED = [
    (Strategy.NO_SHARD, {}, 3),  # a replica of every part: the live state, nothing lost
    (Strategy.HYBRID_SHARD, {"shard_size": 2}, 3),
    (Strategy.FULL_SHARD, {}, 2),  # rank 1's part lives nowhere else: its copy of step 2
]


@pytest.mark.parametrize(("strategy", "options", "back_to"), REPLICATED)
async def test_a_replica_s_live_state_serves_a_lost_rank_and_nothing_is_rolled_back(
    strategy, options, back_to
) -> None:
    """Copies every 2 steps; rank 1 dies during step 4. Where another rank holds the same
    part (NO_SHARD, HYBRID_SHARD), every rank goes on from the state the survivors hold
    after step 3; under FULL_SHARD from the copies of step 2. Either way the run ends as
    the one without the failure."""
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with fsdp_world(4, strategy, "adam", **options) as ranks:
        await _train_saving(ranks, copies, 2)
        states = {2: await _state(ranks)}
        await asyncio.gather(*(train_rank(f, r, 4, steps=range(2, 3)) for r, f in enumerate(ranks)))
        await asyncio.gather(*(c.save(f, 3) for f, c in zip(ranks, copies, strict=True)))
        states[3] = await _state(ranks)
    copies[1] = PeerCopies(2, ranks_per_node=2)  # rank 1's process died with its memory
    resumed, state = await _restored(copies, strategy, back_to, **options)
    assert {r.step for r in resumed} == {back_to}
    _assert_same(state, states[back_to])
    _resumed, final = await _restored(copies, strategy, back_to, finish=True, **options)
    for name, value in (await _straight(strategy, **options)).items():
        np.testing.assert_array_equal(final[name], value)


async def test_a_live_state_changed_after_its_last_save_is_not_used() -> None:
    """The survivors' optimizer took step 4 before the failure was seen, and step 4 was
    never saved: their state is past every step they could name, so the copies of
    step 2 are restored."""
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with fsdp_world(4, Strategy.NO_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 3)
        await asyncio.gather(*(train_rank(f, r, 4, steps=range(3, 4)) for r, f in enumerate(ranks)))
    copies[1] = PeerCopies(2, ranks_per_node=2)
    resumed, _state_then = await _restored(copies, Strategy.NO_SHARD, 2)
    assert {r.step for r in resumed} == {2}


async def test_a_grow_goes_on_from_the_live_state_under_full_shard(tmp_path) -> None:
    """Copies every 3 steps; after step 4 two ranks join (nobody failed): the new group
    of 4 takes the state of step 4 from the 2 ranks' live models, as the checkpoint of
    step 4 would give it, not the copies of step 3."""
    copies = [PeerCopies(3) for _ in range(2)]
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 4)
        await asyncio.gather(*(f.save(tmp_path, step=4) for f in ranks))
    resumed, state = await _restored([*copies, PeerCopies(3), PeerCopies(3)], Strategy.FULL_SHARD)
    assert {r.step for r in resumed} == {4}
    _assert_same(state, await _disk_state(tmp_path, 4, Strategy.FULL_SHARD))


async def test_live_states_that_stopped_at_different_steps_are_not_used() -> None:
    """Step 3 was trained everywhere, but rank 0 failed before its save of step 3 (in
    the step's logging, say) while ranks 2 and 3 saved it: going on from their state
    would skip what rank 0 had still to do, so every rank takes the copies of step 2."""
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with fsdp_world(4, Strategy.NO_SHARD, "adam") as ranks:
        await _train_saving(ranks, copies, 2)
        await asyncio.gather(*(train_rank(f, r, 4, steps=range(2, 3)) for r, f in enumerate(ranks)))
        await asyncio.gather(*(copies[r].save(ranks[r], 3) for r in (2, 3)))
    copies[1] = PeerCopies(2, ranks_per_node=2)
    resumed, _state_then = await _restored(copies, Strategy.NO_SHARD, 2)
    assert {r.step for r in resumed} == {2}
    assert all(3 not in c._own for c in copies)


async def test_copies_of_another_model_or_optimizer_are_not_restored() -> None:
    copies = [PeerCopies(1) for _ in range(2)]
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await asyncio.gather(*(train_rank(f, r, 2, steps=range(1)) for r, f in enumerate(ranks)))
        await _save(ranks, copies, 1)
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:  # SGD has other slots
        assert (
            await asyncio.gather(*(c.restore(f) for f, c in zip(ranks, copies, strict=True)))
            == [None] * 2
        )
    assert all(not c._own and not c._held for c in copies)


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
