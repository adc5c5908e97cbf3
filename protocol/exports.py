"""A package's public names, imported when first read.

A package whose ``__init__.py`` imported every public name at once made every process
that imports one of its modules pay for all of them: the launcher and the coordinator
import a few protocol and launcher modules, not numpy, the collectives and FSDP. Such a
package lists its public names in its ``__init__.pyi`` (``from MODULE import NAME``, as
an ``__init__.py`` would; type checkers read it as the package's interface) and its
``__init__.py`` reads that list here::

    from shardwire.protocol.exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)

A name is imported from its module the first time it is read (``from PACKAGE import
NAME`` included, PEP 562) and kept on the package after it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def _where(package: str, stub: Path) -> dict[str, tuple[str, str]]:
    """Public name -> (its module, its name there), from the stub's ``from`` imports."""
    where: dict[str, tuple[str, str]] = {}
    for node in ast.parse(stub.read_text(), str(stub)).body:
        if not isinstance(node, ast.ImportFrom):
            continue
        module = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
        for alias in node.names:
            where[alias.asname or alias.name] = (module, alias.name)
    return where


def lazy_exports(
    package: str, init_file: str
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for ``package``, whose ``__init__.py``
    is ``init_file``, from the ``__init__.pyi`` beside it."""
    stub = Path(init_file).with_suffix(".pyi")
    if not stub.is_file():
        raise ImportError(f"{package}: its public names are listed in {stub}, which is missing")
    where = _where(package, stub)

    def __getattr__(name: str) -> object:
        try:
            module, attribute = where[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), attribute)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(where) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, sorted(where)


def import_all(module: ModuleType) -> None:
    """Import every public name of ``module`` now, where it is a package whose names are
    imported when first read (:func:`lazy_exports`); nothing otherwise. A fork server does
    this ahead of its ranks, so that they do not each import them after the fork."""
    reader = getattr(module, "__getattr__", None)
    if getattr(reader, "__module__", None) != __name__:
        return
    for name in module.__all__:
        getattr(module, name)
