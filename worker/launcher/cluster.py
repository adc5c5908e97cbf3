"""What a scheduler tells a node agent or a rank, read from its environment (pure).

Three schedulers are understood; explicit flags and ``SHARDWIRE_*`` settings always win:

* **Slurm**, inside a job step (``srun``): the step's node list (expanded with
  python-hostlist, Slurm's own syntax ``n[01-04],gpu7``), this node's name, the job and
  step ids, and for one task per rank ``SLURM_PROCID``, ``SLURM_LOCALID`` and the tasks
  per node. The coordinator runs on the step's first node, at port
  ``20000 + job id mod 10000`` (outside Linux's ephemeral range, so two jobs sharing a
  node rarely meet) unless ``--coordinator-port`` says otherwise; the run id is
  ``slurm-<job>.<step>``.
* **Kubernetes** Indexed Jobs: ``JOB_COMPLETION_INDEX`` is the node rank (the rendered
  manifests, ``shardwire kubernetes``, give everything else).
* **Kubeflow Trainer** (torch runtimes): ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``; node rank 0 starts the
  coordinator at the master address.

Where the scheduler names the coordinator's place (Slurm, Kubeflow) and the user gave no
``--coordinator``, node rank 0 (one task per node) or rank 0 (one task per rank) starts
it, listening on every address at that port, and the others connect to it by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from shardwire.protocol import ShardwireError

SLURM_PORT_BASE = 20000  # + job id mod SLURM_PORT_SPAN
SLURM_PORT_SPAN = 10000


class SchedulerError(ShardwireError):
    """The scheduler's environment cannot describe a shardwire job as asked."""


@dataclass(frozen=True)
class NodePlace:
    """A node agent's place in the job, as its scheduler gives it (None: not given)."""

    scheduler: str  # "slurm", "kubernetes", "kubeflow"
    node_rank: int
    nnodes: int | None = None
    nproc_per_node: int | None = None
    coordinator: tuple[str, int] | None = None  # where the job's coordinator listens
    run_id: str | None = None
    node_id: str | None = None
    job_id: str | None = None  # the scheduler's job (a derived token is per job)


@dataclass(frozen=True)
class RankPlace:
    """A rank started directly by the scheduler (one task per rank)."""

    scheduler: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    coordinator: tuple[str, int]
    run_id: str
    node_id: str
    job_id: str


def node_place(environ: Mapping[str, str]) -> NodePlace | None:
    """This node agent's place from the scheduler's variables, or None outside one."""
    if "SLURM_STEP_ID" in environ and "SLURM_JOB_ID" in environ:
        return _slurm_node(environ)
    if "PET_NODE_RANK" in environ or "PET_MASTER_ADDR" in environ:
        return _kubeflow(environ)
    if "JOB_COMPLETION_INDEX" in environ:
        return NodePlace("kubernetes", node_rank=_int(environ, "JOB_COMPLETION_INDEX"))
    return None


def rank_place(environ: Mapping[str, str]) -> RankPlace:
    """This rank's place when the scheduler started one task per rank (Slurm's
    ``srun -n N``); raises SchedulerError elsewhere."""
    if "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        raise SchedulerError(
            "shardwire run starts one rank per scheduler task and found no Slurm job step "
            "(SLURM_STEP_ID, SLURM_PROCID): run it under srun, or use "
            "`shardwire launch` on one host and `shardwire worker` per node"
        )
    nodes, index = _slurm_nodes(environ)
    per_node = _tasks_per_node(environ, len(nodes))
    local = per_node[index]
    if len(set(per_node)) != 1:
        raise SchedulerError(
            f"shardwire needs the same number of tasks on every node; this step has "
            f"{_show(per_node)} (ask for --ntasks-per-node)"
        )
    rank, local_rank = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_LOCALID")
    # Every task of a node checks the node's whole list (SLURM_GTIDS), so all of them
    # refuse a layout that is not node by node, not only those it misplaces.
    block = list(range(index * local, index * local + local))
    here = [int(t) for t in environ.get("SLURM_GTIDS", "").split(",") if t.strip().isdigit()]
    if rank != block[local_rank] or (here and here != block):
        raise SchedulerError(
            f"the tasks of node {index} ({nodes[index]}) are {_show(here or [rank])}, not "
            f"{_show(block)}: shardwire numbers ranks node by node; run srun with "
            "--distribution=block"
        )
    return RankPlace(
        "slurm",
        rank=rank,
        world_size=local * len(nodes),
        local_rank=local_rank,
        local_world_size=local,
        node_rank=index,
        coordinator=(nodes[0], _slurm_port(environ)),
        run_id=_slurm_run_id(environ),
        node_id=nodes[index],
        job_id=environ["SLURM_JOB_ID"],
    )


