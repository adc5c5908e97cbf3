"""The digits example's data: scikit-learn's copy read once, then a kept file with the
same arrays, so that a run does not import scikit-learn every time."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def digitset(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    module = importlib.import_module("digitset")
    yield module
    sys.modules.pop("digitset", None)


def _sklearn_s() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)


def test_the_first_load_keeps_the_arrays_and_later_loads_read_them_alone(
    digitset, tmp_path, monkeypatch
) -> None:
    x, y = digitset.digits()
    want_x, want_y = _sklearn_s()
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x, want_x) and np.array_equal(y, want_y)
    assert digitset.cache_file() == tmp_path / "cache" / "shardwire" / "digits.npz"
    assert digitset.cache_file().exists()
    assert list(digitset.cache_file().parent.iterdir()) == [digitset.cache_file()]
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # importing it now fails
    again_x, again_y = digitset.digits()
    assert np.array_equal(again_x, want_x) and np.array_equal(again_y, want_y)


def test_an_unreadable_kept_file_is_read_again_from_scikit_learn_and_replaced(digitset) -> None:
    path = digitset.cache_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an npz file")
    x, _y = digitset.digits()
    assert np.array_equal(x, _sklearn_s()[0])
    with np.load(path) as kept:
        assert np.array_equal(kept["x"], x)


def test_a_cache_that_cannot_be_written_still_gives_the_data(digitset, tmp_path) -> None:
    (tmp_path / "cache").write_text("a file where the folder would be")
    x, y = digitset.digits()
    assert x.shape == (1797, 64) and y.shape == (1797,)


def _no_home() -> Path:
    raise RuntimeError("Could not determine home directory.")


def test_without_a_cache_folder_or_home_nothing_is_kept(digitset, monkeypatch) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "home", _no_home)
    assert digitset.cache_file() is None
    x, y = digitset.digits()
    assert x.shape == (1797, 64) and y.shape == (1797,)
