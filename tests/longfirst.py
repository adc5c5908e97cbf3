"""The tests known to take long start first (``pytest.mark.long(SECONDS)``: about how
long the test takes beside another one).

On several test processes (``-n``), a run ends when its last test does: a test of minutes
drawn last keeps one core busy while the others are idle. So the modules holding long
tests go first, the longest (the sum of its marks) first, and a module's long tests
lead it; every other test keeps its place. A module's tests stay together, so its
module-scoped fixtures (a Ray cluster) are set up once per test process as before.
pytest-xdist's worksteal hands each process a contiguous share and lets an idle one take
the end of another's queue: the long tests are started early and the end of the run is
made of short ones."""

from __future__ import annotations

import pytest


def seconds(item: pytest.Item) -> float:
    """The test's ``long`` mark, or 0."""
    mark = item.get_closest_marker("long")
    return float(mark.args[0]) if mark is not None else 0.0


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    weight = {name: sum(map(seconds, members)) for name, members in modules.items()}
    ordered = sorted(modules, key=lambda name: -weight[name])  # stable: ties keep place
    items[:] = [
        item for name in ordered for item in sorted(modules[name], key=lambda i: -seconds(i))
    ]
