"""Compiled decode steps (runner/decode_graph.py) and int8 weights (models/quant.py)
on tiny float32 models, against transformers and against our own eager path."""

from __future__ import annotations

import logging

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.hardware import device_caps
from hyprefix.models import linear_methods
from hyprefix.models.quant import Int8Tiles, Int8Weight, quantize_activations, quantize_int8, reduction_linear
from hyprefix.outputs import ScheduledSeq
from hyprefix.runner.batch import build_batch
from hyprefix.runner.decode_graph import BATCHED, DecodeGraphs, batched_graph_capable
from hyprefix.runner.graph_capture import CapturedStep
from tests.support.compare import hf_greedy, our_last_logits, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = (1, 15, 16, 17, 40)  # a decode crosses block boundaries (block 16) and grows the table width


def _graph_count() -> int:
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(DecodeGraphs._step))


def _decode_batch(llm, prompts: list[list[int]]):
    """A decode-only step for ``prompts`` whose K/V (all but the last token) is already
    in the cache: the scheduler's view, built by hand."""
    kv, runner = llm.engine.cache.kv, llm.engine.runner
    seqs = []
    for i, p in enumerate(prompts):
        assert kv.allocate_slots(f"d{i}", len(p))
        seqs.append(ScheduledSeq(f"d{i}", p[-1:], len(p) - 1, kv.block_table(f"d{i}"), True,
                                 SamplingParams(temperature=0), state_slot=-1))
    return build_batch(seqs, kv.block_size, runner.device, runner.cascade_thresholds)


@pytest.mark.batched_graphs
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_through_compiled_steps_matches_transformers(tiny_models, arch):
    """Batch 1 decodes through the compiled batch-1 step, batches 5 .. 2 through the batched
    graph; both equal transformers' greedy tokens; neither a context that grows across blocks
    nor another batch size recompiles."""
    path, hf = tiny_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.batched and graphs.max_batch is None
    before = _graph_count()
    prompts = random_prompts(LENGTHS, seed=4)
    ran = []
    original = graphs.logits
    graphs.logits = lambda batch, kv, states: ran.append(batch.num_decode) or original(batch, kv, states)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]  # batch 1
    outs_batched = llm.generate(prompts, GREEDY, use_tqdm=False)  # batches 5 .. 1 as prompts finish
    for p, one, batched in zip(prompts, outs, outs_batched, strict=True):
        expected = hf_greedy(hf, p, GREEDY.max_tokens)
        assert one.outputs[0].token_ids == expected, f"{arch} len {len(p)} (batch 1)"
        assert batched.outputs[0].token_ids == expected, f"{arch} len {len(p)} (batched)"
    batch_1 = [n for n in ran if n == 1]
    assert len(batch_1) >= len(prompts) * (GREEDY.max_tokens - 1)  # every batch-1 decode step
    assert set(ran) - {1} == {5}  # the batched run: every prompt decodes in step with the others
    assert graphs.enabled and graphs.compiled_sizes == {1, BATCHED}
    assert _graph_count() - before <= 2  # two graphs for every context length (none if an earlier test made them)
    llm.check_invariants()


@pytest.mark.batched_graphs
@pytest.mark.hybrid_graphs
@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5"])
def test_hybrids_decode_through_compiled_steps(hybrid_models, arch):
    """Models with recurrent layers (Mamba2, Gated DeltaNet) decode through the graphs, whose
    fused recurrent ops advance the live states in place: batch 1, then batches 5 .. 1 (the
    batched graph compiles inside the first batched step, which runs the step twice more and
    must leave the states one step on), equal to transformers' greedy tokens. Checkpoints
    tapped during graph steps (decodes crossing block boundaries) serve the prefix hits of
    prompts that extend those outputs, with transformers' tokens again."""
    path, hf = hybrid_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.batched and graphs.compiled_sizes == set()
    prompts = random_prompts(LENGTHS, seed=4)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert graphs.compiled_sizes == {1}
    llm.reset_prefix_cache()
    outs_batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert graphs.enabled and graphs.compiled_sizes == {1, BATCHED}
    for p, one, batched in zip(prompts, outs, outs_batched, strict=True):
        expected = hf_greedy(hf, p, GREEDY.max_tokens)
        assert one.outputs[0].token_ids == expected, f"{arch} len {len(p)} (batch 1)"
        assert batched.outputs[0].token_ids == expected, f"{arch} len {len(p)} (batched)"
    # every decode step: batch 1, then the batched run (the batch-1 prompt's first step decodes)
    assert runner.decode_steps["eager"] == 0
    assert runner.decode_steps["graph"] >= (len(prompts) + 1) * (GREEDY.max_tokens - 1)
    longer = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]
    again = llm.generate(longer, GREEDY, use_tqdm=False)
    # Prompts of 15 and 40 tokens then 12 decodes: their hits end at checkpoints that decode
    # steps tapped, crossing the block boundaries at 16 and 48.
    cached = [o.num_cached_tokens for o in again]
    assert cached[1] == 16 and cached[4] == 48, cached
    for p, o in zip(longer, again, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens), f"{arch} len {len(p)} (hit)"
    llm.check_invariants()


