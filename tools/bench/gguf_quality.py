"""Quality of each weight format hyprefix runs a GGUF file in, against the same file dequantized
to float32:

    .venv/bin/python tools/bench/gguf_quality.py --model FILE [--model FILE ...] [--out JSON] [--markdown]

For every file, ``LLM(file, quantization="none", dtype="float32")`` (every matrix dequantized by
gguf to float32) is the reference, and each format of ``FORMATS`` is loaded in turn (one engine
at a time) and compared with it:

- next-token distributions: a few plain-English texts (``TEXTS``, each cut to ``--max-text-tokens``)
  are prefilled whole through the engine's runner and the LM head is applied to the hidden state
  of EVERY position (``position_logits``); per position, KL(ref || format) in nats over the full
  vocabulary from float64 log-softmaxes (``kl_divergence``). Reported: mean, 99th percentile
  (linear interpolation) and max over all positions of all texts, top-1 agreement (the % of
  positions whose argmax equals the reference's) and the mean negative log-likelihood of the
  texts' actual next tokens (the model's own quality, for scale);
- greedy decoding: ``PROMPTS`` (chat-templated where the file's tokenizer has a chat template,
  else plain text) decoded at temperature 0 for ``--max-tokens`` new tokens (stopping at EOS, as a
  user's request would) in one ``LLM.generate`` batch; the % of completions whose token ids are
  identical to the reference's and the mean length of the common prefix of token ids
  (``greedy_agreement``);
- the resident weight bytes (``engine.memory_bytes["weights"]``) beside the file size.

The "reference" row is a second run of the reference engine (its prefix cache reset first): KL
exactly 0 and 100 % agreement check that the measurement itself is deterministic. A format that
fails to load or run is reported with its error instead of numbers. No timings are taken.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Format:
    """One way to run a GGUF file: ``LLM(file, quantization=..., dtype=...)``."""

    name: str
    quantization: str | None
    dtype: str


REFERENCE = Format("reference (none, float32)", "none", "float32")
FORMATS: tuple[Format, ...] = (
    REFERENCE,
    Format("default (file blocks), float32", None, "float32"),
    Format("int8, float32", "int8", "float32"),
    Format("int4, float32", "int4", "float32"),
    Format("default, dtype auto", None, "auto"),
)

# Engine arguments of every format: a small pool and context (the texts and prompts fit in 512
# tokens; with max_model_len no longer than a sliding window there is no separate window pool,
# which ``position_logits`` does not fill).
ENGINE_ARGS: dict[str, object] = {"max_model_len": 512, "kv_cache_memory_gb": 0.25, "log_stats_interval": 0}

# Plain-English prose (written for this tool), no code: 300-450 tokens each in the tokenizers of
# SmolLM2 and Gemma 3.
TEXTS: tuple[str, ...] = (
    "The lighthouse on the northern point was built in the spring of a wet year, when the village still "
    "believed that the sea could be argued with. Its first keeper was a widower named Thomas Hale, who had "
    "spent twenty years on fishing boats and knew the coast the way other men knew the streets of their own "
    "town. He climbed the spiral stairs four times a night to trim the wick and polish the great glass lens, "
    "and in the morning he wrote down the weather in a thick book with a green cover. The entries are short "
    "and plain. Wind from the west, strong. Rain before dawn. A schooner passed close to the rocks at four "
    "and turned away in time. Reading them now, one notices how rarely he mentions himself. He does not say "
    "whether he was tired or lonely, or whether he missed his wife, who had died the winter before he took "
    "the post. He writes instead about the colour of the water, the number of gulls on the reef, and the "
    "ships that came and went. Only once, in the autumn of his sixth year, does the book change its tone. A "
    "storm had lasted three days, and on the third night a small boat had come ashore below the tower with "
    "two boys in it, cold and frightened but alive. Hale carried them up to the kitchen, wrapped them in "
    "blankets, and sat with them until morning. In the book he wrote that the light had done its work, and "
    "that he was glad of it. The boys grew up to be fishermen themselves, and one of them, many years later, "
    "became the keeper of the same lighthouse. He kept the green book on the shelf by the stairs, and on "
    "quiet evenings he would read the old entries aloud to his own children, so that they would remember "
    "the man who had kept the lamp burning when it mattered most.",
    "Baking bread at home is less a matter of following a recipe than of learning to pay attention. Flour, "
    "water, salt and yeast are all that a simple loaf needs, but the same four things can produce a dense, "
    "pale brick or a tall loaf with a crackling crust, depending on how they are handled. The first lesson "
    "is patience. Yeast works slowly, especially in a cool kitchen, and dough that is rushed will taste flat "
    "and bake unevenly. Many experienced bakers mix their dough in the evening and leave it to rise overnight "
    "in a cold room, because a long, slow rise develops flavour that no amount of kneading can provide. The "
    "second lesson is touch. A well-kneaded dough feels smooth and springy, and it pulls back gently when it "
    "is pressed with a finger. A dough that tears easily needs more work, while one that feels tight and "
    "resists every stretch should be left to rest for a few minutes before it is shaped. The third lesson is "
    "heat. Home ovens are rarely as hot as the ovens of a bakery, so bakers use tricks to help them: a heavy "
    "pot with a lid that traps steam, a stone that stores heat, or a tray of boiling water placed on the "
    "lowest shelf. Steam keeps the surface of the loaf soft during the first minutes of baking, which lets "
    "it rise fully before the crust sets. Finally, there is the hardest lesson of all, which is to wait "
    "until the bread has cooled before cutting it. The inside of a fresh loaf is still cooking when it "
    "leaves the oven, and a slice taken too early will be gummy and heavy. Those who can resist the smell "
    "for an hour are rewarded with bread that is light, open and full of flavour.",
    "A river is never quite the same from one season to the next. In early spring, when the snow melts in the "
    "hills, the water rises quickly and turns brown with the soil it carries. It spreads over the low meadows "
    "along its banks and leaves behind a thin layer of silt, which makes those fields some of the richest "
    "farmland in the region. By summer the flow has slowed, the water has cleared, and the shallow stretches "
    "warm in the sun. This is the season when insects hatch in enormous numbers, when young fish feed in the "
    "weedy margins, and when herons stand motionless at the edge of the reeds waiting for them. In autumn "
    "the leaves of the willows and alders fall into the current and are carried downstream, where they "
    "collect in slow pools and begin to rot. That may sound like waste, but it is the start of a food chain: "
    "tiny creatures break the leaves down, larger creatures eat them, and fish eat those in turn. Winter is "
    "the quiet season. The water is cold and low, ice forms along the banks on still mornings, and most "
    "animals move less and eat less until the days grow longer again. People who live near rivers have "
    "always understood these rhythms, even when they did not describe them in scientific terms. They knew "
    "when to plant and when to harvest, when the fishing would be good, and when it was wise to move their "
    "animals to higher ground. In recent centuries many rivers have been straightened, dammed and lined "
    "with stone, and some of those rhythms have been lost. Today a growing number of towns are trying to "
    "give their rivers back a little of their old freedom, letting them flood the meadows again and "
    "planting trees along their banks, and they are finding that the rivers are healthier for it.",
    "Dear Anna, I promised to write as soon as we arrived, and I am sorry that it has taken me almost a week. "
    "The city is larger and louder than I expected, and for the first few days I did little more than walk "
    "and look. Our apartment is on the fourth floor of an old building near the market, and every morning "
    "we wake to the sound of traders setting up their stalls and shouting to one another across the square. "
    "The stairs are steep and there is no lift, so we have become very careful about what we buy, since "
    "every bag of oranges has to be carried up eighty steps. On Tuesday we took a boat along the canal to "
    "the old harbour, where the houses are painted in shades of yellow, blue and red, and where the cafes "
    "put their tables right at the edge of the water. We sat there for most of the afternoon, drinking "
    "coffee and watching the boats, and I thought of you and of how much you would have liked it. Yesterday "
    "it rained without stopping, so we spent the day in the museum of history, which has a whole floor of "
    "maps drawn by sailors who had never seen the coasts they were drawing, only heard about them from "
    "others. Some of the maps are wonderfully wrong, with islands that do not exist and rivers that flow "
    "uphill. Tomorrow we plan to take the train into the mountains and stay for two nights in a small inn "
    "that a friend recommended. I will write again when we return, and I will try to send you a photograph "
    "of the lake. Please give my love to your parents, and tell your brother that I have not forgotten "
    "the book I borrowed from him. With love, Clara.",
)

# Short prompts for greedy decoding (a user message each; plain text where there is no chat template).
PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about the sea.",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Tell me a short story about a cat who finds a key.",
    "How do plants make their food?",
    "List five fruits that are red.",
    "Why do we have seasons on Earth?",
    "Describe a busy market in the morning.",
    "What should I pack for a weekend trip to the mountains?",
    "Summarize the story of Cinderella in a few sentences.",
    "How does a bicycle stay upright when it moves?",
    "Write a polite email asking a colleague for a meeting.",
    "What are the main causes of forest fires?",
    "Explain what a library is to a young child.",
)


def position_logits(llm, prompt: Sequence[int], rows: int = 128) -> torch.Tensor:
    """Float32 logits [len(prompt), vocab] at EVERY position of ``prompt``: one prefill of the whole
    prompt through ``llm.engine.runner``'s model (as ``tests/support/compare.our_last_logits``
    runs one), then ``compute_logits`` (final norm and LM head, in the format's own arithmetic)
    on the hidden states of all positions, ``rows`` at a time. The KV slots it takes are freed
    afterwards. Engines with a separate sliding-window KV pool are refused (keep ``max_model_len``
    no longer than the model's window)."""
    from hyprefix.outputs import ScheduledSeq
    from hyprefix.runner.batch import build_batch
    from hyprefix.sampling import SamplingParams

    runner, kv = llm.engine.runner, llm.engine.cache.kv
    if runner.has_window_pool:
        raise ValueError("position_logits does not fill a sliding-window KV pool: use a max_model_len no longer "
                         "than the model's sliding window")
    request_id = "gguf-quality"
    if not kv.allocate_slots(request_id, len(prompt)):
        raise RuntimeError(f"the KV pool cannot hold a {len(prompt)}-token prompt")
    try:
        runner._apply_state_ops([(None, 0)] if runner.recurrent_states else [])
        seq = ScheduledSeq(request_id, list(prompt), 0, kv.block_table(request_id), True,
                           SamplingParams(temperature=0), state_slot=0)
        with torch.inference_mode():
            batch = build_batch([seq], kv.block_size, runner.device, runner.cascade_thresholds)
            hidden = runner.model(batch, runner.kv_caches, runner.recurrent_states)
            assert hidden.shape[0] == len(prompt), "one prefill's hidden states are its tokens in order"
            return torch.cat([runner.model.compute_logits(hidden[i:i + rows]).float()
                              for i in range(0, len(prompt), rows)])
    finally:
        kv.free(request_id)


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """KL(ref || ours) in nats at each position (float64 [positions]): with ``p`` and ``q`` the
    float64 log-softmaxes of the two [positions, vocab] logit tensors over the full vocabulary,
    ``sum_v exp(p_v) * (p_v - q_v)``, ``rows`` positions at a time. Exactly 0 where the logits
    are equal."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits of shapes {tuple(ref_logits.shape)} and {tuple(logits.shape)}")
    out = []
    for i in range(0, ref_logits.shape[0], rows):
        p = torch.log_softmax(ref_logits[i:i + rows].double(), dim=-1)
        q = torch.log_softmax(logits[i:i + rows].double(), dim=-1)
        out.append((p.exp() * (p - q)).sum(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def next_token_nll(logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """Negative log-likelihood (nats, float64) of ``tokens[i + 1]`` under the logits at position
    ``i``, for every position but the last."""
    targets = torch.tensor(list(tokens[1:]), dtype=torch.long)
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -logp.gather(1, targets[:, None])[:, 0]


def distribution_agreement(ref_logits: Sequence[torch.Tensor], logits: Sequence[torch.Tensor],
                           texts: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """Over every position of every text (``ref_logits[i]`` and ``logits[i]``: [len(text i), vocab]):
    the mean, 99th percentile (linear interpolation) and max of ``kl_divergence`` in nats, the % of
    positions whose argmax equals the reference's (``top1_pct``) and the number of positions; with
    ``texts`` (the token ids) also the mean next-token NLL of ``logits`` (``mean_nll``)."""
    kl = torch.cat([kl_divergence(r, o) for r, o in zip(ref_logits, logits, strict=True)])
    same = torch.cat([r.argmax(-1) == o.argmax(-1) for r, o in zip(ref_logits, logits, strict=True)])
    out = {"mean_kl": kl.mean().item(), "p99_kl": torch.quantile(kl, 0.99).item(), "max_kl": kl.max().item(),
           "top1_pct": 100.0 * same.double().mean().item(), "positions": int(kl.numel())}
    if texts is not None:
        out["mean_nll"] = torch.cat([next_token_nll(o, t) for o, t in zip(logits, texts, strict=True)]).mean().item()
    return out


def greedy_agreement(ref_tokens: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> dict[str, float]:
    """Per completion pair: the % of completions whose token ids equal the reference's
    (``identical_pct``), the mean length of their common prefix in tokens
    (``mean_common_prefix``) and the reference completions' mean length (``mean_ref_tokens``)."""
    from hyprefix.text import common_prefix

    pairs = list(zip(ref_tokens, tokens, strict=True))
    if not pairs:
        raise ValueError("no completions to compare")
    return {"identical_pct": 100.0 * sum(list(r) == list(t) for r, t in pairs) / len(pairs),
            "mean_common_prefix": sum(common_prefix(r, t) for r, t in pairs) / len(pairs),
            "mean_ref_tokens": sum(len(r) for r, _ in pairs) / len(pairs), "completions": len(pairs)}


def greedy_tokens(llm, prompts: Sequence[Sequence[int]], max_tokens: int,
                  ignore_eos: bool = False) -> list[list[int]]:
    """The token ids ``llm`` generates for each prompt (token ids) at temperature 0, at most
    ``max_tokens`` of them (stopping at EOS unless ``ignore_eos``), all prompts in one batch."""
    from hyprefix import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def encode_inputs(model: str, texts: Sequence[str], prompts: Sequence[str], max_text_tokens: int,
                  tokenizer: str | None = None) -> tuple[list[list[int]], list[list[int]], bool]:
    """(text token ids, each cut to ``max_text_tokens``; prompt token ids; whether the prompts went
    through the tokenizer's chat template: a user message each when it has one, else plain text)
    under the file's tokenizer (or ``tokenizer``)."""
    from hyprefix.models.loader import load_tokenizer
    from hyprefix.text import chat_token_ids

    tok = load_tokenizer(tokenizer or model)
    text_ids = [list(tok(t)["input_ids"])[:max_text_tokens] for t in texts]
    chat = getattr(tok, "chat_template", None) is not None
    if chat:
        prompt_ids = [chat_token_ids(tok, [{"role": "user", "content": p}]) for p in prompts]
    else:
        prompt_ids = [list(tok(p)["input_ids"]) for p in prompts]
    return text_ids, prompt_ids, chat


def file_types(model: str) -> dict[str, int]:
    """How many tensors of each GGML type the GGUF file holds."""
    import gguf

    return dict(collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(model).tensors).most_common())


def evaluate_file(model: str, text_ids: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]],
                  formats: Sequence[Format] = FORMATS, max_tokens: int = 64, ignore_eos: bool = False,
                  engine_args: dict | None = None) -> dict:
    """The report of one GGUF file: its size and tensor types, and per format of ``formats``
    (whose ``REFERENCE`` entry, run first, is the reference whatever its place) a row with its
    resident weight bytes, resolved dtype, ``distribution_agreement`` over ``text_ids`` and
    ``greedy_agreement`` over ``prompt_ids`` against the reference, or ``error`` where the format
    failed. The reference's own row is a second pass of the reference engine after resetting its
    prefix cache. ``engine_args``: every engine's other ``LLM`` arguments (default ``ENGINE_ARGS``)."""
    from hyprefix import LLM

    kwargs = dict(ENGINE_ARGS if engine_args is None else engine_args)
    report: dict = {"model": str(model), "file_bytes": os.path.getsize(model), "file_types": file_types(model),
                    "texts_tokens": [len(t) for t in text_ids], "prompts": len(prompt_ids),
                    "max_tokens": max_tokens, "ignore_eos": ignore_eos, "engine_args": kwargs, "formats": []}

    def run(llm) -> tuple[list[torch.Tensor], list[list[int]]]:
        return [position_logits(llm, t) for t in text_ids], greedy_tokens(llm, prompt_ids, max_tokens, ignore_eos)

    def row(fmt: Format, llm, logits: list[torch.Tensor], tokens: list[list[int]]) -> dict:
        return {**asdict(fmt), "resident_bytes": llm.engine.memory_bytes["weights"],
                "resolved_dtype": str(llm.engine.runner.model.dtype).removeprefix("torch."),
                **distribution_agreement(ref_logits, logits, text_ids), **greedy_agreement(ref_tokens, tokens)}

    try:
        ref_llm = LLM(model, quantization=REFERENCE.quantization, dtype=REFERENCE.dtype, **kwargs)
        ref_logits, ref_tokens = run(ref_llm)
    except Exception as exc:
        report["error"] = f"reference failed: {type(exc).__name__}: {exc}"
        report["formats"] = [{**asdict(f), "error": report["error"]} for f in formats]
        return report
    rows: dict[Format, dict] = {}
    for fmt in [REFERENCE] + [f for f in formats if f != REFERENCE]:
        llm = None
        try:
            if fmt == REFERENCE:
                llm = ref_llm
                llm.reset_prefix_cache()
            else:
                llm = LLM(model, quantization=fmt.quantization, dtype=fmt.dtype, **kwargs)
            rows[fmt] = row(fmt, llm, *run(llm))
        except Exception as exc:
            rows[fmt] = {**asdict(fmt), "error": f"{type(exc).__name__}: {exc}"}
        finally:
            del llm
            if fmt == REFERENCE:
                del ref_llm
            gc.collect()
        print(f"{Path(model).name}: {fmt.name}: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[fmt].items()
            if k not in asdict(fmt)), file=sys.stderr, flush=True)
    report["formats"] = [rows[f] for f in formats if f in rows]
    return report


