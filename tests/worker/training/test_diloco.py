"""DiLoCo against oracles: with H = 1 and an outer SGD of rate 1 it is plain data parallel
(float64, 1e-10); in general it is the paper's loop written out in one process (replicas
side by side), over every transport, with fragments, overlap and Nesterov momentum; its
state resumes bit for bit mid-round; quantized syncs stay within their error bound and
give every rank the same bits."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.collectives import Group
from shardwire.worker.nn import mse
from shardwire.worker.optim import SGD
from shardwire.worker.training import outer_state, quantize
from shardwire.worker.training.aggregation import AllReduceAggregator, distributed_train_step
from shardwire.worker.training.compression import Quantized, parse
from shardwire.worker.training.diloco import DiLoCo, Phase, replica_rows
from tests.worker.collectives.worlds import KINDS, group_world, on_all
from tests.worker.training.test_aggregation import _batch, _model

SIZES = (7, 5, 9)  # three arrays, so fragments cut across them


async def test_every_step_with_outer_sgd_of_rate_one_is_plain_data_parallel() -> None:
    steps, world = 6, 3

    async def run(diloco: bool) -> list[list[np.ndarray]]:
        async with group_world("memory", world) as groups:
            models = [_model() for _ in groups]
            opts = [SGD(lr=0.1) for _ in groups]
            aggs = [AllReduceAggregator(g) for g in groups]
            outer = [
                DiLoCo(m, g, every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
                for m, g in zip(models, groups, strict=True)
            ]

            async def rank(r: int) -> None:
                for step in range(steps):
                    if diloco:  # each replica on its own batch, then the outer average
                        x, y = _batch(r, step)
                        m = models[r]
                        m.zero_grad()
                        _, dy = mse(m.forward(x), y)
                        m.backward(dy)
                        params = [p for _, p in m.named_parameters()]
                        opts[r].step(params, [g for _, g in m.named_grads()])
                        await outer[r].step()
                    else:
                        await distributed_train_step(
                            models[r], _batch(r, step), mse, aggs[r], opts[r]
                        )

            await asyncio.gather(*(rank(r) for r in range(world)))
        return [[p.copy() for _, p in m.named_parameters()] for m in models]

    plain, outer = await run(False), await run(True)
    for replica in outer:
        for a, b in zip(replica, plain[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


class Shards:
    """A sharded model's surface (what FSDP offers DiLoCo): arrays replaced as a whole."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.arrays = [rng.standard_normal(n) for n in SIZES]
        self.updates = 0

    def shards(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(a, np.zeros_like(a)) for a in self.arrays]

    async def update_shards(self, values: list[np.ndarray]) -> None:
        self.updates += 1
        self.arrays = [np.array(v) for v in values]


def _grad(replica: int, step: int, theta: np.ndarray) -> np.ndarray:
    """A quadratic's gradient, different per replica and step."""
    target = np.random.default_rng(1000 * replica + step).standard_normal(theta.size)
    return 0.5 * (theta - target)


def _inner(shards: Shards, replica: int, step: int, lr: float = 0.3) -> None:
    theta = np.concatenate(shards.arrays)
    theta = theta - lr * _grad(replica, step, theta)
    shards.arrays = np.split(theta, np.cumsum(SIZES)[:-1])


