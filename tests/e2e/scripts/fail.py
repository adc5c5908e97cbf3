"""Test script: rank FAIL_RANK raises (FAIL_MODE=raise) or kills itself (FAIL_MODE=kill);
the others wait for a message from it that never comes."""

from __future__ import annotations

import os
import signal

import shardwire.worker as sw


async def main() -> None:
    fail_rank = int(os.environ["FAIL_RANK"])
    async with sw.init() as pg:
        print(f"rank {pg.rank} ready", flush=True)
        if pg.rank == fail_rank:
            if os.environ.get("FAIL_MODE") == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"deliberate failure on rank {pg.rank}")
        await pg.transport.recv(fail_rank, tag=sw.Tag(0, 0), timeout=60)


if __name__ == "__main__":
    sw.run(main())
