"""A GGUF file's quantized matrices kept in their blocks, for every architecture: which of the
model's matrices can be, and loading them as the kernels' tiles (``quant.QuantTiles``).

A file reader (``gguf_weights.GGUFWeights`` for the architectures transformers reads,
``gguf_hybrid.HybridGGUF`` for the hybrids) offers its quantized matrices as ``BlockMatrix``:
a transformers tensor whose rows are whole rows of the file's blocks, in transformers' order.
Between a transformers name and a parameter of ours the model may still move rows around
(``CausalLM.converted``: Qwen3.5's q_proj split into query and gate rows, Qwen3-Next's grouped
projections). ``plan_blocks`` follows each matrix's rows through that step by passing a tag
column (row ``i`` tagged ``2 i + 1``) instead of the values: a step that only moves, splits or
joins rows gives back tags, so it tells which rows land in which shard of which parameter, and
a step that changes values (an odd tag plus one is even) shows as such and leaves that matrix to
the float path. A parameter is kept where every shard of it (q/k/v, gate/up, the DeltaNet's
four input projections) came as blocks with one column order, its columns fill groups of 32 and
each run of shards of one type but the last holds whole 16-row tiles (the kernel's parts).

Columns cannot move inside a block. A matrix whose columns the converter reordered (Qwen3.5's
``out_proj``, value heads tiled) keeps the file's order, and its inputs are gathered into that
order instead (``MatrixForms.use_column_order``): one index per input value, not a float copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.models.quant import Int8Weight, int8_part, join_parts

Q8_0 = "Q8_0"
INT8_TYPES = (Q8_0, "Q5_0")  # kept as int8 with a scale per 32, exactly
TILE_TYPES = tuple(quant_kernel.GGUF_TYPES)  # Q4_0 Q4_1 Q4_K Q5_K Q6_K
KEPT_TYPES = (*INT8_TYPES, *TILE_TYPES)


@dataclass
class BlockMatrix:
    """One transformers matrix held in a GGUF file's blocks of one type. ``read`` gives uint8
    [rows, bytes a row], rows in transformers' order; ``column_order``, where the converter
    reordered the columns: transformers' matrix is the file's ``[:, column_order]``."""

    name: str
    kind: str  # the GGUF type name
    rows: int
    cols: int
    read: Callable[[], torch.Tensor]
    column_order: torch.Tensor | None = None
    experts: int = 1  # transformers' tensor is [experts, rows / experts, cols] (stacked experts)


@dataclass
class _Shard:
    matrix: BlockMatrix
    ids: torch.Tensor  # the matrix's rows this shard takes, in order


@dataclass
class BlockPlan:
    """Which parameters load from blocks: parameter name -> its shards in order, and the
    transformers names those matrices came from (read as floats by nobody)."""

    params: dict[str, list[_Shard]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)


def row_tags(counts: Iterable[int]) -> list[torch.Tensor]:
    """One tag column [n, 1] per source: row ``i`` of the sources laid end to end is ``2 i + 1``."""
    out, start = [], 0
    for n in counts:
        out.append((torch.arange(start, start + n, dtype=torch.float64) * 2 + 1).reshape(n, 1))
        start += n
    return out


def tagged_rows(result: object, total: int) -> torch.Tensor | None:
    """The rows (of ``total``) a transform of ``row_tags`` picked, in order; None where it did
    anything but move, split or join whole rows."""
    if not isinstance(result, torch.Tensor) or result.dim() != 2 or result.shape[1] != 1 \
            or result.dtype != torch.float64:
        return None
    tags = result[:, 0]
    ids = (tags - 1) / 2
    if not torch.equal(ids, ids.round()) or ids.numel() == 0 or ids.min() < 0 or ids.max() >= total:
        return None
    ids = ids.long()
    return ids if ids.unique().numel() == ids.numel() else None


def plan_blocks(net: torch.nn.Module, matrices: Iterable[BlockMatrix]) -> BlockPlan:
    """The parameters of ``net`` (a ``CausalLM``) that load from ``matrices`` (module doc)."""
    from hyprefix.models.fused_moe import Experts
    from hyprefix.models.layers import Embedding, Linear

    modules = dict(net.named_modules())
    found: dict[str, dict[int, _Shard]] = {}
    expected: dict[str, list[int] | None] = {}
    sources: dict[str, set[str]] = {}  # parameter -> the transformers matrices it reads
    uses: dict[str, set[str]] = {}  # transformers matrix -> the parameters it feeds
    for matrix in matrices:
        for _, ids, param, shard, sizes in _routes(net, matrix):
            module = modules.get(param.rsplit(".", 1)[0])
            if ids is None or not param.endswith(".weight") or not isinstance(module, Linear | Embedding | Experts):
                uses.setdefault(matrix.name, set()).add("")  # a use the blocks cannot serve
                continue
            found.setdefault(param, {})[shard] = _Shard(matrix, ids)
            expected[param] = sizes
            sources.setdefault(param, set()).add(matrix.name)
            uses.setdefault(matrix.name, set()).add(param)
    def sliceable(param: str) -> bool:  # stacked experts: sliced per expert, whole tiles, out of one part
        module = modules[param.rsplit(".", 1)[0]]
        return not isinstance(module, Experts) or (module.tiles_split_by_expert
                                                   and len({s.matrix.kind for s in found[param].values()}) == 1)

    kept = {param for param, shards in found.items() if _whole(shards, expected[param]) and sliceable(param)}
    while True:  # a matrix feeding a parameter that is not kept is read as floats: so are its others
        dropped = {p for p in kept if any(not uses[m] <= kept for m in sources[p])}
        if not dropped:
            break
        kept -= dropped
    plan = BlockPlan()
    for param in sorted(kept):
        plan.params[param] = [found[param][i] for i in sorted(found[param])]
        plan.names |= sources[param]
    return plan


def _routes(net, matrix: BlockMatrix) -> Iterator[tuple[str, torch.Tensor | None, str, int, list[int] | None]]:
    """(converted name, rows taken, parameter, shard, shard sizes) for each tensor the model's
    ``converted`` makes of ``matrix``."""
    [tag] = row_tags([matrix.rows])
    if matrix.experts > 1:
        tag = tag.view(matrix.experts, -1, 1)
    for name, result in net.converted([(matrix.name, tag)]):
        target = net.map_name(name)
        if target is not None:
            param, shard, sizes = target
            yield name, tagged_rows(result, matrix.rows), param, 0 if shard is None else shard, sizes


def _whole(shards: dict[int, _Shard], sizes: list[int] | None) -> bool:
    """Every shard came, with one column count and column order, the columns filling groups of
    32; each run of shards of one type but the last holds whole 16-row tiles (the kernel's parts:
    ``load_blocks`` packs a run as one)."""
    sizes = sizes or [None]
    if sorted(shards) != list(range(len(sizes))):
        return False
    ordered = [shards[i] for i in range(len(sizes))]
    if any(size is not None and s.ids.numel() != size for s, size in zip(ordered, sizes, strict=True)):
        return False
    orders = [s.matrix.column_order for s in ordered]
    same_order = all(o is None for o in orders) or all(o is not None and torch.equal(o, orders[0]) for o in orders)
    runs = _runs(ordered)
    return (same_order and ordered[0].matrix.cols % 32 == 0 and len({s.matrix.cols for s in ordered}) == 1
            and all(sum(s.ids.numel() for s in run) % 16 == 0 for run in runs[:-1]))


def _runs(shards: list[_Shard]) -> list[list[_Shard]]:
    """Consecutive shards of one type."""
    runs: list[list[_Shard]] = []
    for shard in shards:
        if runs and runs[-1][0].matrix.kind == shard.matrix.kind:
            runs[-1].append(shard)
        else:
            runs.append([shard])
    return runs


def pack_rows(raw: torch.Tensor, kind: str, cols: int) -> list[torch.Tensor]:
    """Rows of a GGUF tensor's blocks (uint8 [rows, bytes a row], in order) as one kernel part
    ([data, scales, extra], ``quant.QuantTiles``)."""
    if kind in INT8_TYPES:
        return int8_part(int8_blocks(raw, kind))
    return list(quant_kernel.pack_gguf(raw, kind, cols, torch.arange(raw.shape[0])))


def load_blocks(net: torch.nn.Module, plan: BlockPlan) -> set[str]:
    """Load the planned parameters from their blocks: each ``MatrixForms`` takes the joined
    parts (``use_quant``) and, where the file reordered the columns, their order; the plain
    tensor is emptied. Returns the parameter names so held (``load_weights``' ``quantized``)."""
    from hyprefix.models.layers import drop_plain

    modules = dict(net.named_modules())
    cache: dict[str, torch.Tensor] = {}
    for param, shards in plan.params.items():
        parts = []
        for run in _runs(shards):
            rows = []
            for shard in run:
                raw = cache.get(shard.matrix.name)
                if raw is None:
                    raw = cache[shard.matrix.name] = shard.matrix.read()
                rows.append(raw if _every_row(shard.ids, raw) else raw[shard.ids])
            block = rows[0] if len(rows) == 1 else torch.cat(rows)
            parts.append(pack_rows(block, run[0].matrix.kind, run[0].matrix.cols))
        module = modules[param.rsplit(".", 1)[0]]
        module.forms.use_quant(join_parts(parts))
        order = shards[0].matrix.column_order
        if order is not None:
            module.forms.use_column_order(order)
        drop_plain(module.weight)
        if len(cache) > 4:  # a matrix's shards come together: keep few raw copies alive
            cache.clear()
    return set(plan.params)


def _every_row(ids: torch.Tensor, raw: torch.Tensor) -> bool:
    """Whether ``ids`` takes every row of ``raw`` in order (no copy needed)."""
    return ids.numel() == raw.shape[0] and torch.equal(ids, torch.arange(raw.shape[0]))


def int8_weights(net: torch.nn.Module, matrices: Iterable[BlockMatrix]) -> Iterator[tuple[str, Int8Weight]]:
    """``--quantization int8``: the file's Q8_0 / Q5_0 matrices as ``Int8Weight`` under the
    names ``CausalLM.load_int8_weights`` maps (after ``converted``), their rows as the model
    takes them; a matrix whose columns the converter reordered is left to the float path."""
    for matrix in matrices:
        if matrix.kind not in INT8_TYPES or matrix.column_order is not None:
            continue
        weight: Int8Weight | None = None
        for name, ids, _, _, _ in _routes(net, matrix):
            if ids is None:
                continue
            weight = weight or int8_blocks(matrix.read(), matrix.kind)
            yield name, Int8Weight(weight.qweight[ids], weight.scales[ids])


def int8_blocks(raw: torch.Tensor, kind: str) -> Int8Weight:
    """Q8_0 (float16 d, 32 int8 values) or Q5_0 blocks (float16 d, 32 high bits, 32 low nibbles;
    value d * (q - 16), ggml's order: nibble j low then high of byte j) of uint8 [rows, row bytes]
    as int8 values with their scales per 32."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, 34 if kind == Q8_0 else 22)
    scales = blocks[:, :, :2].contiguous().view(torch.float16)[:, :, 0].float()
    if kind == Q8_0:
        return Int8Weight(blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, -1), scales)
    high_bits = blocks[:, :, 2:6].contiguous().view(torch.int32)  # [n, blocks, 1], bit e of element e
    low = blocks[:, :, 6:].to(torch.int32)
    nibbles = torch.cat([low & 0xF, low >> 4], dim=2)  # elements 0-15, then 16-31
    high = (high_bits >> torch.arange(32, dtype=torch.int32)) & 1
    return Int8Weight(((nibbles | (high << 4)) - 16).to(torch.int8).reshape(n, -1), scales)
