"""``shardwire checkpoint inspect | verify | consolidate``: checkpoints without a job.

``consolidate`` writes one safetensors file holding every full parameter, assembling one
parameter at a time from its pieces (and a tensor-parallel parameter from its slices),
so memory stays bounded by the largest parameter.
``safetensors.numpy.load_file`` reads the result.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from shardwire.worker.fsdp import reshard, store, tensorfile
from shardwire.worker.fsdp.store import CheckpointError


def _open(directory: str, step: int | None) -> tuple[Path, dict[str, Any]]:
    path = store.resolve(Path(directory), step)
    return path, store.read_manifest(path)


def describe(path: Path, manifest: dict[str, Any]) -> str:
    """The checkpoint's step, world, strategy and a table of its tensors."""
    lines = [
        f"{path}: step {manifest['step']}, written by {manifest['world_size']} ranks "
        f"({manifest['strategy']}), optimizer {manifest['optimizer']['kind']} at step "
        f"{manifest['optimizer']['steps']}",
        f"{'tensor':<48} {'dtype':<8} {'shape':<16} {'pieces':>6} {'bytes':>12}",
    ]
    total = 0
    for name, t in sorted(manifest["tensors"].items()):
        nbytes = sum(p["bytes"][1] - p["bytes"][0] for p in t["pieces"])
        total += nbytes
        shape = "x".join(map(str, t["shape"])) or "scalar"
        lines.append(f"{name:<48} {t['dtype']:<8} {shape:<16} {len(t['pieces']):>6} {nbytes:>12}")
    lines.append(f"{len(manifest['tensors'])} tensors, {total} bytes")
    if manifest.get("extra"):
        lines.append(f"extra: {json.dumps(manifest['extra'])}")
    return "\n".join(lines)


def verify(path: Path, manifest: dict[str, Any]) -> list[str]:
    """Every piece read and checked against its digest; the problems found."""
    problems = []
    with store.PieceReader(path, manifest["nonce"]) as reader:
        for key, tensor in sorted(manifest["tensors"].items()):
            covered = 0
            for piece in tensor["pieces"]:
                try:
                    reader.piece(key, piece)
                    covered += piece["count"]
                except CheckpointError as exc:
                    problems.append(str(exc))
            size = int(np.prod(tensor["shape"], dtype=np.int64))
            if covered != size and not problems:
                problems.append(f"{key}: the pieces cover {covered} of {size} values")
    return problems


def consolidate(path: Path, manifest: dict[str, Any], out: Path) -> int:
    """Write the full parameters as one safetensors file; returns the bytes written."""
    tensors = manifest["tensors"]
    params = sorted({reshard.base_of(k) for k in tensors if k.startswith("param:")})
    saved = reshard.Saved(tensors)
    partial = out.with_name(out.name + ".partial")
    with store.PieceReader(path, manifest["nonce"]) as reader:
        specs = []
        for base in params:  # a split parameter is assembled from its slices
            shape, dtype = saved.shape(base) or ((), "")
            read = functools.partial(saved.whole, reader, base)
            specs.append(tensorfile.Spec(base.removeprefix("param:"), np.dtype(dtype), shape, read))
        ranges = tensorfile.write(partial, specs, metadata={"step": str(manifest["step"])})
    os.replace(partial, out)
    return max((end for _start, end in ranges.values()), default=0)


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire checkpoint``."""
    p = argparse.ArgumentParser(
        prog="shardwire checkpoint",
        description=__doc__.splitlines()[0],
        epilog="examples:\n"
        "  shardwire checkpoint inspect runs/ckpt\n"
        "  shardwire checkpoint verify runs/ckpt --step 200\n"
        "  shardwire checkpoint consolidate runs/ckpt model.safetensors",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("inspect", "step, world size, strategy and a table of tensors"),
        ("verify", "check every digest (exit status 1 if any fails)"),
        ("consolidate", "write the full model as one safetensors file"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("directory", help="checkpoint directory (its latest, or --step)")
        cmd.add_argument("--step", type=int, help="a given step instead of the latest")
        if name == "consolidate":
            cmd.add_argument("out", help="the .safetensors file to write")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        path, manifest = _open(args.directory, args.step)
        if args.command == "inspect":
            print(describe(path, manifest))
        elif args.command == "verify":
            problems = verify(path, manifest)
            for problem in problems:
                print(problem, file=sys.stderr)
            if problems:
                return 1
            print(f"{path}: every digest matches")
        else:
            written = consolidate(path, manifest, Path(args.out))
            print(f"wrote {args.out} ({written} bytes)")
    except CheckpointError as exc:
        print(f"shardwire checkpoint: {exc}", file=sys.stderr)
        return 1
    return 0
