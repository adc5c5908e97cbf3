"""What a long benchmark says while it runs: a line per stage in a log, a bar on a
terminal, with the time left from the stages finished; and the benchmarks' loops count
their stages before they start (each run faked here, so nothing is started)."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardwire.worker.bench import across, goodput, slowlink
from shardwire.worker.bench.stages import Stages, duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_stage_with_the_time_left_once_one_finished() -> None:
    out, clock = io.StringIO(), Clock()
    with Stages("demo", 3, out=out, clock=clock) as stages:
        stages.start("first")
        clock.now += 40
        stages.start("second")
        clock.now += 60
        stages.start("third")
        clock.now += 50
    assert out.getvalue().splitlines() == [
        "[demo] 1/3: first (0 s in)",
        "[demo] 2/3: second (40 s in; about 1.3 min left)",  # 40 s a stage, two to go
        "[demo] 3/3: third (1.7 min in; about 50 s left)",  # 100 s over two, one to go
        "[demo] done: 3 stages in 2.5 min",
    ]


def test_the_time_left_weighs_the_stages_by_their_work() -> None:
    out, clock = io.StringIO(), Clock()
    stages = Stages("demo", 3, work=21, out=out, clock=clock)
    stages.start("short", work=1)
    clock.now += 10
    stages.start("long", work=10)  # 10 s for one unit of work: 200 s for the other 20
    clock.now += 100
    stages.start("long again", work=10)  # 110 s for 11 units: 100 s for the last 10
    lines = out.getvalue().splitlines()
    assert lines[1] == "[demo] 2/3: long (10 s in; about 3.3 min left)"
    assert lines[2] == "[demo] 3/3: long again (1.8 min in; about 1.7 min left)"


def test_a_terminal_gets_each_line_with_a_bar_of_the_work_done() -> None:
    out, clock = Terminal(), Clock()
    with Stages("demo", 2, work=4, out=out, clock=clock) as stages:
        stages.start("first")
        clock.now += 30
        stages.start("second", work=3)
        clock.now += 30
    # tqdm draws and leaves each bar on a line of its own (here ten cells of ASCII)
    lines = out.getvalue().split("\n")
    assert lines[0].endswith("\r[demo] 1/2: first (0 s in) |          |")
    assert lines[1].endswith("\r[demo] 2/2: second (30 s in; about 1.5 min left) |##5       |")
    assert lines[2].endswith("\r[demo] done: 2 stages in 1.0 min |##########|")
    assert lines[3:] == [""]


def test_a_terminal_without_tqdm_gets_the_lines_alone(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    out = Terminal()
    with Stages("demo", 1, out=out, clock=Clock()) as stages:
        stages.start("only")
    assert out.getvalue() == "[demo] 1/1: only (0 s in)\n[demo] done: 1 stage in 0 s\n"


@pytest.mark.parametrize("out", [io.StringIO(), Terminal()], ids=["log", "terminal"])
def test_a_run_that_failed_says_no_done(out) -> None:
    with pytest.raises(RuntimeError), Stages("demo", 2, out=out, clock=Clock()) as stages:
        stages.start("first")
        raise RuntimeError("a job failed")
    assert "[demo] 1/2: first" in out.getvalue() and "done" not in out.getvalue()


def test_a_stage_past_the_count_is_a_miscount() -> None:
    stages = Stages("demo", 1, out=io.StringIO())
    stages.start("only")
    with pytest.raises(AssertionError, match="demo: stage 2 of 1"):
        stages.start("one too many")


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0.2, "0 s"),
        (59.4, "59 s"),
        (59.6, "1.0 min"),
        (192, "3.2 min"),
        (1500, "25 min"),
        (5969, "99 min"),
        (5400 * 1.2, "1.8 h"),
    ],
)
def test_durations_read_as_a_person_says_them(seconds: float, said: str) -> None:
    assert duration(seconds) == said


def _stage_lines(err: str, bench: str) -> list[str]:
    """The stage lines of ``bench`` in ``err``, checked to count 1..N of the same N."""
    lines = [line for line in err.splitlines() if re.match(rf"\[{bench}\] \d+/\d+: ", line)]
    counts = [line.split(": ", 1)[0].split()[1] for line in lines]
    assert counts == [f"{i}/{len(lines)}" for i in range(1, len(lines) + 1)], lines
    assert f"[{bench}] done: {len(lines)} stages in " in err
    return [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in lines]


@contextlib.contextmanager
def _hosts(count: int, rate: str | None):
    yield SimpleNamespace(count=count, rate=rate)


def test_slowlink_counts_every_timed_run_then_every_loss_run(monkeypatch, capsys, tmp_path):
    def run_mode(hosts, mode, args, tmp, *, steps, log_every):
        return {
            "steps": steps,
            "tokens_per_s": 1000.0,
            "held_out_loss": 2.0,
            "curve": [],
            "cross_host_bytes_per_token": 10.0,
            "largest_exchange_bytes": None,
        }

    monkeypatch.setattr(slowlink, "emulated", _hosts)
    monkeypatch.setattr(slowlink, "run_mode", run_mode)
    argv = ["--hosts", "2", "4", "--rates", "100mbit", "unshaped", "--modes", "dp", "diloco"]
    args = slowlink.parser().parse_args([*argv, "--steps", "20", "--loss-steps", "300"])
    progress = slowlink.stages(args)
    assert (progress.total, progress.work) == (12, 8 * 20 + 4 * 300)
    rows, _curves = slowlink.measure(args, tmp_path)
    said = _stage_lines(capsys.readouterr().err, "slowlink")
    assert said[:4] == [  # the modes' order turns rate by rate
        "2 hosts, 100mbit, dp: 20 steps timed",
        "2 hosts, 100mbit, diloco: 20 steps timed",
        "2 hosts, unshaped, diloco: 20 steps timed",
        "2 hosts, unshaped, dp: 20 steps timed",
    ]
    assert said[8:] == [
        f"{count} hosts, {mode}: 300 steps for the loss"
        for count in (2, 4)
        for mode in ("dp", "diloco")
    ]
    assert len(rows) == 8


def _cells(hosts, per_host, config, *rest, **options) -> list[dict]:
    return [
        {
            "n": hosts.count * per_host,
            "op": "all_reduce",
            "bytes": config["sizes"][0],
            "algorithm": "ring",
            "median_s": 0.01,
            "tcp": {},
        }
    ]


@pytest.mark.parametrize(
    ("tuning", "systems"),
    [
        ({"congestion": None, "notsent_lowat": None}, ["ours", "default", "gloo"]),
        (across.KERNEL_TCP, ["ours", "gloo"]),  # the kernel's defaults asked for: one column
    ],
)
def test_collectives_across_hosts_count_a_stage_per_system_at_each_size(
    monkeypatch, capsys, tmp_path, tuning, systems
):
    monkeypatch.setattr(across, "emulated", _hosts)
    monkeypatch.setattr(across, "shardwire_cells", _cells)
    monkeypatch.setattr(across, "gloo_cells", _cells)
    config = {"ops": ["all_reduce"], "sizes": [4096, 1 << 20], "target_s": 0.1}
    rows = across.run(
        [2, 3],
        per_host=1,
        rate="100mbit",
        config=config,
        gloo="python",
        tmp=str(tmp_path),
        tuning=tuning,
    )
    said = _stage_lines(capsys.readouterr().err, "collectives")
    assert len(said) == 2 * 2 * len(systems) and len(rows) == 4
    names = {"ours": "shardwire", "default": "shardwire, the kernel's TCP defaults"}
    first = [names.get(s, s) for s in systems]
    assert said[: len(systems)] == [f"2 hosts, 4 KiB: {name}" for name in first]
    turned = first[1:] + first[:1]  # who goes first turns size by size
    assert said[len(systems) : 2 * len(systems)] == [f"2 hosts, 1 MiB: {n}" for n in turned]
    assert said[-1].startswith("3 hosts, 1 MiB: ")


def test_goodput_counts_a_fault_free_run_and_each_mode_per_pair(monkeypatch, capsys):
    faulty = {
        "faulty_s": 12.0,
        "finished": True,
        "goodput": 0.8,
        "faults": 1,
        "lost_per_fault_s": 2.0,
        "steps_lost": 3,
        "recovery_s": [1.0],
        "recovery_median_s": 1.0,
        "recovery_max_s": 1.0,
        "processes": 3,
    }
    monkeypatch.setattr(goodput, "_workload", lambda args: (Path("x.py"), []))
    monkeypatch.setattr(goodput, "clean", lambda args, job_of, root: (10.0, 100))
    monkeypatch.setattr(goodput, "faulty", lambda *a, **k: dict(faulty))
    args = goodput.parser().parse_args(["--pairs", "2", "--minutes", "0.5"])
    result = goodput.measure(args)
    assert result["modes"]["live"]["goodput_pairs"] == [0.8, 0.8]
    said = _stage_lines(capsys.readouterr().err, "goodput")
    assert said == [
        f"pair {pair}: {what}"
        for pair in (1, 2)
        for what in (
            "the fault-free job, 0.5 min",
            "100 steps under the plan, relaunch",
            "100 steps under the plan, live",
        )
    ]


def test_a_faulty_run_a_little_faster_than_its_fault_free_one_loses_0_s_per_fault() -> None:
    assert f"{goodput._seconds(-0.00375):.2f}" == "0.00" and goodput._seconds(1.234) == 1.23
