"""Write a random-weight hybrid model of a real model's shape as GGUF files, the way a llama.cpp
user gets them: the demo model's HF checkpoint (``hyprefix.demo``: ``demo-qwen3.5-0.8b``,
``demo-hybrid-0.5b``) through llama.cpp's own ``convert_hf_to_gguf.py`` to BF16, then
``llama-quantize`` to each requested type. For speed benchmarks (random weights decode at the
speed of real ones).

    python tools/models/make_hybrid_gguf.py --model demo-qwen3.5-0.8b --out /tmp/m \\
        --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp --types Q4_K_M

``--llama-cpp`` is llama.cpp's source tree (from the llama-cpp-python sdist) with
``llama-quantize`` built in ``build/bin`` (``cmake --build build --target llama-quantize``). The
demo tokenizer's pre-tokenizer is unknown to the converter's hash table; it splits as GPT-2
does, so it is named that (as the test suite's converter runs do).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from llama_converter import run_converter  # this script's directory

from hyprefix.demo import resolve_demo_alias

# Config keys the converter is not shown, by model type. transformers 5 saves its MoE defaults
# into every NemotronH config: num_experts_per_tok sends the converter down its MoE path
# (nemotron_h_moe, which llama.cpp cannot load without expert layers), n_routed_experts makes it
# write an expert count and n_group / topk_group expert groups, on which llama.cpp's loader asserts;
# hidden, it writes a dense nemotron_h.
HIDDEN = {"nemotron_h": ["num_experts_per_tok", "n_routed_experts", "n_group", "topk_group"]}
# transformers 5 states NemotronH's layer kinds as a list (layers_block_type), which the converter
# reads as MoE kinds only; the string pattern it also reads names the MLP layers of a dense one.
PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def added_keys(config: dict) -> dict:
    """Config keys the converter is shown besides the checkpoint's own."""
    if config.get("model_type") == "nemotron_h" and "layers_block_type" in config:
        return {"hybrid_override_pattern": "".join(PATTERN[kind] for kind in config["layers_block_type"])}
    return {}


def convert(checkpoint: Path, llama_cpp: Path, out: Path) -> Path:
    """The checkpoint as a BF16 GGUF file written by llama.cpp's converter."""
    config = json.loads((checkpoint / "config.json").read_text())
    model_type = config.get("model_type", "")
    flags = ["--no-mtp"] if model_type.startswith("qwen3") else []
    args = ["--outtype", "bf16", *flags, "--outfile", str(out), str(checkpoint)]
    proc = run_converter(llama_cpp, [(args, HIDDEN.get(model_type, []), added_keys(config))])
    if proc.returncode:
        sys.exit(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-4000:]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo-qwen3.5-0.8b",
                        help="a demo alias of a hybrid model, or a hybrid HF checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="directory for the GGUF files")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, llama-quantize built")
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], help="llama-quantize types to write")
    args = parser.parse_args()
    checkpoint = resolve_demo_alias(args.model) or (args.model if Path(args.model).is_dir() else None)
    if checkpoint is None:
        parser.error(f"{args.model!r} is neither a demo alias nor a checkpoint directory")
    args.out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    bf16 = args.out / f"{name}-BF16.gguf"
    if not bf16.exists():
        convert(Path(checkpoint), args.llama_cpp, bf16)
    for kind in args.types:
        target = args.out / f"{name}-{kind}.gguf"
        subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-quantize"), str(bf16), str(target), kind],
                       check=True)
        print(f"{target}: {target.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
