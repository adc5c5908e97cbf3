"""Run a benchmark and keep its output for the docs: ``docs/data/bench/NAME.json`` holds
the command, the date, the commit and the machine beside what the benchmark wrote with
``--json``. The pages' figures are generated from these files (``figure_pages.py``).

    .venv/bin/python scripts/keep_bench.py NAME "MACHINE" -- shardwire bench ARGS...

``MACHINE`` says what the run ran on (cores, memory, what else was running)."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEPT = ROOT / "docs" / "data" / "bench"


def main(argv: list[str], kept: Path = KEPT) -> int:
    if len(argv) < 4 or argv[2] != "--" or argv[3] != "shardwire":
        raise SystemExit(__doc__)
    name, machine, command = argv[0], argv[1], argv[3:]
    shardwire = str(Path(sys.executable).parent / "shardwire")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="shardwire-keep-") as tmp:
        out = Path(tmp) / "out.json"
        subprocess.run([shardwire, *command[1:], "--json", str(out)], cwd=ROOT, check=True)
        result = json.loads(out.read_text())
    record = {
        "benchmark": " ".join(command),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "commit": commit,
        "machine": machine,
        "result": result,
    }
    path = kept / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"kept in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
