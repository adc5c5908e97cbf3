"""Fault injection a user points at their own job: plans, injection, verdicts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwire.worker.chaos.inject import Injector
    from shardwire.worker.collectives.process import ProcessGroup

PLAN_VARIABLE = "SHARDWIRE_CHAOS"  # the plan a launcher started this process with


def injector(environ: Mapping[str, str], group: ProcessGroup) -> Injector | None:
    """The injector of the plan this process was started with, or None without one; a
    process with no plan does not import the injection machinery (plans, YAML, links)."""
    if not environ.get(PLAN_VARIABLE):
        return None
    from shardwire.worker.chaos.inject import from_environment

    return from_environment(environ, group)
