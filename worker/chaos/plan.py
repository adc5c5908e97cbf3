"""A fault plan: what to break in a job, where and when, and what the job should do.

A plan is a local file (TOML, or YAML) given by the person who starts the job; nothing
that arrives over the network can enable injection. It is a seeded list of faults::

    seed = 7
    expect = "fail"          # or "survive"; checked by ``shardwire chaos``
    expect_within_s = 10     # every rank out within this long of the first fault

    [[faults]]
    kind = "kill"            # kill, stop, term, raise, block
    rank = 1                 # or "random": drawn from the seed
    step = 20                # when that rank reports step 20 ... (or after_s = 3.5)

    [[faults]]
    kind = "stop"
    rank = "random"
    after_s = 4.0            # ... or this long after the rank joined (or collective = 120:
    for_s = 2.0              # as it starts its 120th collective); stop, block last this long

    [[faults]]
    kind = "kill"
    node = 1                 # a whole node: its agent and every rank it started
    after_s = 6.0

The same plan and seed give the same schedule (:meth:`Plan.schedule`): the same faults
on the same ranks at the same steps.
"""

from __future__ import annotations

import random
import tomllib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from shardwire.protocol.errors import InvalidArgument

Kind = Literal[
    "kill",
    "stop",
    "term",
    "raise",
    "block",
    "delay",
    "throttle",
    "blackhole",
    "reset",
    "flip",
    "nofile",
    "shm_fill",
    "slow_disk",
]
KINDS: dict[str, str] = {
    "kill": "SIGKILL to the rank's process",
    "stop": "SIGSTOP to the rank's process, SIGCONT after for_s seconds",
    "term": "SIGTERM to the rank's process (it leaves as a stopped job would)",
    "raise": "InjectedFault raised in the rank's script where it reports the step",
    "block": "the rank's event loop blocked for for_s seconds",
    "delay": "every message the rank sends (to peer, or to all) waits delay_s plus up to "
    "jitter_s more, for for_s seconds",
    "throttle": "what the rank sends (to peer, or to all) is held to rate_mbps megabits "
    "per second, for for_s seconds",
    "blackhole": "what the rank sends (to peer, or to all) is held, not delivered, for "
    "for_s seconds, then goes",
    "reset": "the rank's connection to peer (or to all) is reset (TCP RST)",
    "flip": "one byte of the next message the rank sends (to peer, or to anyone) is flipped",
    "nofile": "the rank's open-file limit lowered to limit (what it opens next may fail)",
    "shm_fill": "/dev/shm filled to percent % by a file of the run (removed with the run's "
    "shared memory)",
    "slow_disk": "each checkpoint file the rank writes is held delay_s seconds first, for "
    "for_s seconds",
}
NETWORK = frozenset({"delay", "throttle", "blackhole", "reset", "flip"})
PROCESS = frozenset({"kill", "term", "stop", "raise", "block"})
MAX_OCCURRENCES = 2_000  # of one every_s fault (at every_s = 30: over 16 hours)
TIMED = frozenset({"stop", "block", "delay", "throttle", "blackhole", "slow_disk"})
MAX_FAULTS = 100
COORDINATOR = -1  # the rank of a fault scheduled on the coordinator
NODE = -2  # the rank of a fault scheduled on a node (its agent injects it)


def _bad(message: str) -> PydanticCustomError:
    """A plan's field that breaks a rule: pydantic names the field, with ``message``."""
    return PydanticCustomError("plan", message)


class PlanError(InvalidArgument):
    """A plan file that cannot be read or does not follow the schema (names the field)."""


