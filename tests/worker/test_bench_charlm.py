"""``shardwire bench charlm``'s runs, as commands (the jobs are recorded, not started):
each system trains the script it names, and ``--wrap`` reaches both torch systems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwire.worker.bench import charlm


@pytest.fixture
def started(monkeypatch) -> list[list[str]]:
    """The command lines the benchmark starts; each "run" writes its summary at once."""
    commands: list[list[str]] = []

    def summary(argv: list[str]) -> None:
        commands.append(argv)
        out = Path(argv[argv.index("--json") + 1])
        out.write_text(json.dumps({"tokens_per_s": 1000.0 + len(commands)}))

    class _Ranks:
        def check(self) -> None:
            return None

    def ranks(n: int, argv: list[str], **_: object) -> _Ranks:
        summary(argv)
        return _Ranks()

    monkeypatch.setattr(charlm, "_launch", lambda n, args: summary(args))
    monkeypatch.setattr(charlm, "run_ranks", ranks)
    monkeypatch.setattr(charlm, "torch_missing", lambda: False)  # no run is started
    return commands


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_both_torch_systems_train_the_model_wrapped_as_asked(started, tmp_path, wrap) -> None:
    for system in ("torch_shardwire", "torch_gloo"):
        charlm.run(system, 2, 3, tmp_path, wrap=wrap)
    shardwire, gloo = started
    for argv in (shardwire, gloo):
        assert argv[argv.index("--wrap") + 1] == wrap
        assert argv[argv.index("--steps") + 1] == "3"
    assert "--backend" not in shardwire and gloo[gloo.index("--backend") + 1] == "gloo"


def test_the_table_and_rows_name_the_wrap(started, tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    argv = ["--world", "2", "--steps", "3", "--repeats", "1", "--wrap", "ddp", "--json", str(out)]
    assert charlm.main([*argv, "--systems", "torch_shardwire", "torch_gloo"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "torch DDP on shardwire tokens/s" in head and "FSDP2" not in head
    (row,) = json.loads(out.read_text())
    assert row["wrap"] == "ddp" and row["ranks"] == 2
    assert all(a[a.index("--wrap") + 1] == "ddp" for a in started)


def test_torch_systems_without_torch_are_refused_saying_how_to_get_it(
    started, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(charlm, "torch_missing", lambda: True)
    assert charlm.main(["--world", "2", "--systems", "numpy", "torch_gloo"]) == 2
    assert "make torch" in capsys.readouterr().err and started == []
