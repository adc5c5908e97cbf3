"""Kubernetes manifests for a shardwire job (pure): a :class:`Deployment` in, the objects
``kubectl apply`` takes out, as plain dicts. ``shardwire kubernetes`` is the CLI.

Theory of operation
-------------------
Four objects, in the order they should exist:

* Service ``NAME-coordinator`` (ClusterIP): the control port and the HTTP status port
  (``/healthz``, ``/readyz``, ``/metrics``) of the coordinator, under a name every worker
  can dial. It publishes the coordinator before it is ready: ``/readyz`` answers 503
  while the job restarts a generation, and that is exactly when the node agents must
  reach it to rejoin; readiness is a signal for people and dashboards, not a gate.
* PersistentVolumeClaim ``NAME-coordinator-state``: the coordinator's state directory
  (its journal of the running generation), which outlives its pod.
* Job ``NAME-coordinator``: one pod at a time. The coordinator is a process of its own,
  not one of the workers, so that its probes sit on the one process that serves them (a
  probe in an Indexed Job's shared template would fire in every worker pod), its life
  is the job's (it exits 0 when the job finishes, 1 when it fails, and the Job completes
  or fails with it), and no worker has to know which of them hosts it. A coordinator
  pod lost otherwise (killed, OOM, a failed liveness probe, its node gone) is replaced,
  up to ``COORDINATOR_REPLACEMENTS`` times and only once the old pod is gone: the new
  one resumes the job from the journal on the claim, while the ranks train on and wait
  for it (``COORDINATOR_GRACE``). Its own exit statuses (1, the job failed; 2, it was
  misconfigured) fail the Job at once (``podFailurePolicy``).
* Service ``NAME`` (headless): stable DNS names ``NAME-INDEX.NAME`` for the worker pods.
* Job ``NAME`` (Indexed, ``completions = parallelism = nodes``): one node agent per pod;
  Kubernetes sets ``JOB_COMPLETION_INDEX``, which the agent takes as its node rank.

Two restart budgets, kept equal. shardwire restarts the job's processes itself, inside
the pods, up to ``max_restarts`` times; a lost pod (node gone, eviction, the agent
killed) is one of those failures to the coordinator too. Kubernetes may replace lost
pods as many times (``backoffLimit = max_restarts``; 0 by default, where a failed pod
fails the Job, as a failed process fails the job) and only once the old pod is gone
(``podReplacementPolicy: Failed``), so two agents never hold one node rank. There is no
``podFailurePolicy``: every cause of a lost pod costs shardwire a restart alike, so
Kubernetes counts them alike.

The pods run as the image's user (10001, the Dockerfile's ``USER``) with a read-only root
file system, no capabilities, no privilege escalation, no service-account token and no
service links (those would set ``NAME_COORDINATOR_PORT=tcp://...`` style variables,
which for a job named ``shardwire`` collide with ``SHARDWIRE_COORDINATOR_PORT``). Writable:
``/tmp`` and ``/dev/shm``; the token comes from a Secret, never from the manifest.

Requests equal limits (Guaranteed QoS, evicted last): a worker pod is one of N, and
losing it costs the whole job a restart. ``/dev/shm`` is a memory-backed emptyDir sized
by :func:`default_shm_bytes`; its pages count against the pod's memory limit, so the
limit is ``memory + shm``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardwire.worker.arena.region import Geometry
from shardwire.worker.runtime.worker_config import WorkerEnv
from shardwire.worker.transport.shm import Segment

MiB = 1 << 20
GiB = 1 << 30
USER_ID = 10001  # the Dockerfile's USER
DEFAULT_IMAGE = "shardwire:local"  # what docker-compose.yml builds
CONTROL_PORT = 29400
HTTP_PORT = 29480
# Arena groups a node's ranks may form at once: the world, and three sub-groups of it
# (tensor, pipeline and data parallel, say).
SHM_GROUPS = 4
SHM_PEERS = 2  # local peers a rank sends large point-to-point payloads to (pipeline neighbours)
SHM_FLOOR = 64 * MiB  # Docker's default /dev/shm, for what else the script puts there
SHM_ROUND = 16 * MiB
COORDINATOR_RESOURCES = {"cpu": "1", "memory": "512Mi"}  # requests = limits
# A replaced coordinator pod must be scheduled, pulled and started before the ranks give
# up on it: longer than the 60 s of a coordinator restarted in place on one machine.
COORDINATOR_GRACE = 180
COORDINATOR_REPLACEMENTS = 10  # as many as `launch --standalone` restarts its own
STATE = "/state"  # where the claim is mounted in the coordinator's pod
STATE_SIZE = "1Gi"  # a journal is kilobytes; 1Gi is the least many provisioners grant
Doc = dict[str, Any]


def default_shm_bytes(nproc_per_node: int) -> int:
    """``/dev/shm`` for ``k`` local ranks: SHM_GROUPS node arenas of k ranks (k slots of
    the default arena slot, plus a control page and a 512-byte row per rank, rounded to
    pages), plus per-pair segments (a header page and ``shm_slots * shm_slot_bytes``) for
    each rank's sends to SHM_PEERS local peers; rounded up to 16 MiB, and never below
    64 MiB."""
    k = nproc_per_node
    defaults = WorkerEnv.model_fields
    arena = Geometry(k, defaults["arena_slot_bytes"].default).size
    segment = Segment.size_for(defaults["shm_slots"].default, defaults["shm_slot_bytes"].default)
    need = SHM_GROUPS * arena + k * min(SHM_PEERS, k - 1) * segment
    return max(SHM_FLOOR, -(-need // SHM_ROUND) * SHM_ROUND)


def quantity(size: int) -> str:
    """Bytes as a Kubernetes quantity, in the largest binary unit that divides them."""
    for unit, factor in (("Gi", GiB), ("Mi", MiB), ("Ki", 1 << 10)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def number(value: float) -> str:
    """A flag value: 300, not 300.0."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """One shardwire job on Kubernetes.

    Attributes:
        name: the job's objects are NAME and NAME-coordinator; also the run id.
        command: what ``shardwire worker`` runs: the script (or ``-m``, module) and its
            arguments.
        nodes: worker pods, one node agent each.
        nproc_per_node: training processes per pod.
        memory_bytes: the pod's memory without ``/dev/shm`` (requests = limits).
        cpu: the pod's CPU, a Kubernetes quantity (requests = limits).
        shm_bytes: the size of ``/dev/shm``.
        token_secret: the Secret whose key ``token`` holds the job's token.
    """

    name: str
    command: tuple[str, ...]
    nodes: int = 1
    nproc_per_node: int = 1
    namespace: str | None = None
    image: str = DEFAULT_IMAGE
    max_restarts: int = 0
    recovery: str = "live"  # a failed rank alone is started again; or "relaunch"
    join_timeout: float = 300.0
    token_secret: str = ""  # "": NAME-token
    port: int = CONTROL_PORT
    http_port: int = HTTP_PORT
    cpu: str = "1"
    memory_bytes: int = GiB
    shm_bytes: int = SHM_FLOOR

    @property
    def coordinator(self) -> str:
        return f"{self.name}-coordinator"

    @property
    def state_claim(self) -> str:
        return f"{self.name}-coordinator-state"

    @property
    def secret(self) -> str:
        return self.token_secret or f"{self.name}-token"


def manifests(d: Deployment) -> list[Doc]:
    """The job's objects, Services before the Jobs whose pods look them up."""
    return [
        _coordinator_service(d),
        _coordinator_state(d),
        _coordinator_job(d),
        _worker_service(d),
        _worker_job(d),
    ]


