"""Real models from GGUF files that ``make test`` fetches with ``tools/models/fetch_test_models.py``:
SmolLM2-135M-Instruct (Q4_1) and Gemma 3 270M (Q4_K_M; sliding-window layers of 512
tokens), dequantized to float32 by our loader and by transformers from the same file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models.loader import gguf_parsed_once
from tests.support.compare import logit_errors

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "models"))
from fetch_test_models import GEMMA3, models_dir

pytestmark = pytest.mark.slow  # real GGUF models (SmolLM2-135M, Gemma 3 270M) loaded here and by transformers

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why they are prime."]


def fetched(name: str) -> Path:
    path = models_dir() / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make test` or `python tools/models/fetch_test_models.py` to fetch it")
    return path


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return fetched(GGUF)


@pytest.fixture(scope="module")
def llm(gguf_path) -> LLM:
    return LLM(str(gguf_path), dtype="float32", quantization="none", enforce_eager=True, log_stats_interval=0)


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_loads_config_tokenizer_and_eos_from_the_file(llm, hf):
    _, tokenizer = hf
    engine = llm.engine
    assert engine.model_path.suffix == ".gguf"
    assert type(engine.runner.model).__name__ == "LlamaForCausalLM"
    assert engine.vocab_size == len(tokenizer) == 49152
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids
    ids = engine.encode_chat(chat(QUESTIONS[0]))
    assert ids == list(tokenizer.apply_chat_template(chat(QUESTIONS[0]), add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))


def test_greedy_tokens_equal_transformers_on_chat_prompts(llm, hf):
    model, _ = hf
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [llm.engine.encode_chat(chat(q)) for q in QUESTIONS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_answers_stop_at_eos_and_the_next_turn_hits_the_cache(llm):
    params = SamplingParams(temperature=0, max_tokens=48)
    (first,) = llm.chat(chat(QUESTIONS[0]), params, use_tqdm=False)
    answer = first.outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"
    assert answer.token_ids[-1] in llm.engine.eos_token_ids
    turn = [*chat(QUESTIONS[0]), {"role": "assistant", "content": answer.text},
            {"role": "user", "content": "And of Italy?"}]
    (second,) = llm.chat(turn, params, use_tqdm=False)
    block = llm.engine.args.block_size
    # the first turn's prompt (and its answer's complete blocks) come from the cache
    assert second.num_cached_tokens >= len(first.prompt_token_ids) // block * block > 0


# ---------------------------------------------------------------- Gemma 3 270M
GEMMA3_WINDOW = 512
LIGHTHOUSES = [  # prompts of 600-900 tokens, longer than the window
    "For most of recorded history, a ship approaching a coast at night had little to go on but the stars, "
    "the depth of the water under its keel and whatever the crew remembered of the shore. The first lights "
    "that guided sailors were simple fires burning on hilltops or on the roofs of temples near a harbour "
    "mouth. They were expensive to keep, easy to confuse with the lamps of a town, and often went out in "
    "exactly the weather in which they were needed most.",
    "The Pharos of Alexandria, finished in the third century before our era, turned that habit into "
    "architecture. Ancient writers describe a tower in three stages, square at the base, eight-sided in the "
    "middle and round at the top, with a fire whose light could be seen from far out at sea. It stood for "
    "more than a thousand years before earthquakes brought it down, and its name survives in the word for "
    "lighthouse in several European languages.",
    "Building a tower on a cliff is one problem; building one on a rock that the sea covers at high tide is "
    "another. The engineers who lit the reefs off the coasts of Britain in the eighteenth century learned "
    "this the hard way. Timber towers were swept away in storms, and it was only when masons began to cut "
    "granite blocks that locked into one another, course by course, like the pieces of a puzzle, that a "
    "light could be made to stand on a bare rock for centuries.",
    "The light itself changed just as much as the towers. Candles gave way to oil lamps with polished "
    "reflectors behind them, and in the 1820s a French physicist designed a lens made of concentric rings "
    "of glass prisms. It gathered the light of a single lamp into a narrow beam, so that a flame no bigger "
    "than a hand could be seen twenty miles away. Turning the lens on a bed of mercury gave each station its "
    "own pattern of flashes, which a navigator could look up in a printed list.",
    "Keeping such a light was a trade of its own. Keepers trimmed wicks, polished brass and glass, wound "
    "the clockwork that turned the lens every few hours, and wrote the weather into a logbook through the "
    "night. On the remote rock stations they lived in rotation, a few weeks on the tower and a few weeks "
    "ashore, and a relief boat that could not land in a gale might leave them waiting for days with short "
    "supplies and no news.",
    "Electric lamps, radio beacons and finally satellite navigation made most of that work unnecessary. "
    "Today nearly every lighthouse is automatic, watched from a control room far away, and many of the old "
    "keepers' cottages have become museums or holiday homes. Yet the towers are still maintained, because a "
    "light that can be seen with the naked eye does not depend on a battery or a receiver, and a sailor "
    "whose instruments have failed will still look for it.",
    "By day a lighthouse has to be recognised without its light, so towers were painted in bands, spirals or "
    "checks of red, black and white, each pattern unique along its stretch of coast. In fog, when neither "
    "paint nor lamp could be seen, stations sounded bells, sirens or diaphones, and sailors learned to count "
    "the seconds between blasts the way they counted the seconds between flashes on a clear night.",
    "Where the sea was too deep or the sand too soft for any tower, the light was put on a ship instead. "
    "Lightships were anchored over dangerous shoals with a lantern hoisted on the mast and a crew that could "
    "go weeks without setting foot on land. They rolled in every swell, were sometimes struck by the very "
    "vessels they were meant to warn, and were among the first stations to be replaced by unmanned buoys.",
]


@pytest.fixture(scope="module")
def one_gguf_parse():
    """The engine parses a GGUF once per load; transformers' own loads (the reference)
    would parse it again, ~15 s apiece for Gemma's 262k-token vocabulary."""
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return fetched(GEMMA3)


