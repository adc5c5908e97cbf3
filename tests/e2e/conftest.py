"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest

from .netns import make_hosts


@pytest.fixture
def hosts():
    """Three network namespaces on one bridge: 10.77.0.1, .2 and .3."""
    yield from make_hosts(3)