def _slurm_node(environ: Mapping[str, str]) -> NodePlace:
    nodes, index = _slurm_nodes(environ)
    per_node = _tasks_per_node(environ, len(nodes))
    if any(n != 1 for n in per_node):
        raise SchedulerError(
            f"shardwire worker is one task per node and starts the node's ranks itself; "
            f"this step has {_show(per_node)} tasks per node: run it with "
            "srun --ntasks-per-node=1, or start one task per rank with `shardwire run`"
        )
    return NodePlace(
        "slurm",
        node_rank=index,
        nnodes=len(nodes),
        coordinator=(nodes[0], _slurm_port(environ)),
        run_id=_slurm_run_id(environ),
        node_id=nodes[index],
        job_id=environ["SLURM_JOB_ID"],
    )


def _slurm_nodes(environ: Mapping[str, str]) -> tuple[list[str], int]:
    """The step's nodes in Slurm's order, and this node's index among them."""
    listed = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    try:
        nodes = hostlist.expand_hostlist(listed)
    except hostlist.BadHostlist as exc:
        raise SchedulerError(f"cannot read Slurm's node list {listed!r}: {exc}") from None
    me = environ.get("SLURMD_NODENAME", "")
    if not nodes or me not in nodes:
        raise SchedulerError(
            f"this node ({me or 'SLURMD_NODENAME unset'}) is not in the step's node list {listed!r}"
        )
    return nodes, nodes.index(me)


def _tasks_per_node(environ: Mapping[str, str], nodes: int) -> list[int]:
    text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    try:
        counts = hostlist.parse_slurm_tasks_per_node(text)
    except (hostlist.BadHostlist, ValueError):
        raise SchedulerError(f"cannot read Slurm's tasks per node {text!r}") from None
    if len(counts) != nodes:
        raise SchedulerError(f"Slurm's tasks per node {text!r} do not match {nodes} nodes")
    return counts


def _slurm_port(environ: Mapping[str, str]) -> int:
    return SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID") % SLURM_PORT_SPAN


def _slurm_run_id(environ: Mapping[str, str]) -> str:
    return f"slurm-{environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}"


def _kubeflow(environ: Mapping[str, str]) -> NodePlace:
    nnodes = environ.get("PET_NNODES", "")
    nproc = environ.get("PET_NPROC_PER_NODE", "")
    address = None
    if "PET_MASTER_ADDR" in environ:
        address = (environ["PET_MASTER_ADDR"], _int(environ, "PET_MASTER_PORT", 29400))
    return NodePlace(
        "kubeflow",
        node_rank=_int(environ, "PET_NODE_RANK", 0),
        # "N" or torchrun's "MIN:MAX" (the latter is left to --nnodes)
        nnodes=int(nnodes) if nnodes.isdigit() else None,
        nproc_per_node=int(nproc) if nproc.isdigit() else None,  # "auto", "cpu": ours
        coordinator=address,
    )


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None and default is not None:
        return default
    if text is None or not text.strip().isdigit():
        raise SchedulerError(f"{name}={text!r} is not a non-negative integer")
    return int(text)


def _show(counts: list[int]) -> str:
    return ", ".join(str(c) for c in counts)
