"""Ray is an extra: without it the commands' help (and so the reference pages) still
works, and a job says what to install."""

from __future__ import annotations

import sys

import pytest

from shardwire.worker.launcher import cli


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import ray`` fails, and shardwire's Ray modules are imported afresh."""
    for name in list(sys.modules):
        if name == "ray" or name.startswith(("ray.", "shardwire.ray")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)


@pytest.mark.parametrize("argv", [["ray", "--help"], ["bench", "ray", "--help"]])
def test_help_needs_no_ray(
    no_ray: None, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    assert ended.value.code == 0
    assert "examples" in capsys.readouterr().out


def test_a_job_without_ray_says_what_to_install(
    no_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["ray", "--num-workers", "2", "train.py"]) == 1
    assert "pip install 'shardwire[ray]'" in capsys.readouterr().err
