"""The shardwire error hierarchy.

Every error a user can see derives from :class:`ShardwireError`. Messages carry the
expected and the actual value plus whatever identifies the operation (rank, peer, op,
sequence number), so a log line alone says what went wrong where.
"""

from __future__ import annotations


class ShardwireError(Exception):
    """Root of every error raised by shardwire."""


class InvalidArgument(ShardwireError, ValueError):
    """A call was given a value it does not take (a size, a rank, a layout, an option);
    nothing was started. Also a ``ValueError``."""


class InvalidType(ShardwireError, TypeError):
    """A call was given an object of a type it does not take. Also a ``TypeError``."""


class InvalidState(ShardwireError, RuntimeError):
    """A call was made when its object cannot take it (closed, already awaited, in the
    middle of another step). Also a ``RuntimeError``."""


class ProtocolError(ShardwireError):
    """A peer sent bytes that violate the wire format; the connection is closed."""


class FrameTooLarge(ProtocolError):
    """A frame announced more meta or payload bytes than the configured limit."""


class VersionMismatch(ProtocolError):
    """The two ends of a connection speak different protocol versions."""

    def __init__(self, *, ours: int, theirs: int) -> None:
        super().__init__(
            f"protocol version mismatch: this side speaks version {ours}, "
            f"the other side speaks version {theirs}; install the same shardwire "
            "release on every host"
        )
        self.ours = ours
        self.theirs = theirs


class AuthFailed(ShardwireError):
    """The handshake proof did not match: the two sides hold different tokens."""


class RendezvousError(ShardwireError):
    """The coordinator refused a join or the rendezvous could not complete.

    ``code`` is a stable machine-readable reason (``duplicate_rank``, ``world_size``,
    ``already_started``, ``run_id``, ``join_timeout``, ``version``, ``auth``, ``bad_request``).
    """

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


class DescriptorLimit(ShardwireError):
    """This process may not open as many descriptors as the job needs (its hard
    RLIMIT_NOFILE is too low); the message names the need and how to raise the limit."""


class JobAborted(ShardwireError):
    """The coordinator aborted the job (a worker failed or the operator stopped it)."""


class PeerFailed(JobAborted):
    """A peer failed; every pending and later operation on this process group raises it.

    Attributes:
        rank: the rank that failed.
        reason: what the coordinator or the transport observed.
        remote_traceback: the failed rank's traceback, when it raised an exception.
    """

    def __init__(self, *, rank: int, reason: str, remote_traceback: str = "") -> None:
        text = f"rank {rank} failed: {reason}"
        if remote_traceback:
            text += f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.reason = reason
        self.remote_traceback = remote_traceback


class RecoveryError(JobAborted):
    """A rank cannot re-form after a failure (``Session.reform``): the job is not run
    with live recovery, it is over (no restart left), or this rank is the one that
    failed. The message says which."""


class LeftJob(ShardwireError):
    """This rank left the job on SIGTERM (a preemption notice) under live recovery,
    after its state at ``step`` reached its copy holder: its replacement resumes from
    that step and no completed step is lost.

    Attributes:
        rank: the rank that left.
        step: the step its state was handed over at (a torch script's: the id of the
            checkpoint ``PeerStorage`` saved).
        holder: the rank that holds its copy.
    """

    def __init__(self, *, rank: int, step: int | str, holder: int) -> None:
        at = f"step {step}" if isinstance(step, int) else f"checkpoint {step!r}"
        super().__init__(
            f"rank {rank} left on SIGTERM after handing its state at {at} to rank "
            f"{holder}; its replacement resumes from there"
        )
        self.rank, self.step, self.holder = rank, step, holder


class CheckpointUnavailable(InvalidState):
    """A checkpoint cannot be restored from the ranks' memory: nothing was saved, no
    live rank holds it, or no live rank holds an intact part of some rank that saved it.
    The message names the checkpoint, the missing parts and the newest whole one."""


class TransportClosed(ShardwireError):
    """The transport was closed locally; no further operations are possible."""


class MessageMismatch(ShardwireError):
    """A received frame does not match what the receive expected (dtype, shape, op)."""


class CollectiveError(ShardwireError):
    """A collective failed; the group is poisoned and refuses further calls with this.

    Attributes:
        origin: on a rank another member relayed the error to, the rank it began on
            (-1 where it began here).
    """

    origin: int = -1


class CollectiveMismatch(CollectiveError, MessageMismatch):
    """Ranks called different collectives, or the same one with different arguments."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete in time; the message names the ranks not heard from."""


class CollectiveCancelled(CollectiveError):
    """A collective was cancelled mid-flight on some rank, leaving the group inconsistent."""


class IntegrityError(CollectiveError):
    """A data frame's checksum did not match: bytes were corrupted between two ranks.

    Attributes (on the rank that detected it; ranks it is relayed to see the message):
        peer: the rank the corrupted frame came from.
        op: the operation (signature) of the frame.
        seq: the collective sequence number of the frame.
    """

    def __init__(self, message: str, *, peer: int = -1, op: str = "", seq: int = -1) -> None:
        super().__init__(message)
        self.peer, self.op, self.seq = peer, op, seq


# Errors that one rank may hand to the others of its group (by class name, never code).
_RELAYED: dict[str, type[CollectiveError]] = {
    cls.__name__: cls
    for cls in (
        CollectiveMismatch,
        CollectiveTimeout,
        CollectiveCancelled,
        IntegrityError,
        CollectiveError,
    )
}


def relayed_error(kind: str, message: str, origin: int = -1) -> CollectiveError:
    """Rebuild an error rank ``origin`` reported for the group (unknown kinds: the base)."""
    error = _RELAYED.get(kind, CollectiveError)(message)
    error.origin = origin
    return error


def origin_of(error: BaseException, me: int) -> int:
    """The rank ``error`` began on, as this rank (``me``) relays it to the others."""
    if isinstance(error, PeerFailed):
        return error.rank
    if isinstance(error, CollectiveError) and error.origin >= 0:
        return error.origin
    return me


def blamed_rank(exc: BaseException) -> int:
    """The rank a failure began on when another rank's news brought it here, else -1 (a
    relayed timeout is not blamed on the rank that timed out: the coordinator asks every
    rank what it was doing)."""
    if isinstance(exc, PeerFailed):
        return exc.rank
    if isinstance(exc, CollectiveError) and not isinstance(exc, CollectiveTimeout):
        return exc.origin
    return -1


def failure_reason(exc: BaseException) -> str:
    """One line saying how a rank failed, for the coordinator."""
    if isinstance(exc, PeerFailed):
        return exc.reason
    return f"raised {type(exc).__name__}: {exc}".splitlines()[0]
