"""The language-model example end to end in every layout of four ranks (tensor parallel,
pipelines, both, FSDP with offload) and in 2 x 2 x 2 on eight. Each starts from the same
parameters, sees the same batches and clips at the same global norm, so its training
and held-out losses are the plain FSDP run's to float32 rounding, logged and summarised
the same way; a checkpoint saved in one layout resumes in another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli import shardwire

pytestmark = pytest.mark.e2e
SMALL = ["--steps", "6", "--log-every", "3", "--dim", "32", "--layers", "2", "--heads", "4"]


def _run(tmp: Path, *layout: str, ranks: int = 4) -> tuple[list[dict], dict]:
    """charlm on ``ranks`` ranks in ``layout``: its metric records and summary."""
    run = tmp / ("run" + "".join(layout).replace("--", "-").replace("/", "_"))
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "examples/charlm.py",
        *SMALL,
        "--sample",
        "5",
        "--run-dir",
        str(run),
        *layout,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[list[dict], dict]:
    return _run(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize(
    "layout, dp, pp, tp",
    [
        (("--tp", "2"), 2, 1, 2),
        (("--pp", "2", "--micro-batches", "4"), 2, 2, 1),
        (("--tp", "2", "--pp", "2", "--offload"), 1, 2, 2),
        (("--dp", "2", "--tp", "2", "--offload"), 2, 1, 2),
        (("--dp", "2", "--tp", "2", "--pp", "2"), 2, 2, 2),
    ],
    ids=["tp2", "pp2", "tp2-pp2-offload", "tp2-offload", "2x2x2"],
)
def test_every_layout_follows_the_plain_runs_loss_curve(plain, tmp_path, layout, dp, pp, tp):
    base_records, base = plain
    records, summary = _run(tmp_path, *layout, ranks=dp * pp * tp)
    assert summary["layout"] == {"dp": dp, "pp": pp, "tp": tp}
    assert base["layout"] == {"dp": 4, "pp": 1, "tp": 1} and base["offloaded_bytes"] == 0
    if "--offload" in layout:  # shards, gradients and AdamW's moments live in files
        assert summary["offloaded_bytes"] > 0
    assert [r["step"] for r in records] == [r["step"] for r in base_records] == [3, 6]
    for mine, theirs in zip(records, base_records, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["held_out"] == pytest.approx(theirs["held_out"], rel=1e-5)
    assert records[-1]["loss"] < 4.7  # and it trained: the first step's loss is about 4.76
    for key in ("train_loss", "held_out_nats_per_char"):
        assert summary[key] == pytest.approx(base[key], abs=2e-4)


def test_a_layout_that_does_not_fit_is_refused(tmp_path) -> None:
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "4",
        "examples/charlm.py",
        *SMALL,
        "--tp",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    assert result.returncode != 0
    assert "MeshError: 4 ranks do not split into pp=1 x tp=3" in result.stderr


@pytest.mark.parametrize(
    "saved, resumed",
    [(("--tp", "2"), ()), (("--tp", "2", "--pp", "2"), ()), ((), ("--pp", "2"))],
    ids=["tp2-plain", "tp2-pp2-plain", "plain-pp2"],
)
def test_a_checkpoint_resumes_in_another_layout(plain, tmp_path, saved, resumed):
    """Three steps in one layout, saved; the next three in another from that checkpoint:
    step 6's losses are the uninterrupted plain run's."""
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "3"]
    first = [*SMALL[2:], "--steps", "3", *ckpt]  # SMALL without its --steps
    _run(tmp_path / "a", *first, *saved)
    records, _summary = _run(tmp_path / "b", *SMALL, *ckpt, *resumed)
    base_records, _ = plain
    assert [r["step"] for r in records] == [6]
    assert records[0]["loss"] == pytest.approx(base_records[1]["loss"], rel=1e-5)
    assert records[0]["held_out"] == pytest.approx(base_records[1]["held_out"], rel=1e-5)
