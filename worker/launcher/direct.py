"""``shardwire run``: one rank per scheduler task, with no node agent (Slurm's ``srun -n N``).

The scheduler starts this command once per rank. It reads the rank's place from the
scheduler (:func:`~shardwire.worker.launcher.cluster.rank_place`); rank 0 starts the
job's coordinator on its node, listening on every address, unless ``--coordinator``
names one; each task then runs the script as its child with torchrun's variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), forwards SIGINT and SIGTERM to it, and
exits as it did. The child's output goes straight to the task's (``srun --label``
prefixes it).

Shared memory: names of a run are unlinked as soon as every rank has attached, so a
killed rank leaves nothing behind once its groups are up; if the script ends by a signal
or fails, this task also removes the names of the run still present on its node (the
job is over then: the coordinator stops every rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Mapping

from pydantic import SecretStr

from shardwire.worker.launcher.agent import token_env, worker_env
from shardwire.worker.launcher.cluster import RankPlace, rank_place
from shardwire.worker.launcher.hosted import coordinator_command, own_coordinator
from shardwire.worker.launcher.options import LaunchSettings
from shardwire.worker.launcher.secret import job_token
from shardwire.worker.transport import shm

# After rank 0's script ends, the longest its coordinator may wait for the other ranks.
_JOB_END_BOUND = 7 * 24 * 3600.0


def placed(
    settings: LaunchSettings, place: RankPlace, environ: Mapping[str, str]
) -> tuple[LaunchSettings, bool]:
    """Settings for this rank's job and whether this task serves the coordinator."""
    given = settings.model_fields_set
    update: dict[str, object] = {
        "nproc_per_node": place.local_world_size,
        "nnodes": str(place.world_size // place.local_world_size),
        "node_rank": place.node_rank,
    }
    if "run_id" not in given:
        update["run_id"] = place.run_id
    if "node_id" not in given:
        update["node_id"] = place.node_id
    serve = "coordinator" not in given
    if serve:
        host, port = place.coordinator
        update["coordinator"] = f"{host}:{settings.coordinator_port or port}"
    if not (settings.token or settings.token_file):
        update["token"] = SecretStr(job_token(place.scheduler, place.job_id, environ))
    return settings.model_copy(update=update), serve and place.rank == 0


async def run_rank(settings: LaunchSettings, argv: list[str]) -> int:
    """Run this task's rank of the job (and the coordinator on rank 0)."""
    place = rank_place(os.environ)
    settings, serve = placed(settings, place, os.environ)
    env = token_env(settings)
    tls = settings.tls_files()
    if tls is not None:
        env.update(tls.env())
    address = settings.coordinator_address()
    child_env = {
        **worker_env(settings, address, env),
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "GROUP_RANK": str(place.node_rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "SHARDWIRE_NODE_ID": settings.node_id or place.node_id,
        "PYTHONUNBUFFERED": "1",
    }
    if not serve:
        return await _script(argv, child_env, settings)
    # Rank 0's script may end before the others': the coordinator then stays until it has
    # seen every rank out (or failed the job: its liveness rules bound that wait).
    command = coordinator_command(settings, serve=True)
    async with own_coordinator(command, env, linger=_JOB_END_BOUND):
        return await _script(argv, child_env, settings)


async def _script(argv: list[str], env: dict[str, str], settings: LaunchSettings) -> int:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL)
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def forward(sig: int) -> None:
        received.append(sig)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, forward, sig)
    try:
        code = await proc.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if proc.returncode is None:
            await _stop(proc, settings.term_timeout)
    if code != 0 and (swept := shm.sweep(settings.run_id)):
        print(
            f"[rank {env['RANK']}]: removed {swept} shared-memory name(s) of the run",
            file=sys.stderr,
            flush=True,
        )
    if code < 0:
        return 128 - code
    return 128 + received[0] if received and code == 0 else code


async def _stop(proc: asyncio.subprocess.Process, grace: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace):
            await proc.wait()
            return
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
