"""End to end: tokens/s of the charlm model shape, trained three ways in one run, at 1, 2
and 4 ranks:

- ``examples/charlm.py``: shardwire's own numpy layers, FULL_SHARD with prefetch;
- ``examples/torch_charlm.py``: PyTorch with FSDP2 (``fully_shard``, or DDP with
  ``--wrap ddp``) over the shardwire backend, under ``shardwire launch``;
- the same torch script over gloo, started the way torchrun starts it.

    shardwire bench charlm [--world 1 2 4] [--steps 40] [--repeats 2] [--wrap fsdp2]
                           [--json out.json]

The systems alternate world size by world size and repeat by repeat (the order turns
around every repeat), so a machine that slows down during the run hurts all alike. All
count tokens/s over the whole loop, every step, one thread per rank. The torch runs need
torch in this environment (``make torch``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench.jobs import command_line, example
from shardwire.worker.bench.stages import Stages
from shardwire.worker.bench.torchrun import clean_env, run_ranks

SHARDWIRE = str(Path(sys.executable).parent / "shardwire")
MODEL = {"batch": 32, "context": 64, "dim": 128, "heads": 4, "layers": 4, "lr": 3e-3, "seed": 0}
SYSTEMS = {
    "numpy": "shardwire (numpy layers)",
    "torch_shardwire": "torch {wrap} on shardwire",
    "torch_gloo": "torch {wrap} on gloo",
}
WRAPS = {"fsdp2": "FSDP2", "ddp": "DDP"}


def label(system: str, wrap: str) -> str:
    """What ``system`` is called in the table, its torch runs wrapped in ``wrap``."""
    return SYSTEMS[system].format(wrap=WRAPS[wrap])


def _model_args() -> list[str]:
    return [f"--{k}={v}" for k, v in MODEL.items()]


def _launch(n: int, args: list[str]) -> None:
    import subprocess

    cmd = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", str(n), *args]
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL, env=clean_env())


def run(system: str, n: int, steps: int, tmp: Path, *, wrap: str = "fsdp2") -> float:
    tag = f"{system}-{n}-{len(list(tmp.iterdir()))}"
    out = tmp / f"{tag}.json"
    if system == "numpy":
        run_dir = tmp / tag
        _launch(
            n,
            [
                str(example("charlm.py")),
                "--steps",
                str(steps),
                "--log-every",
                str(10 * steps),
                "--sample",
                "0",
                "--run-dir",
                str(run_dir),
                *_model_args(),
            ],
        )
        return float(json.loads((run_dir / "summary.json").read_text())["tokens_per_s"])
    script = [
        str(example("torch_charlm.py")),
        "--steps",
        str(steps),
        "--json",
        str(out),
        "--wrap",
        wrap,
        *_model_args(),
    ]
    if system == "torch_shardwire":
        _launch(n, script)
    else:
        argv = [sys.executable, *script, "--backend", "gloo"]
        run_ranks(n, argv, logs=tmp / f"{tag}-logs", timeout=1800).check()
    return float(json.loads(out.read_text())["tokens_per_s"])


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench charlm``."""
    p = command_line("charlm", __doc__)
    p.add_argument(
        "--world",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="ranks of a run, a row per value (1 2 4)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=40,
        help="training steps of every run, all counted in its tokens/s (%(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each system at each world size, the systems' order turned around every "
        "repeat (%(default)s)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        choices=list(SYSTEMS),
        help="what is trained: numpy (examples/charlm.py), torch_shardwire and torch_gloo "
        "(examples/torch_charlm.py on either backend) (all three)",
    )
    p.add_argument(
        "--wrap",
        choices=list(WRAPS),
        default="fsdp2",
        help="how the torch runs spread the model: FSDP2's fully_shard or DDP (%(default)s)",
    )
    p.add_argument("--json", help="write the rows here")
    return p


def torch_missing() -> bool:
    """Whether this environment lacks torch (the torch systems' runs need it)."""
    try:
        import shardwire.torch  # noqa: F401
    except ImportError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if any(s.startswith("torch") for s in args.systems) and torch_missing():
        print("torch is not installed in this environment (make torch)", file=sys.stderr)
        return 2
    rows = []
    progress = Stages("charlm", len(args.world) * args.repeats * len(args.systems))
    with progress, tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        turn = 0
        for n in args.world:
            got: dict[str, list[float]] = {s: [] for s in args.systems}
            for repeat in range(args.repeats):
                for system in args.systems[:: 1 if turn % 2 == 0 else -1]:
                    ranks = f"{n} rank{'' if n == 1 else 's'}"
                    said = label(system, args.wrap)
                    progress.start(f"{ranks}, run {repeat + 1}/{args.repeats}: {said}")
                    got[system].append(run(system, n, args.steps, tmp, wrap=args.wrap))
                turn += 1
            rows.append(
                {"ranks": n, "wrap": args.wrap, **{f"{s}_tokens_per_s": v for s, v in got.items()}}
            )
    _print(rows, args.systems, args.wrap)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _print(rows: list[dict], systems: list[str], wrap: str) -> None:
    head = "| ranks | " + " | ".join(f"{label(s, wrap)} tokens/s" for s in systems) + " |"
    ratios = [
        (a, b)
        for a, b in (("torch_shardwire", "torch_gloo"), ("numpy", "torch_gloo"))
        if a in systems and b in systems
    ]
    head += "".join(f" {label(a, wrap)} / {label(b, wrap)} |" for a, b in ratios)
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        cells = [", ".join(f"{v:,.0f}" for v in r[f"{s}_tokens_per_s"]) for s in systems]
        line = f"| {r['ranks']} | " + " | ".join(cells) + " |"
        for a, b in ratios:
            ratio = statistics.median(r[f"{a}_tokens_per_s"]) / statistics.median(
                r[f"{b}_tokens_per_s"]
            )
            r[f"{a}_over_{b}"] = ratio
            line += f" {ratio:.2f}x |"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
