"""Optimizers over flat parameter shards, and the learning-rate schedule."""

from shardwire.worker.optim.optimizers import SGD, AdamW, Optimizer, warmup_cosine

__all__ = ["SGD", "AdamW", "Optimizer", "warmup_cosine"]
