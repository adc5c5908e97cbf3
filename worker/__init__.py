"""Worker side: user API, process group, transports and launcher.

Typical script::

    import shardwire.worker as sw

    async def main():
        async with sw.init() as pg:
            print(pg.rank, pg.world_size)

    sw.run(main())

Its public names are imported when first read (`shardwire.protocol.exports`);
`__init__.pyi` lists them."""

from shardwire.protocol.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
