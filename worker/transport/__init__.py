"""Transports: the contract, the TCP peer mesh and the in-memory hub.

Its public names are imported when first read (`shardwire.protocol.exports`);
`__init__.pyi` lists them."""

from shardwire.protocol.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
