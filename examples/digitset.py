"""The 8x8 handwritten digits that ship inside scikit-learn, for ``digits.py``.

Importing scikit-learn takes about a second of CPU, more than the rest of a rank's
start. The first load reads scikit-learn's copy and keeps the arrays in
``$XDG_CACHE_HOME/shardwire/digits.npz`` (``~/.cache`` by default); later loads read that
file, bit for bit the same arrays. scikit-learn is imported in the function that needs
it, in this module rather than in the script, so a node's fork server does not import
it ahead of every run (it imports what the script itself names).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def cache_file() -> Path | None:
    """Where the arrays are kept: ``$XDG_CACHE_HOME/shardwire/digits.npz``; None where
    neither that variable nor a home folder is known (nothing is kept)."""
    root = os.environ.get("XDG_CACHE_HOME")
    if not root:
        try:
            root = str(Path.home() / ".cache")
        except RuntimeError:  # no HOME and no account entry (a container's bare uid)
            return None
    return Path(root) / "shardwire" / "digits.npz"


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The images as float32 rows in [0, 1] (64 pixels) and their labels as int64."""
    path = cache_file()
    if path is not None:
        try:
            with np.load(path) as kept:
                return kept["x"], kept["y"]
        except (OSError, KeyError, ValueError):
            pass  # not kept yet (or unreadable): read scikit-learn's copy
    from sklearn.datasets import load_digits  # bundled with scikit-learn, no download

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    if path is None:
        return x, y
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # every rank of a first run may write it: each to its own file, then one rename
        part = path.with_name(f"{path.stem}.{os.getpid()}.npz")
        np.savez(part, x=x, y=y)
        os.replace(part, path)
    except OSError:
        pass  # a read-only cache only costs the next run the import again
    return x, y
