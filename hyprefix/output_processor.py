"""The output processor: every user request's state from admission to its last output, and the
one place that forgets it. It turns the scheduler's per-sequence progress into ``RequestOutput``s:
incremental detokenizing, stop strings, the stop of a complete structured output, logprob texts,
fan-out of ``n`` samples gathered back into one output."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hyprefix.detokenizer import IncrementalDetokenizer, text_decoder
from hyprefix.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from hyprefix.request import Request
from hyprefix.sampling import SamplingParams
from hyprefix.scheduler import Scheduler

log = logging.getLogger("hyprefix")


@dataclass
class _Sample:
    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None = None  # one per output token, where asked


@dataclass
class _Parent:
    """A user request: ``n`` sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    arrival_time: float
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # where asked: None first

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class OutputProcessor:
    """Requests by id (user requests and their samples) and the outputs not yet returned.
    ``scheduler``: where a stop it finds (a stop string, a complete structured output) ends the
    sequence."""

    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, tuple[_Parent, _Sample]] = {}
        self._pending: list[RequestOutput] = []
        self._text_decoders = {(True, True): text_decoder(tokenizer)}
        self._token_texts: dict[int, str] = {}  # logprobs' token texts by id
        backend = getattr(tokenizer, "_tokenizer", None)
        self._token_decoder = (lambda ids: backend.decode_batch([[t] for t in ids], skip_special_tokens=False)) \
            if backend is not None and hasattr(backend, "decode_batch") else \
            (lambda ids: [tokenizer.decode([t], skip_special_tokens=False) for t in ids])

    def knows(self, request_id: str) -> bool:
        """Whether the id is a live user request or one of its samples."""
        return request_id in self._parents or request_id in self._samples

    @property
    def request_ids(self) -> list[str]:
        return list(self._parents)

    def has_unfinished(self) -> bool:
        return bool(self._parents) or bool(self._pending)

    def add(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
            requests: list[Request], arrival: float) -> None:
        """Track a user request whose samples (``requests``) the caller queues."""
        samples = [_Sample(r, IncrementalDetokenizer(self.tokenizer, ids, params.stop_list, self._decoder(params),
                                                     include_stop=params.include_stop_str_in_output),
                           [] if params.logprobs is not None else None) for r in requests]
        parent = _Parent(request_id, text, ids, samples, arrival,
                         [None] * len(ids) if params.prompt_logprobs is not None else None)
        self._parents[request_id] = parent
        for sample in samples:
            self._samples[sample.request.request_id] = (parent, sample)

    def abort(self, request_id: str) -> bool:
        """End every sample of the request (the scheduler frees their blocks) and queue its last
        output. Returns whether it was known and unfinished."""
        parent = self._parents.get(request_id)
        if parent is None:
            return False
        for sample in parent.samples:
            if not sample.request.is_finished:
                self.scheduler.finish(sample.request.request_id, "abort")
        self._pending.append(self._output(parent))
        self._forget(parent)
        return True

    def take_pending(self) -> list[RequestOutput]:
        """Outputs made between steps (aborted requests'), to return before the next step's."""
        outputs, self._pending = self._pending, []
        return outputs

    def process(self, advanced: list[Request], logprobs: dict[str, list[PositionLogprobs]],
                prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]]) -> list[RequestOutput]:
        """A step's progress: prompt logprobs, the new tokens of each advanced sequence, and one
        output per user request that progressed (forgotten once finished)."""
        for request_id, (first, entries) in prompt_logprobs.items():
            if request_id in self._samples:
                parent = self._samples[request_id][0]
                parent.prompt_logprobs[first:first + len(entries)] = [self._decoded(e) for e in entries]
        touched: dict[str, _Parent] = {}
        for request in advanced:
            if request.request_id not in self._samples:
                continue
            parent, sample = self._samples[request.request_id]
            self._take_new_tokens(request, sample, logprobs.get(request.request_id))
            touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            outputs.append(self._output(parent))
            if parent.finished:
                self._forget(parent)
        return outputs

    def _forget(self, parent: _Parent) -> None:
        del self._parents[parent.request_id]
        for sample in parent.samples:
            self._samples.pop(sample.request.request_id, None)

    def _decoder(self, params: SamplingParams):
        key = (params.skip_special_tokens, params.spaces_between_special_tokens)
        decoder = self._text_decoders.get(key)
        if decoder is None:
            decoder = self._text_decoders[key] = text_decoder(self.tokenizer, *key)
        return decoder

    def _take_new_tokens(self, request: Request, sample: _Sample, logprobs: list[PositionLogprobs] | None) -> None:
        """Detokenize the tokens the step appended (one, or several after accepted drafts) and
        apply the stops the scheduler does not see: stop strings and a complete structured output.
        A stop string ends the output at the token that completed it, as if no later token had
        been sampled (the tokens after it, accepted drafts, are dropped)."""
        params = request.params
        out = request.output_token_ids
        first = len(out) - request.num_new_tokens
        for i in range(first, len(out)):
            if sample.logprobs is not None:
                sample.logprobs.append(self._decoded(logprobs[i - first]))
            # The token that stopped the request (EOS or one of stop_token_ids) stays in token_ids.
            # Its text joins the text with include_stop_str_in_output (vLLM's rule) or with
            # skip_special_tokens false (ours, not vLLM's: the text then decodes every id of
            # token_ids, which RL clients rely on); otherwise it is left out, as in vLLM.
            stopped_by_token = i == len(out) - 1 and request.is_finished and request.finish_reason == "stop"
            matched = None
            if not stopped_by_token:
                matched = sample.detok.append(out[i], check_stop=i + 1 > params.min_tokens)
            elif params.include_stop_str_in_output or not params.skip_special_tokens:
                sample.detok.append(out[i], check_stop=False)
            if matched is None and not request.is_finished and request.grammar is not None \
                    and request.grammar.is_stopped():  # the structured output is complete
                if request.grammar.is_error():
                    log.warning("request %s left its grammar: %s", request.request_id, request.grammar.error())
                self.scheduler.finish(request.request_id, "stop")
                request.finish_reason, request.stop_reason = "stop", None
            if matched is not None:
                if not request.is_finished:
                    self.scheduler.finish(request.request_id, "stop")
                request.finish_reason, request.stop_reason = "stop", matched
                del out[i + 1:]
                return

    def _output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for i, sample in enumerate(parent.samples):
            request = sample.request
            finished = request.is_finished
            completions.append(CompletionOutput(
                index=i, text=sample.detok.visible_text(finished),
                token_ids=list(request.output_token_ids),
                finish_reason=request.finish_reason if finished else None,
                stop_reason=request.stop_reason if finished else None,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                retention=request.retention if finished else None))
        reqs = [s.request for s in parent.samples]
        drafting = [r.drafting.counts for r in reqs if r.drafting is not None]
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=_min_time(r.first_scheduled_time for r in reqs),
            first_token_time=_min_time(r.first_token_time for r in reqs),
            finished_time=max((r.finished_time or 0.0) for r in reqs) if parent.finished else None,
            spec_num_drafts=sum(d.num_drafts for d in drafting),
            spec_num_draft_tokens=sum(d.num_draft_tokens for d in drafting),
            spec_num_accepted_tokens=sum(d.num_accepted_tokens for d in drafting),
        )
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=completions,
            finished=parent.finished, num_cached_tokens=min(r.num_cached_tokens for r in reqs),
            metrics=metrics,
            prompt_logprobs=list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None)

    def _decoded(self, entry: PositionLogprobs) -> PositionLogprobs:
        """``entry`` with each token's text (``decode([id])``, special tokens kept), cached by id:
        the ids not seen before are decoded in one call, so a logprobs request costs the
        engine thread its own tokens' texts, never the whole vocabulary's."""
        texts = self._token_texts
        missing = [t for t in entry if t not in texts]
        if missing:
            texts.update(zip(missing, self._token_decoder(missing), strict=True))
        return {t: Logprob(lp.logprob, lp.rank, texts[t]) for t, lp in entry.items()}


def _min_time(values) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None
