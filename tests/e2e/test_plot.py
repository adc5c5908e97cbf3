"""``shardwire plot`` writes a PNG a person can open."""

from __future__ import annotations

import json

import pytest

from .cli import shardwire

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("split", [False, True], ids=["curves", "with-breakdown"])
def test_plot_writes_a_decodable_png_of_the_expected_size(tmp_path, split: bool) -> None:
    import matplotlib.image

    run = tmp_path / "run"
    run.mkdir()
    records = [
        {
            "step": s,
            "time_s": s / 10,
            "loss": 2.0 / s,
            "lr": 1e-3,
            "accuracy": s / 400,
            "samples_per_s": 1000.0 + s,
            "bytes_sent": [1, 2],
            "bytes_received": [2, 1],
            **({"comm_s": [0.01, 0.03], "compute_s": [0.04, 0.02]} if split else {}),
        }
        for s in range(50, 350, 50)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = shardwire("plot", str(run))
    assert result.returncode == 0, result.stderr
    image = matplotlib.image.imread(run / "metrics.png")
    assert image.shape[:2] == (400, 1000)
    assert image[..., :3].std() > 0.05  # not a blank canvas
    red = (image[..., 0] > 0.75) & (image[..., 1] < 0.3) & (image[..., 2] < 0.3)
    assert bool(red.sum() > 100) == split  # the "waiting for comm" bars, only with the split


def test_plot_explains_a_missing_run_directory(tmp_path) -> None:
    result = shardwire("plot", str(tmp_path / "nope"))
    assert result.returncode == 1 and "metrics.jsonl does not exist" in result.stderr


def test_every_panel_has_a_legend_and_throughput_starts_at_zero() -> None:
    from shardwire.worker.launcher.plot import figure

    records = [
        {
            "step": s,
            "loss": 2.0 / s,
            "accuracy": s / 400,
            "samples_per_s": 1000.0 + s,
            "comm_s": [0.01, 0.03],
            "compute_s": [0.04, 0.02],
            **({"held_out": 2.5 / s} if s % 100 == 0 else {}),
        }
        for s in range(50, 350, 50)
    ]
    fig = figure(records, "run")
    loss, throughput, breakdown, accuracy = fig.axes
    labels = [t.get_text() for t in accuracy.get_legend().get_texts()]
    assert labels == ["loss", "held-out loss", "accuracy"]
    assert [t.get_text() for t in throughput.get_legend().get_texts()] == ["samples/s"]
    assert breakdown.get_legend() is not None
    assert throughput.get_ylim()[0] == 0 and breakdown.get_ylim()[0] == 0
    held = [line for line in loss.get_lines() if line.get_label() == "held-out loss"]
    assert list(held[0].get_xdata()) == [100, 200, 300]
