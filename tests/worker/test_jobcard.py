"""A standalone job's card: what ``shardwire status`` reads to find it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardwire.protocol import ShardwireError
from shardwire.worker.launcher.jobcard import cards_dir, lookup, publish, withdraw
from shardwire.worker.launcher.status import settings_from


def test_a_card_is_found_by_run_id_and_removed_with_its_job(tmp_path) -> None:
    directory = tmp_path / "cards"
    card = publish(directory, "job/1", "127.0.0.1:4567", "secret")
    assert directory.stat().st_mode & 0o777 == 0o700
    assert card.token_file.stat().st_mode & 0o777 == 0o600
    assert card.token_file.read_text() == "secret\n"
    assert lookup(directory, "job/1") == card
    assert lookup(directory, "job_1") is None  # the file name is not the run id
    withdraw(directory, card)
    assert lookup(directory, "job/1") is None and not card.token_file.exists()


@pytest.mark.e2e
def test_a_card_whose_launcher_is_gone_is_ignored(tmp_path) -> None:
    card = publish(tmp_path, "r", "127.0.0.1:1", "t")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    stale = (tmp_path / "r.json").read_text().replace(str(card.pid), gone.stdout.strip())
    (tmp_path / "r.json").write_text(stale)
    assert lookup(tmp_path, "r") is None


def test_a_directory_others_may_enter_is_refused(tmp_path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(ShardwireError, match="nobody else may enter"):
        publish(open_dir, "r", "127.0.0.1:1", "t")


def test_the_directory_is_per_user() -> None:
    assert cards_dir({"XDG_RUNTIME_DIR": "/run/user/7"}).as_posix() == "/run/user/7/shardwire"
    assert cards_dir({}).name == f"shardwire-{os.getuid()}"


def test_status_takes_the_card_only_where_nothing_was_said(tmp_path) -> None:
    environ = {"XDG_RUNTIME_DIR": str(tmp_path)}
    card = publish(tmp_path / "shardwire", "shardwire", "127.0.0.1:4567", "t")
    found = settings_from([], environ)
    assert found.coordinator == "127.0.0.1:4567" and found.token_file == str(card.token_file)
    named = settings_from(["--coordinator", "10.0.0.1:29400"], environ)
    assert named.coordinator == "10.0.0.1:29400" and named.token_file is None
    other = settings_from(["--run-id", "other"], environ)
    assert other.coordinator == "127.0.0.1:29400"
