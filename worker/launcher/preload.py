"""What a node's fork server imports ahead of its ranks: the modules the rank's script
imports.

A rank's start is mostly imports (shardwire and numpy; torch alone takes about 1.8 s on
a small machine). The fork server reads the script its ranks run (or the module run
with ``-m``), finds every module the file imports, anywhere in it, and imports those
that are installed (found outside the script's own folder) before it forks any: a torch
script's ranks have torch and ``shardwire.torch`` loaded when they start. The script's
own modules beside it are not imported ahead: they may run the user's code at import,
which must run once, in each rank.

Some packages import more at their first use than at import, and a rank that starts
during a job pays for that while the others wait for it: torch's DDP, FSDP2 and
optimizers import ``torch._dynamo`` (about 200 modules of torch's compiler, 0.45 s on a
small machine) when a rank first builds its model or steps. Those are imported ahead too,
where the script imports their package (:data:`FIRST_USE`); so are the public names of
a shardwire package the script imports (``shardwire.worker``), which the package itself
imports when first read.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from shardwire.protocol.exports import import_all

# package -> what it imports at its first use rather than at import
FIRST_USE: dict[str, tuple[str, ...]] = {"torch": ("torch._dynamo",)}


def imports_of(source: str) -> list[str]:
    """The absolute modules ``source`` imports, in the order it names them, each once
    (``from a.b import c`` names ``a.b``; relative imports are the script's own)."""
    found: dict[str, None] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found[node.module] = None
    return [name for name in found if name != "__main__"]


def script_of(argv: Sequence[str]) -> Path | None:
    """The file a rank's ``argv`` (a script and its arguments, or ``-m`` and a module's)
    runs; None where it cannot be found."""
    if not argv:
        return None
    if argv[0] != "-m":
        return Path(argv[0])
    if len(argv) < 2:
        return None
    try:
        spec = importlib.util.find_spec(argv[1])
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def installed(name: str, beside: Path) -> bool:
    """Whether module ``name``'s top-level package is found outside folder ``beside``."""
    try:
        spec = importlib.util.find_spec(name.split(".", 1)[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    where = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    if where is None or where in ("built-in", "frozen"):
        return True
    return not Path(where).resolve().is_relative_to(beside.resolve())


def preload(argv: Sequence[str]) -> list[str]:
    """Import the installed modules the rank's script imports, and what their packages
    import at first use (:data:`FIRST_USE`); the names imported."""
    script = script_of(argv)
    if script is None:
        return []
    try:
        source = script.read_text(encoding="utf-8")
        names = imports_of(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []  # the rank reports what is wrong with its script when it runs it
    done = [name for name in names if installed(name, script.parent) and _imported(name)]
    packages = dict.fromkeys(name.split(".", 1)[0] for name in done)
    later = [name for top in packages for name in FIRST_USE.get(top, ())]
    return done + [name for name in later if _imported(name)]


def _imported(name: str) -> bool:
    try:
        import_all(importlib.import_module(name))
    except Exception:  # noqa: BLE001 - the rank raises the same error itself, as its own
        return False
    return True
