"""One torchft replica of torch charlm, for ``shardwire bench goodput --compare-torchft``.

Run by the benchmark with an interpreter that has torch, torchft and shardwire (the
model comes from ``examples/torch_charlm.py``, which imports ``shardwire.torch``); it
trains the same model, batch and data order as that example under DDP, as torchft runs
it: every replica a replica group of one process, a torchft ``Manager`` joining the
lighthouse's quorum each step, ``torchft.DistributedDataParallel`` averaging the
gradients over the replicas in the quorum, and a restarted replica healing from a live
peer's state. Replica ``r`` of ``n`` takes the ``r``-th of ``n`` parts of each step's
global batch, as rank ``r`` does under DDP.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT FT_REPLICA=r FT_REPLICAS=n \\
    FT_EXAMPLES=examples FT_OUT=DIR python torchft_replica.py CHARLM-FLAGS

Everything listens on 127.0.0.1. ``FT_BARRIER`` (a directory): a replica says there
that it is ready and waits until all ``n`` have, so the first quorum holds them all; one
started again (the others said so long ago) goes on at once, and so does the first
replica of a rank killed before it said so. The replica writes
``FT_OUT/replica-r.json`` (its steps, last loss, wall time and a digest of its
parameters) when the job's steps are done.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torchft.manager
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

READY_WAIT_S = 120.0  # the first replicas' start barrier, at most


def _loopback_store() -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1 (torch's own binds every address)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def _loopback_manager_server() -> None:
    """torchft binds a replica group's manager server on every address; keep it on
    loopback (its port stays torchft's choice)."""
    server = torchft.manager.ManagerServer

    def on_loopback(**kwargs):
        kwargs["bind"] = "127.0.0.1:" + kwargs["bind"].rsplit(":", 1)[1]
        return server(**kwargs)

    torchft.manager.ManagerServer = on_loopback


def _barrier(directory: Path, replica: int, replicas: int) -> None:
    (directory / f"ready-{replica}").touch()
    deadline = time.monotonic() + READY_WAIT_S
    while len(list(directory.glob("ready-*"))) < replicas and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    replica, replicas = int(os.environ["FT_REPLICA"]), int(os.environ["FT_REPLICAS"])
    out = Path(os.environ["FT_OUT"])
    sys.path.insert(0, os.environ["FT_EXAMPLES"])
    import torch_charlm as charlm

    args = charlm.parse()
    torch.set_num_threads(1)
    _loopback_manager_server()
    group = _loopback_store()  # the replica group's store (torchrun would host it)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group.port), RANK="0")
    os.environ["WORLD_SIZE"] = "1"

    data, vocab = charlm.corpus()
    cut = int(len(data) * 0.9)
    train = data[:cut]
    torch.manual_seed(args.seed)
    model = charlm.LM(
        vocab, dim=args.dim, heads=args.heads, layers=args.layers, context=args.context
    )
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(
        timeout=timedelta(seconds=float(os.environ.get("FT_PG_TIMEOUT_S", "0.5")))
    )
    pg._rendezvous_store = _loopback_store()  # torchft's own would bind every address
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"charlm-{replica}",
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        checkpoint_transport=PGTransport(
            pg, timeout=timedelta(seconds=10), device=torch.device("cpu")
        ),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    if barrier := os.environ.get("FT_BARRIER"):
        _barrier(Path(barrier), replica, replicas)

    mine = np.array_split(np.arange(args.batch), replicas)[replica]
    start = time.perf_counter()
    loss = torch.zeros(())
    while manager.current_step() < args.steps:
        draw = np.random.default_rng([args.seed + 1, manager.current_step()])
        starts = draw.integers(0, len(train) - args.context - 1, args.batch)[mine]
        opt.zero_grad()  # starts this step's quorum
        loss = charlm.loss_of(ddp, *charlm.windows(train, starts, args.context))
        loss.backward()  # the gradients averaged over the quorum's replicas
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # applied only where every replica of the quorum committed
    summary = {
        "replica": replica,
        "steps": manager.current_step(),
        "train_loss": round(float(loss), 4),
        "wall_s": round(time.perf_counter() - start, 3),
        "digest": hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        ).hexdigest(),
    }
    (out / f"replica-{replica}.json").write_text(json.dumps(summary))
    sys.stdout.flush()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads and gloo's pairs are not joined at exit


if __name__ == "__main__":
    main()
