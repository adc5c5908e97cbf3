"""Optimizers against their textbook formulas, and shard updates equal full updates."""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.optim import SGD, AdamW, warmup_cosine


def test_sgd_momentum_and_weight_decay_match_the_formula() -> None:
    p = np.array([1.0, -2.0])
    opt = SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    v = np.zeros(2)
    expected = p.copy()
    for g in (np.array([0.5, 0.5]), np.array([-1.0, 2.0])):
        d = g + 0.01 * expected
        v = 0.9 * v + d
        expected = expected - 0.1 * v
        opt.step([p], [g])
    np.testing.assert_allclose(p, expected, rtol=1e-15)


def test_sgd_nesterov_matches_the_formula() -> None:
    p = np.array([1.0, -2.0])
    opt = SGD(lr=0.7, momentum=0.9, nesterov=True)
    v = np.zeros(2)
    expected = p.copy()
    for g in (np.array([0.5, 0.5]), np.array([-1.0, 2.0]), np.array([0.25, -0.5])):
        v = 0.9 * v + g
        expected = expected - 0.7 * (g + 0.9 * v)
        opt.step([p], [g])
    np.testing.assert_allclose(p, expected, rtol=1e-15)
    with pytest.raises(InvalidArgument, match="Nesterov momentum needs momentum > 0"):
        SGD(lr=0.1, nesterov=True)


def test_adamw_matches_the_formula() -> None:
    p = np.array([0.3, -0.7, 1.1])
    opt = AdamW(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    m = np.zeros(3)
    v = np.zeros(3)
    expected = p.copy()
    rng = np.random.default_rng(0)
    for t in range(1, 4):
        g = rng.standard_normal(3)
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        expected = expected * (1 - 0.01 * 0.1)
        expected = expected - 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.99**t)) + 1e-8)
        opt.step([p], [g])
    np.testing.assert_allclose(p, expected, rtol=1e-14)


@pytest.mark.parametrize(
    "make", [lambda: SGD(lr=0.1, momentum=0.9, weight_decay=1e-3), lambda: AdamW(lr=0.01)]
)
def test_updating_shards_equals_updating_the_whole(make) -> None:
    rng = np.random.default_rng(1)
    full = rng.standard_normal(10)
    shards = [full[:4].copy(), full[4:7].copy(), full[7:].copy()]
    whole, parts = make(), [make() for _ in shards]
    for _ in range(5):
        g = rng.standard_normal(10)
        whole.step([full], [g])
        for opt, shard, (a, b) in zip(parts, shards, [(0, 4), (4, 7), (7, 10)], strict=True):
            opt.step([shard], [g[a:b]])
    np.testing.assert_array_equal(np.concatenate(shards), full)
    assert sum(o.state_bytes() for o in parts) == whole.state_bytes()


def test_state_dict_round_trip() -> None:
    p = np.ones(3)
    opt = AdamW(lr=0.1)
    opt.step([p], [np.ones(3)])
    clone = AdamW(lr=0.1)
    clone.load_state_dict(opt.state_dict())
    q = p.copy()
    opt.step([p], [np.ones(3)])
    clone.step([q], [np.ones(3)])
    np.testing.assert_array_equal(p, q)


def test_warmup_then_cosine() -> None:
    lrs = [warmup_cosine(s, base_lr=1.0, warmup=4, total=12, min_lr=0.1) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[8] == pytest.approx(0.55)
    assert lrs[12] == pytest.approx(0.1) and lrs[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))


def test_state_shape_mismatch_is_an_error() -> None:
    opt = AdamW(lr=0.1)
    opt.step([np.ones(2)], [np.ones(2)])
    with pytest.raises(InvalidArgument, match="holds state for 1 arrays, step got 2"):
        opt.step([np.ones(2), np.ones(2)], [np.ones(2), np.ones(2)])