def _oracle(world: int, steps: int, *, every: int, fragments: int, overlap: bool) -> np.ndarray:
    """The loop of the paper for ``world`` replicas in one process: replicas' parameters
    after ``steps`` inner steps (rows)."""
    start = np.concatenate(Shards(0).arrays)  # every replica starts from rank 0's
    local = np.tile(start, (world, 1))
    glob, velocity = start.copy(), np.zeros_like(start)
    cuts = np.linspace(0, start.size, fragments + 1).round().astype(int)
    flight = None
    for step in range(1, steps + 1):
        for r in range(world):
            local[r] -= 0.3 * _grad(r, step - 1, local[r])
        due = [f for f in range(fragments) if step % every == f * every // fragments]
        ready = [flight] if flight is not None else []
        if due and not overlap:
            ready.append((due[0], local[:, cuts[due[0]] : cuts[due[0] + 1]].copy()))
        for f, sent in ready:
            part = slice(cuts[f], cuts[f + 1])
            average = sum((glob[part] - sent[r]) for r in range(world)) / world
            velocity[part] = 0.9 * velocity[part] + average
            glob[part] -= 0.7 * (average + 0.9 * velocity[part])
            for r in range(world):
                local[r, part] = glob[part] + (local[r, part] - sent[r] if overlap else 0)
        flight = None
        if due and overlap:
            flight = (due[0], local[:, cuts[due[0]] : cuts[due[0] + 1]].copy())
    return local


async def _replicas(groups: list[Group], steps: int, **options) -> list[DiLoCo]:
    models = [Shards(r) for r in range(len(groups))]  # rank 0's arrays win at begin()
    outers = [DiLoCo(m, g, **options) for m, g in zip(models, groups, strict=True)]
    await on_all(groups, lambda g: outers[g.rank].begin())

    async def train(g: Group) -> None:
        for step in range(steps):
            _inner(models[g.rank], g.rank, step)
            await outers[g.rank].step()

    await on_all(groups, train)
    return outers


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("every", "fragments", "overlap"),
    [(4, 1, False), (4, 2, False), (6, 3, True), (1, 1, True)],
    ids=["plain", "streaming", "streaming-overlap", "overlap-every-step"],
)
async def test_replicas_follow_the_papers_loop(kind, every, fragments, overlap) -> None:
    world, steps = 3, 13
    expected = _oracle(world, steps, every=every, fragments=fragments, overlap=overlap)
    async with group_world(kind, world) as groups:
        outers = await _replicas(groups, steps, every=every, fragments=fragments, overlap=overlap)
    for r, outer in enumerate(outers):
        got = np.concatenate(outer.model.arrays)  # type: ignore[union-attr]
        np.testing.assert_allclose(got, expected[r], rtol=1e-12, atol=1e-12)
        in_flight = overlap and outer.due(steps) is not None  # started after the last step
        assert outer.phase is (Phase.EXCHANGING if in_flight else Phase.INNER)


def test_fragments_sync_at_staggered_steps_in_index_order() -> None:
    outer = DiLoCo(Shards(0), _Lone(), every=6, fragments=3)
    schedule = [(step, outer.due(step)) for step in range(1, 13) if outer.due(step) is not None]
    assert schedule == [(2, 1), (4, 2), (6, 0), (8, 1), (10, 2), (12, 0)]
    assert [hi - lo for lo, hi in outer.bounds] == [7, 7, 7]
    assert outer.bounds[0][0] == 0 and outer.bounds[-1][1] == sum(SIZES)


class _Lone:
    """Stands in for a group where no exchange happens (schedule and argument checks)."""

    size = 1
    rank = 0


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"every": 0}, "every >= 1"),
        ({"every": 2, "fragments": 3}, "fragments must be between 1 and every=2"),
        ({"every": 2, "quantize": "int2"}, "int8, int4 or None"),
        ({"every": 2, "quantize": "int8", "block": 3}, "block must be an even count"),
        ({"every": 30, "fragments": 30}, "30 fragments for 21 parameters"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options, words) -> None:
    with pytest.raises(InvalidArgument, match=words):
        DiLoCo(Shards(0), _Lone(), **options)


@pytest.mark.parametrize("overlap", [False, True])
async def test_a_run_resumed_mid_round_from_the_state_continues_bit_for_bit(
    tmp_path, overlap
) -> None:
    world, steps, cut = 2, 11, 6  # 6 is a sync step: with overlap, an exchange is in flight
    options = {"every": 3, "fragments": 3, "overlap": overlap, "quantize": "int8", "block": 4}
    async with group_world("memory", world) as groups:
        whole = await _replicas(groups, steps, **options)
    async with group_world("memory", world) as groups:
        first = await _replicas(groups, cut, **options)
        states = await on_all(groups, lambda g: first[g.rank].state_dict())
        if overlap:  # through the file a restarted run reads
            await on_all(groups, lambda g: first[g.rank].save(tmp_path / f"r{g.rank}.st"))
            states = [outer_state.read(tmp_path / f"r{r}.st") for r in range(world)]
        arrays = [[a.copy() for a in o.model.arrays] for o in first]  # type: ignore[union-attr]
    assert (states[0]["flight"] is not None) is overlap
    async with group_world("memory", world) as groups:  # a new process, as after a restart
        models = [Shards(r) for r in range(world)]
        outers = [DiLoCo(m, g, **options) for m, g in zip(models, groups, strict=True)]
        for r in range(world):
            models[r].arrays = arrays[r]
            outers[r].load_state_dict(states[r])

        await resume_and_compare(groups, outers, whole, cut, steps)