@pytest.mark.hybrid_graphs
@pytest.mark.parametrize("arch", ["bamba", "mamba2"])
def test_other_mamba2_models_decode_through_the_batch_1_graph(hybrid_models, arch):
    """Bamba (attention with partial rotary, gated MLPs) and pure Mamba2 (a float32 residual
    stream) through the batch-1 graph: transformers' greedy tokens, every decode step compiled."""
    path, hf = hybrid_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16)
    runner = llm.engine.runner
    for prompt in random_prompts((3, 18), seed=7):
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
            hf_greedy(hf, prompt, GREEDY.max_tokens), f"{arch} len {len(prompt)}"
    assert runner.decode_steps == {"kernel": 0, "graph": 2 * (GREEDY.max_tokens - 1), "eager": 0}


@pytest.mark.hybrid_graphs
@pytest.mark.batched_graphs
def test_moe_hybrids_decode_through_the_graphs(hybrid_models):
    """A hybrid with MoE layers (Qwen3-Next) decodes in the compiled graphs: the experts are one op
    (``hyprefix::moe_experts``) that groups tokens by expert inside it, an extern call in the graph.
    Batch 1 and a batch of three: transformers' greedy tokens, every decode step compiled."""
    path, hf = hybrid_models["qwen3_next"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16)
    runner = llm.engine.runner
    assert runner.model.decode_graph_capable and runner.decode_graphs is not None
    prompts = random_prompts((20, 7, 33), seed=6)
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompts[0], 12)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens), f"len {len(prompt)}"
    assert runner.decode_steps["eager"] == 0 and runner.decode_steps["graph"] > 0
    assert runner.decode_graphs.compiled_sizes == ({1, BATCHED} if runner.decode_graphs.batched else {1})


def _compiled_and_eager_logits(llm, prompts: list[list[int]], batch=None,
                               graphs: DecodeGraphs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    runner = llm.engine.runner
    graphs = graphs or runner.decode_graphs
    batch = batch if batch is not None else _decode_batch(llm, prompts)
    assert graphs.eligible(batch)
    with torch.inference_mode():
        out = graphs.logits(batch, runner.kv_caches)
        eager = runner.model.compute_logits(runner.model(batch, runner.kv_caches, None)[batch.logits_indices])
    assert out is not None
    compiled, greedy = out
    assert torch.equal(greedy, compiled.argmax(dim=-1))  # the graph's greedy tokens are its logits' argmax
    return compiled, eager


def test_compiled_step_is_called_without_dynamo(tiny_models):
    """An engine's step is Inductor's compiled code called directly with its flat inputs
    (``graph_capture``): once captured, it never enters Dynamo again (with Dynamo's caches
    cleared, nothing recompiles). Two engines of different shapes in one process trace their
    own graphs; a third whose shapes match an earlier one's reuses that trace (no graph of its
    own) and is captured with its own tensors. Each step equals its eager forward."""
    path, _ = tiny_models["llama"]
    before = _graph_count()
    engines = [LLM(str(path), dtype="float32", num_kv_blocks=n, block_size=16) for n in (96, 112, 96)]
    prompts = random_prompts((20, 37), seed=9)
    firsts = {tuple(llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) for llm in engines}
    assert len(firsts) == 1
    assert _graph_count() - before <= 2
    steps = [llm.engine.runner.decode_graphs._steps[1] for llm in engines]
    assert all(isinstance(step, CapturedStep) for step in steps)
    assert steps[0].compiled is steps[2].compiled and steps[0].compiled is not steps[1].compiled
    caches = {id(t) for t in steps[2].template if isinstance(t, torch.Tensor)}
    assert id(engines[2].engine.runner.kv_caches[0][0]) in caches
    assert id(engines[0].engine.runner.kv_caches[0][0]) not in caches
    torch.compiler.reset()
    for llm in engines:
        compiled, eager = _compiled_and_eager_logits(llm, prompts[1:])
        assert (compiled - eager).abs().max().item() < 1e-4
    assert _graph_count() == 0


@pytest.mark.batched_graphs
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_compiled_step_logits_equal_eager(tiny_models, arch):
    """One decode step of one row, then of 3, 2 and 6 rows (the batched graph, compiled once
    for all of them): the compiled graphs' logits equal the eager forward's (qwen2: q/k/v
    bias through oneDNN's packed matmul)."""
    path, _ = tiny_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16)
    prompts = random_prompts((33, 9, 20, 17, 48, 5, 26), seed=5)
    our_last_logits(llm, [p[:-1] for p in prompts])  # fills their K/V (freed blocks keep it)
    compiled, eager = _compiled_and_eager_logits(llm, prompts[:1])
    assert (compiled - eager).abs().max().item() < 1e-4
    before = _graph_count()
    for rows in (prompts[1:4], prompts[4:6], prompts[1:]):
        compiled, eager = _compiled_and_eager_logits(llm, rows)
        assert compiled.shape[0] == len(rows) and (compiled - eager).abs().max().item() < 1e-4
        for i in range(len(rows)):
            llm.engine.cache.kv.free(f"d{i}")
    assert _graph_count() - before <= 1 and llm.engine.runner.decode_graphs.compiled_sizes == {1, BATCHED}


