"""Collective benchmark; the same as ``shardwire bench collectives`` (see --help)."""

import sys

from shardwire.worker.bench.collectives import main

if __name__ == "__main__":
    sys.exit(main())
