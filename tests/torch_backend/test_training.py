"""torch DDP and FSDP2 over shardwire train exactly as over gloo."""

from __future__ import annotations

import pytest

from .lazy import skip_without_torch

skip_without_torch()

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from .spawn import PROGS, launch, run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


class Runs:
    """Each run of ``train.py`` (deterministic: same ranks, backend and mode, same
    result) made once for the module; the tests that compare a run read the one copy."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[int, str, str], dict[str, np.ndarray]] = {}

    def __call__(self, n: int, backend: str, mode: str) -> dict[str, np.ndarray]:
        key = (n, backend, mode)
        if key not in self.made:
            work = self.root / f"{backend}-{mode}-{n}"
            work.mkdir()
            out = work / "result.npz"
            run_ranks(n, "train.py", backend, mode, str(out), tmp=work).check()
            with np.load(out) as saved:
                self.made[key] = dict(saved)
        return self.made[key]


@pytest.fixture(scope="module")
def train(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("train"))


def _same_run(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name, value in a.items():
        np.testing.assert_allclose(value, b[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    ("n", "mode"),
    [(2, "ddp"), (2, "fsdp"), (2, "fsdp-keep"), (2, "fsdp-mixed"), (4, "ddp"), (4, "fsdp")],
)
def test_training_matches_gloo(n, mode, train):
    theirs = train(n, "gloo", mode)
    ours = train(n, "shardwire", mode)
    _same_run(theirs, ours)


def test_torch_diloco_syncing_every_step_with_outer_sgd_of_rate_one_is_ddp(train):
    ddp = train(2, "gloo", "ddp-sgd")  # gloo's DDP with SGD: the oracle
    diloco = train(2, "shardwire", "diloco-sgd")
    _same_run(ddp, diloco)


def test_torch_diloco_with_int8_syncs_leaves_the_replicas_alike(train):
    quantized = train(2, "shardwire", "diloco")  # the program checks alikeness
    plain = train(2, "shardwire", "diloco-sgd")
    assert np.all(np.isfinite(quantized["losses"]))
    assert not np.allclose(quantized["losses"], plain["losses"])


@pytest.mark.long(30)
def test_torch_diloco_over_fsdp2_shards_trains_as_over_whole_replicas(train):
    """2 replicas of 2 ranks: FSDP2 inside each replica (DiLoCo's outer step over each
    rank's local shard, with the same shard of the other replica) ends with the
    parameters of DDP inside each (whole parameters), bit for bit; with int8 outer
    syncs the blocks quantized differ (a shard's blocks, not the whole parameter's), so
    the runs agree to int8's error only."""
    runs = {m: train(4, "shardwire", m) for m in ("diloco-ddp", "diloco-fsdp")}
    whole, sharded = runs["diloco-ddp"], runs["diloco-fsdp"]
    assert sorted(whole) == sorted(sharded)
    for name, value in whole.items():
        np.testing.assert_array_equal(value, sharded[name], err_msg=name)
    int8 = train(4, "shardwire", "diloco-fsdp-int8")
    assert not np.array_equal(int8["losses"], sharded["losses"])  # the option reached it
    for name, value in whole.items():
        if name != "losses":
            np.testing.assert_allclose(int8[name], value, atol=2e-3, err_msg=name)


def test_mixed_precision_changes_the_run(train):
    """bf16 parameters really went through the backend: the run differs from fp32's."""
    full = train(2, "shardwire", "fsdp")
    mixed = train(2, "shardwire", "fsdp-mixed")
    assert not np.allclose(full["losses"], mixed["losses"], rtol=1e-7, atol=0)


def test_fsdp_under_shardwire_launch_matches_gloo(train, tmp_path):
    theirs = train(2, "gloo", "fsdp")
    out = tmp_path / "launched.npz"
    done = launch("--nproc-per-node", "2", str(PROGS / "train.py"), "shardwire", "fsdp", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as saved:
        _same_run(theirs, dict(saved))


def test_distributed_checkpoint_saves_and_loads(tmp_path):
    ranks = run_ranks(2, "checkpoint.py", str(tmp_path / "ckpt"), tmp=tmp_path).check()
    assert all("restored" in out for out in ranks.outs)
