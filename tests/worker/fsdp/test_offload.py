"""Offload: training equals in-memory training bit for bit, state lives in unnamed
memory-mapped files that are paged out after use, and nothing is left behind."""

from __future__ import annotations

import asyncio
import gc
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.fsdp import FSDP, Offload, Strategy
from tests.worker.transport.fabric import WORLDS

from .training import fsdp_world, train_rank

OFFLOADED = (Strategy.FULL_SHARD, Strategy.SHARD_GRAD_OP, Strategy.NO_SHARD)


def mapped(array: np.ndarray) -> bool:
    """Whether ``array``'s memory is a memory-mapped file."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap)


def offload_mappings(directory: Path, pid: int | str = "self") -> dict[str, int]:
    """Offload mappings of a process under ``directory``: name -> resident KiB."""
    found: dict[str, int] = {}
    current = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            path = line.split(maxsplit=5)[5] if len(fields) > 5 else ""
            current = path if path.startswith(f"{directory}/shardwire-offload-") else None
            if current:
                found[current] = 0
        elif current and fields[0] == "Rss:":
            found[current] += int(fields[1])
    return found


async def trained_state(strategy: Strategy, kind: str, transport: str, **options) -> dict:
    async with fsdp_world(2, strategy, kind, transport=transport, **options) as ranks:
        await asyncio.gather(*(train_rank(f, r, 2, clip=0.5) for r, f in enumerate(ranks)))
        if "offload" in options:
            for f in ranks:
                for unit in f.all_units():
                    assert mapped(unit.shard) and mapped(unit.grad_shard)
                assert all(mapped(a) for slot in f.optimizer.state for a in slot.values())
        return (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("strategy", OFFLOADED)
async def test_offload_training_equals_in_memory_training_bit_for_bit(
    strategy: Strategy, transport: str, tmp_path: Path
) -> None:
    for kind in ("adamw", "sgd"):
        plain = await trained_state(strategy, kind, transport)
        spilled = await trained_state(
            strategy, kind, transport, offload=Offload(directory=tmp_path)
        )
        assert spilled.keys() == plain.keys()
        for name, value in plain.items():
            np.testing.assert_array_equal(spilled[name], value, err_msg=f"{kind} {name}")
    assert os.listdir(tmp_path) == []


async def test_each_flag_offloads_its_own_state(tmp_path: Path) -> None:
    flags = ((True, False, False), (False, True, False), (False, False, True))
    for params, grads, optimizer in flags:
        offload = Offload(params=params, grads=grads, optimizer=optimizer, directory=tmp_path)
        async with fsdp_world(2, Strategy.FULL_SHARD, "adamw", offload=offload) as ranks:
            await asyncio.gather(*(train_rank(f, r, 2) for r, f in enumerate(ranks)))
            f = ranks[0]
            units = f.all_units()
            assert all(mapped(u.shard) == params for u in units)
            assert all(mapped(u.grad_shard) == grads for u in units)
            state = [a for slot in f.optimizer.state for a in slot.values()]
            assert state and all(mapped(a) == optimizer for a in state)
            stats = f.memory_stats()
            shard_bytes = sum(u.shard.nbytes for u in units)
            assert stats["offloaded"]["params"] == (shard_bytes if params else 0)
            assert stats["offloaded"]["grads"] == (shard_bytes if grads else 0)
            assert stats["offloaded"]["optimizer"] == (2 * shard_bytes if optimizer else 0)
            assert stats["held"]["optimizer"] == (0 if optimizer else 2 * shard_bytes)


async def test_pages_are_dropped_after_use_and_mappings_go_on_close(tmp_path: Path) -> None:
    offload = Offload(directory=tmp_path)
    async with fsdp_world(2, Strategy.FULL_SHARD, "adamw", offload=offload) as ranks:
        await asyncio.gather(*(train_rank(f, r, 2) for r, f in enumerate(ranks)))
        maps = offload_mappings(tmp_path)
        # per rank and unit: shard, gradient shard, two AdamW moments
        assert len(maps) == 2 * 4 * len(ranks[0].all_units())
        assert all(name.endswith("(deleted)") for name in maps)
        assert os.listdir(tmp_path) == []  # the files have no names
        assert sum(maps.values()) == 0, maps  # the step paged every unit out
        for unit in ranks[0].all_units():  # touching state maps it back in
            unit.grad_shard.fill(unit.grad_shard[0])
        assert sum(offload_mappings(tmp_path).values()) > 0
        ranks[0].zero_grad()
        assert sum(offload_mappings(tmp_path).values()) == 0
    del ranks, unit  # the arrays were the last users of their mappings
    gc.collect()
    assert offload_mappings(tmp_path) == {}


async def test_checkpoint_round_trip_keeps_offloaded_state_in_files(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    offload = Offload(directory=spill)
    async with fsdp_world(2, Strategy.FULL_SHARD, "adamw", offload=offload) as ranks:
        await asyncio.gather(*(train_rank(f, r, 2, steps=range(2)) for r, f in enumerate(ranks)))
        await asyncio.gather(*(f.save(tmp_path / "ckpt", step=2) for f in ranks))
        want = [{k: v.copy() for k, v in slot.items()} for f in ranks for slot in f.optimizer.state]
        for f in ranks:
            for slot in f.optimizer.state:
                for a in slot.values():
                    a.fill(0)
        await asyncio.gather(*(f.load(tmp_path / "ckpt") for f in ranks))
        assert sum(offload_mappings(spill).values()) == 0  # the load paged out what it set
        assert len(offload_mappings(spill)) == 2 * 4 * len(ranks[0].all_units())
        got = [slot for f in ranks for slot in f.optimizer.state]
        for mine, theirs in zip(got, want, strict=True):
            for name, value in theirs.items():
                assert mapped(mine[name])
                np.testing.assert_array_equal(mine[name], value)


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="not a directory"):
        Offload(directory=tmp_path / "absent")


CRASHER = textwrap.dedent(
    """
    import asyncio, sys
    from shardwire.worker.collectives import Group
    from shardwire.worker.fsdp import FSDP, Offload, Strategy
    from tests.worker.fsdp.training import make_model, make_optimizer, train_rank
    from tests.worker.transport.fabric import WORLDS

    async def main():
        async with WORLDS["memory"](1, timeout=60) as (transport,):
            group = Group(transport, timeout=60)
            fsdp = await FSDP.create(
                make_model(), group, optimizer=make_optimizer("adamw"),
                strategy=Strategy.NO_SHARD, offload=Offload(directory=sys.argv[1]),
            )
            await train_rank(fsdp, 0, 1)
            print("ready", flush=True)
            await asyncio.sleep(120)

    asyncio.run(main())
    """
)


@pytest.mark.e2e
def test_nothing_is_left_after_sigkill(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHER, str(tmp_path)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        assert len(offload_mappings(tmp_path, proc.pid)) > 0
        assert os.listdir(tmp_path) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while os.listdir(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(tmp_path) == []


async def test_state_held_before_wrapping_moves_to_files(tmp_path: Path) -> None:
    from tests.worker.fsdp.training import make_model, make_optimizer

    async with WORLDS["memory"](1, timeout=60) as (transport,):
        from shardwire.worker.collectives import Group

        group = Group(transport, timeout=60)
        optimizer = make_optimizer("adamw")
        plain = await FSDP.create(make_model(), group, optimizer=optimizer)
        await train_rank(plain, 0, 1, steps=range(1))
        before = [{k: v.copy() for k, v in s.items()} for s in optimizer.state]
        await plain.aclose()
        await group.aclose()
        group = Group(transport, timeout=60)
        spilled = await FSDP.create(
            make_model(), group, optimizer=optimizer, offload=Offload(directory=tmp_path)
        )
        for mine, theirs in zip(optimizer.state, before, strict=True):
            for name, value in theirs.items():
                assert mapped(mine[name])
                np.testing.assert_array_equal(mine[name], value)
        await spilled.aclose()
        await group.aclose()


TRIM = textwrap.dedent(
    """
    from pathlib import Path
    import numpy as np
    from shardwire.worker.fsdp.offload import return_free_memory

    def rss_mib():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) >> 10

    big = np.ones(2 << 20)
    del big  # a freed 16 MiB mapping raises glibc's mmap threshold
    arrays = [np.ones(1 << 20) for _ in range(20)]  # 8 MiB each, now from the heap
    last = arrays[-1]
    del arrays
    before = rss_mib()
    released = return_free_memory()
    print(released, before - rss_mib())
    """
)


@pytest.mark.e2e
def test_freed_heap_memory_goes_back_to_the_system() -> None:
    out = subprocess.run(
        [sys.executable, "-c", TRIM], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) >= 100  # of the 152 MiB freed


async def test_fsdp_returns_freed_memory_after_wrapping_and_offloaded_steps(
    tmp_path: Path, monkeypatch
) -> None:
    from shardwire.worker.fsdp import wrapper

    calls = []
    monkeypatch.setattr(wrapper, "return_free_memory", lambda: calls.append(1))
    async with fsdp_world(1, Strategy.FULL_SHARD, "sgd") as (plain,):
        assert len(calls) == 1
        await train_rank(plain, 0, 1, steps=range(2))
        assert len(calls) == 1  # in memory, steps keep their buffers
    calls.clear()
    offload = Offload(directory=tmp_path)
    async with fsdp_world(1, Strategy.FULL_SHARD, "sgd", offload=offload) as (spilled,):
        await train_rank(spilled, 0, 1, steps=range(2))
        assert len(calls) == 3
