"""The collective groups open on one transport, by group id.

A group id is unique on a transport while its group is open: the groups' frames share
the transport's tag space, keyed by it. The transport looks a group up to relay its
failure notices, and tells every open group when it is poisoned (each wakes its node
arena then).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol


class OpenGroup(Protocol):
    """What the registry needs of a group."""

    @property
    def group_id(self) -> int: ...

    @property
    def ranks(self) -> Sequence[int]:
        """The group's members, as global ranks."""

    def transport_aborted(self, error: BaseException) -> None:
        """The transport under the group was poisoned with ``error``."""


class OpenGroups:
    """The open groups of one transport (see the module docstring)."""

    def __init__(self) -> None:
        self._open: dict[int, OpenGroup] = {}

    def get(self, group_id: int) -> OpenGroup | None:
        return self._open.get(group_id)

    def add(self, group: OpenGroup) -> None:
        """Register ``group`` under its id (the caller checked the id is free)."""
        self._open[group.group_id] = group

    def remove(self, group: OpenGroup) -> None:
        """Forget ``group``, if it is the one registered under its id."""
        if self._open.get(group.group_id) is group:
            del self._open[group.group_id]

    def aborted(self, error: BaseException) -> None:
        """Tell every open group that the transport was poisoned with ``error``."""
        for group in list(self._open.values()):
            group.transport_aborted(error)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._open

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._open))

    def __len__(self) -> int:
        return len(self._open)
