"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest

from .netns import make_hosts
from .slurm import slurm_cluster


@pytest.fixture
def hosts():
    """Three network namespaces on one bridge: 10.77.0.1, .2 and .3."""
    yield from make_hosts(3)


@pytest.fixture
def slurm(tmp_path):
    """A real two-node Slurm cluster (see ``tests/e2e/slurm.py``); yields its ``Cluster``."""
    with slurm_cluster(tmp_path, nodes=2) as cluster:
        yield cluster
