"""Benchmarks shipped with the package (``shardwire bench ...``)."""
