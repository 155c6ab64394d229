"""``hyprefix chat``: an interactive chat in the terminal, with a model loaded here or with a
running server (``--url``). Each turn streams the reply and then says how many of the
prompt's tokens came from the prefix cache and how long the first token took, so the cache
is seen at work: every turn resends the whole conversation, and only its new end is computed.

Commands: ``/reset`` forgets the conversation, ``/system TEXT`` sets the system prompt (and
starts over, since it is the start of every prompt), ``/system`` shows it, ``/exit`` ends."""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

HELP = ("commands: /reset (new conversation), /system TEXT (set the system prompt; starts over), "
        "/system (show it), /exit (or Ctrl-D)")


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    seconds: float = 0.0

    def describe(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f} s"
        decode = self.seconds - (self.ttft_s or 0.0)
        rate = f" at {(self.completion_tokens - 1) / decode:.1f} tok/s" if self.completion_tokens > 1 and decode > 0 \
            else ""
        return (f"[cached {self.cached_tokens}/{self.prompt_tokens} prompt tokens · TTFT {ttft} · "
                f"{self.completion_tokens} tokens{rate}]")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ChatArgs:
    """``hyprefix chat``'s own flags (a model loaded here takes the engine's, ``EngineArgs``)."""

    url: str | None = _opt(None, "chat with the OpenAI-compatible server at this URL (e.g. http://127.0.0.1:8000) "
                                 "instead of loading --model here; --model then names one of the server's models, "
                                 "its first when not given")
    api_key: str | None = _opt(None, "with --url: the server's API key (default: $HYPREFIX_API_KEY)")
    system: str | None = _opt(None, "system prompt (/system changes it during the chat)")
    max_tokens: int = _opt(512, "most tokens of one reply")
    temperature: float = _opt(0.8, "sampling temperature (llama.cpp's chat default); 0 is greedy")
    top_p: float = _opt(0.95, "nucleus sampling: the smallest set of tokens holding this much probability")

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


class ChatBackend(Protocol):
    name: str

    def stream(self, messages: list[dict[str, str]], sampling: ChatArgs, stats: TurnStats) -> Iterator[str]:
        """The reply's text in pieces as they come; fills ``stats`` (its token counts once the
        reply ends). Closing the iterator early abandons the reply."""


class LocalChat:
    """A model in this process: the engine's own step loop, one request a turn."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name
        self._ids = itertools.count()

    def stream(self, messages: list[dict[str, str]], sampling: ChatArgs, stats: TurnStats) -> Iterator[str]:
        from hyprefix.sampling import SamplingParams

        engine = self.engine
        request_id = f"chat-{next(self._ids)}"
        params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p)
        engine.add_request(request_id, {"prompt_token_ids": engine.encode_chat(messages)}, params)
        shown, finished = 0, False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    text, finished = out.outputs[0].text, out.finished
                    stats.prompt_tokens, stats.cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
                    stats.completion_tokens = len(out.outputs[0].token_ids)
                    if len(text) > shown:
                        yield text[shown:]
                        shown = len(text)
        finally:
            if not finished:
                engine.abort(request_id)


class RemoteChat:
    """A running OpenAI-compatible server: streamed chat completions whose last chunk carries
    the usage (``stream_options.include_usage``), cached tokens included."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600) -> None:
        import httpx

        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.name = model or self._first_model()

    def _first_model(self) -> str:
        import httpx

        try:
            response = self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from exc
        _raise_for_error(response)
        return response.json()["data"][0]["id"]

    def stream(self, messages: list[dict[str, str]], sampling: ChatArgs, stats: TurnStats) -> Iterator[str]:
        import httpx

        try:
            yield from self._events(messages, sampling, stats)
        except httpx.HTTPError as exc:
            raise ChatError(f"{self.url}: {exc}") from exc

    def _events(self, messages: list[dict[str, str]], sampling: ChatArgs, stats: TurnStats) -> Iterator[str]:
        body = {"model": self.name, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                _raise_for_error(response)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage")
                if usage:
                    stats.prompt_tokens, stats.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    stats.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in chunk.get("choices", []):
                    if text := (choice.get("delta") or {}).get("content"):
                        yield text


def _raise_for_error(response: Any) -> None:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise ChatError(f"{response.request.url}: {response.status_code} {message}")


class ChatError(RuntimeError):
    """The server refused a turn or could not be reached; the chat goes on."""


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": user}]


def run_chat(backend: ChatBackend, sampling: ChatArgs, conversation: Conversation,
             read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> int:
    """The loop: read a line, answer it (or run a command), until EOF or /exit."""
    print(f"hyprefix chat with {backend.name}. {HELP}", file=out, flush=True)
    while True:
        try:
            line = read("\n> ").strip()
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print(file=out)
            return 130
        if not line:
            continue
        if line.startswith("/"):
            if _command(line, conversation, out):
                return 0
            continue
        _turn(backend, sampling, conversation, line, out)


def _command(line: str, conversation: Conversation, out: TextIO) -> bool:
    """Run a /command; True to end the chat."""
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit", "/bye"):
        return True
    if name == "/reset":
        conversation.turns.clear()
        print("(new conversation)", file=out)
    elif name == "/system" and arg.strip():
        conversation.system, conversation.turns = arg.strip(), []
        print("(system prompt set; new conversation)", file=out)
    elif name == "/system":
        print(f"(system prompt: {conversation.system!r})", file=out)
    else:
        print(f"(unknown command {name}; {HELP})", file=out)
    return False


def _turn(backend: ChatBackend, sampling: ChatArgs, conversation: Conversation, user: str, out: TextIO) -> None:
    stats, pieces = TurnStats(), []
    t0 = time.perf_counter()
    replies = backend.stream(conversation.messages(user), sampling, stats)
    try:
        for piece in replies:
            if stats.ttft_s is None:
                stats.ttft_s = time.perf_counter() - t0
            pieces.append(piece)
            print(piece, end="", file=out, flush=True)
    except KeyboardInterrupt:
        replies.close()
        print("\n(reply interrupted; not kept)", file=out, flush=True)
        return
    except (ChatError, ValueError) as exc:  # a server's refusal, or the engine's (RequestError): not kept
        print(f"\n(error: {exc})", file=out, flush=True)
        return
    stats.seconds = time.perf_counter() - t0
    conversation.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": "".join(pieces)}]
    print(f"\n{stats.describe()}", file=out, flush=True)
