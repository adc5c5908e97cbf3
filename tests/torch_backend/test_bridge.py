"""The bridge's parts in one process: tensor staging, reduce ops, Work and the engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from datetime import timedelta

import numpy as np
import pytest

from shardwire.protocol import CollectiveTimeout, InvalidArgument, InvalidState
from shardwire.worker.collectives import ReduceOp

from .lazy import Lazy, skip_without_torch

skip_without_torch()
torch = Lazy("torch")
dist = Lazy("torch.distributed")
swt = Lazy("shardwire.torch")
loopthread = Lazy("shardwire.torch.loopthread")
tensors = Lazy("shardwire.torch.tensors")
bridgework = Lazy("shardwire.torch.work")


@pytest.fixture
def engine():
    e = loopthread.LoopThread()
    e.start()
    yield e
    e.close()


def test_a_contiguous_tensor_is_shared_not_copied():
    t = torch.arange(6, dtype=torch.float32)
    s = tensors.Staged(t, "op", reduce=True)
    s.array[0] = 42
    assert not s.staged and t[0] == 42


def test_a_transposed_tensor_is_staged_and_written_back():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    s = tensors.Staged(t, "op", reduce=True)
    assert s.staged
    s.array += 1
    assert t[0, 1] == 3  # untouched until finish
    s.finish()
    np.testing.assert_array_equal(t.numpy(), np.arange(6).reshape(2, 3).T + 1)


def test_bfloat16_reduces_in_float32_and_moves_as_bytes():
    t = torch.tensor([1.5, 2.25], dtype=torch.bfloat16)
    r = tensors.Staged(t, "op", reduce=True)
    assert r.array.dtype == np.float32
    r.array *= 2
    r.finish()
    assert t.tolist() == [3.0, 4.5]
    m = tensors.Staged(t, "op", reduce=False)
    assert m.array.dtype == np.int16 and not m.staged
    np.testing.assert_array_equal(m.array, t.view(torch.int16).numpy())


def test_float8_moves_as_bytes_and_is_not_reduced():
    t = torch.tensor([1.5, -2.0], dtype=torch.float8_e4m3fn)
    m = tensors.Staged(t, "broadcast", reduce=False)
    assert m.array.dtype == np.uint8 and not m.staged
    with pytest.raises(swt.UnsupportedTensor, match="all_reduce.*float8"):
        tensors.Staged(t, "all_reduce", reduce=True)


def test_a_complex_tensor_reduces_as_its_parts_and_comes_back():
    t = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    s = tensors.Staged(t, "reduce", reduce=True)
    assert s.array.dtype == np.float32 and s.array.shape == (2, 2) and not s.staged
    strided = torch.tensor([1 + 2j, 0, 3 - 1j], dtype=torch.complex128)[::2]
    staged = tensors.Staged(strided, "reduce", reduce=True)
    staged.array *= 2
    staged.finish()
    assert strided.tolist() == [2 + 4j, 6 - 2j]
    with pytest.raises(swt.UnsupportedTensor, match="view_as_real"):
        tensors.Staged(t, "gather", reduce=False)  # gloo refuses it too


def test_a_transposed_bfloat16_tensor_reduces_through_contiguous_staging():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()
    s = tensors.Staged(t, "all_reduce", reduce=True)
    assert s.array.flags.c_contiguous
    s.array += 1
    s.finish()
    assert t.tolist() == [[1, 4], [2, 5], [3, 6]]


def test_reduce_ops_gloo_refuses_are_refused_by_dtype():
    z = torch.zeros(2, dtype=torch.complex64)
    assert tensors.reduction(dist.ReduceOp.AVG, "x", [z]).op is ReduceOp.AVG
    with pytest.raises(TypeError, match="MAX is not defined on complex"):
        tensors.reduction(dist.ReduceOp.MAX, "reduce", [z])
    if hasattr(dist._make_nccl_premul_sum(0.5), "factor"):
        with pytest.raises(TypeError, match="PREMUL_SUM needs a floating"):
            tensors.reduction(
                dist._make_nccl_premul_sum(0.5), "x", [torch.zeros(2, dtype=torch.int32)]
            )


def test_a_tensor_on_another_device_is_refused_naming_the_op():
    with pytest.raises(swt.UnsupportedTensor, match="all_gather.*meta"):
        tensors.Staged(torch.empty(3, device="meta"), "all_gather", reduce=False)


def test_every_torch_reduce_op_maps():
    assert tensors.reduction(dist.ReduceOp.SUM, "x").op is ReduceOp.SUM
    assert tensors.reduction(dist.ReduceOp.AVG, "x").op is ReduceOp.AVG
    assert tensors.reduction(dist.ReduceOp.BXOR, "x").op is ReduceOp.BXOR
    if not hasattr(dist._make_nccl_premul_sum(0.125), "factor"):
        pytest.skip("this torch does not show PREMUL_SUM's factor to a Python backend")
    premul = tensors.reduction(dist._make_nccl_premul_sum(0.125), "x")
    assert premul.op is ReduceOp.SUM and premul.scale == 0.125
    a = np.ones(3, np.float32)
    assert tensors.scaled(a, premul) is not a and a[0] == 1  # a copy: the caller's input stays
    assert tensors.scaled(a, premul, own=True) is a and a[0] == 0.125


def test_joined_lays_tensors_end_to_end():
    flat, sizes = tensors.joined([torch.ones(2), torch.zeros(3)], "x", reduce=False)
    assert sizes == [2, 3] and flat.tolist() == [1, 1, 0, 0, 0]


def test_wait_honours_its_timeout_and_the_call_goes_on(engine):
    gate = threading.Event()

    async def slow() -> None:
        await asyncio.to_thread(gate.wait, 30)

    work = bridgework.BridgeWork(engine, engine.submit(slow()), [], op="all_reduce #3", limit=60)
    with pytest.raises(CollectiveTimeout, match=r"all_reduce #3.*wait\(timeout=0.05 s\)"):
        work.wait(timedelta(milliseconds=50))
    assert not work.is_completed()
    gate.set()
    assert work.wait() is True
    assert work.is_success()


def test_the_future_completes_off_the_loop_with_the_result(engine):
    t = torch.ones(2)

    async def nothing() -> None:
        return None

    work = bridgework.BridgeWork(engine, engine.submit(nothing()), [t], op="x", limit=5)
    seen = []
    chained = work.get_future().then(
        lambda f: seen.append((threading.current_thread().name, f.value()))
    )
    chained.wait()
    name, value = seen[0]
    assert name != "shardwire-loop" and value[0] is t  # never on the loop


def test_callbacks_of_a_running_call_run_on_the_completion_thread(engine):
    gate = threading.Event()

    async def held() -> None:
        await asyncio.to_thread(gate.wait, 30)

    work = bridgework.BridgeWork(engine, engine.submit(held()), [], op="x", limit=60)
    seen = []
    chained = work.get_future().then(lambda f: seen.append(threading.current_thread().name))
    gate.set()
    chained.wait()
    assert seen[0].startswith("shardwire-torch-done")


def test_an_error_reaches_wait_and_the_future(engine):
    async def fail() -> None:
        raise CollectiveTimeout("rank 3 silent in all_gather #9")

    work = bridgework.BridgeWork(engine, engine.submit(fail()), [], op="x", limit=5)
    with pytest.raises(CollectiveTimeout, match="rank 3 silent in all_gather #9") as waited:
        work.wait()
    assert waited.value is work.exception()  # the call's own error, as is
    # the future is failed in C++ terms (a reader in C++ raises, not reads a value): its
    # Python wait raises the RuntimeError torch makes of it, naming the typed error
    with pytest.raises(RuntimeError, match="CollectiveTimeout: rank 3 silent in all_gather #9"):
        work.get_future().wait()
    with pytest.raises(RuntimeError, match="rank 3 silent"):  # C++'s collectAll sees it
        torch.futures.collect_all([work.get_future()]).wait()
    assert not work.is_success()


def test_the_engine_starts_calls_in_submission_order(engine):
    seen: list[int] = []

    async def note(i: int) -> None:
        seen.append(i)

    futures = [engine.submit(note(i)) for i in range(50)]
    concurrent.futures.wait(futures, 10)
    assert seen == list(range(50))


def test_a_blocking_call_on_the_loop_thread_is_refused(engine):
    async def inner() -> None:
        return None

    async def outer() -> None:
        engine.run(inner(), 1)

    with pytest.raises(
        InvalidState, match="a blocking shardwire call was made on shardwire's own loop"
    ):
        engine.run(outer(), 5)


def test_only_a_receive_has_a_source_rank(engine):
    async def received() -> list:
        return [(3, None)]

    work = bridgework.BridgeWork(
        engine, engine.submit(received()), [], op="recv", limit=5, source=lambda r: r[0][0]
    )
    assert work._source_rank() == 3
    other = bridgework.BridgeWork(
        engine, engine.submit(received()), [], op="all_reduce #1", limit=5
    )
    with pytest.raises(InvalidArgument, match="all_reduce #1 is not a receive"):
        other._source_rank()


def test_re_forming_is_refused_without_a_job_or_where_ranks_met_through_torch_s_store():
    from shardwire.protocol.errors import RecoveryError
    from shardwire.torch.bridge import Bridge
    from shardwire.torch.join import Joined

    bridge = Bridge({})
    with pytest.raises(RecoveryError, match="in a shardwire job"):
        bridge.reform(RuntimeError("a peer failed"))
    assert not bridge.live  # not started by shardwire's launcher

    async def close(_error):
        return None

    bridge._engine = loopthread.LoopThread()  # not started: nothing runs on it
    bridge._joined = Joined(world=None, ranks=[0], close=close)  # type: ignore[arg-type]
    with pytest.raises(RecoveryError, match="met through torch's store"):
        bridge.reform(RuntimeError("a peer failed"))
    assert (
        bridge.live is False
        and Bridge({"SHARDWIRE_RUN_ID": "r", "SHARDWIRE_RECOVERY": "live"}).live
    )