def _labels(d: Deployment, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "shardwire",
        "app.kubernetes.io/instance": d.name,
        "app.kubernetes.io/component": component,
    }


def _metadata(d: Deployment, name: str, component: str) -> Doc:
    meta: Doc = {"name": name}
    if d.namespace:
        meta["namespace"] = d.namespace
    meta["labels"] = _labels(d, component)
    return meta


def _coordinator_service(d: Deployment) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(d, d.coordinator, "coordinator"),
        "spec": {
            "type": "ClusterIP",
            "selector": _labels(d, "coordinator"),
            "publishNotReadyAddresses": True,  # reachable while restarting (/readyz 503)
            "ports": [
                {"name": "control", "port": d.port, "targetPort": "control"},
                {"name": "http", "port": d.http_port, "targetPort": "http"},
            ],
        },
    }


def _worker_service(d: Deployment) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(d, d.name, "worker"),
        "spec": {
            "clusterIP": "None",
            "selector": _labels(d, "worker"),
            "publishNotReadyAddresses": True,  # names from the start, as agents join
        },
    }


def _job(d: Deployment, name: str, component: str, spec: Doc, pod: Doc) -> Doc:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(d, name, component),
        "spec": {
            **spec,
            "template": {"metadata": {"labels": _labels(d, component)}, "spec": pod},
        },
    }


def _pod(container: Doc, volumes: list[Doc], **extra: Any) -> Doc:
    return {
        "restartPolicy": "Never",
        **extra,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "runAsGroup": USER_ID,
            "fsGroup": USER_ID,  # a claim's fresh volume is writable by that user
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        **({"volumes": volumes} if volumes else {}),
    }


