"""The OpenAI completion and chat endpoints on top of ``AsyncEngine``.

Every request is validated and added to the engine (on the engine thread) before
any response byte is sent, so bad input is always a 4xx and never a broken
stream. Outputs are cumulative; streams send the new text of each choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from hyprefix.async_engine import AsyncEngine, EngineClosedError, EngineDeadError, OutputStream
from hyprefix.detokenizer import text_decoder
from hyprefix.engine import Engine
from hyprefix.errors import RequestError
from hyprefix.outputs import RequestOutput, RetentionGrant
from hyprefix.sampling import SamplingParams
from hyprefix.scheduling_policy import check_priority, grant_priority
from hyprefix.server.chat_output import ChatOptions, ChatOutputRules, ChatStreamer, final_message
from hyprefix.server.limits import ServerLimits
from hyprefix.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from hyprefix.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    _SamplingRequest,
)
from hyprefix.server.responses import (
    AssistantMessage,
    CacheRetention,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DetokenizeResponse,
    TokenizeResponse,
    Usage,
    chat_chunk,
    completion_chunk,
    sse,
    usage_chunk,
)
from hyprefix.text import chat_token_ids, check_text

DEFAULT_COMPLETION_MAX_TOKENS = 16

log = logging.getLogger("hyprefix.server")


@dataclass
class _Call:
    """One API call: ``len(prompts)`` engine requests, ``n`` choices each."""

    request_id: str
    model: str
    created: int
    n: int
    stream: OutputStream
    engine_ids: list[str]
    prompt_texts: list[str | None]  # each prompt's text where it came as one (echo's)
    prompt_ids: list[list[int]]  # each prompt's token ids as the engine was fed them
    include_usage: bool
    return_token_ids: bool = False
    logprobs: int | None = None  # top logprobs per token where the request asked
    priority: int | None = None  # the priority granted, where the request sent one (--highest-request-priority)

    def __post_init__(self) -> None:
        self._index = {engine_id: i for i, engine_id in enumerate(self.engine_ids)}

    def prompt_index(self, engine_id: str) -> int:
        return self._index[engine_id]


def check_model(model: str | None, model_names: list[str]) -> str:
    """The served name a request's ``model`` picks (the first when it names none); a 404 for
    a name this server does not serve."""
    if model is not None and model not in model_names:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return model or model_names[0]


class Tokenization:
    """vLLM's ``/tokenize`` and ``/detokenize``, from the tokenizer alone: they never wait
    on the engine thread (the Ray ingress answers them with its copy of the replicas'
    tokenizer), and run on a worker thread so a long text does not hold the event loop.

    A text is tokenized as ``/v1/completions`` tokenizes its prompt and a conversation as
    ``/v1/chat/completions`` renders it (``text.chat_token_ids``), so the ids are those the
    engine would be fed. Ids are decoded as the engine decodes outputs with
    ``skip_special_tokens: false`` (special tokens kept, spaces not cleaned up), so
    ``/detokenize`` of a choice's ``token_ids`` is its text."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, model_names: list[str]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_names = model_names
        self._decode = text_decoder(tokenizer, skip_special_tokens=False)

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        check_model(req.model, self.model_names)
        return await asyncio.to_thread(self._tokenize, req)

    def _tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        chat = isinstance(req, TokenizeChatRequest)
        try:
            if chat:
                ids = chat_token_ids(self.tokenizer, req.chat_prompt(), add_special_tokens=bool(req.add_special_tokens))
            else:
                check_text(req.prompt, "the prompt", param="prompt")
                ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False))
        except RequestError as exc:
            raise request_error(exc, "messages" if chat else "prompt") from exc
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(req.model, self.model_names)
        outside = [t for t in req.tokens if t >= self.vocab_size]
        if outside:
            raise APIError(400, f"token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self._decode, list(req.tokens)))


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, model_names: list[str], limits: ServerLimits | None = None,
                 chat: ChatOptions | None = None) -> None:
        self.async_engine = async_engine
        self.model_names = model_names
        self.limits = limits or ServerLimits()
        self.chat_options = chat or ChatOptions()
        # calls in flight by response id, for /abort_request (an entry goes with its call)
        self._calls: weakref.WeakValueDictionary[str, _Call] = weakref.WeakValueDictionary()
        self._releases: set[asyncio.Task] = set()  # retentions being ended (``_release_soon``)

    async def abort(self, rid: str | None) -> int:
        """Abort a call by its response id or the ``request_id`` its client gave (None: every
        request in flight); each aborted request's caller gets what it has, finish reason
        ``abort``. Returns how many engine requests were in flight."""
        if rid is None:
            return await self.async_engine.abort_requests()
        call = self._calls.get(rid) or self._calls.get(f"cmpl-{rid}") or self._calls.get(f"chatcmpl-{rid}")
        return 0 if call is None else await self.async_engine.abort_requests(list(call.engine_ids))

    # ------------------------------------------------------------- shared
    def _check(self, req: _SamplingRequest) -> str:
        model = check_model(req.model, self.model_names)
        bad = req.unsupported()
        if isinstance(req, CompletionRequest) and req.stream and req.echo and req.logprobs is not None:
            bad.append("logprobs")  # the echoed prompt's logprobs are not streamed
        if bad:
            raise APIError(400, f"{', '.join(bad)} is not supported by this server", param=bad[0])
        return model

    async def _start(self, req: _SamplingRequest, request_id: str, engine_ids: list[str], model: str,
                     add: Callable[[Engine], list[tuple[str | None, list[int]]]], prompt_param: str,
                     granted: list[int]) -> _Call:
        """Add the call's engine requests in one engine-thread command; ``add`` answers each
        prompt's (text or None, token ids) and appends the priority granted to ``granted``."""
        stream = self.async_engine.open_stream()
        try:
            added = await self.async_engine.add(stream, engine_ids, add)
        except RequestError as exc:
            error = request_error(exc, prompt_param)
            structured = req.structured()
            if error.param == "structured_outputs" and structured is not None:
                error.param = structured[0]  # the field the client used (response_format, guided_json, ...)
            raise error from exc
        call = _Call(request_id, model, int(time.time()), req.choices, stream, engine_ids,
                     [text for text, _ in added], [ids for _, ids in added], req.include_usage,
                     bool(req.return_token_ids), req.logprobs_wanted(),
                     granted[-1] if req.priority is not None and granted else None)
        self._calls[request_id] = call
        return call

    async def _collect(self, call: _Call) -> tuple[list[RequestOutput], Usage]:
        finals: dict[str, RequestOutput] = {}
        try:
            async for outs in call.stream:
                for out in outs:
                    finals[out.request_id] = out
        finally:
            call.stream.close()
        ordered = [finals[i] for i in call.engine_ids]
        return ordered, _usage(ordered)

    # -------------------------------------------------------- completions
    async def completions(self, req: CompletionRequest,
                          tenant: str | None = None) -> CompletionResponse | AsyncIterator[str]:
        model = self._check(req)
        arrival = time.time()
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens

        prompts = req.prompts()
        self.limits.check_seqs(len(prompts), req.choices)
        request_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
        engine_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]

        granted: list[int] = []  # the priority granted (``add`` runs on the engine thread)

        def add(engine: Engine) -> list[tuple[str | None, list[int]]]:
            # add_requests checks every prompt before it adds any: a bad one leaves nothing behind.
            params = SamplingParams(max_tokens=max_tokens, **req.sampling_kwargs())
            granted.append(checked_priority(engine, params))
            salt = engine_salt(req.cache_salt, tenant)
            added = engine.add_requests(
                [(engine_id, {"prompt" if isinstance(p, str) else "prompt_token_ids": p, "cache_salt": salt}, params)
                 for engine_id, p in zip(engine_ids, prompts, strict=True)],
                arrival_time=arrival, group=request_id, max_total_tokens=self.limits.max_request_tokens)
            return [(engine.tokenizer.decode(ids) if req.echo and text is None else text, ids) for text, ids in added]

        call = await self._start(req, request_id, engine_ids, model, add, "prompt", granted)
        if req.stream:
            return finalize_on_gc(self._stream_completion(call, bool(req.echo)), call.stream.close)
        outs, usage = await self._collect(call)
        choices = []
        for i, out in enumerate(outs):
            prefix = (call.prompt_texts[i] or "") if req.echo else ""
            for c in out.outputs:
                logprobs = None
                if c.logprobs is not None:
                    if req.echo:
                        logprobs = completion_logprobs(out.prompt_token_ids + list(c.token_ids),
                                                       out.prompt_logprobs + c.logprobs)
                    else:
                        logprobs = completion_logprobs(c.token_ids, c.logprobs)
                choices.append(CompletionChoice(index=i * call.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                token_ids=list(c.token_ids) if req.return_token_ids else None,
                                                prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids
                                                else None,
                                                prompt_logprobs=prompt_logprobs(out.prompt_logprobs)))
        return CompletionResponse(id=call.request_id, created=call.created, model=model, choices=choices, usage=usage,
                                  cache_retention=cache_retention([c.retention for o in outs for c in o.outputs]),
                                  priority=call.priority)

    async def _stream_completion(self, call: _Call, echo: bool) -> AsyncIterator[str]:
        args = (call.request_id, call.created, call.model)
        prompt_sent: set[int] = set()  # choices whose first chunk (the one with prompt_token_ids) went out

        def chunk(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                  logprobs: tuple[list[int], list] | None = None, stop_reason: str | int | None = None,
                  text_offset: int = 0, full_text: str = "", retention: RetentionGrant | None = None) -> dict:
            formatted = None if logprobs is None else completion_logprobs(*logprobs, text_offset)
            prompt_ids = None
            if call.return_token_ids and index not in prompt_sent:
                prompt_sent.add(index)
                prompt_ids = call.prompt_ids[index // call.n]
            return _granted(call, finish_reason, completion_chunk(
                *args, index, text, finish_reason, token_ids, formatted, stop_reason, prompt_ids,
                _retention_dict(cache_retention([retention]))))

        try:
            if echo:
                for i, text in enumerate(call.prompt_texts):
                    for j in range(call.n):
                        yield sse(chunk(i * call.n + j, text or "", None))
            async for event in _stream_choices(call, chunk, "text_completion"):
                yield event
        finally:
            call.stream.close()

    # --------------------------------------------------------------- chat
    async def chat(self, req: ChatCompletionRequest,
                   tenant: str | None = None) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self._check(req)
        arrival = time.time()
        chat = req.chat_prompt()
        rules = self._output_rules(req)
        self.limits.check_seqs(1, req.choices)
        request_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        # --tool-call-retention-s: kept from the finish, let go unless the turn ends in tool calls
        provisional = req.cache_control is None and rules.tool_mode != "none"

        granted: list[int] = []  # the priority granted (``add`` runs on the engine thread)

        def add(engine: Engine) -> list[tuple[str | None, list[int]]]:
            ids = engine.encode_chat(chat)
            room = min(engine.max_model_len, engine.max_pool_tokens)
            # the rules' overrides: a harmony reply decoded with its special tokens, its tool grammar
            kwargs = {**req.sampling_kwargs(), **rules.sampling_overrides()}
            if provisional and engine.args.tool_call_retention_s > 0:
                kwargs["cache_ttl_s"] = engine.args.tool_call_retention_s
            params = SamplingParams(max_tokens=req.max_new_tokens(len(ids), room), **kwargs)
            granted.append(checked_priority(engine, params))
            prompt = {"prompt_token_ids": ids, "cache_salt": engine_salt(req.cache_salt, tenant)}
            ((_, fed),) = engine.add_requests([(request_id, prompt, params)], arrival_time=arrival,
                                              max_total_tokens=self.limits.max_request_tokens)
            return [(None, fed)]  # fed: after truncate_prompt_tokens

        # vLLM's chat echo: the reply starts with the last message's content when it is the
        # assistant's own (continue_final_message)
        last = chat.messages[-1]
        echo = last["content"] if req.echo and last["role"] == "assistant" else ""
        call = await self._start(req, request_id, [request_id], model, add, "messages", granted)
        if req.stream:
            return finalize_on_gc(self._stream_chat(call, echo, rules, provisional), call.stream.close)
        (out,), usage = await self._collect(call)
        choices, dropped = [], []
        for c in out.outputs:
            message, finish_reason = final_message(rules, echo + c.text, c.finish_reason)
            if provisional and c.retention is not None and not (message["tool_calls"] and c.finish_reason == "stop"):
                dropped.append(c.index)  # the server keeps only a turn that ends in tool calls
            choices.append(ChatChoice(
                index=c.index, message=AssistantMessage(**message),
                logprobs=None if c.logprobs is None else chat_logprobs(c.token_ids, c.logprobs, call.logprobs or 0),
                finish_reason=finish_reason, stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None))
        if dropped:
            await self._release_retention(call, dropped)
        return ChatCompletionResponse(
            id=call.request_id, created=call.created, model=model, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs(out.prompt_logprobs),
            prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
            cache_retention=cache_retention([c.retention for c in out.outputs if c.index not in dropped]),
            priority=call.priority)

    async def _release_retention(self, call: _Call, samples: list[int]) -> None:
        """End the retentions of these choices (the server's, for a turn without tool calls)."""
        engine = self.async_engine.engine
        with contextlib.suppress(EngineClosedError, EngineDeadError):  # the engine, and its cache, are gone
            await self.async_engine.call(lambda: engine.release_retention(call.engine_ids[0], call.n, samples))

    def _release_soon(self, call: _Call, samples: list[int]) -> None:
        """``_release_retention`` from a stream's synchronous chunk builder."""
        task = asyncio.get_running_loop().create_task(self._release_retention(call, samples))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _output_rules(self, req: ChatCompletionRequest) -> ChatOutputRules:
        """How this request's replies are read (tool mode, parsers); a 400 for a tool choice
        this server was not started for."""
        mode, function = req.tool_mode()
        options = self.chat_options
        if mode == "auto" and not options.enable_auto_tool_choice:
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                                '--enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice "none", '
                                '"required" or a named function', param="tool_choice")
        return ChatOutputRules(options.reasoning_parser, mode, function, options.tool_call_parser,
                               tuple(req.tool_dicts()), req.parallel_tool_calls is not False)

    async def _stream_chat(self, call: _Call, echo: str = "", rules: ChatOutputRules | None = None,
                           provisional: bool = False) -> AsyncIterator[str]:
        args = (call.request_id, call.created, call.model)
        streamers = [ChatStreamer(rules or ChatOutputRules()) for _ in range(call.n)]

        def chunk(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                  logprobs: tuple[list[int], list] | None = None, stop_reason: str | int | None = None,
                  text_offset: int = 0, full_text: str = "", retention: RetentionGrant | None = None) -> dict:
            formatted = None if logprobs is None else chat_logprobs(*logprobs, call.logprobs or 0)
            streamer = streamers[index]
            delta = streamer.deltas(echo + full_text, finish_reason is not None)
            if provisional and retention is not None and not (streamer.called_tools and finish_reason == "stop"):
                self._release_soon(call, [index])  # the server keeps only a turn that ends in tool calls
                retention = None
            return _granted(call, finish_reason, chat_chunk(
                *args, index, delta, streamer.finish_reason(finish_reason), formatted, stop_reason, token_ids,
                retention=_retention_dict(cache_retention([retention]))))

        try:
            prompt_ids = call.prompt_ids[0] if call.return_token_ids else None
            for j in range(call.n):  # each choice's first chunk, with the prompt's ids where asked (vLLM's)
                yield sse(chat_chunk(*args, j, {"role": "assistant", "content": ""}, prompt_token_ids=prompt_ids))
            async for event in _stream_choices(call, chunk, "chat.completion.chunk"):
                yield event
        finally:
            call.stream.close()


