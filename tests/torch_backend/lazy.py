"""The torch tests' skip where torch is not installed, and, for the modules of the quick
tier, torch and the modules that import it read when a test first needs them, not when
the module is collected: every test process of the tier collects every quick module,
and importing torch costs about two CPU-seconds in each; this way only the processes
that run one of these tests pay it."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest

REASON = "torch is not installed (`make torch` installs its CPU build)"


def skip_without_torch() -> None:
    """Skip the calling test module where torch is not installed (looked up on the
    import path, not imported)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip(REASON, allow_module_level=True)


class Lazy:
    """The module named ``name``, imported at the first read of one of its attributes.

    Collection reads a few attributes of every module global to tell tests, fixtures
    and mocks apart (``__test__``, ``__wrapped__``, mock's ``_mock_name``); those are
    answered as absent without importing the module."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith(("__", "_mock_")):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported at first use>"