async def resume_and_compare(
    groups: list[Group], outers: list[DiLoCo], whole: list[DiLoCo], first: int, steps: int
) -> None:
    """Train ``outers`` (resumed) from step ``first`` to ``steps``; every replica's model
    and global parameters must then be those of the run ``whole`` that never stopped."""

    async def train(g: Group) -> None:
        for step in range(first, steps):
            _inner(outers[g.rank].model, g.rank, step)  # type: ignore[arg-type]
            await outers[g.rank].step()

    await on_all(groups, train)
    for resumed, straight in zip(outers, whole, strict=True):
        for a, b in zip(resumed.model.arrays, straight.model.arrays, strict=True):  # type: ignore[union-attr]
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(resumed.global_params, straight.global_params)


async def test_finish_leaves_every_replica_with_the_same_parameters() -> None:
    async with group_world("memory", 3) as groups:
        outers = await _replicas(groups, 5, every=4, fragments=2, overlap=True)
        await on_all(groups, lambda g: outers[g.rank].finish())
    first = np.concatenate(outers[0].model.arrays)  # type: ignore[union-attr]
    for outer in outers:
        np.testing.assert_array_equal(np.concatenate(outer.model.arrays), first)  # type: ignore[union-attr]
        np.testing.assert_array_equal(outer.global_params, first)
        assert outer.behind == [False, False] and outer.phase is Phase.INNER


@pytest.mark.parametrize("bits", [8, 4])
async def test_quantized_syncs_give_every_rank_the_same_bits_within_the_bound(bits) -> None:
    world = 3
    async with group_world("tcp", world) as groups:
        outers = await _replicas(
            groups,
            8,
            every=4,
            outer_lr=1.0,
            outer_momentum=0.0,
            nesterov=False,
            quantize=f"int{bits}",
            block=4,
        )
        plain = await _replicas(
            groups, 8, every=4, outer_lr=1.0, outer_momentum=0.0, nesterov=False
        )
    for outer in outers[1:]:
        assert outer.global_params.tobytes() == outers[0].global_params.tobytes()
    # int8 sends a byte per value and int4 half of one (21 values padded to 6 blocks of
    # 4), plus a float32 scale per block
    per_sync = 24 * bits // 8 + 4 * 6
    assert outers[0].sent_bytes == 2 * per_sync and plain[0].sent_bytes == 2 * 8 * sum(SIZES)
    assert outers[0].largest_sent == per_sync and plain[0].largest_sent == 8 * sum(SIZES)
    drift = np.abs(outers[0].global_params - plain[0].global_params).max()
    assert 0 < drift < (0.05 if bits == 8 else 0.8)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("count", [1, 7, 256, 1000])
def test_block_quantization_stays_within_half_a_scale(bits, count) -> None:
    rng = np.random.default_rng(count)
    x = rng.standard_normal(count) * np.exp(rng.uniform(-8, 8, count))
    x[: count // 3] = 0.0  # a zero block, where the scale is 0
    shape = quantize.layout(count, bits=bits, block=8)
    buffer = quantize.encode(x, shape)
    assert buffer.dtype == np.uint8 and buffer.size == shape.nbytes
    error = np.abs(quantize.decode(buffer, shape) - x)
    assert np.all(error <= quantize.error_bound(x, shape))
    assert np.all(quantize.decode(buffer, shape)[: count // 3] == 0.0)


def test_a_state_file_of_another_kind_is_refused(tmp_path) -> None:
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2)}, str(tmp_path / "other.st"))
    with pytest.raises(outer_state.OuterStateError, match="not a DiLoCo state file"):
        outer_state.read(tmp_path / "other.st")
    with pytest.raises(outer_state.OuterStateError, match="cannot read DiLoCo state"):
        outer_state.read(tmp_path / "missing.st")


def test_block_quantization_refuses_what_it_cannot_carry() -> None:
    shape = quantize.layout(4, bits=8, block=4)
    with pytest.raises(InvalidArgument, match="NaN or infinity"):
        quantize.encode(np.array([1.0, np.nan, 0.0, 2.0]), shape)
    with pytest.raises(InvalidArgument, match="expected 4 values"):
        quantize.encode(np.zeros(5), shape)
    with pytest.raises(InvalidArgument, match="expected a 8-byte quantized buffer"):
        quantize.decode(np.zeros(9, np.uint8), shape)
    with pytest.raises(InvalidArgument, match="bits must be one of"):
        quantize.layout(4, bits=2, block=4)


