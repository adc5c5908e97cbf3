"""Durable checkpoints: saved at one world size and strategy, loaded at another with
every value intact; resumed training equal to uninterrupted training; corrupt, missing
or foreign files refused with a typed error and nothing loaded half-way."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardwire.worker.fsdp import CheckpointCorrupt, CheckpointError, Strategy
from shardwire.worker.fsdp.persist import owned_range

from .training import STEPS, fsdp_world, reference, train_rank

SAVED_AT = 2  # steps trained before the save


def _hybrid(world: int) -> int:
    return 2 if world % 2 == 0 else 1


async def _train(ranks, steps: range) -> None:
    await asyncio.gather(*(train_rank(f, r, len(ranks), steps=steps) for r, f in enumerate(ranks)))


def _optimizer_state(ranks) -> dict[str, np.ndarray]:
    """Every optimizer slot of every parameter, assembled from the ranks' shards."""
    out: dict[str, np.ndarray] = {}
    for f in ranks:
        for index, unit in enumerate(f.all_units()):
            lo, hi = owned_range(unit)
            for slot, values in f.optimizer.state[index].items():
                for e in unit.layout.entries:
                    full = out.setdefault(f"{slot}:{e.name}", np.full(e.numel, np.nan))
                    a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
                    if a < b:
                        full[a - e.offset : b - e.offset] = values[a - lo : b - lo]
    return out


WRITERS = [
    (4, Strategy.FULL_SHARD),
    (3, Strategy.SHARD_GRAD_OP),
    (2, Strategy.NO_SHARD),
    (4, Strategy.HYBRID_SHARD),
]


@pytest.fixture(scope="module", params=WRITERS, ids=lambda w: f"from-{w[0]}-{w[1].value}")
def saved(request, tmp_path_factory) -> tuple[Path, dict, dict]:
    """A checkpoint written by N ranks with strategy S after SAVED_AT AdamW steps."""
    world, strategy = request.param
    root = tmp_path_factory.mktemp("ckpt")
    shard = _hybrid(world) if strategy is Strategy.HYBRID_SHARD else None

    async def make():
        async with fsdp_world(world, strategy, "adam", shard_size=shard) as ranks:
            await _train(ranks, range(SAVED_AT))
            reports = await asyncio.gather(
                *(f.save(root, step=SAVED_AT, extra={"cursor": 7}) for f in ranks)
            )
            assert {r.step for r in reports} == {SAVED_AT}
            params = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
            return params, _optimizer_state(ranks)

    params, optim = asyncio.run(make())
    yield root, params, optim
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", list(Strategy))
async def test_a_checkpoint_loads_anywhere_and_training_continues(saved, world, strategy):
    root, params, optim = saved
    shard = _hybrid(world) if strategy is Strategy.HYBRID_SHARD else None
    async with fsdp_world(world, strategy, "adam", shard_size=shard) as ranks:
        resumed = await asyncio.gather(*(f.load(root) for f in ranks))
        assert {(r.step, r.extra["cursor"]) for r in resumed} == {(SAVED_AT, 7)}
        loaded = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
        for name, value in params.items():
            np.testing.assert_array_equal(loaded[name], value)  # bit for bit
        state = _optimizer_state(ranks)
        assert state.keys() == optim.keys()
        for key, value in optim.items():
            np.testing.assert_array_equal(state[key], value)
        assert {f.optimizer.steps for f in ranks} == {SAVED_AT}
        await _train(ranks, range(SAVED_AT, STEPS))
        final = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
    expected = reference("adam")["params"]
    for name, value in expected.items():  # the tolerance of the FSDP oracle tests
        np.testing.assert_allclose(final[name], value, rtol=1e-10, atol=1e-10, err_msg=name)


async def test_resuming_at_the_same_shape_is_bit_identical(tmp_path) -> None:
    async with fsdp_world(2, Strategy.SHARD_GRAD_OP, "adam") as ranks:
        await _train(ranks, range(STEPS))
        straight = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
    async with fsdp_world(2, Strategy.SHARD_GRAD_OP, "adam") as ranks:
        await _train(ranks, range(SAVED_AT))
        await asyncio.gather(*(f.save(tmp_path, step=SAVED_AT) for f in ranks))
    async with fsdp_world(2, Strategy.SHARD_GRAD_OP, "adam") as ranks:
        await asyncio.gather(*(f.load(tmp_path) for f in ranks))
        await _train(ranks, range(SAVED_AT, STEPS))
        resumed = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
    for name, value in straight.items():
        np.testing.assert_array_equal(resumed[name], value)


async def test_an_async_save_keeps_the_snapshot_while_training_goes_on(tmp_path) -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await _train(ranks, range(SAVED_AT))
        at_save = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
        works = await asyncio.gather(
            *(f.save(tmp_path, step=SAVED_AT, blocking=False) for f in ranks)
        )
        await _train(ranks, range(SAVED_AT, SAVED_AT + 1))  # training goes on meanwhile
        reports = await asyncio.gather(*(w.wait() for w in works))
        assert all(r.stall_s < r.total_s for r in reports)
        await asyncio.gather(*(f.load(tmp_path) for f in ranks))
        loaded = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
    for name, value in at_save.items():
        np.testing.assert_array_equal(loaded[name], value)


