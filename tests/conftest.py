"""Shared test set-up: every async test runs on uvloop and on the stock asyncio loop."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest
import uvloop

pytest_plugins = ["pytester", "tests.quicktier"]

_FACTORIES = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
_SELECTED = os.environ.get("SHARDWIRE_TEST_LOOPS", "asyncio,uvloop").split(",")


def pytest_asyncio_loop_factories(config, item):
    if item.get_closest_marker("one_loop"):
        return {_SELECTED[0]: _FACTORIES[_SELECTED[0]]}
    return {name: _FACTORIES[name] for name in _SELECTED}


@pytest.fixture(scope="session")
def certificates():
    """A job CA with a member certificate, and an unrelated CA's; the files are removed
    at the end of the session."""
    from shardwire.worker.bench.certs import make_certificates

    with tempfile.TemporaryDirectory(prefix="shardwire-tls-") as directory:
        yield make_certificates(Path(directory))