async def test_the_quantized_codec_sums_gradients_the_same_on_every_rank() -> None:
    grads = [np.random.default_rng(r).standard_normal(300) for r in range(3)]
    assert isinstance(parse("int8"), Quantized) and parse("int4").bits == 4  # type: ignore[union-attr]
    async with group_world("memory", 3) as groups:
        sums = await on_all(groups, lambda g: Quantized(8).sum(g, 0, grads[g.rank]))
    bound = sum(quantize.error_bound(g, quantize.layout(300, bits=8, block=256)) for g in grads)
    assert all(s.tobytes() == sums[0].tobytes() for s in sums)
    assert np.all(np.abs(sums[0] - sum(grads)) <= bound)


def test_a_replicas_share_of_a_split_batch() -> None:
    # 10 rows over 2 replicas of 2 data ranks: 3, 3 | 2, 2
    rows, count = replica_rows(10, replica=1, replicas=2, rank=0, size=2)
    assert rows.tolist() == [6, 7] and count == 4
    rows, count = replica_rows(10, replica=0, replicas=2, rank=1, size=2)
    assert rows.tolist() == [3, 4, 5] and count == 6


def test_fragments_of_shards_are_cut_in_the_whole_model_s_elements():
    from shardwire.worker.training.diloco import _cuts

    # two parameters of 6 and 4 elements, this rank holding [3, 6) of the first and
    # [2, 4) of the second: the whole model's halves are [0, 5) and [5, 10), so the
    # first half holds local elements 0-1 (whole 3, 4) and the second the rest
    def places() -> tuple[list[int], int]:
        return [3, 8], 10

    assert _cuts(2, [3, 2], places) == [0, 2, 5]
    assert _cuts(2, [3, 2], None) == [0, 2, 5]  # even cuts of the local elements
    # the rank with [0, 3) and [0, 2) holds the first half's 3 + 0 and 2 of the second
    assert _cuts(2, [3, 2], lambda: ([0, 6], 10)) == [0, 3, 5]
    # a fragment can hold none of a rank's elements (whole [4, 6) here)
    assert _cuts(5, [3, 2], lambda: ([0, 6], 10)) == [0, 2, 3, 3, 5, 5]


class Slice:
    """One rank's shard of a larger model (what TorchDiLoCo offers over FSDP2): 2 of the
    whole model's 10 elements, [0, 2), so the whole's fragments past the first hold none
    of them."""

    def __init__(self, seed: int) -> None:
        self.arrays = [np.random.default_rng(seed).standard_normal(2)]

    def places(self) -> tuple[list[int], int]:
        return [0], 10

    def shards(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(a, np.zeros_like(a)) for a in self.arrays]

    async def update_shards(self, values: list[np.ndarray]) -> None:
        self.arrays = [np.array(v) for v in values]


@pytest.mark.parametrize("quantize", [None, "int8"])
async def test_a_shard_with_fewer_elements_than_fragments_syncs_its_empty_ones(quantize) -> None:
    """Five fragments of the whole model: this shard's 2 elements are all in the first,
    the other four are empty here. Every fragment syncs in turn (the empty ones with
    nothing to send) and the shard ends as the replicas' average (outer SGD of rate 1)."""
    async with group_world("memory", 2) as groups:
        models = [Slice(r) for r in range(2)]
        options = {"every": 5, "fragments": 5, "outer_lr": 1.0, "outer_momentum": 0.0}
        outers = [
            DiLoCo(m, g, nesterov=False, quantize=quantize, **options)
            for m, g in zip(models, groups, strict=True)
        ]
        await on_all(groups, lambda g: outers[g.rank].begin())
        start = models[0].arrays[0].copy()
        moved = [start + 1.0, start - 3.0]

        async def train(g: Group) -> None:
            for step in range(5):
                if step == 0:
                    models[g.rank].arrays = [moved[g.rank].copy()]
                await outers[g.rank].step()

        await on_all(groups, train)
    assert [o.bounds for o in outers] == [[(0, 2), (2, 2), (2, 2), (2, 2), (2, 2)]] * 2
    for model in models:
        bound = 0.0 if quantize is None else 4.0 / 127  # int8: half a step of the block's
        np.testing.assert_allclose(model.arrays[0], start - 1.0, atol=bound + 1e-12)
