"""The documentation says what the code does: the generated reference pages match the
parsers and settings models, every environment variable the package reads is in them,
every Python sample compiles and its imports resolve, and the README stays a short
front door whose links lead somewhere."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .docblocks import block, blocks

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
PACKAGE = ["worker", "coordinator", "protocol", "torch_bridge", "ray_bridge"]


@pytest.mark.e2e
def test_the_generated_reference_pages_match_the_code() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
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


def test_every_scheduler_and_thread_variable_is_documented() -> None:
    documented = (ROOT / "docs" / "reference" / "environment.md").read_text()
    pattern = r'"((?:SLURM|PET)_[A-Z_]+|JOB_COMPLETION_INDEX|[A-Z]+_NUM_THREADS|XDG_[A-Z_]+)"'
    read = set()
    for folder in PACKAGE:
        for path in (ROOT / folder).rglob("*.py"):
            read.update(re.findall(pattern, path.read_text()))
    assert {"SLURM_PROCID", "PET_NODE_RANK", "JOB_COMPLETION_INDEX", "OMP_NUM_THREADS"} <= read
    missing = sorted(name for name in read if f"`{name}`" not in documented)
    assert not missing, missing


def _reference():
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_and_every_error_is_on_the_api_page() -> None:
    reference = _reference()
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    listed = [m for _, modules in reference.SECTIONS for m in modules]
    # every package that declares public names has its section
    for init in sorted(p for f in PACKAGE for p in (ROOT / f).rglob("__init__.py")):
        module = reference._module_of(init)
        if reference.public_names(module) is not None and not module.startswith(
            "shardwire.worker.bench"
        ):
            assert module in listed, f"{module} declares __all__ but has no section"
    errors = reference.errors()
    assert ("shardwire.worker.runtime.launched", "NotLaunched") in errors
    assert ("shardwire.worker.transport.listen", "ListenFailed") in errors
    for module, name in errors:
        assert f"::: {module}.{name}\n" in page, name
    names = {name for _, name in errors}
    for module in listed:
        for name in reference.public_names(module) or []:
            assert name in names or f"        - {name}\n" in page, f"{module}.{name}"


def test_every_benchmark_has_its_help_in_the_cli_reference() -> None:
    from shardwire.worker.bench import BENCHES

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for name in BENCHES:
        assert f"## `shardwire bench {name}`" in page, name


def test_every_block_has_a_name_and_a_test_that_reads_it() -> None:
    """A console or Python block a user could copy is run by a test, which reads it from
    its page by name (``tests/docblocks.py``): a new block without its test, or a test
    asking for a name no block has any more, fails here."""
    found = blocks()
    unnamed = [f"{b.page}:{b.line}" for b in found if b.label is None]
    assert unnamed == [], "name these blocks (<!-- block: NAME --> above the fence)"
    labels = [b.label for b in found]
    assert sorted({x for x in labels if labels.count(x) > 1}) == []
    # a test names the block it runs: ``block("NAME")``, or the name handed to a helper
    # that reads the block
    sources = [p.read_text() for p in (ROOT / "tests").rglob("*.py")]
    named = {name for source in sources for name in re.findall(r'"([a-z0-9-]+)"', source)}
    asked = {n for source in sources for n in re.findall(r'block\(\s*"([a-z0-9-]+)"', source)}
    assert sorted(set(labels) - named) == [], "blocks no test runs"
    assert sorted(asked - set(labels)) == [], "names asked for that no block has"


def test_ci_runs_the_set_up_commands_the_readme_and_getting_started_give() -> None:
    """The two set-up commands are what CI runs on a fresh clone, in that order."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for label in ("readme-setup", "gs-setup"):
        commands = [c.split("#")[0].strip() for c in block(label).commands()]
        assert commands == ["make run", "make test"]
        assert [ci.index(c) for c in commands] == sorted(ci.index(c) for c in commands)


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


def test_the_status_page_screenshot_is_the_test_s_chromium_picture() -> None:
    image = ROOT / "docs" / "img" / "status-page.png"
    head = image.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert (width, height) == (1000, 800)  # the window size the status page test gives
    assert "](img/status-page.png)" in (ROOT / "docs" / "why-slow.md").read_text()
