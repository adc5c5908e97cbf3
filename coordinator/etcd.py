"""A small client of etcd's v3 API through its JSON gateway (``/v3/...`` over HTTP).

Why the gateway and the standard library rather than a client package: the gateway is
part of every etcd server since 3.4, so nothing beyond etcd itself is needed (the
maintained gRPC clients pull in grpcio, a large native dependency, for the five calls
used here: lease grant, keep-alive and revoke, range, and transactions). The calls are
blocking and short; the coordinator makes its fenced journal writes on its loop, before
the decision they record goes out (as it fsyncs a state directory), and every other call
in a worker thread (``asyncio.to_thread``).

Every call is bounded: each endpoint is tried in turn with ``timeout`` seconds per
attempt, in rounds with backoff, for at most ``patience`` seconds; then
:class:`EtcdUnavailable` names every endpoint and what its last attempt said. A call
never hangs on an etcd that does not answer.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwire.protocol.errors import InvalidArgument, ShardwireError

_FIRST_BACKOFF = 0.05  # seconds between rounds of attempts (doubling, at most _MAX_BACKOFF)
_MAX_BACKOFF = 0.5


class EtcdUnavailable(ShardwireError, ConnectionError):
    """No etcd endpoint answered a call within its patience (the message names each)."""


class EtcdRefused(ShardwireError):
    """etcd answered a call with an error (a request it would not serve)."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key's value and revisions."""

    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def endpoint(text: str) -> tuple[str, int]:
    """``http://host:port`` or ``host:port`` as (host, port); other schemes are refused."""
    url = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
    if url.scheme != "http" or not url.hostname or url.port is None:
        raise InvalidArgument(
            f"etcd endpoint {text!r}: expected http://HOST:PORT (etcd's TLS is not supported)"
        )
    return url.hostname, url.port


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdClient:
    """Calls to one etcd cluster (any of ``endpoints`` serves every call)."""

    def __init__(
        self, endpoints: Sequence[str], *, timeout: float = 2.0, patience: float = 10.0
    ) -> None:
        if not endpoints:
            raise InvalidArgument("etcd: no endpoint given")
        self.endpoints = [endpoint(e) for e in endpoints]
        self.timeout = timeout
        self.patience = patience
        self._preferred = 0  # the endpoint that answered last is tried first

    @property
    def where(self) -> str:
        return ",".join(f"http://{h}:{p}" for h, p in self.endpoints)

    def call(self, path: str, body: dict[str, Any], *, patience: float | None = None) -> Any:
        """POST ``body`` to ``path`` on the first endpoint that answers (bounded)."""
        until = time.monotonic() + (self.patience if patience is None else patience)
        data = json.dumps(body).encode()
        last: dict[int, str] = {}
        backoff = _FIRST_BACKOFF
        while True:
            for k in range(len(self.endpoints)):
                i = (self._preferred + k) % len(self.endpoints)
                left = until - time.monotonic()
                if left <= 0:
                    break
                try:
                    status, reply = self._post(i, path, data, min(self.timeout, left))
                except (OSError, http.client.HTTPException) as exc:
                    last[i] = str(exc) or type(exc).__name__
                    continue
                self._preferred = i
                return _decoded(status, reply, path)
            if time.monotonic() + backoff >= until:
                said = "; ".join(
                    f"http://{h}:{p}: {last.get(i, 'not tried')}"
                    for i, (h, p) in enumerate(self.endpoints)
                )
                raise EtcdUnavailable(f"no etcd endpoint answered {path} ({said})")
            time.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def _post(self, i: int, path: str, data: bytes, timeout: float) -> tuple[int, bytes]:
        host, port = self.endpoints[i]
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    # ---- the calls used ------------------------------------------------------------------

    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds: its id, and the cluster's revision then."""
        reply = self.call("/v3/lease/grant", {"TTL": ttl})
        return int(reply["ID"]), int(reply["header"]["revision"])

    def keepalive(self, lease: int, *, patience: float | None = None) -> int:
        """Renew ``lease``: the seconds it now has (0: it had expired, or was revoked)."""
        reply = self.call("/v3/lease/keepalive", {"ID": str(lease)}, patience=patience)
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now; the keys it holds are deleted."""
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("/v3/kv/range", {"key": b64(key)}).get("kvs", [])
        return _entry(kvs[0]) if kvs else None

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
        *,
        patience: float | None = None,
    ) -> tuple[bool, dict[str, Any]]:
        """One transaction: ``success`` if every comparison holds, else ``failure``."""
        body = {"compare": compare, "success": success, "failure": failure or []}
        reply = self.call("/v3/kv/txn", body, patience=patience)
        return bool(reply.get("succeeded", False)), reply


def range_entry(reply: dict[str, Any], index: int = 0) -> KeyValue | None:
    """The key a transaction's ``index``-th (range) response read, if any."""
    responses = reply.get("responses", [])
    if index >= len(responses):
        return None
    kvs = responses[index].get("response_range", {}).get("kvs", [])
    return _entry(kvs[0]) if kvs else None


def _entry(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(
        value=base64.b64decode(kv.get("value", "")),
        create_revision=int(kv.get("create_revision", 0)),
        mod_revision=int(kv.get("mod_revision", 0)),
        lease=int(kv.get("lease", 0)),
    )


def _decoded(status: int, reply: bytes, path: str) -> Any:
    try:
        doc = json.loads(reply.decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise EtcdRefused(f"etcd answered {path} with HTTP {status} and no JSON") from None
    if status != 200 or "error" in doc:
        error = doc.get("error")  # a string, or (from a stream) an object with a message
        said = error.get("message") if isinstance(error, dict) else error
        raise EtcdRefused(f"etcd refused {path}: {doc.get('message') or said or status}")
    return doc
