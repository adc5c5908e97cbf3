"""A job's token derived from the user's own secret, for schedulers that start every task
with the same environment but no shared secret (Slurm).

The secret is 32 random bytes in ``$XDG_CONFIG_HOME/shardwire/secret`` (by default
``~/.config/shardwire/secret``), mode 0600, made on first use; on a cluster the home
directory is shared, so every node reads the same file. A job's token is
HMAC-SHA256(secret, "<scheduler>-job:<job id>"): each job has its own, nothing secret
is in the environment or on a command line, and another user cannot compute it.
Where the home directory is not shared, give ``--token-file`` instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from shardwire.protocol import ShardwireError


def secret_path(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or str(
        Path(environ.get("HOME", "~")).expanduser() / ".config"
    )
    return Path(base) / "shardwire" / "secret"


def job_token(scheduler: str, job_id: str, environ: Mapping[str, str]) -> str:
    """The token of ``job_id``, from the user's secret (made if there is none)."""
    key = _read_or_make(secret_path(environ))
    return hmac.new(key, f"{scheduler}-job:{job_id}".encode(), hashlib.sha256).hexdigest()


def _read_or_make(path: Path) -> bytes:
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Every task of a job may get here at once, on several hosts: the file appears
        # whole or not at all (a hard link of a finished file; the first one wins).
        tmp = path.with_name(f".secret-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ShardwireError(
            f"{path} must belong to you with mode 0600 (it is mode "
            f"{stat.S_IMODE(info.st_mode):04o}); it derives your jobs' tokens"
        )
    key = path.read_bytes().strip()
    if len(key) < 32:
        raise ShardwireError(f"{path} holds no secret (remove it to make a new one)")
    return key
