"""Benchmarks: ``hyprefix bench --workload ...`` compares the engine with plain transformers.

``cli`` (flags, orchestration), ``workloads`` (request generators), ``arms`` (one protocol for
every engine, the timed runs), ``online`` (the server arm), ``summary`` (one summary schema,
ratios, agreement, FLOPs), ``env`` (machine facts, matmul peak), ``report`` and ``plots``.
"""
