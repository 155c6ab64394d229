"""Plain dataclasses that cross stage boundaries (scheduler -> runner -> engine -> user)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hyprefix.sampling import SamplingParams

# The paths a decode-only step can take in the runner: the model's own one-call decode kernel,
# a compiled decode graph, or the eager forward. Counted per step (``Engine.get_stats``).
DECODE_PATHS = ("kernel", "graph", "eager")


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: compute ``token_ids`` at positions
    ``start_pos .. start_pos + len(token_ids) - 1``, reading earlier K/V through
    ``block_table``; sample one token afterwards when ``sample`` is set."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    num_generated: int = 0
    write_kv: bool = True  # False: the tokens' K/V already sit in shared blocks (full prefix hit)
    state_slot: int = -1  # live Mamba state slot (hybrid models)
    state_taps: tuple[tuple[int, int], ...] = ()  # (position, checkpoint slot): save the state there
    # Sliding-window layers with a pool of their own: their block ids from block
    # ``window_first_block`` on (earlier blocks left every window).
    window_first_block: int = 0
    window_blocks: list[int] | None = None
    # The request's prompt and output so far (the request's own lists, not copies): what
    # logits processing (penalties, bad words) and prompt logprobs read.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Speculative decoding: the last ``num_drafts`` of ``token_ids`` are drafts to verify (the
    # row samples after every one of its tokens; ``sample`` is set)
    num_drafts: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Run before the forward, in order: (checkpoint slot to restore or None = zeros, live slot)
    state_ops: list[tuple[int | None, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Logprob(NamedTuple):
    """One token's log-probability under the model (float32 logits before any processing),
    its rank among the vocabulary (1: the most likely), and its text where the engine
    decoded it (vLLM's ``Logprob``; a named tuple: made for every top token of every step)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, the sampled (or prompt) token first, then the top ones.
PositionLogprobs = dict[int, Logprob]


@dataclass
class StepResult:
    """What one step computed: each sampling request's new tokens (one, or after verified drafts
    the accepted drafts and the token sampled after them); where asked, their logprobs
    and prompt logprobs ((position of the first prompt token they cover, one entry a token))."""

    sampled: dict[str, list[int]] = field(default_factory=dict)  # several after accepted drafts
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # one per token of ``sampled``
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    """Lifecycle timestamps (``time.time()`` seconds) of a request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding (vLLM's ``spec_decode_*`` counts, for this request's sequences):
    # verifications (steps whose row carried drafts), drafted tokens, accepted drafts
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a verification step produced on average (accepted drafts + the sampled one);
        None without one."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RetentionGrant:
    """What a finished request's retention got (``SamplingParams.cache_ttl_s``, the server's
    ``cache_control``; ``cache/retention.py``): its prefix's first ``num_tokens`` tokens kept
    ``ttl_s`` seconds after it finished (capped by the limits; 0 and 0: nothing kept)."""

    ttl_s: float
    num_tokens: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per token id, where ``SamplingParams.logprobs`` asked
    retention: RetentionGrant | None = None  # once finished, where a retention was asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # Where ``SamplingParams.prompt_logprobs`` asked: None for the first prompt token, then
    # one entry per prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first, over its longest sequence (vLLM's
        ``time_per_output_token``); None until finished or with fewer than two tokens."""
        m = self.metrics
        longest = max((len(c.token_ids) for c in self.outputs), default=0)
        if m.first_token_time is None or m.finished_time is None or longest < 2:
            return None
        return max(0.0, m.finished_time - m.first_token_time) / (longest - 1)

    @property
    def retention(self) -> RetentionGrant | None:
        """What the retention of its prefix got (``cache_ttl_s``), the least over its samples
        (None: none asked, or not finished)."""
        grants = [c.retention for c in self.outputs if c.retention is not None]
        if not grants:
            return None
        return RetentionGrant(min(g.ttl_s for g in grants), min(g.num_tokens for g in grants))
