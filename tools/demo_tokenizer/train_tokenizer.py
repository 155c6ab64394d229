"""Train the demo byte-level BPE tokenizer from ``corpus.txt`` and write ``tokenizer.json``.

Run once by hand (``python tools/demo_tokenizer/train_tokenizer.py``); it reads ``corpus.txt`` next to
this script and writes ``hyprefix/assets/tokenizer.json`` (the only file of the two the package
ships and reads at run time), which is committed.
Special tokens get ids 0, 1, 2 in the order of ``SPECIAL_TOKENS``.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
TOKENIZER_JSON = HERE.parents[1] / "hyprefix" / "assets" / "tokenizer.json"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train(corpus: Path = HERE / "corpus.txt") -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    return tok


def main() -> None:
    tok = train()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    out = TOKENIZER_JSON
    tok.save(str(out), pretty=True)
    print(f"wrote {out}: vocab size {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
