"""Benchmarks: ``hyprefix bench --workload ...`` compares the engine against plain transformers.

One module per job: ``cli`` (arguments, model aliases, orchestration), ``peak`` (the
machine's bf16 matmul peak), ``flops`` (model FLOPs from its config), ``arms`` (timed
prefill / decode runs of each engine), ``throughput`` (the throughput workload),
``workloads`` (request generators of the prefix-cache workloads: shared-prefix, rl-burst,
multi-turn), ``offline`` (the in-process driver that runs those workloads on each arm),
``prefix`` (their interleaved repeats, summary, ratios and targets), ``env`` (machine and
library facts), ``report`` (tables and JSON) and ``plots`` (PNG plots).
"""

from __future__ import annotations
