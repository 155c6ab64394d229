"""``hyprefix serve --speculative-config``: the served path verifies drafts (the counters on
/metrics move), streamed and whole answers carry every accepted token with its logprobs, and
greedy answers equal the offline engine's without speculation."""

from __future__ import annotations

import json

import httpx

from hyprefix import LLM, SamplingParams
from hyprefix.demo import demo_model_path
from tests.server.test_server import launch_server, metric

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPT = "one two three four one two three four one two three four one two"


def test_served_drafts_stream_and_match_decoding_without_them(tmp_path):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    with launch_server(tmp_path / "server.log", "--speculative-config", SPEC) as (url, _):
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        tokens, texts, logprobs = [], [], []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    texts.append(choice["text"])
                    if choice.get("logprobs"):
                        tokens += choice["logprobs"]["tokens"]
                        logprobs += choice["logprobs"]["token_logprobs"]
        drafts = metric(url, "hyprefix:spec_decode_num_drafts_total")
        accepted = metric(url, "hyprefix:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted >= 0
    assert "".join(texts) == whole["text"]
    assert len(whole["logprobs"]["tokens"]) == 40 and tokens == whole["logprobs"]["tokens"]
    assert logprobs == whole["logprobs"]["token_logprobs"]

    llm = LLM(str(demo_model_path("dense")), enforce_eager=True, num_kv_blocks=1024, log_stats_interval=0)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].text == whole["text"]
