"""GGUF files hyprefix cannot run fail with an error that names what is wrong: the
architecture, or the quantization type and its tensors. The files are tiny ones
written here with the ``gguf`` library."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hyprefix import LLM
from hyprefix.models.loader import load_model

HIDDEN, VOCAB = 256, 16
TENSORS = {
    "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN),
    "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
    "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (HIDDEN // 2, HIDDEN),
    "blk.0.attn_v.weight": (HIDDEN // 2, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
    "blk.0.ffn_gate.weight": (HIDDEN, HIDDEN), "blk.0.ffn_up.weight": (HIDDEN, HIDDEN),
    "blk.0.ffn_down.weight": (HIDDEN, HIDDEN),
}


def write_gguf(path: Path, arch: str = "llama", q_type=None, tensors: dict | None = None,
               leave_out: str | None = None) -> Path:
    """A one-layer Llama-shaped GGUF (float32 tensors; ``blk.0.attn_q.weight`` stored as
    ``q_type`` raw bytes when given; ``tensors``: name -> a float32 array, or (raw blocks, their
    ggml type), in place of the random float32 tensor; ``leave_out``: a tensor not written)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // 2)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(0)
    for name, shape in TENSORS.items():
        if name == leave_out:
            continue
        given = (tensors or {}).get(name)
        if isinstance(given, tuple):
            w.add_tensor(name, given[0], raw_shape=given[0].shape, raw_dtype=given[1])
        elif given is not None:
            w.add_tensor(name, given)
        elif q_type is not None and name == "blk.0.attn_q.weight":
            block, size = gguf.GGML_QUANT_SIZES[q_type]
            raw = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=q_type)
        else:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_tiny_llama_gguf_loads(tmp_path):
    loaded = load_model(str(write_gguf(tmp_path / "ok.gguf")), "float32", torch.device("cpu"), 64)
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.model.config.num_hidden_layers == 1


def test_an_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "foo.gguf", arch="foo")
    with pytest.raises(ValueError, match=r"architecture 'foo' is not supported; hyprefix loads GGUF files of llama"):
        LLM(str(path), dtype="float32")


def test_an_architecture_transformers_reads_but_we_do_not_run_is_named(tmp_path):
    path = write_gguf(tmp_path / "starcoder2.gguf", arch="starcoder2")
    with pytest.raises(ValueError, match=r"architecture 'starcoder2' is not supported"):
        LLM(str(path), dtype="float32")


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if the model's weights are allocated (``CausalLM.materialize``)."""
    from hyprefix.models.base import CausalLM

    def allocate(self, device):
        raise AssertionError("the weights were allocated before the file was refused")

    monkeypatch.setattr(CausalLM, "materialize", allocate)


def test_an_unsupported_quantization_type_is_named_with_its_tensors(tmp_path, no_allocation):
    """Refused before any weight is allocated, naming the type, its tensors and the types that read."""
    import gguf

    path = write_gguf(tmp_path / "q8k.gguf", q_type=gguf.GGMLQuantizationType.Q8_K)
    with pytest.raises(ValueError, match=r"Q8_K.*tensors of that type: blk\.0\.attn_q\.weight.*types that read: F32, "
                                         r"F16, Q4_0"):
        LLM(str(path), dtype="float32")


def test_a_missing_tensor_names_the_parameter_before_allocating(tmp_path, no_allocation):
    path = write_gguf(tmp_path / "no-v.gguf", leave_out="blk.0.attn_v.weight")
    with pytest.raises(ValueError, match=r"no-v\.gguf has no tensor for the model's layers\.0\.attn\.qkv\.weight"):
        LLM(str(path), dtype="float32")


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        LLM(str(path), dtype="float32")


def test_gguf_parsed_once_shares_name_tables_and_restores_gguf():
    """Inside the block one name table per (architecture, layers) serves transformers'
    per-submodule lookups; the block leaves gguf as it found it."""
    import gguf

    from hyprefix.models.loader import gguf_parsed_once

    before = gguf.get_tensor_name_map, gguf.GGUFReader
    with gguf_parsed_once():
        llama, layers = gguf.MODEL_ARCH.LLAMA, 4
        table = gguf.get_tensor_name_map(llama, layers)
        assert gguf.get_tensor_name_map(llama, layers) is table
        assert gguf.get_tensor_name_map(llama, layers + 1) is not table
        assert table.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == before


def test_a_tensor_of_the_wrong_shape_is_named_before_allocating(tmp_path, no_allocation):
    """The file's k projection has half the rows the config's KV heads need: refused naming the
    tensor (and the file's name for it), its shape and the expected one."""
    wrong = np.zeros((HIDDEN // 4, HIDDEN), dtype=np.float32)
    path = write_gguf(tmp_path / "k.gguf", tensors={"blk.0.attn_k.weight": wrong})
    with pytest.raises(ValueError, match=r"k\.gguf: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' \(the "
                                         r"file's blk\.0\.attn_k\.weight\) has shape \(64, 256\), the model expects "
                                         r"\(128, 256\)"):
        LLM(str(path), dtype="float32")