async def _stream_choices(call: _Call, chunk: Callable[..., dict], object: str) -> AsyncIterator[str]:
    """SSE events: each choice's new text, one final chunk per choice with its finish
    and stop reasons, the usage chunk when asked for, then ``[DONE]``. With
    ``return_token_ids`` or logprobs every new token gets into a chunk with its id or
    logprobs, even one whose text is held back."""
    sent: dict[int, int] = {}
    sent_ids: dict[int, int] = {}
    offsets: dict[int, int] = {}  # completions' text offset of the next logprob token
    done: set[int] = set()
    finals: dict[str, RequestOutput] = {}
    tokens_with_text = call.return_token_ids or call.logprobs is not None
    try:
        async for outs in call.stream:
            for out in outs:
                base = call.prompt_index(out.request_id) * call.n
                for c in out.outputs:
                    index = base + c.index
                    if index in done:
                        continue
                    start = sent_ids.get(index, 0)
                    new_text = len(c.text) > sent.get(index, 0)
                    new_ids = tokens_with_text and len(c.token_ids) > start
                    if new_text or new_ids:
                        ids = list(c.token_ids[start:]) if call.return_token_ids else None
                        logprobs = (list(c.token_ids[start:]), c.logprobs[start:]) if c.logprobs is not None else None
                        yield sse(chunk(index, c.text[sent.get(index, 0):], None, ids, logprobs,
                                        text_offset=offsets.get(index, 0), full_text=c.text))
                        if logprobs is not None:
                            offsets[index] = offsets.get(index, 0) + sum(
                                len(e[t].decoded_token or "") for t, e in zip(*logprobs, strict=True))
                        sent[index] = len(c.text)
                        sent_ids[index] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(index)
                        yield sse(chunk(index, "", c.finish_reason, stop_reason=c.stop_reason, full_text=c.text,
                                        retention=c.retention))
                if out.finished:
                    finals[out.request_id] = out
        if call.include_usage:
            usage = _usage([finals[i] for i in call.engine_ids if i in finals])
            yield sse(usage_chunk(call.request_id, call.created, call.model, object, usage))
    except (EngineClosedError, EngineDeadError) as exc:
        yield sse(APIError(503, str(exc), type="service_unavailable").body())
    yield "data: [DONE]\n\n"


