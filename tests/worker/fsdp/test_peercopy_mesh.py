"""Peer copies under tensor-parallel and pipeline layouts: each data-parallel group (the
ranks of one stage and slice) keeps its copies, every group of the mesh restores the
same step, and the state is the one before the failure (or, at another data-parallel
size, the one the checkpoint of that step gives), bit for bit."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.worker.fsdp import PeerCopies
from shardwire.worker.fsdp.copystate import layout_of

from .test_reshard import _layout, _train
from .training import STEPS, reference, tp_slices


async def _train_saving(ranks, copies: list[PeerCopies], steps: range) -> None:
    for step in steps:
        await _train(ranks, range(step, step + 1))
        await asyncio.gather(
            *(c.save(r.fsdp, step + 1) for r, c in zip(ranks, copies, strict=True))
        )
    await asyncio.gather(*(c.wait() for c in copies))


def _arrays(ranks) -> list[list[np.ndarray]]:
    """Each rank's shards and optimizer slots, copied."""
    return [[a.copy() for _name, a in layout_of(r.fsdp)] for r in ranks]


def _assert_same(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> None:
    assert len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)  # bit for bit


@pytest.mark.parametrize(("pp", "tp"), [(1, 2), (2, 1)], ids=["dp2tp2", "dp2pp2"])
async def test_a_replaced_rank_of_a_mesh_restores_from_its_group_s_copies(pp, tp) -> None:
    """4 ranks on 2 nodes; rank 1 dies after step 5 (copies every 2 steps): every rank
    of the mesh, in every group, rolls back to step 4, and training on ends as the
    single-process oracle."""
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with _layout(4, pp, tp) as ranks:
        await _train_saving(ranks, copies, range(4))
        at_four = _arrays(ranks)
        await _train(ranks, range(4, 5))  # never saved: the copies of step 4 serve
    copies[1] = PeerCopies(2, ranks_per_node=2)  # rank 1's process died with its memory
    async with _layout(4, pp, tp) as ranks:
        resumed = await asyncio.gather(
            *(c.restore(r.fsdp) for r, c in zip(ranks, copies, strict=True))
        )
        assert {x.step for x in resumed} == {4}
        _assert_same(_arrays(ranks), at_four)
        await _train(ranks, range(4, STEPS))
        states = await asyncio.gather(*(r.fsdp.state_dict() for r in ranks))
    full = reference("adam")["params"]
    for r, state in zip(ranks, states, strict=True):
        expected = tp_slices(r.model, full)
        for name, value in state.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-10, err_msg=name)


async def test_a_tensor_parallel_job_that_lost_a_replica_restores_what_the_checkpoint_gives(
    tmp_path,
) -> None:
    """dp2 x tp2 on 2 nodes (a replica per node); node b is lost and the job goes on as
    dp1 x tp2: each slice's survivor restores both replicas' parts from its copies, as
    loading the checkpoint of that step at dp1 x tp2 gives them."""
    copies = [PeerCopies(2, ranks_per_node=2) for _ in range(4)]
    async with _layout(4, 1, 2) as ranks:
        await _train_saving(ranks, copies, range(4))
        await asyncio.gather(*(r.fsdp.save(tmp_path, step=4) for r in ranks))
    async with _layout(2, 1, 2) as ranks:
        await asyncio.gather(*(r.fsdp.load(tmp_path) for r in ranks))
        from_disk = _arrays(ranks)
    async with _layout(2, 1, 2) as ranks:  # ranks 0 and 1: node a's, slices 0 and 1
        resumed = await asyncio.gather(
            *(c.restore(r.fsdp) for r, c in zip(ranks, copies[:2], strict=True))
        )
        assert {x.step for x in resumed} == {4}
        _assert_same(_arrays(ranks), from_disk)
