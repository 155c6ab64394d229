"""Prometheus metrics of a serving engine, named ``hyprefix:*`` in the style of vLLM's.

Each ``ServerMetrics`` has its own ``CollectorRegistry`` (several apps can live
in one process). Request counters and latency histograms are fed with every
step's outputs on the engine thread (``observe``); the engine's own cumulative
counters and gauges are read from a ``get_stats()`` snapshot at scrape time, so
they are exact counters without any delta bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from hyprefix.outputs import DECODE_PATHS, RequestOutput
from hyprefix.server.status import RecentRequests

# (name, stats key, help)
_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("prefill_computed_tokens", "prefill_computed_tokens", "Prompt tokens computed by prefill."),
    ("prefill_skipped_tokens", "prefill_skipped_tokens", "Prompt tokens skipped thanks to the prefix cache."),
    ("num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks."),
    ("sibling_waits", "sibling_waits", "Times a request waited for another to compute a shared prefix."),
    ("hybrid_hit_tokens_lost", "hybrid_hit_tokens_lost",
     "Cached KV tokens a hit could not reuse: no recurrent-state checkpoint there, or its sliding window was evicted."),
    ("swa_blocks_released", "swa_blocks_released",
     "Sliding-window KV blocks running requests gave back as they left the window."),
    ("kv_retained_blocks_evicted", "kv_retained_blocks_evicted",
     "Retained KV blocks evicted before their retention ended (no other block was free)."),
    ("disk_cache_hit_tokens", "disk_cache_hit_tokens", "Tokens of KV blocks brought back from the disk cache."),
    ("disk_cache_loads", "disk_cache_loads", "Requests that read blocks from the disk cache."),
    ("disk_cache_bytes_read", "disk_cache_bytes_read", "Bytes read from the disk cache (headers included)."),
    ("disk_cache_bytes_written", "disk_cache_bytes_written", "Bytes written to the disk cache (headers included)."),
    ("disk_cache_evictions", "disk_cache_evictions", "Disk cache files removed to stay within --disk-cache-gb."),
    ("disk_cache_refused", "disk_cache_refused",
     "Disk cache files refused and removed: damaged, truncated, renamed or of another model or layout."),
    ("disk_cache_saves_dropped", "disk_cache_saves_dropped",
     "Blocks not written to the disk cache because its writer was too far behind."),
    ("disk_cache_imports_dropped", "disk_cache_imports_dropped",
     "Disk cache loads (or their sliding-window part) that found no room in memory."),
    ("spec_decode_num_drafts", "spec_decode_num_drafts",
     "Speculative decoding: verifications (a sequence's step that carried drafts)."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative decoding: drafted tokens."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Speculative decoding: drafted tokens accepted (each one a decode step saved)."),
)
_ENGINE_GAUGES = (
    ("num_requests_running", "num_requests_running", "Sequences in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "Sequences waiting to be scheduled."),
    ("kv_blocks_total", "kv_blocks_total", "KV blocks in the pool."),
    ("kv_blocks_used", "kv_blocks_used", "KV blocks referenced by requests."),
    ("kv_blocks_cached", "kv_blocks_cached", "Unreferenced KV blocks still findable by prefix hash."),
    ("kv_blocks_free", "kv_blocks_free", "Unreferenced KV blocks holding no cached prefix."),
    ("kv_blocks_per_gib", "kv_blocks_per_gib", "KV blocks of the main pool a GiB holds (--kv-cache-dtype)."),
    ("kv_tokens_per_gib", "kv_tokens_per_gib",
     "Tokens of K/V of every main-pool layer a GiB holds (--kv-cache-dtype)."),
    ("mamba_checkpoints_used", "mamba_checkpoints_used", "State checkpoints in use (Mamba2, DeltaNet)."),
    ("mamba_checkpoints_capacity", "mamba_checkpoints_capacity", "State checkpoint slots (Mamba2, DeltaNet)."),
    ("mamba_checkpoint_bytes", "mamba_checkpoint_bytes", "Bytes of one state checkpoint (0: no recurrent layers)."),
    ("swa_blocks_total", "swa_blocks_total", "Blocks in the sliding-window layers' own KV pool."),
    ("swa_blocks_used", "swa_blocks_used", "Sliding-window KV blocks referenced by requests."),
    ("swa_blocks_cached", "swa_blocks_cached", "Unreferenced sliding-window KV blocks still findable by hash."),
    ("kv_retentions", "kv_retentions", "Finished requests whose prefix is retained now (cache_control)."),
    ("kv_blocks_retained", "kv_blocks_retained", "KV blocks retained for finished requests (evicted last)."),
    ("mamba_checkpoints_retained", "mamba_checkpoints_retained",
     "State checkpoints retained for finished requests (evicted last)."),
    ("disk_cache_files", "disk_cache_files", "Files in the disk cache (this process's index)."),
    ("disk_cache_bytes_used", "disk_cache_bytes_used", "Bytes of the disk cache's files (this process's index)."),
)

_ACCEPTED_AT = "spec_decode_num_accepted_tokens_pos"  # + the draft position: a stats key per position

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, int | float]], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        for name, key, doc in _ENGINE_COUNTERS:
            family = CounterMetricFamily(f"hyprefix:{name}", doc, labels=names)
            family.add_metric(values, float(stats.get(key, 0)))
            yield family
        family = CounterMetricFamily(
            "hyprefix:decode_steps", "Decode-only steps by the path that ran them: kernel (one call of the "
            "model's own decode kernel), graph (a compiled decode step) or eager.", labels=[*names, "path"])
        for path in DECODE_PATHS:
            family.add_metric([*values, path], float(stats.get(f"decode_steps_{path}", 0)))
        yield family
        family = CounterMetricFamily(
            "hyprefix:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: accepted drafts by their "
            "position in the draft (0: the first).", labels=[*names, "position"])
        for key, value in stats.items():
            if key.startswith(_ACCEPTED_AT):
                family.add_metric([*values, key[len(_ACCEPTED_AT):]], float(value))
        yield family
        for name, key, doc in _ENGINE_GAUGES:
            family = GaugeMetricFamily(f"hyprefix:{name}", doc, labels=names)
            family.add_metric(values, float(stats.get(key, 0)))
            yield family


class ServerMetrics:
    """``replica``: a ``replica`` label on every series (engine replicas behind one app)."""

    def __init__(self, stats: Callable[[], Mapping[str, int | float]], model_name: str,
                 replica: str | None = None) -> None:
        self.registry = CollectorRegistry()
        const = {"model_name": model_name, **({"replica": replica} if replica is not None else {})}
        labels = list(const)
        self._values = tuple(const.values())
        reg = self.registry
        self.request_success = Counter(
            "hyprefix:request_success", "Finished sequences (one per choice) by finish reason.",
            [*labels, "finished_reason"], registry=reg)
        self.prompt_tokens = Counter("hyprefix:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=reg)
        self.generation_tokens = Counter("hyprefix:generation_tokens", "Generated tokens.", labels, registry=reg)
        self.ttft = Histogram("hyprefix:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("hyprefix:time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.", labels,
                              buckets=_TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("hyprefix:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram("hyprefix:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                                    buckets=_LATENCY_BUCKETS, registry=reg)
        reg.register(_EngineStatsCollector(stats, const))
        self.recent = RecentRequests()  # the status page's last finished requests
        self._generated: dict[str, int] = {}  # request id -> tokens counted so far (engine thread only)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Count one step's outputs (called on the engine thread)."""
        values = self._values
        for out in outputs:
            total = sum(len(c.token_ids) for c in out.outputs)
            new = total - self._generated.get(out.request_id, 0)
            if new > 0:
                self.generation_tokens.labels(*values).inc(new)
            if not out.finished:
                self._generated[out.request_id] = total
                continue
            self._generated.pop(out.request_id, None)
            self.recent.add(out)
            self.prompt_tokens.labels(*values).inc(len(out.prompt_token_ids))
            for c in out.outputs:
                self.request_success.labels(*values, c.finish_reason or "abort").inc()
            m = out.metrics
            if m.first_scheduled_time is not None:
                self.queue_time.labels(*values).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.ttft.labels(*values).observe(max(0.0, m.first_token_time - m.arrival_time))
                if out.tpot is not None:
                    self.tpot.labels(*values).observe(out.tpot)
            if m.finished_time is not None:
                self.e2e.labels(*values).observe(max(0.0, m.finished_time - m.arrival_time))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(texts: list[bytes | str]) -> bytes:
    """One exposition of several (engine replicas, each with its ``replica`` label):
    the samples of a metric family from every text under a single HELP/TYPE header."""
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


class RouterMetrics:
    """The replica routers of this process (one per deployment handle, in the ingress)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "hyprefix:router_requests", "Requests routed, by replica and the rule that ranked the replicas "
            "(prefix, least-loaded, imbalanced).", ["reason", "replica"], registry=self.registry)
        self.matched_blocks = Counter(
            "hyprefix:router_matched_blocks", "Blocks of the routed requests that their replica held when "
            "routed (from its KV events).", ["replica"], registry=self.registry)
        self.running = Gauge(
            "hyprefix:router_requests_running", "Requests this process's routers count against a replica: "
            "chosen or routed there and not ended (the load the least-loaded rule weighs).", ["replica"],
            registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


ROUTER_METRICS = RouterMetrics()
