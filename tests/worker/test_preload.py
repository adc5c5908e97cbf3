"""What a node's fork server imports ahead of its ranks: the installed modules its script imports,
never the script's own modules beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardwire.worker.launcher import preload as preload_module
from shardwire.worker.launcher.preload import imports_of, installed, preload, script_of

SOURCE = """
import os, json as j
from collections import abc
from . import sibling
from .pkg import thing
import xml.dom.minidom

def main():
    import numpy
    from email.mime import text
"""


def test_every_absolute_import_anywhere_in_the_file_once():
    assert imports_of(SOURCE + "\nimport os\n") == [
        "os",
        "json",
        "collections",
        "xml.dom.minidom",
        "numpy",
        "email.mime",
    ]


def test_the_script_is_the_file_or_the_module_s_file(tmp_path):
    assert script_of([str(tmp_path / "a.py"), "--x"]) == tmp_path / "a.py"
    found = script_of(["-m", "json.tool", "--x"])
    assert found is not None and found.name == "tool.py"
    assert script_of(["-m"]) is None and script_of([]) is None
    assert script_of(["-m", "no_such_module_anywhere"]) is None


def test_only_modules_installed_outside_the_script_s_folder(tmp_path):
    (tmp_path / "local_helper.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        assert not installed("local_helper", tmp_path)
        assert installed("json", tmp_path) and installed("numpy.linalg", tmp_path)
        assert installed("sys", tmp_path)  # built in
        assert not installed("no_such_module_anywhere", tmp_path)
    finally:
        sys.path.remove(str(tmp_path))


def _python(code: str, *args: str, cwd: Path) -> list[str]:
    """The lines ``python -c CODE ARGS`` printed in ``cwd`` (it must succeed)."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


@pytest.mark.e2e
def test_the_server_imports_the_script_s_installed_modules_and_runs_none_of_its_own(tmp_path):
    (tmp_path / "side_effect.py").write_text("raise SystemExit('imported ahead')\n")
    script = tmp_path / "job.py"
    script.write_text("import side_effect\nimport xml.dom.minidom\nimport no_such_module_x\n")
    probe = (
        "import sys\n"
        "from shardwire.worker.launcher.preload import preload\n"
        f"done = preload([{str(script)!r}])\n"
        "print(done, 'xml.dom.minidom' in sys.modules, 'side_effect' in sys.modules)\n"
    )
    assert _python(probe, cwd=tmp_path)[0] == "['xml.dom.minidom'] True False"


def test_a_script_that_cannot_be_read_or_parsed_preloads_nothing(tmp_path):
    assert preload([str(tmp_path / "missing.py")]) == []
    bad = tmp_path / "bad.py"
    bad.write_text("def (:\n")
    assert preload([str(bad)]) == []


def test_what_a_package_imports_at_first_use_is_imported_after_it(tmp_path, monkeypatch):
    monkeypatch.setattr(preload_module, "FIRST_USE", {"xml": ("xml.sax.saxutils", "no_such_x")})
    script = tmp_path / "job.py"
    script.write_text("import xml.dom.minidom\nimport json\n")
    assert preload([str(script)]) == ["xml.dom.minidom", "json", "xml.sax.saxutils"]
    assert "xml.sax.saxutils" in sys.modules


FIRST_DDP = """
import socket, sys
from shardwire.worker.launcher.preload import preload
print(preload([sys.argv[1]]))
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
before = set(sys.modules)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
torch.optim.AdamW(model.parameters()).step()
print(sorted(m for m in set(sys.modules) - before if m.startswith("torch._dynamo")))
dist.destroy_process_group()
"""


@pytest.mark.e2e
def test_a_torch_script_s_first_ddp_model_and_step_import_nothing_of_torch_s_compiler(tmp_path):
    """DDP and the optimizers import torch._dynamo at their first use: a replacement rank
    forked from the server has it already, so the survivors do not wait on its import."""
    pytest.importorskip("torch", reason="torch is not installed (make torch)")
    script = tmp_path / "job.py"
    script.write_text("import torch.distributed as dist\n")
    said = _python(FIRST_DDP, str(script), cwd=tmp_path)
    assert said[:2] == ["['torch.distributed', 'torch._dynamo']", "[]"]


LAUNCHER_PROBE = """
import sys
import shardwire.worker.launcher.cli
import shardwire.coordinator.__main__
rank_side = ["shardwire.worker.api", "shardwire.worker.collectives", "shardwire.worker.fsdp",
             "shardwire.worker.chaos.inject", "shardwire.worker.transport.mesh", "numpy"]
print([name for name in rank_side if name in sys.modules])
"""


@pytest.mark.e2e
def test_the_launcher_and_coordinator_import_none_of_a_rank_s_machinery(tmp_path):
    """Each job starts a launcher and a coordinator: they import the modules they use, not
    the collectives, FSDP or the fault injector that ``shardwire.worker`` names, nor numpy
    (the protocol checks a tensor's dtype with it, which neither does)."""
    assert _python(LAUNCHER_PROBE, cwd=tmp_path)[0] == "[]"


@pytest.mark.e2e
def test_a_script_importing_shardwire_worker_gets_its_public_names_ahead(tmp_path):
    """``shardwire.worker`` imports its names when first read; the fork server reads them
    all ahead, so its ranks do not each import them after the fork."""
    script = tmp_path / "job.py"
    script.write_text("import shardwire.worker as sw\n")
    probe = (
        "import sys\n"
        "from shardwire.worker.launcher.preload import preload\n"
        "print('shardwire.worker.api' in sys.modules)\n"
        f"print(preload([{str(script)!r}]))\n"
        "import shardwire.worker as sw\n"
        "print(all(name in vars(sw) for name in sw.__all__))\n"
        "print('shardwire.worker.api' in sys.modules)\n"
    )
    assert _python(probe, cwd=tmp_path)[:4] == ["False", "['shardwire.worker']", "True", "True"]
