"""The engine: an input processor, the engine core and an output processor (vLLM v1's shape).

``add_requests`` checks prompts and parameters (``InputProcessor``: nothing is queued or
allocated for a bad one), fans ``n`` out into samples and queues them in the core; ``step``
runs one core step (schedule -> execute -> update, ``engine_core.py``) and hands the progress
to the ``OutputProcessor``, the one owner of every request's state (text, stop strings,
logprob texts, ``RequestOutput``s) and the one place that forgets it.

The front ends (``LLM``, the server's backend, the replicas) use only ``Engine.API``
(tests/unit/test_code_shape.py checks); the parts behind it (``core``, ``scheduler``,
``runner``, ``cache``, ``disk``) are for tests and tools.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from hyprefix.config import EngineArgs
from hyprefix.engine_config import EngineConfig
from hyprefix.engine_core import EngineCore
from hyprefix.engine_stats import ModelFacts, model_facts
from hyprefix.errors import RequestError
from hyprefix.input_processor import InputProcessor, Prepared, PromptInput
from hyprefix.loading import load_parts
from hyprefix.openmp import release_workers
from hyprefix.output_processor import OutputProcessor
from hyprefix.outputs import RequestOutput
from hyprefix.request import Request
from hyprefix.sampling import SamplingParams
from hyprefix.scheduling_policy import check_priority, grant_priority
from hyprefix.structured.grammar import GrammarCompiler
from hyprefix.text import ChatPrompt
from hyprefix.weight_updates import Weights, WeightUpdater

log = logging.getLogger("hyprefix")

__all__ = ["Engine", "ModelFacts"]


class Engine:
    # What the front ends may use (a test checks they use nothing else).
    API = frozenset({
        "add_request", "add_requests", "abort", "step", "take_outputs", "request_ids", "has_unfinished",
        "has_unfinished_sequences", "tokenize_prompt", "encode_chat", "validate", "warmup", "update_weights",
        "get_stats", "reset_prefix_cache", "close", "check_invariants", "model_facts", "max_pool_tokens",
        "max_model_len", "vocab_size", "tokenizer", "eos_token_ids", "model_identity", "weight_version",
        "memory_bytes", "args", "config", "kv_events_endpoints", "map_kv_pages", "release_retention",
    })

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.config = config = EngineConfig.from_args(args)
        parts = load_parts(config)
        loaded = parts.loaded
        self.tokenizer = parts.tokenizer
        self.model_path = loaded.path
        self.hf_config = loaded.hf_config
        self.text_config = loaded.hf_config.get_text_config()  # the config itself but for multimodal ones
        self.dtype = loaded.dtype
        self.vocab_size = int(self.text_config.vocab_size)
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.state_bytes_per_slot = parts.state_bytes_per_slot
        self.memory_bytes = parts.memory_bytes
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.cache, self.scheduler, self.runner, self.disk = parts.cache, parts.scheduler, parts.runner, parts.disk
        self.core = EngineCore(parts.scheduler, parts.runner, parts.cache, parts.disk, self.grammars.step_masks(),
                               parts.cache_events, config.events, config.log_stats_interval)
        self.weights = WeightUpdater(loaded.model, loaded.hf_config, loaded.identity, config.model.weight_version,
                                     self.core.set_model_identity)
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, config.max_logprobs,
                                     self.grammars, lambda: (self.cache.kv.num_blocks, self.max_pool_tokens))
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        freeze_startup_heap()
        # Loading ran parallel work on this thread; the thread that steps the engine may be
        # another, and two OpenMP pools would slow every step (``openmp.py``).
        release_workers()

    # ------------------------------------------------------------------ model
    @property
    def model_facts(self) -> ModelFacts:
        return model_facts(self.runner.model, self.dtype, int(self.text_config.hidden_size), self.vocab_size,
                           self.state_bytes_per_slot, self.config.model.quantization, self.runner.kv_dtype,
                           self.config.cache.kv_cache_dtype)

    @property
    def model_identity(self) -> str:
        """Names the weights running now: the root of every block hash."""
        return self.weights.identity

    @property
    def weight_version(self) -> str:
        return self.weights.weight_version

    @property
    def event_publisher(self):
        return self.core.event_publisher

    def kv_events_endpoints(self) -> dict[str, str] | None:
        """Where the KV events go (``--kv-events-config``): endpoint, replay endpoint and topics,
        with the ports bound; None when they are off."""
        publisher = self.core.event_publisher
        if publisher is None:
            return None
        return {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                "topic": publisher.config.topic, "state_topic": publisher.config.state_topic}

    def warmup(self) -> None:
        """Compile the kernels of large steps now (the server calls it before serving)."""
        t0 = time.perf_counter()
        if self.runner.warmup():
            log.info("warmed up the compiled kernels in %.1fs", time.perf_counter() - t0)
            freeze_startup_heap()
        release_workers()  # as after loading

    def update_weights(self, weights: Weights, weight_version: str | None = None) -> dict[str, object]:
        """Load new weights into the running model, in place (``weight_updates.py``): a checkpoint
        directory or GGUF file of the same architecture and shapes, or (name, tensor) pairs.
        A mismatch raises ``RequestError`` and leaves the model as it was. No block computed by
        the old weights is hit again. Requests in flight keep what they computed and go on with
        the new weights (callers that want otherwise finish or abort them first:
        ``AsyncEngine.update_weights``)."""
        return self.weights.update(weights, weight_version)

    # ------------------------------------------------------------------ intake
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of one prompt; raises RequestError on bad input."""
        return self.inputs.tokenize_prompt(prompt)

    def encode_chat(self, messages: list[dict] | ChatPrompt, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation (or a ``ChatPrompt``) under the tokenizer's chat template."""
        return self.inputs.encode_chat(messages, add_generation_prompt)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` unless the prompt ``ids`` with ``params`` can ever run here."""
        self.inputs.validate(ids, params)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, group: str | None = None) -> None:
        """Validate and queue one request (``add_requests`` with one item)."""
        self.add_requests([(request_id, prompt, params)], arrival_time, group)

    def add_requests(self, requests: Sequence[tuple[str, PromptInput, SamplingParams | None]],
                     arrival_time: float | None = None, group: str | None = None,
                     max_total_tokens: int | None = None) -> list[tuple[str | None, list[int]]]:
        """Validate every request, then queue them all: a bad one (``RequestError``)
        queues none and allocates nothing. ``group``: the client call they belong to
        (the scheduler shares slots fairly between groups); by default each is its own.
        ``max_total_tokens``: the most tokens they may ask for together, n x (prompt +
        max_tokens) summed (a server's per-call limit). Returns each prompt's (text or
        None, token ids)."""
        checked = []
        taken: set[str] = set()
        for request_id, prompt, params in requests:
            params = params or SamplingParams()
            if not isinstance(params, SamplingParams):
                raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
            check_priority(self.config.scheduler.policy, params.priority)
            granted = grant_priority(params.priority, self.config.scheduler.highest_priority)
            if granted != params.priority:  # capped (--highest-request-priority): the server's response says so
                params = replace(params, priority=granted)
            child_ids = sample_ids(request_id, params.n)
            if self.outputs.knows(request_id) or request_id in taken:
                raise RequestError(f"request id {request_id!r} is already in use")
            for child_id in child_ids:  # e.g. "a#1" given by the user, then "a" with n=2
                if self.outputs.knows(child_id) or child_id in self.scheduler.requests or child_id in taken:
                    raise RequestError(f"request id {request_id!r} clashes with request {child_id!r} in use")
            taken.update([request_id, *child_ids])
            checked.append((request_id, child_ids, self.inputs.prepare(prompt, params)))
        total = sum(p.params.n * (len(p.ids) + p.params.max_tokens) for _, _, p in checked)
        if max_total_tokens is not None and total > max_total_tokens:
            raise RequestError(f"this request asks for up to {total} tokens (n x (prompt tokens + max_tokens) over "
                               f"its prompts), more than the limit of {max_total_tokens} per request: lower n or "
                               "max_tokens", param="max_tokens", code="request_too_large")
        arrival = time.time() if arrival_time is None else arrival_time
        for request_id, child_ids, prepared in checked:
            samples = [self._sequence(child_id, i, prepared, arrival, group or request_id)
                       for i, child_id in enumerate(child_ids)]
            self.outputs.add(request_id, prepared.text, prepared.ids, prepared.params, samples, arrival)
            self.core.add(samples)
        return [(p.text, p.ids) for _, _, p in checked]

    def _sequence(self, request_id: str, index: int, prepared: Prepared, arrival: float, group: str) -> Request:
        """Sample ``index`` of a prepared request as a scheduler ``Request``, with its grammar
        (processed logprobs of a grammar row read its mask: such rows mask first, ``runner/sampler.py``)."""
        params = prepared.params
        request = Request(request_id, prepared.ids, params.for_sample(index) if params.n > 1 else params,
                          eos_token_ids=self.eos_token_ids, cache_salt=prepared.salt, arrival_time=arrival,
                          group=group)
        if params.structured_outputs is not None:
            processed_logprobs = self.config.runner.logprobs_mode.startswith("processed")
            request.grammar = self.grammars.grammar(
                params.structured_outputs,
                masks_first=params.top_k != -1 or params.top_p < 1.0 or params.min_p > 0
                or (processed_logprobs and params.logprobs is not None))
        return request

    @property
    def max_pool_tokens(self) -> int:
        """Tokens the whole KV pool holds: no request may need more."""
        return self.cache.kv.num_blocks * self.cache.block_size

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its samples); its blocks are freed at once. Returns
        whether it was known and unfinished."""
        return self.outputs.abort(request_id)

    def release_retention(self, request_id: str, n: int = 1, samples: Sequence[int] | None = None) -> int:
        """End now the retention of a finished request's prefix (``SamplingParams.cache_ttl_s``;
        ``cache/retention.py``): of the samples ``samples`` (None: all ``n``). Returns how many
        retentions ended."""
        ids = sample_ids(request_id, n)
        return self.scheduler.release_retention(ids if samples is None else [ids[i] for i in samples])

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one core step; returns the outputs of requests that progressed (and of those
        aborted since the last step)."""
        outputs = self.outputs.take_pending()
        progress = self.core.step()
        return outputs + self.outputs.process(progress.advanced, progress.logprobs, progress.prompt_logprobs)

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs made between steps (aborted requests') that ``step`` would return
        first: for a caller that does not step now (a paused server)."""
        return self.outputs.take_pending()

    @property
    def request_ids(self) -> list[str]:
        """Every user request not finished (or whose last output is still to be returned)."""
        return self.outputs.request_ids

    def has_unfinished(self) -> bool:
        """Requests not finished, or outputs not yet returned by ``step``."""
        return self.outputs.has_unfinished()

    def has_unfinished_sequences(self) -> bool:
        """Sequences waiting or running: whether another ``step`` can make progress."""
        return self.core.has_work()

    # ------------------------------------------------------------------- stats
    def get_stats(self) -> dict[str, int | float]:
        """Cumulative token counters and current pool usage (docs/architecture.md, "Stats")."""
        return self.core.stats(self.state_bytes_per_slot)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no running request holds; returns how many."""
        dropped = self.core.reset_prefix_cache()
        log.info("reset the prefix cache: dropped %d cached blocks", dropped)
        return dropped

    def map_kv_pages(self) -> bool:
        """For an idle server: map the K/V pool's next few MiB of pages before the prefills
        that first write them would fault them in (``runner/huge_pages.PageMapper``). False
        once every page is mapped; it changes no state a request sees."""
        return self.core.map_kv_pages()

    def close(self) -> None:
        """Write the disk tier out and stop its threads; stop the KV event publisher."""
        self.core.close()

    def check_invariants(self) -> None:
        self.core.check_invariants()


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine's ids of a request's ``n`` samples."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (the imports, the model, its config and
    tokenizer: hundreds of thousands of objects) out of the cyclic collector's reach, as vLLM's
    engine does after start-up. Each full collection otherwise walks them all, a pause of many
    decode steps at moments set by allocation counts. Objects frozen
    here that die later are still freed by their reference counts; only a cycle among them
    stays until the process ends."""
    gc.collect()
    gc.freeze()