def markdown(report: dict) -> str:
    """One file's table: format, resident MB, mean / p99 / max KL, top-1 %, greedy identical %,
    mean common prefix / the reference completions' mean length (a failed format's row names its
    error)."""
    mb = 1e6
    types = ", ".join(f"{n} {k}" for k, n in report["file_types"].items())
    lines = [f"**{Path(report['model']).name}** ({report['file_bytes'] / mb:.1f} MB; tensors: {types}; "
             f"{sum(report['texts_tokens'])} positions over {len(report['texts_tokens'])} texts, "
             f"{report['prompts']} greedy prompts of up to {report['max_tokens']} tokens)", "",
             "| format | resident MB | mean KL | p99 KL | max KL | top-1 % | greedy identical % "
             "| mean common prefix / ref. tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["formats"]:
        name = r["name"] + (f" (= {r['resolved_dtype']})" if r.get("dtype") == "auto" and "resolved_dtype" in r
                            else "")
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'].replace('|', '/')} | | | | | | |")
            continue
        lines.append(f"| {name} | {r['resident_bytes'] / mb:.1f} | {r['mean_kl']:.2e} | {r['p99_kl']:.2e} | "
                     f"{r['max_kl']:.2e} | {r['top1_pct']:.1f} | {r['identical_pct']:.1f} | "
                     f"{r['mean_common_prefix']:.1f} / {r['mean_ref_tokens']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a GGUF file (repeatable)")
    parser.add_argument("--out", default=None, help="write the reports here (JSON)")
    parser.add_argument("--markdown", action="store_true", help="print a table per file")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens of each greedy completion")
    parser.add_argument("--max-text-tokens", type=int, default=448, help="cut each text to this many tokens")
    parser.add_argument("--ignore-eos", action="store_true", help="greedy completions run to --max-tokens")
    args = parser.parse_args()

    from hyprefix.hardware import device_caps

    reports = []
    for model in args.model:
        text_ids, prompt_ids, chat = encode_inputs(model, TEXTS, PROMPTS, args.max_text_tokens)
        report = evaluate_file(model, text_ids, prompt_ids, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        report["chat_template"] = chat
        reports.append(report)
    meta = {"date": datetime.date.today().isoformat(), "cpu": device_caps("cpu").name, "torch": torch.__version__,
            "command": " ".join([Path(sys.executable).name, *sys.argv])}
    if args.out:
        Path(args.out).write_text(json.dumps({**meta, "reports": reports}, indent=1))
    if args.markdown:
        print(f"{meta['date']}, CPU: {meta['cpu']}\n")
        for report in reports:
            print(markdown(report) + "\n")


if __name__ == "__main__":
    main()