class Fault(BaseModel):
    """One fault: its kind, the rank it hits, and when (a step or a time)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    rank: int | Literal["random", "coordinator"] | None = Field(
        None,
        description="the rank it hits, random, or the coordinator (kill, stop, term at a time)",
    )
    node: int | None = Field(
        None,
        ge=0,
        description="instead of rank: the node (by node rank) whose agent and ranks it hits "
        "(kill, stop, term at a time)",
    )
    step: int | None = Field(None, ge=0, description="when the rank reports this step")
    collective: int | None = Field(
        None,
        ge=1,
        description="as the rank starts this collective call of its world group (1 is the "
        "first; kill, stop, term, raise and block)",
    )
    after_s: float | None = Field(None, ge=0, description="seconds after the rank joined")
    every_s: float | None = Field(
        None,
        gt=0,
        description="at random: the mean seconds between occurrences (drawn from the seed, "
        "from the job's start; each occurrence draws its own rank when rank is random)",
    )
    for_s: float = Field(
        0.0, ge=0, le=3600, description="how long stop, block, delay, throttle, blackhole last"
    )
    peer: int | None = Field(None, ge=0, description="network faults: the link to this rank")
    delay_s: float = Field(
        0.0, ge=0, le=60, description="delay: added to every message; slow_disk: to every file"
    )
    jitter_s: float = Field(0.0, ge=0, le=60, description="delay: up to this much more")
    rate_mbps: float = Field(0.0, ge=0, description="throttle: the link's rate")
    limit: int = Field(0, ge=0, description="nofile: the open-file limit")
    percent: float = Field(0.0, ge=0, le=100, description="shm_fill: how full /dev/shm gets")

    @model_validator(mode="after")
    def _when(self) -> Fault:
        whens = (self.step, self.after_s, self.every_s, self.collective)
        if sum(w is not None for w in whens) != 1:
            raise _bad("give exactly one of step, after_s, every_s and collective")
        if (self.rank is None) == (self.node is None):
            raise _bad("give exactly one of rank and node")
        if self.collective is not None and self.kind not in PROCESS:
            raise _bad(f"collective is for kill, term, stop, raise and block, not {self.kind}")
        if self.node is not None and self.kind not in ("kill", "stop", "term"):
            raise _bad(f"a node takes kill, stop and term, not {self.kind}")
        if self.node is not None and self.after_s is None:
            raise _bad("a fault on a node is timed: give after_s")
        if self.every_s is not None and self.kind not in PROCESS:
            raise _bad(f"every_s is for kill, term, stop, raise and block, not {self.kind}")
        if self.kind in TIMED and self.for_s <= 0:
            raise _bad(f"a {self.kind} fault needs for_s > 0")
        if isinstance(self.rank, int) and self.rank < 0:
            raise _bad("rank must be 0 or more")
        if self.rank == "coordinator" and self.kind not in ("kill", "stop", "term"):
            raise _bad(f"the coordinator takes kill, stop and term, not {self.kind}")
        if self.rank == "coordinator" and self.after_s is None:  # every_s, step: refused
            raise _bad("a fault on the coordinator is timed: give after_s")
        if self.kind == "delay" and self.delay_s + self.jitter_s <= 0:
            raise _bad("a delay fault needs delay_s or jitter_s > 0")
        if self.kind == "slow_disk" and self.delay_s <= 0:
            raise _bad("a slow_disk fault needs delay_s > 0")
        if self.kind == "throttle" and self.rate_mbps <= 0:
            raise _bad("a throttle fault needs rate_mbps > 0")
        if self.kind == "nofile" and self.limit < 3:
            raise _bad("a nofile fault needs limit >= 3 (stdin, stdout, stderr)")
        if self.kind == "shm_fill" and self.percent <= 0:
            raise _bad("a shm_fill fault needs percent > 0")
        if self.peer is not None and self.kind not in NETWORK:
            raise _bad(f"peer is for network faults, not {self.kind}")
        if self.peer is not None and self.peer == self.rank:
            raise _bad("peer must be another rank than rank")
        return self

    @property
    def on_rank(self) -> bool:
        """Whether a rank injects it into itself (not the coordinator, not a node)."""
        return self.node is None and self.rank != "coordinator"


class Plan(BaseModel):
    """A seeded list of faults and what the job should do under them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    faults: list[Fault] = Field(min_length=1, max_length=MAX_FAULTS)
    expect: Literal["survive", "fail"] | None = None
    expect_within_s: float | None = Field(None, gt=0)
    expect_names: int | None = Field(
        None,
        ge=0,
        description="the error of the rank that first noticed the first fault names this rank",
    )
    compare: Literal["clean"] | None = Field(
        None,
        description="clean: run the same command without faults first; the faulty run's "
        "final loss and every step's state must equal the clean run's",
    )
    check_every: int = Field(
        1,
        ge=0,
        description="the ranks note the digest of their state and their data position every "
        "this many steps (where the script hands them to the run log); 0: never",
    )

    def on_coordinator(self) -> list[Scheduled]:
        """The faults that hit the coordinator."""
        return [
            Scheduled(index=i, fault=f, rank=COORDINATOR)
            for i, f in enumerate(self.faults)
            if f.rank == "coordinator"
        ]

    def on_node(self, node: int) -> list[Scheduled]:
        """The faults that hit the node of node rank ``node``."""
        return [
            Scheduled(index=i, fault=f, rank=NODE)
            for i, f in enumerate(self.faults)
            if f.node == node
        ]

    def occurrences(self, index: int, world_size: int) -> list[Scheduled]:
        """The occurrences of the ``every_s`` fault ``index``: times from the job's start
        and ranks drawn from the seed (the same for the same seed, fault and world)."""
        fault = self.faults[index]
        assert fault.every_s is not None and fault.on_rank  # refused at load
        rng = random.Random(f"{self.seed}:{index}")
        at, out = 0.0, []
        for k in range(MAX_OCCURRENCES):
            at += rng.expovariate(1.0 / fault.every_s)
            rank = _drawn(fault, rng, world_size)
            out.append(Scheduled(index=index, fault=fault, rank=rank, occurrence=k, at_s=at))
        return out

    def schedule(self, world_size: int) -> list[Scheduled]:
        """Every fault with its rank drawn (the same for the same seed and world)."""
        rng = random.Random(self.seed)
        out = []
        for index, fault in enumerate(self.faults):
            if not fault.on_rank:  # the launcher or a node agent injects it
                rank = COORDINATOR if fault.node is None else NODE
                out.append(Scheduled(index=index, fault=fault, rank=rank))
                continue
            if fault.every_s is not None:  # its own draws: the others' stay as they were
                if isinstance(fault.rank, int) and fault.rank >= world_size:
                    raise PlanError(
                        f"faults.{index}.rank: {fault.rank} is not a rank of {world_size}"
                    )
                out.extend(self.occurrences(index, world_size))
                continue
            rank = _drawn(fault, rng, world_size)
            if rank >= world_size:
                raise PlanError(f"faults.{index}.rank: {rank} is not a rank of {world_size}")
            if fault.peer is not None and fault.peer >= world_size:
                raise PlanError(f"faults.{index}.peer: {fault.peer} is not a rank of {world_size}")
            out.append(Scheduled(index=index, fault=fault, rank=rank))
        return out


def _drawn(fault: Fault, rng: random.Random, world_size: int) -> int:
    """The rank a fault on a rank hits: its own, or one drawn from ``rng``."""
    if fault.rank == "random":
        return rng.randrange(world_size)
    assert isinstance(fault.rank, int)  # a fault on a rank (on_rank)
    return fault.rank


class Scheduled(BaseModel):
    """A fault of the plan on the rank it hits."""

    model_config = ConfigDict(frozen=True)

    index: int
    fault: Fault
    rank: int  # COORDINATOR for the coordinator, NODE for a node
    occurrence: int = 0  # of an every_s fault
    at_s: float | None = None  # of an every_s fault: seconds from the job's start


def load(path: str | Path) -> Plan:
    """Read and check the plan at ``path`` (``.toml``, else YAML)."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read the plan {source}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text) if source.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise PlanError(f"{source} is not valid {_format(source)}: {exc}") from None
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the plan"
        raise PlanError(f"{source}: {where}: {first['msg']}") from None


def _format(source: Path) -> str:
    return "TOML" if source.suffix == ".toml" else "YAML"
