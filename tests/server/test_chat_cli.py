"""``hyprefix chat``: the loop with a model loaded here and with a server, its commands, and
the per-turn line that shows the prefix cache at work (every turn resends the conversation)."""

from __future__ import annotations

import io
import itertools
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from hyprefix.chat_cli import ChatArgs, ChatError, Conversation, LocalChat, RemoteChat, TurnStats, run_chat
from hyprefix.config import EngineArgs
from hyprefix.engine import Engine
from tests.server.test_server import MODEL, launch_server

SYSTEM = "You answer questions about the weather. " * 12  # several blocks every turn repeats
GREEDY = ChatArgs(max_tokens=6, temperature=0.0)
TURN = re.compile(r"\[cached (\d+)/(\d+) prompt tokens · TTFT [\d.]+ s · (\d+) tokens")


def chat(backend, lines: list[str], args: ChatArgs = GREEDY, system: str | None = SYSTEM) -> tuple[str, list]:
    """Run the loop over ``lines`` (then EOF); the output and each turn's (cached, prompt, completion)."""
    script: Iterator[str] = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(script)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    assert run_chat(backend, args, Conversation(system), read, out) == 0
    text = out.getvalue()
    return text, [tuple(int(g) for g in m.groups()) for m in TURN.finditer(text)]


@pytest.fixture(scope="module")
def local() -> LocalChat:
    engine = Engine(EngineArgs(model="demo-dense-tiny", enforce_eager=True, num_kv_blocks=256, log_stats_interval=0))
    return LocalChat(engine, "demo-dense-tiny")


def test_each_turn_reuses_the_conversation_so_far(local):
    text, turns = chat(local, ["hello", "tell me more", "and more"])
    assert text.startswith("hyprefix chat with demo-dense-tiny.")
    assert len(turns) == 3
    assert turns[0][0] == 0
    for (_, prompt_before, _), (cached, prompt, completion) in itertools.pairwise(turns):
        assert prompt > prompt_before and completion == 6
        assert cached >= 16 * (prompt_before // 16)  # at least the previous prompt's whole blocks
        assert cached % 16 == 0 and cached < prompt
    local.engine.check_invariants()
    assert local.engine.get_stats()["num_requests_running"] == 0


def test_commands_reset_and_set_the_system_prompt(local):
    text, turns = chat(local, ["/system", "first question", "/reset", "first question", "/system Be brief.",
                               "/system", "/nonsense", "hi", "/exit", "never read"], system="Be kind.")
    assert "(system prompt: 'Be kind.')" in text and "(system prompt: 'Be brief.')" in text
    assert "(new conversation)" in text and "(unknown command /nonsense" in text
    assert len(turns) == 3  # the line after /exit is never read
    assert turns[1][0] > 0 and turns[1][1] == turns[0][1]  # the same prompt again after /reset: a hit


def test_a_turn_the_engine_refuses_is_not_kept_and_bad_flags_stop_at_once(local):
    text, turns = chat(local, ["x " * 5000, "hello"], system=None)  # the first is over the model's context
    assert text.count("(error: ") == 1 and len(turns) == 1 and turns[0][1] < 100
    local.engine.check_invariants()
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}):
        with pytest.raises(ValueError):
            ChatArgs(**bad)


def test_stopping_a_reply_early_aborts_its_request(local):
    stats = TurnStats()
    stream = local.stream([{"role": "user", "content": "go on"}], ChatArgs(max_tokens=200, temperature=0.0), stats)
    next(stream)
    stream.close()  # as Ctrl-C does
    assert stats.prompt_tokens > 0
    assert local.engine.get_stats()["num_requests_running"] == 0
    local.engine.check_invariants()


def test_with_a_running_server(tmp_path):
    with launch_server(tmp_path / "server.log") as (url, _):
        backend = RemoteChat(url)
        assert backend.name == MODEL
        text, turns = chat(backend, ["hello", "tell me more"])
        assert len(turns) == 2 and turns[0][0] == 0 and turns[1][0] > 0
        # a refused turn says why, is not kept, and the chat goes on
        text, turns = chat(backend, ["hello", "again"], ChatArgs(max_tokens=10**7))
        assert text.count("(error: ") == 2 and "400" in text and not turns
    with pytest.raises(ChatError, match="cannot reach"):
        RemoteChat(url)


def test_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "hyprefix.cli", "chat", "--model", "demo-dense-tiny", "--enforce-eager",
           "--num-kv-blocks", "128", "--max-tokens", "4", "--temperature", "0", "--system", SYSTEM]
    done = subprocess.run(cmd, input="hello\nagain\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    turns = TURN.findall(done.stdout)
    assert len(turns) == 2 and int(turns[1][0]) > 0
    assert "running 1, waiting" not in done.stderr  # the engine's stats lines stay out of the chat
    refused = subprocess.run([*cmd[:4], "--url", "http://127.0.0.1:9", "--dtype", "float32"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "drop --dtype" in refused.stderr