@pytest.mark.batched_graphs
def test_batched_graph_needs_an_extern_matmul_for_every_layer(tiny_models):
    """The batched graph exists where every matmul has a prepacked weight or int8 tiles; a
    layer left with only its plain weight (as on a GPU) keeps batched steps eager."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16)
    model = llm.engine.runner.model
    assert batched_graph_capable(model)
    o_proj = model.layers[0].attn.o_proj
    packed, method = o_proj.forms.packed, o_proj.forms.method
    o_proj.forms.packed, o_proj.forms.method = None, linear_methods.PLAIN
    try:
        assert not batched_graph_capable(model)
        graphs = DecodeGraphs(model)
        assert not graphs.batched and graphs.max_batch == 1
        assert not graphs.eligible(_decode_batch(llm, random_prompts((9, 20), seed=5)))
    finally:
        o_proj.forms.packed, o_proj.forms.method = packed, method


def test_a_long_context_of_one_row_stays_on_the_compiled_step(tiny_models):
    """One row whose private blocks are long enough for a cascade segment of their own
    (the production threshold is 256 tokens) still decodes through the graph, which reads
    its whole block table: the same logits as the eager cascade path."""
    path, _ = tiny_models["qwen3"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16, cascade_min_solo_run_tokens=32)
    prompts = random_prompts((70,), seed=11)
    our_last_logits(llm, [p[:-1] for p in prompts])
    batch = _decode_batch(llm, prompts)
    assert batch.decode_cascade is not None and [s.rows.tolist() for s in batch.decode_cascade.segments] == [[0]]
    compiled, eager = _compiled_and_eager_logits(llm, prompts, batch)
    assert (compiled - eager).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.batched_graphs
def test_gemma3_decodes_through_compiled_steps(gemma3_model):
    """Gemma 3 (embedding scale, sliding-window layers sharing the main pool, 1+w norms,
    tanh-GELU MLP) through the compiled steps equals transformers."""
    path, hf = gemma3_model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16, disable_hybrid_swa_memory=True)
    graphs = llm.engine.runner.decode_graphs
    prompts = random_prompts((5, 40), seed=6)
    outs = [llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0], llm.generate(prompts, GREEDY, use_tqdm=False)[1]]
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens), f"len {len(p)}"
    assert graphs.enabled and graphs.compiled_sizes == {1, BATCHED}


@pytest.mark.batched_graphs
def test_steps_outside_the_graphs_run_eagerly(tiny_models):
    """Ten requests on one shared 48-token prefix: their decodes read it once through a
    cascade plan, eagerly (not eligible); the engine with graphs gives the same tokens as
    one without."""
    path, _ = tiny_models["qwen3"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16, max_num_seqs=16,
              cascade_min_saved_tokens=32)
    graphs = llm.engine.runner.decode_graphs
    shared = random_prompts([48], seed=7)[0]
    prompts = [shared + p for p in random_prompts([3] * 10, seed=8)]
    eager = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16, enforce_eager=True,
                cascade_min_saved_tokens=32)
    assert eager.engine.runner.decode_graphs is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    kv = llm.engine.cache.kv
    assert kv.allocate_slots("prefix", len(shared))
    seqs = []
    for i, p in enumerate(prompts):  # every row's table: the prefix's 3 blocks, then one of its own
        assert kv.allocate_slots(f"d{i}", len(p) - len(shared))
        seqs.append(ScheduledSeq(f"d{i}", p[-1:], len(p) - 1, kv.block_table("prefix") + kv.block_table(f"d{i}"),
                                 True, SamplingParams(temperature=0), state_slot=-1))
    batch = build_batch(seqs, kv.block_size, llm.engine.runner.device, llm.engine.runner.cascade_thresholds)
    assert batch.decode_cascade is not None and batch.decode_cascade.shares_prefix
    assert not graphs.eligible(batch)


def test_compile_failure_falls_back_to_eager(tiny_models, caplog):
    path, hf = tiny_models["qwen3"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    graphs = llm.engine.runner.decode_graphs

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    graphs._compile = broken
    prompt = random_prompts((10,), seed=8)[0]
    with caplog.at_level(logging.WARNING, logger="hyprefix.runner"):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert not graphs.enabled
    assert any("compiled decode steps are off" in r.getMessage() for r in caplog.records)


@pytest.mark.batched_graphs
def test_a_batched_compile_failure_keeps_the_batch_1_graph(tiny_models, caplog):
    """If the batched graph fails to compile (or specialises its batch size), batched steps
    run eagerly with one warning and batch 1 keeps its graph; the tokens stay transformers'."""
    path, hf = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    graphs = llm.engine.runner.decode_graphs
    original = graphs._compile

    def batched_fails(args, batched):
        if batched:
            raise RuntimeError("the batched graph specialised its batch size")
        return original(args, batched)

    graphs._compile = batched_fails
    prompts = random_prompts((10, 21), seed=8)
    with caplog.at_level(logging.WARNING, logger="hyprefix.runner"):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False) + llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    for p, out in zip([*prompts, prompts[0]], outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert graphs.enabled and not graphs.batched and graphs.compiled_sizes == {1}
    assert [r.getMessage() for r in caplog.records if "off" in r.getMessage()] == [
        "batched compiled decode steps are off (compiling failed: RuntimeError: the batched graph specialised "
        "its batch size); they run eagerly"]


def test_reduction_linear_matches_matmul():
    """Float weights: x @ w^T. int8 weights: the activations quantized per 32 (K = 64)
    times the dequantized weight; a K that is no multiple of 32 keeps float activations."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 64), torch.randn(40, 64), torch.randn(40)
    assert torch.allclose(reduction_linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5)
    q = quantize_int8(w)
    xq = quantize_activations(x)
    assert not torch.equal(xq, x)
    assert torch.allclose(reduction_linear(x, q, None), xq @ q.dequantize(torch.float32).T, atol=1e-4)
    grouped = Int8Weight(q.qweight, q.scales[:, None].expand(40, 2).contiguous())  # groups of 32
    assert grouped.group == 32
    assert torch.allclose(reduction_linear(x, grouped, b), xq @ q.dequantize(torch.float32).T + b, atol=1e-4)
    odd = quantize_int8(torch.randn(8, 40))
    x40 = torch.randn(3, 40)
    assert torch.allclose(reduction_linear(x40, odd, None), x40 @ odd.dequantize(torch.float32).T, atol=1e-4)


def test_quantize_int8_error_is_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (64,)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize(torch.float32) - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_int8_close_to_float32(tiny_models, enforce_eager):
    """--quantization int8 (every linear and the tied LM head, activations quantized per 32):
    last-token logits within 5 % of the logit scale of float32, the same first greedy token
    on most prompts, a quarter of the weight bytes. The weights take the int8 kernel's tiles
    exactly where the CPU runs it. A compiled int8 decode step's logits are the eager
    step's, to the activation rounding."""
    path, _ = tiny_models["qwen3"]
    ref = LLM(str(path), dtype="float32", num_kv_blocks=128, enforce_eager=True)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, quantization="int8", enforce_eager=enforce_eager)
    model = llm.engine.runner.model
    layout = Int8Tiles if device_caps("cpu").int8_isa else Int8Weight
    assert type(model.layers[0].attn.qkv.forms.int8) is layout and type(model.embed.forms.int8) is layout
    assert llm.engine.model_identity != ref.engine.model_identity  # different K/V: never share cached blocks
    prompts = random_prompts((3, 17, 40), seed=9)
    ours, floats = our_last_logits(llm, prompts), our_last_logits(ref, prompts)
    err = (ours - floats).abs().max().item()
    scale = floats.abs().max().item()
    assert err < 0.05 * scale, f"int8 logit error {err:.3g} vs scale {scale:.3g}"
    assert (ours.argmax(-1) == floats.argmax(-1)).sum().item() >= 2
    int8_bytes = model.decode_weight_bytes()
    assert int8_bytes < 0.3 * ref.engine.runner.model.decode_weight_bytes()
    if not enforce_eager:
        # Where the decode kernel runs the model's steps the runner compiles none: compile one here
        # (the model's layers op by op) against the kernel's step.
        # Batches of 1 and 3 rows: the batched graph multiplies the int8 tiles too.
        runner = llm.engine.runner
        graphs = runner.decode_graphs or DecodeGraphs(runner.model, batched=True)
        assert (runner.decode_graphs is None) == model.decode_kernel
        assert graphs.batched == (layout is Int8Tiles)
        prompts = random_prompts((33, 9, 20), seed=5)
        for rows in ([prompts[0]], prompts) if graphs.batched else ([prompts[0]],):
            compiled, eager = _compiled_and_eager_logits(llm, rows, graphs=graphs)
            llm.engine.cache.kv.free("d0")
            gap = (compiled - eager).abs().max().item()
            assert gap < 0.01 * eager.abs().max().item(), f"compiled vs eager int8 logits differ by {gap:.3g}"
        assert graphs.compiled_sizes == ({1, BATCHED} if graphs.batched else {1})


