"""Scratch directories: removed by their owner, or by the next of their kind once the
owner is gone, never while it lives."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shardwire.worker.launcher.hosted import _Hosted
from shardwire.worker.runtime.beats import NodeBeats, socket_parent
from shardwire.worker.runtime.scratch import OWNER, Scratch, sweep

PREFIX = "shardwire-test-"


def test_a_directory_is_private_and_removed_by_its_owner(tmp_path) -> None:
    made = Scratch(PREFIX, str(tmp_path))
    assert made.path.parent == tmp_path and made.path.name.startswith(PREFIX)
    assert made.path.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in made.path.iterdir()) == [OWNER]
    made.remove()
    made.remove()
    assert not made.path.exists()


def test_a_live_owner_s_directory_is_kept_and_a_gone_one_s_swept(tmp_path) -> None:
    live = Scratch(PREFIX, str(tmp_path))
    gone = Scratch(PREFIX, str(tmp_path))
    (gone.path / "journal.json").write_text("{}")
    assert gone._fd is not None
    os.close(gone._fd)  # what its process's end does: the kernel drops the lock
    gone._fd = None
    third = Scratch(PREFIX, str(tmp_path))
    assert third.swept == [gone.path]
    assert live.path.exists() and third.path.exists() and not gone.path.exists()
    for made in (live, third):
        made.remove()


def test_what_is_not_a_scratch_directory_is_left_alone(tmp_path) -> None:
    (tmp_path / f"{PREFIX}plain").mkdir()  # no owner file: being made, or not ours
    (tmp_path / f"{PREFIX}file").write_text("x")
    (tmp_path / "other-prefix").mkdir()
    assert sweep(PREFIX, str(tmp_path)) == []
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {f"{PREFIX}plain", f"{PREFIX}file", "other-prefix"}


@pytest.mark.e2e
def test_the_directory_of_a_killed_process_is_swept_by_the_next_one(tmp_path) -> None:
    code = (
        "import sys, time\n"
        "from shardwire.worker.runtime.scratch import Scratch\n"
        f"made = Scratch({PREFIX!r}, sys.argv[1])\n"
        "print(made.path, flush=True)\n"
        "time.sleep(120)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        made = child.stdout.readline().strip()
        assert made and os.path.isdir(made)
        assert sweep(PREFIX, str(tmp_path)) == []  # it lives
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        after = Scratch(PREFIX, str(tmp_path))
        assert [str(p) for p in after.swept] == [made] and not os.path.exists(made)
        after.remove()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)


@pytest.fixture
def short_tmp():
    """A temporary directory with a short path (not tmp_path, which under a test process
    is long): a socket's path inside it must stay within the 107 bytes it may have."""
    root = Path(tempfile.mkdtemp(prefix="swscratch-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def test_the_launcher_s_coordinator_and_the_agent_s_beats_live_in_scratch_directories(
    monkeypatch, short_tmp
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(short_tmp))
    hosted = _Hosted(["shardwire-coordinator"], {})
    beats = NodeBeats(lambda beat: None, 1.0)
    socket = Path(await beats.start())
    try:
        state = Path(hosted.command[hosted.command.index("--state-dir") + 1])
        for directory in (state, socket.parent):
            assert directory.parent == short_tmp and (directory / OWNER).is_file()
            assert sweep(directory.name[: directory.name.rindex("-") + 1], str(short_tmp)) == []
    finally:
        await beats.aclose()
        hosted.state.remove()
    assert not any(map(os.path.exists, (state, socket.parent)))


async def test_a_temporary_directory_too_long_for_a_socket_puts_the_beats_under_tmp(
    monkeypatch, short_tmp
) -> None:
    long = short_tmp / ("d" * 90)  # a socket's path under it would pass 107 bytes
    long.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(long))
    beats = NodeBeats(lambda beat: None, 1.0)
    socket = Path(await beats.start())
    try:
        assert socket.parent.parent == Path("/tmp") and await asyncio.to_thread(socket.exists)
        assert len(os.fsencode(socket)) <= 107
        assert socket_parent() == "/tmp"
    finally:
        await beats.aclose()
    assert not await asyncio.to_thread(socket.parent.exists)


def test_a_temporary_directory_short_enough_is_kept(monkeypatch, short_tmp) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(short_tmp))
    assert socket_parent() == str(short_tmp)
