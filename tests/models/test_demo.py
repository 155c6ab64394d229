from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hyprefix import demo
from hyprefix.bench.cli import resolve_model
from hyprefix.demo import demo_model_path, make_demo_model, resolve_demo_alias
from hyprefix.models.loader import resolve_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model("dense", tmp_path_factory.mktemp("tiny"))


def test_layout_and_config(tiny: Path) -> None:
    names = {p.name for p in tiny.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] == 4096
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (256, 4, 32)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    assert cfg["intermediate_size"] == 768 and cfg["max_position_embeddings"] == 4096
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 0
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == 2
    tc = json.loads((tiny / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tc["bos_token"] is None and tc["eos_token"] == "<|im_end|>"
    assert tc["pad_token"] == "<|endoftext|>"


def test_loads_and_generates(tiny: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    assert model.config.vocab_size == len(tok) == 4096
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and tok.bos_token is None
    ids = tok("The cache is warm.", return_tensors="pt")
    out1 = model.generate(**ids, max_new_tokens=8, do_sample=False)
    out2 = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out1, out2)
    assert out1.shape[1] > ids["input_ids"].shape[1]
    # Random weights, but not a flat output distribution.
    probs = model(**ids).logits[0, -1].softmax(-1)
    assert probs.max().item() > 10 / 4096


def test_deterministic(tiny: Path, tmp_path: Path) -> None:
    other = make_demo_model("dense", tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer_config.json"):
        assert (tiny / name).read_bytes() == (other / name).read_bytes(), name


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_demo_model("dense", tmp_path)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "text",
    ["héllo wörld 你好 🙂", "", "  tabs\tand\nnewlines\r\n", "<|im_start|>x<|im_end|>", "\x00\xff\U0010ffff"],
)
def test_tokenizer_round_trip(tiny: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_special_tokens_are_atomic(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == [1, 2]
    assert tok.decode([1, 85, 2], skip_special_tokens=True) == tok.decode([85])


def test_chat_template(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo 🙂"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhéllo 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text.startswith(no_prompt) and not no_prompt.endswith("assistant\n")
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = list(enc["input_ids"])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids) == text


@pytest.mark.parametrize("arch", ["moe", "", "Dense"])
def test_unknown_arch(arch: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dense"):
        make_demo_model(arch, tmp_path)
    with pytest.raises(ValueError):
        demo_model_path(arch)


@pytest.mark.parametrize(("arch", "hf_class", "layers"), [
    ("hybrid", "NemotronHForCausalLM", ["linear_attention", "mlp", "linear_attention", "full_attention",
                                        "linear_attention", "mlp"]),
    ("deltanet", "Qwen3_5ForCausalLM", ["linear_attention"] * 3 + ["full_attention"])])
def test_hybrid_demo_loads_in_transformers_and_hyprefix(tmp_path: Path, arch: str, hf_class: str,
                                                        layers: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    from hyprefix import LLM, SamplingParams

    path = make_demo_model(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert type(hf).__name__ == hf_class
    assert (getattr(hf.config, "layers_block_type", None) or hf.config.layer_types) == layers
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 8:].tolist()
    out = LLM(str(path), dtype="float32").generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref


def test_unknown_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny"):
        make_demo_model("dense", tmp_path, size="huge")


def test_demo_model_path_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPREFIX_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    real = demo.make_demo_model

    def counting(arch: str, out_dir: str | Path, *, size: str = "tiny") -> Path:
        calls.append(Path(out_dir))
        return real(arch, out_dir, size=size)

    monkeypatch.setattr(demo, "make_demo_model", counting)
    p = demo_model_path()
    assert p.parent == tmp_path / "cache"
    assert p.name == f"demo-dense-tiny-v{demo.DEMO_VERSION}"
    assert (p / "model.safetensors").is_file()
    assert calls and calls[0] != p  # built elsewhere, then renamed into place
    assert demo_model_path("dense", "tiny") == p
    assert len(calls) == 1
    assert sorted(x.name for x in p.parent.iterdir()) == [p.name]  # no temp dirs left


def test_demo_model_path_concurrent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPREFIX_CACHE", str(tmp_path))
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(demo_model_path())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert sorted(x.name for x in tmp_path.iterdir()) == [results[0].name]
    AutoModelForCausalLM.from_pretrained(results[0])


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPREFIX_CACHE", str(tmp_path))

    def boom(arch: str, out_dir: str | Path, *, size: str = "tiny") -> Path:
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(demo, "make_demo_model", boom)
    with pytest.raises(RuntimeError):
        demo_model_path()
    assert list(tmp_path.iterdir()) == []


def test_model_aliases_name_the_demo_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_dir("demo-dense-tiny") == demo_model_path("dense", "tiny")
    monkeypatch.setattr(demo, "demo_model_path", lambda arch, size: Path("/demo") / f"{arch}-{size}")
    assert {name: resolve_demo_alias(name) for name in demo.DEMO_ALIASES} == {
        "demo-dense-0.6b": "/demo/dense-bench", "demo-hybrid-0.5b": "/demo/hybrid-bench",
        "demo-dense-tiny": "/demo/dense-tiny", "demo-hybrid-tiny": "/demo/hybrid-tiny",
        "demo-qwen3.5-0.8b": "/demo/deltanet-bench", "demo-qwen3.5-tiny": "/demo/deltanet-tiny",
        "demo-lfm2-350m": "/demo/lfm2-bench", "demo-lfm2-tiny": "/demo/lfm2-tiny"}
    assert resolve_demo_alias("Qwen/Qwen3-0.6B") is None
    assert resolve_model_dir("demo-hybrid-0.5b") == Path("/demo/hybrid-bench")
    assert resolve_model("demo-hybrid-tiny") == ("/demo/hybrid-tiny", "demo-hybrid-tiny")  # the bench's --model
    assert resolve_model(None) == ("/demo/dense-bench", "demo-dense-0.6b")
    assert resolve_model("/some/dir") == ("/some/dir", "/some/dir")
