"""The documentation says what the code does: the generated reference pages match the
parsers and settings models, every environment variable the package reads is in them,
every Python sample compiles and its imports resolve, and the README stays a short
front door whose links lead somewhere."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
PACKAGE = ["worker", "coordinator", "protocol", "torch_bridge"]


def test_the_generated_reference_pages_match_the_code() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs_reference.py"), "--check"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_variable_the_package_reads_is_documented() -> None:
    documented = (ROOT / "docs" / "reference" / "environment.md").read_text()
    read = set()
    for folder in PACKAGE:
        for path in (ROOT / folder).rglob("*.py"):
            read.update(re.findall(r"SHARDWIRE_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    assert len(read) > 20
    missing = sorted(name for name in read if f"`{name}`" not in documented)
    assert not missing, missing


def _samples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            found.append((f"{page.relative_to(ROOT)}#{i}", code))
    return found


@pytest.mark.parametrize("where, code", _samples(), ids=[w for w, _ in _samples()])
def test_every_python_sample_compiles_and_imports(where: str, code: str) -> None:
    tree = compile(code, where, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    if "torch" in code:  # the torch backend's samples need torch (make torch)
        pytest.importorskip("torch", reason="torch is not installed here (make torch)")
    for node in imports:  # what a sample imports exists, under the name it uses
        exec(compile(ast.Module([node], []), where, "exec"), {})  # noqa: S102


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert len(links) >= 10
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert "make run" in readme and "make test" in readme