def _container_security() -> Doc:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


# A hang inquest's whole detail, in the coordinator pod (an emptyDir: it lives as long as
# the pod; mount a persistent volume at /tmp to keep it longer).
INQUESTS = "/tmp/inquests"
_TMP: Doc = {"name": "tmp", "emptyDir": {}}


def _token(d: Deployment) -> Doc:
    ref = {"name": d.secret, "key": "token"}
    return {"name": "SHARDWIRE_TOKEN", "valueFrom": {"secretKeyRef": ref}}


def _probe(path: str, *, period: int, failures: int) -> Doc:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _coordinator_args(d: Deployment) -> Iterator[str]:
    yield from ("coordinator", "--host", "0.0.0.0", "--port", str(d.port))
    yield from ("--http-host", "0.0.0.0", "--http-port", str(d.http_port))
    yield from ("--world-size", str(d.nodes * d.nproc_per_node), "--run-id", d.name)
    yield from ("--max-restarts", str(d.max_restarts), "--join-timeout", number(d.join_timeout))
    yield from ("--inquest-dir", INQUESTS)  # the root filesystem is read-only
    yield from ("--state-dir", STATE, "--coordinator-grace", str(COORDINATOR_GRACE))


def _coordinator_state(d: Deployment) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(d, d.state_claim, "coordinator"),
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": STATE_SIZE}},
        },
    }


def _coordinator_job(d: Deployment) -> Doc:
    container = {
        "name": "coordinator",
        "image": d.image,
        "command": ["shardwire"],
        "args": list(_coordinator_args(d)),
        "env": [_token(d)],
        "ports": [
            {"name": "control", "containerPort": d.port},
            {"name": "http", "containerPort": d.http_port},
        ],
        # started: /healthz within a minute (an image pull is before the container starts)
        "startupProbe": _probe("/healthz", period=2, failures=30),
        # alive: an event loop that answers within a minute
        "livenessProbe": _probe("/healthz", period=10, failures=6),
        # ready: waiting for or running a generation (503 while restarting, and at the end)
        "readinessProbe": _probe("/readyz", period=5, failures=1),
        "resources": {
            "requests": dict(COORDINATOR_RESOURCES),
            "limits": dict(COORDINATOR_RESOURCES),
        },
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "state", "mountPath": STATE},
        ],
    }
    spec = {
        "completions": 1,
        "parallelism": 1,
        "backoffLimit": COORDINATOR_REPLACEMENTS,
        "podReplacementPolicy": "Failed",  # never two coordinators on one journal
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",  # its own verdict: the job failed, or a bad flag
                    "onExitCodes": {
                        "containerName": "coordinator",
                        "operator": "In",
                        "values": [1, 2],
                    },
                }
            ]
        },
    }
    state = {"name": "state", "persistentVolumeClaim": {"claimName": d.state_claim}}
    return _job(d, d.coordinator, "coordinator", spec, _pod(container, [_TMP, state]))


def _worker_env(d: Deployment) -> list[Doc]:
    values = {
        "SHARDWIRE_COORDINATOR": f"{d.coordinator}:{d.port}",
        "SHARDWIRE_NNODES": str(d.nodes),
        "SHARDWIRE_NPROC_PER_NODE": str(d.nproc_per_node),
        "SHARDWIRE_RUN_ID": d.name,
        "SHARDWIRE_MAX_RESTARTS": str(d.max_restarts),
        "SHARDWIRE_JOIN_TIMEOUT": number(d.join_timeout),
        "SHARDWIRE_RECOVERY": d.recovery,
    }
    pod_name = {"fieldRef": {"fieldPath": "metadata.name"}}  # unique per pod
    return [
        *({"name": key, "value": value} for key, value in values.items()),
        {"name": "SHARDWIRE_NODE_ID", "valueFrom": pod_name},
        _token(d),
    ]


def _worker_job(d: Deployment) -> Doc:
    memory = quantity(d.memory_bytes + d.shm_bytes)  # /dev/shm pages count as the pod's
    container = {
        "name": "worker",
        "image": d.image,
        "command": ["shardwire"],
        "args": ["worker", *d.command],
        "env": _worker_env(d),
        "resources": {
            "requests": {"cpu": d.cpu, "memory": memory},
            "limits": {"cpu": d.cpu, "memory": memory},
        },
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    volumes = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(d.shm_bytes)}},
        _TMP,
    ]
    spec = {
        "completionMode": "Indexed",
        "completions": d.nodes,
        "parallelism": d.nodes,
        "backoffLimit": d.max_restarts,
        "podReplacementPolicy": "Failed",
    }
    return _job(d, d.name, "worker", spec, _pod(container, volumes, subdomain=d.name))
