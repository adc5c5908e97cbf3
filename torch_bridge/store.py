"""The store torch gets when a shardwire job's coordinator did the rendezvous."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardwire.protocol import ShardwireError


class StoreUnavailable(ShardwireError, RuntimeError):
    """A key-value store operation inside a shardwire job, which serves none."""


class JobStore(dist.Store):
    """torch's ``init_process_group`` wants a store from every rendezvous; the shardwire
    backend needs none (the coordinator placed the ranks and answers address lookups),
    so this one refuses every operation with a message that says what to do instead."""

    def _refuse(self, op: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"store.{op}: inside a shardwire job torch's key-value store is not served; "
            "the shardwire backend does not need one. For a backend that does (gloo), "
            "start the script with torchrun instead of shardwire's launcher"
        )

    def set(self, key: str, value: Any) -> None:
        raise self._refuse("set")

    def get(self, key: str) -> bytes:
        raise self._refuse("get")

    def add(self, key: str, value: int) -> int:
        raise self._refuse("add")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        raise self._refuse("compare_set")

    def delete_key(self, key: str) -> bool:
        raise self._refuse("delete_key")

    def num_keys(self) -> int:
        raise self._refuse("num_keys")

    def check(self, keys: list[str]) -> bool:
        raise self._refuse("check")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        raise self._refuse("wait")