def test_bad_quantization_is_a_value_error():
    from hyprefix.config import EngineArgs

    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="int3")


def test_capture_takes_only_what_it_can_replay():
    """``capture`` maps each flat input of the compiled graph to a step input, a symbolic size
    of one, or a lasting tensor, and later calls put each call's own values in their places;
    a graph that reads any other tensor, or specialised a size the caller keeps symbolic, is refused."""
    from hyprefix.runner.graph_capture import CaptureError, backend_for, capture

    weight, cache, other = torch.randn(4, 4), torch.zeros(8, 4), torch.randn(4)

    def step(x, tables):
        cache.index_copy_(0, tables[:, 0], x)
        return x @ weight + tables.shape[1], (x * 2).sum()

    def reads_other(x, tables):
        return x + other + tables.shape[1], x.sum()

    backend = backend_for({"size_asserts": False})
    x, tables = torch.randn(2, 4), torch.tensor([[1, 5], [3, 0]])
    torch._dynamo.mark_dynamic(tables, 1)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(tables, 0)
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)
    with torch.inference_mode():
        captured, out = capture(lambda: compiled(x, tables), (x, tables), [weight, cache], [(1, 1), (0, 0)])
        assert torch.allclose(out[0], x @ weight + 2)
        for rows, width in ((3, 5), (4, 7)):
            x2, t2 = torch.randn(rows, 4), torch.randint(0, 8, (rows, width))
            got = captured((x2, t2))
            assert torch.allclose(got[0], x2 @ weight + width) and torch.allclose(got[1], (x2 * 2).sum())
            assert torch.equal(cache[t2[-1, 0]], x2[-1])
        other_step = torch.compile(reads_other, fullgraph=True, dynamic=False, backend=backend)
        with pytest.raises(CaptureError, match="neither a step input"):
            capture(lambda: other_step(x, tables), (x, tables), [])
        x3, t3 = torch.randn(3, 4), torch.tensor([[1, 2], [3, 4], [5, 6]])
        fixed = torch.compile(lambda x, tables: step(x, tables), fullgraph=True, dynamic=False, backend=backend)
        with pytest.raises(CaptureError, match="specialised size 0 of step input 0"):
            capture(lambda: fixed(x3, t3), (x3, t3), [weight, cache], [(0, 0)])