def cache_retention(grants: list[RetentionGrant | None]) -> CacheRetention | None:
    """A response's ``cache_retention``: the least of its engine requests' grants (None: none asked)."""
    asked = [grant for grant in grants if grant is not None]
    if not asked:
        return None
    return CacheRetention(ttl_s=min(g.ttl_s for g in asked), tokens=min(g.num_tokens for g in asked))


def _retention_dict(retention: CacheRetention | None) -> dict[str, Any] | None:
    return None if retention is None else retention.model_dump()


def _granted(call: _Call, finish_reason: str | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """A choice's final chunk carries the priority granted, where the request sent one."""
    if finish_reason is not None and call.priority is not None:
        chunk["priority"] = call.priority
    return chunk


def checked_priority(engine: Engine, params: SamplingParams) -> int:
    """The priority ``params`` will get (``grant_priority``); a 400 where the policy takes none."""
    check_priority(engine.args.scheduling_policy, params.priority)
    return grant_priority(params.priority, engine.args.highest_request_priority)


def engine_salt(cache_salt: str | None, tenant: str | None) -> str | None:
    """The engine's cache salt: the client's, bound to its tenant when there is one."""
    return cache_salt if tenant is None else f"{tenant}|{cache_salt or ''}"


def _usage(outs: list[RequestOutput]) -> Usage:
    usage = Usage()
    for out in outs:
        usage.add(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
    return usage


def finalize_on_gc(events: AsyncIterator[str], cancel: Callable[[], None]) -> AsyncIterator[str]:
    """Run ``cancel`` (abort the stream's requests) if the event generator is dropped
    without ever running (its ``finally`` then never runs), e.g. the client left before
    the response started."""
    weakref.finalize(events, cancel)
    return events


def request_error(exc: RequestError, prompt_param: str) -> APIError:
    """The 400 of an engine ``RequestError``: its param and code, where the engine's
    "prompt" is the endpoint's prompt field (``messages`` for a chat)."""
    param = prompt_param if exc.param == "prompt" else exc.param
    return APIError(400, str(exc), param=param, code=exc.code)


def as_api_error(exc: BaseException) -> APIError:
    """The OpenAI error a failed call answers: its own ``APIError``; 503 while the engine
    stops; 500 when it died or on any other exception (a bug of ours, logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), type="service_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), type="internal_server_error")
    log.error("internal error", exc_info=exc)
    return APIError(500, "internal server error", type="internal_server_error")
