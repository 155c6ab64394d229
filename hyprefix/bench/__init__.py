"""Benchmarks: ``hyprefix bench --workload ...`` compares the engine against plain transformers.

One module per job: ``cli`` (arguments, orchestration), ``peak`` (the machine's bf16 matmul
peak), ``flops`` (model FLOPs from its config), ``arms`` (timed runs of each engine),
``throughput`` (the throughput workload), ``env`` (machine and library facts) and
``report`` (table and JSON).
"""

from __future__ import annotations
