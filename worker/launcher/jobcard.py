"""How ``shardwire status`` finds a standalone job: ``launch --standalone`` picks a random
token and an ephemeral port, so it leaves a card for the job under a directory only its
user may read (``$XDG_RUNTIME_DIR/shardwire``, else ``/tmp/shardwire-UID``): the
coordinator's address in ``RUN_ID.json`` and the token in ``RUN_ID.token`` (mode 0600),
removed when the job ends. ``shardwire status`` reads the card of its run id when it is
given no coordinator.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardwire.protocol import ShardwireError


@dataclass(frozen=True)
class JobCard:
    """Where one standalone job listens, and the file holding its token."""

    run_id: str
    coordinator: str  # HOST:PORT
    token_file: Path
    pid: int  # the launcher's


def cards_dir(environ: Mapping[str, str]) -> Path:
    """This user's card directory (not created)."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "shardwire"
    return Path(tempfile.gettempdir()) / f"shardwire-{os.getuid()}"


def _stem(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id) or "_"


def _private(directory: Path) -> Path:
    """``directory``, made mode 0700 if missing; refused unless this user owns it and
    nobody else may enter it (it may lie in a directory every user writes to)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ShardwireError(
            f"{directory} must be a directory of this user's that nobody else may enter "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); remove it and start again"
        )
    return directory


def publish(directory: Path, run_id: str, coordinator: str, token: str) -> JobCard:
    """Leave this process's card for ``run_id`` (replacing a card of the same run id)."""
    base = _private(directory) / _stem(run_id)
    token_file = base.with_suffix(".token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    card = JobCard(run_id, coordinator, token_file, os.getpid())
    text = json.dumps({"run_id": run_id, "coordinator": coordinator, "pid": card.pid})
    scratch = base.with_suffix(f".json.{card.pid}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    scratch.replace(base.with_suffix(".json"))
    return card


def withdraw(directory: Path, card: JobCard) -> None:
    """Remove ``card`` unless a later job of the same run id replaced it."""
    base = directory / _stem(card.run_id)
    if (found := lookup(directory, card.run_id)) is not None and found.pid == card.pid:
        base.with_suffix(".json").unlink(missing_ok=True)
        base.with_suffix(".token").unlink(missing_ok=True)


def lookup(directory: Path, run_id: str) -> JobCard | None:
    """The card of a running standalone job of ``run_id``, if there is one."""
    base = directory / _stem(run_id)
    try:
        data = json.loads(base.with_suffix(".json").read_text())
        pid = int(data["pid"])
        os.kill(pid, 0)  # the launcher is still there
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("run_id") != run_id:
        return None
    return JobCard(run_id, str(data["coordinator"]), base.with_suffix(".token"), pid)
