"""Rewrite a GGUF file with every 2-D weight stored as Q8_0 (blocks of 32 int8 values
and one float16 scale), as ``llama-quantize ... Q8_0`` does, or as F32; 1-D tensors
(norms) stay float32. The metadata (config, tokenizer, chat template) is copied unchanged.

    python tools/models/requantize_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.Q8_0.gguf
    python tools/models/requantize_gguf.py --type F32 SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.F32.gguf

The Q8_0 values are computed by ``gguf``'s reference quantizer from the source tensors
dequantized to float32 (a Q4 source loses nothing more: every Q4 value is exact in Q8_0's
range, up to the rounding of one scale per 32). Used for the int8 benchmark with a file
llama.cpp and hyprefix both read.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np


def requantize(src: str, dst: str, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for tensor in reader.tensors:
        values = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if qtype != gguf.GGMLQuantizationType.F32 and values.ndim == 2 and values.shape[1] % block == 0:
            raw = gguf.quantize(values, qtype)
            writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--type", choices=["Q8_0", "F32"], default="Q8_0")
    args = parser.parse_args()
    requantize(args.src, args.dst, gguf.GGMLQuantizationType[args.type])


if __name__ == "__main__":
    main()
