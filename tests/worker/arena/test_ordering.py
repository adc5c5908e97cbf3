"""Memory ordering across processes: what a rank publishes is what the others read, on
the plain path (x86-64's store order) and through libatomic's acquire and release."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardwire.worker.arena.atomics import PLAIN
from shardwire.worker.arena.region import Region

from . import hammer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "libatomic"])
def test_published_halves_are_never_seen_torn(tmp_path: Path, plain: bool) -> None:
    if plain and not PLAIN:
        pytest.skip("plain loads and stores are only ordered enough on x86-64")
    region, nonce = Region.create("hammer", hammer.GEOMETRY, tmp_path)
    rounds = 20000
    try:
        reader = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.worker.arena.hammer",
                str(tmp_path),
                region.path.name,
                nonce.hex(),
                str(rounds),
                "1" if plain else "0",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            hammer.write(region, rounds, plain)
            out, _ = reader.communicate(timeout=120)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        assert reader.returncode == 0
        assert int(out) == 0  # every round read exactly what was published
    finally:
        region.unlink()
        region.close()