def test_inductor_cache_key_follows_the_kernel_sources(tmp_path, monkeypatch, tiny_models):
    """Compiled steps carry a no-op pass whose uuid (part of Inductor's on-disk cache key) hashes
    the C++ kernel sources: an edited kernel (say, an op taking another argument) never reuses a
    step compiled against the old one."""
    import hyprefix.runner.decode_graph as decode_graph

    monkeypatch.setattr(decode_graph, "KERNELS_DIR", tmp_path)
    (tmp_path / "op.cpp").write_text("m.def(\"op(Tensor x) -> Tensor\");")
    (tmp_path / "op.py").write_text("not a kernel source")
    key = decode_graph.KernelSourcesKey()
    before = key.uuid()
    (tmp_path / "op.py").write_text("still not one")
    decode_graph.get_hash_for_files.cache_clear()  # torch caches it per path list: one read per process
    assert key.uuid() == before
    (tmp_path / "op.cpp").write_text("m.def(\"op(Tensor x, Tensor? bias=None) -> Tensor\");")
    decode_graph.get_hash_for_files.cache_clear()
    assert key.uuid() != before
    path, _ = tiny_models["llama"]
    graphs = LLM(str(path), dtype="float32", num_kv_blocks=64).engine.runner.decode_graphs
    assert isinstance(graphs._options["post_grad_custom_post_pass"], decode_graph.KernelSourcesKey)
