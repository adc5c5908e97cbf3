"""Shared test set-up: every async test runs on uvloop and on the stock asyncio loop
(those that touch no socket on the first only)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest
import uvloop

pytest_plugins = ["pytester", "tests.quicktier", "tests.longfirst"]

_FACTORIES = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
_SELECTED = os.environ.get("SHARDWIRE_TEST_LOOPS", "asyncio,uvloop").split(",")


def pytest_asyncio_loop_factories(config, item):
    if item.get_closest_marker("one_loop"):
        return {_SELECTED[0]: _FACTORIES[_SELECTED[0]]}
    return {name: _FACTORIES[name] for name in _SELECTED}


def _in_memory_on_another_loop(item: pytest.Item) -> bool:
    """A case of a test parametrized over transports that runs over the in-memory one
    (``kind`` or ``transport`` "memory") on a loop other than the first: it opens no
    socket, so the loops cannot differ, as for a ``one_loop`` test. The same test's
    socket cases run on every loop."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    loop = params.get("_asyncio_loop_factory")
    memory = "memory" in (params.get("kind"), params.get("transport"))
    return memory and loop is not None and loop is not _FACTORIES[_SELECTED[0]]


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if _in_memory_on_another_loop(item) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def certificates():
    """A job CA with a member certificate, and an unrelated CA's; the files are removed
    at the end of the session."""
    from shardwire.worker.bench.certs import make_certificates

    with tempfile.TemporaryDirectory(prefix="shardwire-tls-") as directory:
        yield make_certificates(Path(directory))