@pytest.fixture(scope="module")
def gemma_llm(gemma_path, one_gguf_parse) -> LLM:
    # Prefill chunks of 256 tokens: a long prompt's chunks cross the 512-token window.
    return LLM(str(gemma_path), dtype="float32", quantization="none", enforce_eager=True, log_stats_interval=0,
               max_model_len=2048,
               num_kv_blocks=512, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def gemma_hf(gemma_path, one_gguf_parse):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                dtype=torch.float32).eval()


def test_gemma3_loads_and_knows_paris(gemma_llm):
    """Sane output: llama.cpp stores Gemma norms as 1 + w, transformers' GGUF reader
    subtracts the 1, our loader adds it back (a wrong offset on both sides would still
    agree token for token)."""
    engine = gemma_llm.engine
    assert type(engine.runner.model).__name__ == "Gemma3ForCausalLM"
    assert engine.runner.model.kv_layout.windows.count(GEMMA3_WINDOW) == 15  # 18 layers, every 6th full
    (out,) = gemma_llm.generate(["The Eiffel Tower is located in the city of"],
                                SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "Paris" in out.outputs[0].text


def test_gemma3_long_prompt_logits_close_to_transformers(gemma_llm, gemma_hf):
    """A whole-prompt prefill past the window (the engine's token budget does not apply
    here); observed max error 2.3e-5 on logits up to 25."""
    prompts = [gemma_llm.engine.tokenizer("\n\n".join(LIGHTHOUSES)).input_ids]
    for err, scale in logit_errors(gemma_llm, gemma_hf, prompts):
        assert err < 1e-3, f"max |logit diff| {err:.3g} vs logit scale {scale:.3g}"


def test_gemma3_greedy_equals_transformers_with_prefix_hits_across_the_window(gemma_llm, gemma_hf):
    tokenizer = gemma_llm.engine.tokenizer
    a = tokenizer("\n\n".join(LIGHTHOUSES)).input_ids
    b = tokenizer("\n\n".join(LIGHTHOUSES[3:] + LIGHTHOUSES[:3])).input_ids
    tail = tokenizer("\n\nIn short, the history of the lighthouse", add_special_tokens=False).input_ids
    rounds = [[a, b], [a[:600] + tail, a, b[:620] + tail]]  # round 2 shares 600+ tokens with round 1
    assert all(600 <= len(p) <= 900 for r in rounds for p in r)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    expected: dict[tuple[int, ...], list[int]] = {}  # transformers' tokens of each prompt (a repeats)
    for i, prompts in enumerate(rounds):
        outs = gemma_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            if tuple(prompt) not in expected:
                with torch.no_grad():
                    ref = gemma_hf.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)
                expected[tuple(prompt)] = ref[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == expected[tuple(prompt)], f"round {i} len {len(prompt)}"
            if i == 1:
                assert out.num_cached_tokens > GEMMA3_WINDOW, f"len {len(prompt)}: {out.num_cached_tokens} cached"
    gemma_llm.check_invariants()


def test_bench_transformers_arm_loads_a_gguf_file(gguf_path, hf):
    """``hyprefix bench --arms transformers --model FILE.gguf``: the anchor arm loads the file
    as transformers does (``gguf_file=``), the same weights as the reference model here."""
    import torch

    from hyprefix.bench.arms import TransformersArm

    arm = TransformersArm("transformers", str(gguf_path), "float32")
    reference, _ = hf
    assert arm.vocab_size == reference.config.vocab_size
    ours, theirs = dict(arm.hf.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


# ------------------------------------------------- the OpenAI API over these files
SCHEMA = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["capital", "population_millions"], "additionalProperties": False}
# Gemma 3's turn format (its GGUF file carries no chat template): sent as vLLM's chat_template field
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                  "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
                  "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_chat_logprobs_json_schema_and_a_required_tool_call_through_the_openai_client(which, request):
    """Both files end to end through the official ``openai`` client, on an app over the
    module's engines: their own chat template (Gemma's file has none: sent as vLLM's
    chat_template), logprobs, a JSON schema and a required tool call."""
    import openai
    from fastapi.testclient import TestClient

    from hyprefix.server import build_app

    llm = request.getfixturevalue("llm" if which == "smollm2" else "gemma_llm")
    extra = {"chat_template": GEMMA_TEMPLATE} if which == "gemma3" else {}
    with TestClient(build_app(llm.engine, ["m"])) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        _chat_api_checks(client, extra)


def _chat_api_checks(client, extra: dict) -> None:
    import json

    import jsonschema

    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="m", messages=question, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body=extra)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(t.top_logprobs[0].token == t.token and t.logprob == t.top_logprobs[0].logprob for t in content)
    structured = client.chat.completions.create(
        model="m", messages=question, max_tokens=60, temperature=0.7, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, extra_body=extra)
    for choice in structured.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(model="m", messages=weather, tools=TOOLS, tool_choice="required",
                                            max_tokens=60, temperature=0, extra_body=extra)
    (call,) = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    follow_up = [*weather, called.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model="m", messages=follow_up, tools=TOOLS, tool_choice="none",
                                           max_tokens=12, temperature=0, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