async def test_a_load_while_a_save_is_in_flight_waits_for_it(tmp_path) -> None:
    """Both speak on the checkpoint group: a load that began while the save was still
    writing would interleave their messages differently on each rank and hang."""
    async with fsdp_world(2, Strategy.FULL_SHARD, "adam") as ranks:
        await _train(ranks, range(SAVED_AT))
        at_save = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
        works = await asyncio.gather(
            *(f.save(tmp_path, step=SAVED_AT, blocking=False) for f in ranks)
        )
        await _train(ranks, range(SAVED_AT, SAVED_AT + 1))

        async def load(rank: int):
            await asyncio.sleep(0.05 * rank)  # the ranks' writes at different points
            return await ranks[rank].load(tmp_path)

        resumed = await asyncio.wait_for(asyncio.gather(load(0), load(1)), 60)
        assert [r.step for r in resumed] == [SAVED_AT, SAVED_AT]
        assert all(w.done() for w in works)
        loaded = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
    for name, value in at_save.items():
        np.testing.assert_array_equal(loaded[name], value)


async def test_keep_retains_the_newest_and_latest_points_at_the_last(tmp_path) -> None:
    async with fsdp_world(2, Strategy.NO_SHARD, "sgd") as ranks:
        for step in (1, 2, 3):
            await asyncio.gather(*(f.save(tmp_path, step=step, keep=2) for f in ranks))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    assert not list(tmp_path.glob(".partial-*"))


async def _save_one(root: Path) -> Path:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        await _train(ranks, range(1))
        reports = await asyncio.gather(*(f.save(root, step=1) for f in ranks))
    return reports[0].path


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(data)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "foreign"])
async def test_damage_is_refused_and_nothing_is_loaded(tmp_path, damage) -> None:
    path = await _save_one(tmp_path / "a")
    victim = path / "rank-00001.safetensors"
    manifest = json.loads((path / "manifest.json").read_text())
    if damage == "flip":
        pieces = [p for t in manifest["tensors"].values() for p in t["pieces"]]
        piece = next(p for p in pieces if p["file"] == victim.name)
        _flip(victim, piece["bytes"][0])
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif damage == "delete":
        victim.unlink()
    else:  # another run's file in its place
        other = await _save_one(tmp_path / "b")
        shutil.copy(other / victim.name, victim)
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        before = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
        results = await asyncio.gather(
            *(f.load(tmp_path / "a") for f in ranks), return_exceptions=True
        )
        # the same layout: rank 1 alone reads rank-00001 and finds the damage, rank 0 is told
        told, found = results
        assert type(found) is CheckpointCorrupt and victim.name in str(found), results
        assert type(told) is CheckpointError, results
        assert str(told).startswith("the checkpoint could not be loaded: rank 1: "), results
        assert victim.name in str(told), results
        after = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)


async def test_a_different_model_is_named(tmp_path) -> None:
    path = await _save_one(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tensors"]["param:head.weight"]["shape"] = [3, 3]
    (path / "manifest.json").write_text(json.dumps(manifest))
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        results = await asyncio.gather(*(f.load(tmp_path) for f in ranks), return_exceptions=True)
    assert all(isinstance(r, CheckpointError) and "head.weight" in str(r) for r in results)


async def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    path = await _save_one(tmp_path)
    crashed = tmp_path / ".partial-00000002-deadbeef"
    crashed.mkdir()
    (crashed / "rank-00000.safetensors").write_bytes(b"half a file")
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        resumed = await asyncio.gather(*(f.load(tmp_path) for f in ranks))
        assert {r.path for r in resumed} == {path}
        await asyncio.gather(*(f.save(tmp_path, step=3) for f in ranks))
    assert not crashed.exists()  # the next save cleans up


def test_the_checkpoint_command_inspects_verifies_and_consolidates(saved, tmp_path) -> None:
    from safetensors.numpy import load_file

    from shardwire.worker.fsdp.tools import main

    root, params, _optim = saved
    assert main(["inspect", str(root)]) == 0
    assert main(["verify", str(root)]) == 0
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(root), str(out)]) == 0
    whole = load_file(str(out))
    assert whole.keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(whole[name], value)


def test_verify_fails_on_a_flipped_byte(tmp_path, capsys) -> None:
    from shardwire.worker.fsdp.tools import main

    path = asyncio.run(_save_one(tmp_path))
    manifest = json.loads((path / "manifest.json").read_text())
    piece = next(iter(manifest["tensors"].values()))["pieces"][0]
    _flip(path / piece["file"], piece["bytes"][1] - 1)
    assert main(["verify", str(tmp_path)]) == 1
    assert "does not match its digest" in capsys.readouterr().err


async def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path, monkeypatch) -> None:
    from shardwire.worker.fsdp import store

    first = await _save_one(tmp_path)
    real = store.write_rank_file

    def full_disk(directory, rank, tensors, nonce):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(directory, rank, tensors, nonce)

    monkeypatch.setattr(store, "write_rank_file", full_disk)
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        async with asyncio.timeout(30):  # at once, not at a collective timeout
            results = await asyncio.gather(
                *(f.save(tmp_path, step=2) for f in ranks), return_exceptions=True
            )
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert all("rank 1: [Errno 28] No space left on device" in str(r) for r in results)
    assert (tmp_path / "latest").read_text().strip() == first.name  # still the last good one
