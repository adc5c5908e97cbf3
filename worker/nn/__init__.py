"""numpy layers with explicit forward and backward."""

from shardwire.worker.nn.attention import CausalSelfAttention
from shardwire.worker.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU
from shardwire.worker.nn.losses import mse, softmax_cross_entropy
from shardwire.worker.nn.module import Module, Sequential
from shardwire.worker.nn.transformer import Block, TransformerLM

__all__ = [
    "GELU",
    "Block",
    "CausalSelfAttention",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "Module",
    "ReLU",
    "Sequential",
    "TransformerLM",
    "mse",
    "softmax_cross_entropy",
]
