"""A package's public names, imported when first read from the list in its stub."""

from __future__ import annotations

import ast
import builtins
import importlib
import sys
from pathlib import Path

import pytest

from shardwire.protocol.exports import import_all

ROOT = Path(__file__).resolve().parent.parent.parent

INIT = (
    "from shardwire.protocol.exports import lazy_exports\n\n"
    "__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)\n"
)
STUB = (
    "from .light import SMALL\n"
    "from .heavy import Big, make\n"
    "from json import dumps as to_json\n"
    "__all__ = ['Big', 'SMALL', 'make', 'to_json']\n"
)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``lazypkg`` on the path: its ``heavy`` module notes that it ran."""
    folder = tmp_path / "lazypkg"
    folder.mkdir()
    (folder / "__init__.py").write_text(INIT)
    (folder / "__init__.pyi").write_text(STUB)
    (folder / "light.py").write_text("SMALL = 1\n")
    (folder / "heavy.py").write_text(
        "import builtins\nbuiltins.lazypkg_heavy_ran = True\n"
        "class Big: pass\n"
        "def make(): return Big()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield folder
    for name in [m for m in sys.modules if m == "lazypkg" or m.startswith("lazypkg.")]:
        del sys.modules[name]
    vars(builtins).pop("lazypkg_heavy_ran", None)


def test_a_name_s_module_is_imported_when_the_name_is_first_read(package):
    lazypkg = importlib.import_module("lazypkg")
    assert "lazypkg.heavy" not in sys.modules and "lazypkg.light" not in sys.modules
    assert lazypkg.SMALL == 1
    assert "lazypkg.light" in sys.modules and "lazypkg.heavy" not in sys.modules
    from lazypkg import Big, make  # PEP 562: from-imports read through __getattr__

    assert isinstance(make(), Big) and "lazypkg.heavy" in sys.modules
    assert vars(lazypkg)["Big"] is Big  # kept on the package: read once
    assert lazypkg.to_json([1]) == "[1]"  # absolute imports too, under their alias


def test_the_listed_names_are_all_and_dir_and_no_other_name_is_read(package):
    lazypkg = importlib.import_module("lazypkg")
    assert lazypkg.__all__ == ["Big", "SMALL", "make", "to_json"]
    assert {"Big", "SMALL", "make", "to_json"} <= set(dir(lazypkg))
    with pytest.raises(AttributeError, match="'lazypkg' has no attribute 'Small'"):
        _ = lazypkg.Small
    assert "lazypkg.heavy" not in sys.modules


def test_import_all_reads_every_name_of_such_a_package_and_leaves_others_alone(package):
    lazypkg = importlib.import_module("lazypkg")
    import_all(lazypkg)
    assert {"lazypkg.heavy", "lazypkg.light"} <= set(sys.modules)
    assert {"Big", "SMALL", "make", "to_json"} <= set(vars(lazypkg))
    import json

    before = set(vars(json))
    import_all(json)  # a module with an __all__ of its own, not read through a stub
    assert set(vars(json)) == before


def test_a_package_without_its_stub_says_which_file_is_missing(package):
    (package / "__init__.pyi").unlink()
    with pytest.raises(ImportError, match=r"lazypkg: its public names are listed in .*\.pyi"):
        importlib.import_module("lazypkg")


@pytest.mark.parametrize(
    "folder, package_name",
    [
        ("protocol", "shardwire.protocol"),
        ("worker", "shardwire.worker"),
        ("worker/transport", "shardwire.worker.transport"),
    ],
)
def test_every_name_a_package_lists_is_there_and_its_all_is_the_stub_s(folder, package_name):
    stub = ast.parse((ROOT / folder / "__init__.pyi").read_text())
    (listed,) = [
        ast.literal_eval(node.value)
        for node in stub.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
    ]
    module = importlib.import_module(package_name)
    assert sorted(listed) == module.__all__
    for name in listed:
        assert getattr(module, name) is not None, name
