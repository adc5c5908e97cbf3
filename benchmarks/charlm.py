"""End to end: tokens/s of the charlm example (FULL_SHARD with prefetch) against the same
model shape trained with PyTorch FSDP2 over gloo, at 1, 2 and 4 ranks, in one run.

    python benchmarks/charlm.py [--world 1 2 4] [--steps 40] [--repeats 2] [--json out.json]

The two alternate world size by world size and repeat by repeat (shardwire first on
even turns, torch first on odd ones), so a machine that slows down during the run
hurts both alike. torch runs from an interpreter that has it (``--torch-python``, else
this one, else ``~/.cache/gloo-venv/bin/python``: ``pip install torch`` there, the CPU
build). Both count tokens/s over the whole loop, every step, one thread per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench import fsdp2
from shardwire.worker.bench.collectives import side_python

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"batch": 32, "context": 64, "dim": 128, "heads": 4, "layers": 4, "lr": 3e-3, "seed": 0}


def shardwire_run(n: int, steps: int, tmp: str) -> float:
    run_dir = Path(tmp) / f"sw-{n}-{len(os.listdir(tmp))}"
    cmd = [
        str(Path(sys.executable).parent / "shardwire"), "launch", "--standalone",
        "--nproc-per-node", str(n), str(ROOT / "examples" / "charlm.py"),
        "--steps", str(steps), "--log-every", str(10 * steps), "--sample", "0",
        "--run-dir", str(run_dir),
        *(f"--{k}={v}" for k, v in MODEL.items()),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL, env=env)
    return float(json.loads((run_dir / "summary.json").read_text())["tokens_per_s"])


def torch_run(n: int, steps: int, python: str, tmp: str) -> float:
    out = Path(tmp) / f"fsdp2-{n}.json"
    config = {**MODEL, "n": n, "steps": steps}
    cmd = [python, fsdp2.__file__, str(out), json.dumps(config)]
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    return float(json.loads(out.read_text())["tokens_per_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--torch-python", help="interpreter with torch")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    python = side_python(args.torch_python, "gloo-venv", "import torch.distributed.fsdp")
    if python is None:
        print("no interpreter with torch (pip install torch)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        turn = 0
        for n in args.world:
            ours: list[float] = []
            theirs: list[float] = []
            for _ in range(args.repeats):
                for system in ("shardwire", "torch")[:: 1 if turn % 2 == 0 else -1]:
                    if system == "shardwire":
                        ours.append(shardwire_run(n, args.steps, tmp))
                    else:
                        theirs.append(torch_run(n, args.steps, python, tmp))
                turn += 1
            rows.append(
                {
                    "ranks": n,
                    "shardwire_tokens_per_s": ours,
                    "fsdp2_gloo_tokens_per_s": theirs,
                    "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
                }
            )
    print("| ranks | shardwire tokens/s | FSDP2 + gloo tokens/s | shardwire / FSDP2 |")
    print("|---|---|---|---|")
    for r in rows:
        ours_text = ", ".join(f"{v:,.0f}" for v in r["shardwire_tokens_per_s"])
        theirs_text = ", ".join(f"{v:,.0f}" for v in r["fsdp2_gloo_tokens_per_s"])
        print(f"| {r['ranks']} | {ours_text} | {theirs_text} | {r['ratio_of_medians']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
