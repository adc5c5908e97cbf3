"""Forming a generation: node assignments, placements and the agents' agreement (pure)."""

from __future__ import annotations

import ipaddress
from collections.abc import Collection

from shardwire.coordinator.generations import Generations
from shardwire.coordinator.membership import Shape
from shardwire.coordinator.state import Action, Agent, RendezvousConfig, Send, Worker
from shardwire.protocol.messages import Heartbeat, NodeAssignment, NodeJoin
from shardwire.protocol.placement import Member, Placement


def assignments(
    agents: Collection[Agent], shape: Shape, gens: Generations, now: float, *, grace: float = 0.0
) -> tuple[int, list[Action]]:
    """Node ranks in the scheduler's node order (then node id order, for agents that do not
    say theirs): (the generation's world size, one message per agent). ``grace``: how long
    the agents wait for this coordinator if it goes away."""
    ordered = sorted(agents, key=_node_order)
    world = len(ordered) * shape.local_world_size
    history = gens.info(now, upto=gens.current)
    actions: list[Action] = []
    for i, agent in enumerate(ordered):
        agent.node_rank = i
        msg = NodeAssignment(
            node_rank=i,
            nnodes=len(ordered),
            world_size=world,
            generation=gens.current,
            max_restarts=gens.max_restarts,
            restarts=gens.restarts,
            history=history,
            grace=grace,
        )
        actions.append(Send(agent.conn, msg))
    return world, actions


def _node_order(agent: Agent) -> tuple[bool, int, str]:
    index = agent.join.node_index
    return index is None, index or 0, agent.join.node_id


def member(w: Worker, local_world_size: int) -> Member:
    """What a ranked worker's peers learn of it."""
    return Member(
        rank=w.rank,
        node_id=w.join.node_id,
        node_rank=w.rank // local_world_size,
        local_rank=w.join.local_rank,
        host=w.host,
        port=w.join.listen_port,
    )


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (a name, or no address, is not known to be)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def placements(
    workers: Collection[Worker], shape: Shape, generation: int, *, grace: float = 0.0
) -> tuple[list[Member], list[Action]]:
    """The members by rank (served on request, a few at a time) and every worker's placement
    (their ranks are assigned): a few numbers each, whatever the job's size. ``grace``: how
    long the workers wait for this coordinator if it goes away."""
    lws = shape.local_world_size
    members = sorted((member(w, lws) for w in workers), key=lambda m: m.rank)
    one_machine = all(_loopback(m.host) for m in members)
    sends: list[Action] = [
        Send(
            w.conn,
            Placement(
                rank=w.rank,
                world_size=shape.world_size,
                generation=generation,
                local_rank=w.join.local_rank,
                local_world_size=lws,
                node_rank=w.rank // lws,
                grace=grace,
                one_machine=one_machine,
            ),
        )
        for w in workers
    ]
    return members, sends


def agreement_problem(
    config: RendezvousConfig, shape: Shape, gens: Generations, msg: NodeJoin, *, first: bool
) -> tuple[str, str] | None:
    """The first agent sets the node range and restart budget the coordinator was not
    given; later agents must agree. Returns a refusal (code, message) or None."""
    if first:
        low = config.min_nodes or msg.min_nodes
        shape.min_nodes = low if low < shape.nnodes else 0
        if config.max_restarts is None:
            gens.max_restarts = msg.max_restarts or 0
        return None
    said = msg.min_nodes if msg.min_nodes < shape.nnodes else 0
    if config.min_nodes is None and said != shape.min_nodes:
        return "world_size", (
            f"node range disagreement: this agent says at least {msg.min_nodes or 'all'} "
            f"nodes, the job has {shape.min_nodes or 'all'}"
        )
    budget = msg.max_restarts
    if config.max_restarts is None and budget is not None and budget != gens.max_restarts:
        return "bad_request", (
            f"restart budget disagreement: this agent says --max-restarts {budget}, "
            f"the job has {gens.max_restarts}"
        )
    return None


def stall_text(who: str, before: Heartbeat, now: Heartbeat) -> str | None:
    """A line when a busy event loop starts or ends being busy (never a failure)."""
    if now.busy_s and not before.busy_s:
        return (
            f"{who} busy for {now.busy_s:.0f} s at {now.busy_at or 'an unknown place'} "
            "(its event loop is not running; heartbeats continue, the job goes on)"
        )
    if before.busy_s and not now.busy_s:
        busy = f"{before.busy_s:.0f} s or more"
        return f"{who} responsive again (its event loop was busy for {busy})"
    return None
