"""Incremental detokenization over the project's byte-level BPE tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from hyprefix.detokenizer import IncrementalDetokenizer, text_decoder

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "hyprefix" / "assets"
CORPUS = ROOT / "tools" / "demo_tokenizer" / "corpus.txt"  # the text the tokenizer was trained on
FFFD = "\ufffd"

MULTIBYTE_TEXTS = [
    "Hello 😀 世界! naïve café — 日本語のテキスト 👨‍👩‍👧 ok",
    "😀🎉🚀🧪",
    "漢字かな交じり文、中文字符和한국어 텍스트。",
    "e\u0301 combining, ZWJ 🏳️‍🌈 and flags 🇫🇷🇯🇵 at the end 🦀",
    "∑ ∫ √ → ⇒ ≤ ≥ ≠ ∞ § ¶ © ®",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=str(ASSETS / "tokenizer.json"))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(tok, prompt: list[int], ids: list[int], stop: tuple[str, ...] = ()):
    """Feed ``ids`` one by one; returns (detokenizer, visible texts while running, matched stop)."""
    d = IncrementalDetokenizer(tok, prompt, stop)
    visible, previous = [], ""
    for i in ids:
        matched = d.append(i)
        assert d.text.startswith(previous) or matched is not None, "text must only grow while running"
        previous = d.text
        if matched is not None:
            return d, visible, matched
        visible.append(d.visible_text(False))
    return d, visible, None


def test_the_texts_really_split_characters_across_tokens(tok):
    ids = [i for text in MULTIBYTE_TEXTS for i in encode(tok, text)]
    assert sum(FFFD in tok.decode([i]) for i in ids) > 20


@pytest.mark.parametrize("prompt_text", [None, "The user said:", "前の文 😀 then"],
                         ids=["no-prompt", "ascii", "multibyte"])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_token_by_token(tok, text, prompt_text):
    prompt = [] if prompt_text is None else encode(tok, prompt_text)
    ids = encode(tok, text)
    d, visible, matched = feed(tok, prompt, ids)
    assert matched is None
    for v in visible:
        assert FFFD not in v, v
    assert d.text == tok.decode(ids) == text
    assert visible[-1] == d.visible_text(True) == text  # no stop strings: nothing held back


def test_corpus_slices_token_by_token(tok):
    corpus = CORPUS.read_text()
    rng = random.Random(0)
    for _ in range(30):
        start = rng.randrange(len(corpus) - 300)
        text = corpus[start:start + rng.randint(1, 300)] + rng.choice(MULTIBYTE_TEXTS)[: rng.randint(1, 20)]
        ids = encode(tok, text)
        split = rng.randint(0, len(ids) - 1)
        while tok.decode(ids[:split]).endswith(FFFD):  # split at a character boundary
            split -= 1
        d, _, _ = feed(tok, ids[:split], ids[split:])
        assert d.text == tok.decode(ids[split:])
        assert FFFD not in d.text


def test_prompt_ending_inside_a_character(tok):
    """The prompt ends with part of a character that the first generated token
    completes: no U+FFFD, and no later character is lost."""
    for text in MULTIBYTE_TEXTS:
        ids = encode(tok, "Q: " + text)
        full = tok.decode(ids)
        for split in range(2, len(ids)):
            prompt_text = tok.decode(ids[:split])
            if not prompt_text.endswith(FFFD):
                continue
            d, visible, _ = feed(tok, ids[:split], ids[split:])
            assert FFFD not in d.text and all(FFFD not in v for v in visible)
            assert full.endswith(d.text)
            assert len(d.text) >= len(full) - len(prompt_text)


def test_an_incomplete_character_is_held_back_until_complete(tok):
    ids = encode(tok, "a😀")
    assert len(ids) >= 3 and tok.decode(ids[:2]).endswith(FFFD)
    d = IncrementalDetokenizer(tok, [], ())
    texts = []
    for i in ids:
        d.append(i)
        texts.append(d.text)
    assert texts[0] == "a"
    assert all(t == "a" for t in texts[:-1])
    assert texts[-1] == "a😀"


# ----------------------------------------------------------------------- stop strings
STOP_CASES = [
    ("The answer is STOP here", ("STOP",), "The answer is "),
    ("a STOX b STOP c STOP", ("STOP",), "a STOX b "),
    ("abc 世界 def", ("世界",), "abc "),
    ("fire 😀🎉 water", ("😀🎉",), "fire "),
    ("we meet here and there", ("er",), "we meet h"),
    ("one two three four five six", ("a very long stop string", "thr"), "one two "),
    ("one two three four five six", ("four", "two three"), "one "),
    ("stop at the very start", ("st",), ""),
    ("ends exactly with the end", ("the end",), "ends exactly with "),
]


@pytest.mark.parametrize(("text", "stop", "expected"), STOP_CASES)
def test_stop_strings_cut_the_text_and_are_never_streamed(tok, text, stop, expected):
    ids = encode(tok, text)
    d, visible, matched = feed(tok, encode(tok, "Prompt:"), ids, stop)
    assert matched is not None and matched in stop
    final = d.visible_text(True)
    assert final == d.text == expected
    assert text.startswith(expected + matched)
    for v in visible:
        assert final.startswith(v), (v, final)
        assert FFFD not in v


@pytest.mark.parametrize("stop", [("STOP",), ("zz", "a longer stop")])
def test_hold_back_without_a_match(tok, stop):
    text = "nothing matches in this piece of text 世界"
    ids = encode(tok, text)
    d, visible, matched = feed(tok, [], ids, stop)
    assert matched is None
    hold = max(len(s) for s in stop) - 1
    assert d.text == text
    assert visible[-1] == text[: len(text) - hold]
    assert d.visible_text(True) == text  # everything once finished
    for v in visible:
        assert text.startswith(v)


def test_random_stop_strings_from_the_corpus(tok):
    corpus = CORPUS.read_text()
    rng = random.Random(1)
    for _ in range(60):
        start = rng.randrange(len(corpus) - 200)
        text = corpus[start:start + rng.randint(20, 200)] + rng.choice(MULTIBYTE_TEXTS)
        a = rng.randrange(len(text) - 1)
        stop_a = text[a:a + rng.randint(1, 6)]
        b = rng.randrange(len(text) - 1)
        stop_b = text[b:b + rng.randint(1, 12)]
        stops = (stop_a, stop_b)
        first = min(text.index(s) for s in stops)
        if len({(text.index(s) + len(s), text.index(s)) for s in stops}) == 2 and \
                min(stops, key=text.index) != min(stops, key=lambda s: text.index(s) + len(s)):
            continue  # the one that starts first completes last: the other one wins, as in vLLM
        ids = encode(tok, text)
        d, visible, matched = feed(tok, [], ids, stops)
        assert matched is not None
        assert d.visible_text(True) == text[:first], (text, stops)
        assert text.index(matched) == first
        for v in visible:
            assert text[:first].startswith(v)


# ----------------------------------------------------------------------- the backend shortcut
def test_text_decoder_equals_the_tokenizers_decode(tok):
    """The backend shortcut gives what transformers' decode gives, special tokens and broken
    UTF-8 included; a tokenizer class overriding ``_decode`` keeps its own."""
    rng = random.Random(0)
    with_special = PreTrainedTokenizerFast(tokenizer_file=str(ASSETS / "tokenizer.json"))
    with_special.add_special_tokens({"eos_token": "<|eos|>", "additional_special_tokens": ["<|tool|>"]})
    special = sorted(with_special.all_special_ids)
    assert len(special) == 2
    fast = text_decoder(with_special)
    for _ in range(300):
        ids = [rng.randrange(len(with_special)) for _ in range(rng.randrange(0, 12))] + special
        rng.shuffle(ids)
        assert fast(ids) == with_special.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    loud = Shouting(tokenizer_file=str(ASSETS / "tokenizer.json"))
    ids = encode(tok, "quiet words")
    assert text_decoder(loud)(ids) == "QUIET WORDS"
