"""Torch charlm (``examples/torch_charlm.py`` of the checkout this runs in) trained by
Ray Train's torch trainer on a cluster, over the backend named: shardwire (through
:class:`~shardwire.ray.train.ShardwireConfig`) or gloo. Prints rank 0's summary (with its
``tokens_per_s``) as one JSON line.

    python -m shardwire.ray.charlm ADDRESS shardwire|gloo NUM_WORKERS [charlm flags...]
"""

from __future__ import annotations

import json
import runpy
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray


def _train(config: dict[str, Any]) -> None:
    """One worker of the trainer: charlm's own training loop on the group Ray Train made."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    charlm = runpy.run_path(config["script"], run_name="charlm")
    sys.argv = [config["script"], *config["flags"]]
    args = charlm["parse"]()
    data, vocab = charlm["corpus"]()
    summary = charlm["train"](args, data, vocab, None)
    if dist.get_rank() == 0:
        summary["backend"] = dist.get_backend()
        Path(config["out"]).write_text(json.dumps(summary))


def main(argv: list[str]) -> int:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from shardwire.ray.train import ShardwireConfig
    from shardwire.worker.bench.jobs import example

    address, backend, workers, *flags = argv
    ray.init(address=address, include_dashboard=False)
    with tempfile.TemporaryDirectory(prefix="shardwire-ray-charlm-") as directory:
        scratch = Path(directory)
        out = scratch / "summary.json"
        config = ShardwireConfig() if backend == "shardwire" else TorchConfig(backend=backend)
        TorchTrainer(
            _train,
            train_loop_config={
                "script": str(example("torch_charlm.py").absolute()),
                "flags": [*flags, f"--backend={backend}"],
                "out": str(out),
            },
            scaling_config=ScalingConfig(num_workers=int(workers), resources_per_worker={"CPU": 1}),
            torch_config=config,
            run_config=RunConfig(storage_path=str(scratch / "results")),
        ).fit()
        print(json.dumps(json.loads(out.read_text())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
