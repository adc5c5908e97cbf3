"""shardwire as a ``torch.distributed`` backend (``pip install shardwire[torch]``).

Importing this package registers the backend ``"shardwire"`` for CPU tensors::

    import shardwire.torch  # noqa: F401
    import torch.distributed as dist

    dist.init_process_group("shardwire")     # or "cpu:shardwire"

Under ``shardwire launch`` / ``shardwire worker`` this joins the job through shardwire's
coordinator with no other argument. Elsewhere (torchrun, ``env://``, ``tcp://``,
``file://``, a store passed in) the ranks meet through torch's store. Every collective
torch calls on a CPU group then runs on shardwire: its loop on a thread of its own, its
node arena between ranks of one host, its TCP mesh between hosts; a failed peer raises
``PeerFailed`` naming the rank from ``Work.wait()`` on every rank. Under
``shardwire launch --recovery live`` a script can go on in its processes:
``shardwire.torch.recovering(train)`` catches it, re-forms the default group on the
job's next generation (:func:`reform`) and runs ``train`` again.

Inside a shardwire job, ``env://`` rendezvous goes through the coordinator (torch's
``MASTER_ADDR``/``MASTER_PORT`` name it there); the package installs that handler for
``env://`` and hands every other case to torch's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised where torch is absent
    raise ImportError(
        "shardwire's torch backend needs torch: pip install 'shardwire[torch]'"
    ) from exc

from shardwire.torch.bridge import Bridge, rendezvous_handlers
from shardwire.torch.diloco import TorchDiLoCo
from shardwire.torch.group import ShardwireProcessGroup
from shardwire.torch.livestate import heal
from shardwire.torch.peerstorage import PeerStorage
from shardwire.torch.steps import Steps
from shardwire.torch.store import JobStore, StoreUnavailable
from shardwire.torch.tensors import UnsupportedTensor
from shardwire.torch.work import BridgeWork
from shardwire.worker.runtime.leave import LeaveNotice

MIN_TORCH = (2, 7)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+", maxsplit=1)[0].split(".")[:2]
    return int(major), int(minor)


if _version(torch.__version__) < MIN_TORCH:
    raise ImportError(
        f"shardwire's torch backend needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, "
        f"found {torch.__version__}"
    )

bridge = Bridge(os.environ)

T = TypeVar("T")


_steps = Steps()


def step_finished(
    step: int,
    *,
    read: Sequence[int] | np.ndarray | None = None,
    model: torch.nn.Module | None = None,
    loss: float | None = None,
    samples: int = 0,
    total_steps: int = 0,
) -> None:
    """Tell shardwire this rank finished ``step`` (after its optimizer step): progress
    for the status views (``samples``: the step's samples on this rank, for samples/s;
    ``total_steps``: the run's, for time left), and, under ``shardwire chaos``, the
    plan's faults at a step and its invariants: ``read`` is where the rank is in its
    data (the sample ids it read), ``model`` what it holds (its parameters, whole or
    sharded), ``loss`` the step's loss. Does nothing outside a shardwire job or on
    another backend's default group. See
    :mod:`shardwire.torch.steps`."""
    if bridge.in_job:
        _steps.finished(
            step, read=read, model=model, loss=loss, samples=samples, total_steps=total_steps
        )


def leave_notice(*, grace: float = 30.0) -> LeaveNotice:
    """SIGTERM as a notice to leave, for ``PeerStorage(leave=...)`` (live recovery).
    See :meth:`Bridge.leave_notice`."""
    return bridge.leave_notice(grace=grace)


def reform(error: BaseException) -> None:
    """Re-form after a peer's failure, in this process (``--recovery live``): the
    default process group is destroyed and created again on the job's next generation.
    See :meth:`Bridge.reform`."""
    bridge.reform(error)


def recovering(train: Callable[[], T]) -> T:
    """Run ``train()``; under live recovery, when a peer's failure ends the generation,
    re-form (:func:`reform`) and run it again, until it returns. The failure is
    recognised however it reaches ``train``: ``PeerFailed`` from ``Work.wait()``, the
    ``RuntimeError`` torch's C++ side raises from a failed future (DDP's ``backward()``),
    or DCP's ``CheckpointException`` from a save or load the failure interrupted.
    ``train`` builds its model on the current default group and restores its state (a
    ``torch.distributed.checkpoint``, say) before it trains. Without live recovery, or
    for any other error, the error propagates, as from ``train`` itself."""
    while True:
        try:
            return train()
        except BaseException as error:
            # DCP wraps what fails inside a save or a load in CheckpointException, which
            # derives from BaseException: a peer's death mid-save arrives that way
            if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            if not bridge.live:
                raise
            failure = bridge.peer_failure(error)
            if failure is None:
                raise
            reform(failure)


if "shardwire" not in dist.Backend.backend_list:
    dist.Backend.register_backend("shardwire", bridge.create, extended_api=True, devices=["cpu"])
    rendezvous_handlers()["env"] = bridge.env_rendezvous

__all__ = [
    "BridgeWork",
    "JobStore",
    "PeerStorage",
    "ShardwireProcessGroup",
    "StoreUnavailable",
    "TorchDiLoCo",
    "UnsupportedTensor",
    "bridge",
    "heal",
    "leave_notice",
    "recovering",
    "reform",
    "step_finished",
]
