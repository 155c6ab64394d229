"""The disk tier: evicted KV blocks and recurrent-state checkpoints kept in files, found again
after memory and after a restart (``--disk-cache-dir``; docs/architecture.md, "Disk tier").

Shaped as a KV connector under the cache coordinator (vLLM's KV connector, SGLang's HiCache):

- ``tier.py``, the scheduler side (no torch): asked by the coordinator at admission how many
  more tokens of a prefix it can load (``num_loadable_tokens``, starting the read), told what
  the pools evicted or published (``note``, from ``CacheCoordinator.take_saves``), and running
  the reader and writer threads;
- ``connector.py`` with ``block_io.py``, the worker side: at fixed points of each step it gets
  memory for finished reads from the coordinator (``reserve_load``), copies payloads in on a
  thread of its own, publishes them (``publish_load``), and copies saved entries out of the
  cache tensors before the forward can rewrite them;
- ``store.py`` and ``format.py``: the files (header, checksum, identity, LRU budget).

Nothing is wired by callbacks: the pools append to a ``SaveLog`` the coordinator drains.
"""
