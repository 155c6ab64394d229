"""Weights in transparent huge pages and K/V in lazily mapped small pages
(runner/huge_pages.py): the arena's tensors, moving a model's weights, and an engine whose
weights and K/V live there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.runner import huge_pages
from hyprefix.runner.huge_pages import HUGE_PAGE, HugePageArena, PageMapper, lazy_zeros, move_weights, thp_available
from tests.support.compare import our_last_logits, random_prompts

needs_thp = pytest.mark.skipif(not thp_available(), reason="no transparent huge pages here (not Linux, or THP 'never')")


def _smaps_kb(address: int, field: str = "AnonHugePages") -> int:
    """``field`` (kB) of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@needs_thp
def test_arena_tensors_are_separate_zeroed_and_in_huge_pages():
    arena = HugePageArena(8 * HUGE_PAGE)
    a = arena.take(0, (HUGE_PAGE // 4,), torch.float32)
    b = arena.take(HUGE_PAGE, (4, HUGE_PAGE // 16), torch.float32)
    c = arena.take(2 * HUGE_PAGE, (6 * HUGE_PAGE,), torch.uint8)
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() - a.data_ptr() == HUGE_PAGE
    # each its own storage, none a view: a compiled step writing into them must not copy them whole
    assert len({t.untyped_storage().data_ptr() for t in (a, b, c)}) == 3
    assert all(t._base is None and t.is_contiguous() for t in (a, b, c))
    assert not a.any() and not b.any() and not c.any()
    a.fill_(1.0)
    c.fill_(7)
    assert not b.any() and a.sum().item() == HUGE_PAGE // 4
    del arena  # the tensors keep the mapping
    assert c.sum().item() == 7 * 6 * HUGE_PAGE
    assert _smaps_kb(c.data_ptr()) >= HUGE_PAGE // 1024


@needs_thp
def test_a_small_arena_gets_a_huge_page_wherever_its_mapping_lands():
    """An arena smaller than a huge page still holds one whole aligned huge page, even where
    the kernel placed its mapping off a 2 MiB boundary (odd-sized mappings in between make
    that likely: before the fix, 1 of 20 such arenas got none)."""
    import mmap

    kept = []
    for i in range(20):
        kept.append(mmap.mmap(-1, 4096 * (i + 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        t = HugePageArena(300_000).take(0, (1000,), torch.float32)
        t.fill_(1.0)
        kept.append(t)
        assert _smaps_kb(t.data_ptr()) > 0, i


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 96)
        self.norm = torch.nn.LayerNorm(96)
        self.down = torch.nn.Linear(96, 64, bias=False)
        self.tied = torch.nn.Linear(96, 64, bias=False)
        self.tied.weight = self.down.weight  # one parameter in two modules
        self.register_buffer("table", torch.randn(10, 8))
        self.register_buffer("empty", torch.empty(0))
        shared = torch.randn(4, 16)
        self.norm.register_buffer("left", shared[:2])  # two tensors on one storage: they stay put
        self.norm.register_buffer("right", shared[2:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.up(x))
        return self.down(h) + self.tied(h) + self.table.sum()


@needs_thp
def test_move_weights_keeps_tensors_and_values_in_forward_order():
    torch.manual_seed(0)
    model = _Tiny()
    shared_ptr = model.norm.left.untyped_storage().data_ptr()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = {name: id(t) for name, t in model.state_dict(keep_vars=True).items()}
    x = torch.randn(3, 64)
    expected = model(x)
    moved = move_weights(model)
    after = model.state_dict(keep_vars=True)
    assert {name: id(t) for name, t in after.items()} == ids  # the same tensor objects
    for name, t in after.items():
        assert torch.equal(t, before[name]), name
    assert torch.equal(model(x), expected)
    assert model.tied.weight is model.down.weight
    # module order, each module's parameters then buffers; the tied weight once; 64-byte aligned
    order = [model.table, model.up.weight, model.up.bias, model.norm.weight, model.norm.bias, model.down.weight]
    assert moved == sum(-(-t.nbytes // 64) * 64 for t in order)
    ptrs = [t.data_ptr() for t in order]
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < moved and ptrs[0] % HUGE_PAGE == 0
    assert model.norm.left.untyped_storage().data_ptr() == shared_ptr == model.norm.right.untyped_storage().data_ptr()


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_available", lambda: False)
    model = torch.nn.Linear(8, 8)
    ptr = model.weight.data_ptr()
    assert move_weights(model) == 0 and model.weight.data_ptr() == ptr


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps here")
def test_kv_tensors_are_zeroed_separate_and_mapped_only_as_written():
    """The K/V's mapping costs no memory until written, then only the pages written, in
    small pages (a huge-page fault compacts memory inside the prefill that writes it)."""
    shapes = [(64, 16, 2, 64), (64, 16, 2, 64), (8, 16, 2, 64)]
    k, v, w = lazy_zeros(shapes, torch.bfloat16, torch.device("cpu"))
    assert [t.shape for t in (k, v, w)] == [torch.Size(s) for s in shapes]
    assert len({t.untyped_storage().data_ptr() for t in (k, v, w)}) == 3 and all(t._base is None for t in (k, v, w))
    assert _smaps_kb(k.data_ptr(), "Rss") == 0
    assert not k.any() and not w.any()  # reading maps the shared zero page, not memory of its own
    k[3].fill_(1.0)
    rss = _smaps_kb(k.data_ptr(), "Rss")
    assert 0 < rss <= 8 and _smaps_kb(k.data_ptr()) == 0 and k.sum().item() == k[3].numel()
    assert not v.any()
    assert lazy_zeros([(3, 4)], torch.float32, torch.device("meta"))[0].device.type == "meta"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps here")
def test_page_mapper_maps_the_lowest_blocks_first_then_all_without_writing():
    """An idle server's mapping (``PageMapper``): chunk by chunk in block order over every
    tensor (the order the block pool first hands blocks out), values untouched, then done."""
    shapes = [(64, 16, 2, 64), (64, 16, 2, 64), (16, 16, 2, 64)]  # 4 KiB a block; a window pool of 16
    kv = lazy_zeros(shapes, torch.bfloat16, torch.device("cpu"))
    kv[1][5, 0, 0, 0] = 3.0  # a block a step wrote before the mapper got there
    mapper = PageMapper(kv, chunk_bytes=3 * 4096 * 8)  # 8 blocks of all three a chunk
    rss = [_smaps_kb(t.data_ptr(), "Rss") for t in kv]  # one mapping: the same for all three
    if mapper.done:
        pytest.skip("madvise(MADV_POPULATE_WRITE) is not available here (Linux 5.14+)")
    assert mapper.map_next()
    after_one = _smaps_kb(kv[0].data_ptr(), "Rss")
    assert rss[0] == 4 and after_one >= 3 * 8 * 4  # 8 blocks of 4 KiB in each of the three (one was written)
    assert after_one < 3 * 64 * 4
    steps = 1
    while mapper.map_next():
        steps += 1
    assert steps == 7 and mapper.done and not mapper.map_next()  # 64 blocks, 8 a chunk
    assert _smaps_kb(kv[0].data_ptr(), "Rss") >= (64 + 64 + 16) * 4
    assert kv[1].sum().item() == 3.0 and not kv[0].any() and not kv[2].any()


def test_engine_with_and_without_huge_pages_gives_the_same_numbers(tiny_models, monkeypatch):
    """The engine's weights and K/V in huge pages (where this machine has them) change no
    number: the same logits as an engine without them (prefill in two chunks, which reads
    the first chunk's K/V back; the compiled decode step) and the same greedy tokens
    (batch 1 through the compiled step, 3 rows eager)."""
    from tests.kernels.test_decode_graph import _compiled_and_eager_logits

    path, _ = tiny_models["llama"]
    prompts = random_prompts((9, 23, 40), seed=4)
    with_thp = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16)
    runner = with_thp.engine.runner
    assert (runner.huge_page_bytes > 0) == thp_available()
    monkeypatch.setattr(huge_pages, "thp_available", lambda: False)
    plain = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16)
    assert plain.engine.runner.huge_page_bytes == 0
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for batch in ([prompts[0]], prompts):
        ours, theirs = (llm.generate(batch, greedy, use_tqdm=False) for llm in (with_thp, plain))
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert torch.equal(our_last_logits(with_thp, prompts, chunk=16), our_last_logits(plain, prompts, chunk=16))
    (compiled, _), (plain_compiled, _) = (_compiled_and_eager_logits(llm, [prompts[1]]) for llm in (with_thp, plain))
    assert torch.equal(compiled, plain_compiled)
    if thp_available():  # the weights in huge pages; the K/V's first blocks written by now, in small pages
        weight = next(runner.model.parameters())
        assert _smaps_kb(weight.data_ptr()) > 0 and _smaps_kb(runner.kv_caches[0][0].data_ptr()) == 0
        assert _smaps_kb(runner.kv_caches[0][0].data_ptr(), "Rss") > 0
