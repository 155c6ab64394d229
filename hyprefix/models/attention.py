"""Paged attention over the block-table KV cache.

Decode tokens attend through their block tables. On CPUs where it builds
(``hardware.DeviceCaps.paged_decode``), ``kernels/decode_attention.cpp`` reads each
row's blocks where they lie; elsewhere they are gathered into a padded batch for
SDPA. Sliding-window layers with a block pool of their own read it through
``ForwardBatch.window_kv``: only the blocks from the first one their window can see.
With a segment plan (``runner/cascade.py``) that has a prefix shared by several
decodes, that prefix is read once for the group, and every row's rest (its tail, read
in place or padded) separately; the partial results merge through their log-sum-exp.
A plan of only single-row segments (a long context's own run) matters only to the
padded path: the in-place kernel reads such a row whole. Prefill chunks attend over
their own tokens (plain causal) or over their gathered context with an explicit mask:
through ``kernels/prefill_attention.cpp`` where it runs
(``hardware.DeviceCaps.flash_prefill``), else torch's SDPA.

The batch-invariant mode (``ForwardBatch.batch_invariant``) has one arithmetic for every query
token: each token of the step, prefill or decode, is a row of the decode-attention kernel over
its sequence's blocks up to its own position (written first), with the kernel's runs fixed
(``INVARIANT_RUN_TOKENS``), so its result depends neither on the rest of the batch nor on how
its prompt was chunked or whether its prefix came from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyprefix.forward import DecodeCascade, ForwardBatch
from hyprefix.kernels import decode_attention as decode_kernel
from hyprefix.kernels import kv_write
from hyprefix.kernels import prefill_attention as prefill_kernel
from hyprefix.models import kv_quant

# Keys per run of the batch-invariant mode's attention: a row's keys are split into runs of this
# many positions (whole blocks, at least one) at fixed places, merged in order. Only a decode row
# with a longer context than this is split over threads; every run costs a merge.
INVARIANT_RUN_TOKENS = 256


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend.

    q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D].
    ``sinks`` [H] (gpt-oss): a logit per head that joins every softmax's denominator and
    attends to nothing; applied once to each row's whole attention, after any split of its
    keys is merged (``_sunk``), so a cached prefix or a cascade segment never counts it twice.
    ``v_dim`` (MLA's latent cache: its first ``kv_lora_rank`` values): each head's output is the
    first ``v_dim`` values of its attention; the decode kernel then weighs only those.
    Returns [T, H, v_dim or D] in the batch's token order (decodes first, then prefills).
    """
    if not kv_quant.is_quantized(k_cache):
        write_kv(k, v, k_cache, v_cache, batch, window)
        return attend(q, k, v, k_cache, v_cache, batch, scale, window, sinks, v_dim=v_dim)
    # 8-bit rows: K and the queries rotated (kv_quant.rotation: q . k unchanged, the outliers of a
    # few channels spread over all; V as it is, kv_quant's docstring says why), and every attention
    # reads the K/V as stored, cached or new (K written from float32 rows, rounded once, into codes)
    dtype = q.dtype
    q, k = (kv_quant.rotate(t.float(), invariant=batch.batch_invariant) for t in (q, k))
    q = q.to(dtype)
    if not batch.prefills:
        write_kv(k, v, k_cache, v_cache, batch, window)
    else:  # a prefill reads its own rows as stored: the write op returns them
        k, v = (t.to(dtype) for t in write_kv_stored(k, v, k_cache, v_cache, batch, window))
    return attend(q, k, v, k_cache, v_cache, batch, scale, window, sinks, v_dim=v_dim)


def _write_slots(batch: ForwardBatch, window: int | None) -> torch.Tensor:
    """The cache slots this step's rows go to: the window pool's for a sliding-window layer with
    a pool of its own, else the main pool's."""
    view = batch.kv_view(window)
    return view.slot_mapping if view is not None else batch.slot_mapping


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
             window: int | None) -> None:
    """This step's K/V into the paged cache (the window pool's slots for a layer with one); a
    latent cache (``KVLayout.latent``) is its own V: written once. An 8-bit cache
    (``kv_quant``) takes each row quantized as it is written."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    slot_mapping = _write_slots(batch, window)
    flats = [(k_cache, k)] if v_cache is k_cache else [(k_cache, k), (v_cache, v)]
    for cache, rows in flats:
        if kv_quant.is_quantized(cache):
            if slot_mapping.numel():
                kv_write.kv_write_8bit(rows if batch.write_index is None else rows.index_select(0, batch.write_index),
                                       cache, slot_mapping)
            continue
        flat = cache.view(-1, num_kv_heads, head_dim)
        if batch.write_index is None:
            flat.index_copy_(0, slot_mapping, rows)
        elif slot_mapping.numel():
            flat.index_copy_(0, slot_mapping, rows.index_select(0, batch.write_index))


def write_kv_stored(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``write_kv`` into 8-bit caches (``kv_quant``), returning every row of k and v as stored, read
    back in float32 (``kv_quant.as_stored``'s values, from the write op's own pass)."""
    slot_mapping = _write_slots(batch, window)
    k_stored = kv_write.kv_write_8bit_stored(k, k_cache, slot_mapping, batch.write_index)
    if v_cache is k_cache:  # a latent cache is its own V
        return k_stored, k_stored
    return k_stored, kv_write.kv_write_8bit_stored(v, v_cache, slot_mapping, batch.write_index)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           batch: ForwardBatch, scale: float, window: int | None, sinks: torch.Tensor | None = None,
           spans: set[int] | None = None, v_dim: int | None = None) -> torch.Tensor:
    """``paged_attention`` after its write: the decode rows, then each prefill span (those in
    ``spans`` alone where given: their rows, in order, follow the decode rows in the result)."""
    if batch.batch_invariant:
        tables, context_lens, first_pos = batch.query_tables(window)
        out, lse = decode_kernel.decode_attention(q, k_cache, v_cache, tables, context_lens, scale, window, first_pos,
                                                  run_blocks=max(1, INVARIANT_RUN_TOKENS // batch.block_size),
                                                  v_dim=v_dim)
        return out if sinks is None else _sunk(out, lse, sinks)
    outs: list[torch.Tensor] = []
    if batch.num_decode:
        outs.append(_decode_rows(q[:batch.num_decode], k_cache, v_cache, batch, window, scale, sinks, v_dim))
    prefills = _prefill_spans(q, k, v, k_cache, v_cache, batch, window, scale, sinks, spans)
    outs += prefills if v_dim is None else [o[..., :v_dim] for o in prefills]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                 window: int | None, scale: float, sinks: torch.Tensor | None,
                 v_dim: int | None = None) -> torch.Tensor:
    """The decode rows' attention (q [n, H, D], one query token a row; the first ``v_dim`` values
    of each head's output where given) through their block tables: in place by the decode kernel
    (a latent cache by its own path there), by a cascade plan's segments, or gathered and padded."""
    n, num_kv_heads, head_dim = q.shape[0], k_cache.shape[2], q.shape[2]
    view = batch.kv_view(window)
    # One query token per sequence: fold the query heads of a KV group into the
    # "query length" axis so no K/V repeat is needed.
    qd = q.view(n, num_kv_heads, q.shape[1] // num_kv_heads, head_dim)
    in_place = q.device.type == "cpu" and decode_kernel.available(q.dtype)
    cascade = batch.decode_cascade if window is None else None
    tables = view.decode_block_tables if view is not None else batch.decode_block_tables
    assert tables is not None and batch.decode_context_lens is not None
    lse = None
    if cascade is not None and (not in_place or cascade.shares_prefix):
        od, lse = _cascade_decode(qd, k_cache, v_cache, cascade, scale, in_place)
    elif in_place:  # every row's blocks read where they lie, through its table
        od, lse = decode_kernel.decode_attention(q, k_cache, v_cache, tables, batch.decode_context_lens,
                                                 scale, window, view.decode_first_pos if view is not None else None,
                                                 v_dim=v_dim)
    else:
        kd, vd = _gather_blocks(k_cache, v_cache, tables, q.dtype)
        if sinks is not None:
            od, lse = math_attention_with_lse(qd, kd, vd, _additive(batch.decode_mask(window), q.dtype), scale)
        elif torch.compiler.is_compiling():  # a compiled decode step: fused loops, no kernel call per layer
            od = _reduction_attention(qd, kd, vd, batch.decode_mask(window), scale)
        else:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=batch.decode_mask(window), scale=scale)
    od = od.reshape(n, q.shape[1], -1)[..., :v_dim]  # v_dim None: all
    return od if sinks is None else _sunk(od, lse.reshape(n, -1), sinks)


def _prefill_spans(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: ForwardBatch, window: int | None, scale: float,
                   sinks: torch.Tensor | None, spans: set[int] | None = None) -> list[torch.Tensor]:
    """Each prefill span's attention (those in ``spans`` where given) over its own tokens and,
    after a cached prefix, its context: the flash kernel (cached keys read through the span's
    block table, an 8-bit cache's rows dequantized by the kernel), else torch's SDPA over the
    gathered (and dequantized) blocks."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    view = batch.kv_view(window)
    flash = bool(batch.prefills) and q.device.type == "cpu" and prefill_kernel.available(q.dtype)
    outs = []
    for i, span in enumerate(batch.prefills):
        if spans is not None and i not in spans:
            continue
        table, keys = None, -1  # the kernel reads the caches through the block table, where given
        if span.start_pos == 0:
            ks, vs, first_pos = k[span.token_slice], v[span.token_slice], 0
        else:
            blocks = view.prefill_block_tables[i] if view is not None else span.block_table
            first_pos = batch.prefill_first_pos(i, window)
            keys = span.context_len - first_pos
            if flash:  # the cached keys read where they lie, through the table (8-bit rows dequantized as packed)
                ks, vs, table = k_cache, v_cache, blocks
            else:
                ks, vs = (kv_quant.read_blocks(cache, blocks, q.dtype).view(-1, num_kv_heads, head_dim)[:keys]
                          for cache in (k_cache, v_cache))
        qs = q[span.token_slice]
        if flash:
            outs.append(prefill_kernel.prefill_attention(qs, ks, vs, scale, span.start_pos, first_pos, window, table,
                                                         keys, sinks))
            continue
        mask = batch.prefill_mask(i, window)
        if sinks is not None:
            outs.append(_sunk_prefill(qs, ks, vs, mask, scale, sinks))
            continue
        os_ = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] > num_kv_heads)
        outs.append(os_[0].transpose(0, 1))
    return outs


def _sunk(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out`` [T, H, D] whose softmax over the keys had log-sum-exp ``lse`` [T, H], as
    if each head's sink logit had joined the denominator: exp(lse) / (exp(lse) + exp(sink))."""
    return (out.float() * torch.sigmoid(lse.float() - sinks.float())[..., None]).to(out.dtype)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True: attend) as an additive one."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _sunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  sinks: torch.Tensor) -> torch.Tensor:
    """A prefill span's attention with sinks: q [n, H, D] over k, v [L, KVH, D] (the keys its
    ``mask`` [n, L] shows, plain causal where None), through the log-sum-exp path."""
    n, heads = q.shape[0], q.shape[1]
    if mask is None:
        mask = torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device).tril(k.shape[0] - n)
    group = heads // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    out, lse = attention_with_lse(q.transpose(0, 1)[None], kh, vh, _additive(mask, q.dtype)[None, None], scale)
    return _sunk(out[0].transpose(0, 1), lse[0].transpose(0, 1), sinks)


def _gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [rows, KVH, blocks * block_size, D] for a [rows, blocks] table (an 8-bit cache's
    rows dequantized to ``dtype``, the queries')."""
    rows, kvh = tables.shape[0], k_cache.shape[2]
    flat = tables.reshape(-1)
    k, v = (kv_quant.read_blocks(cache, flat, dtype) for cache in (k_cache, v_cache))
    return k.view(rows, -1, kvh, k.shape[-1]).transpose(1, 2), v.view(rows, -1, kvh, v.shape[-1]).transpose(1, 2)



def _reduction_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Softmax attention of q [B, KVH, G, D] over k, v [B, KVH, L, D] with a bool mask
    [B, 1, 1, L], written as broadcast products and sums (float32 statistics) that
    Inductor compiles into a few loops with the block gather folded into their loads."""
    scores = (q.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs[..., None] * v.float()[:, :, None, :, :]).sum(-2).to(q.dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention [B, H, Lq, D] and its float32 log-sum-exp [B, H, Lq].

    ``mask`` is additive, in ``q``'s dtype. CPU uses torch's fused flash kernel, which
    returns the log-sum-exp (its output is in ``q``'s dtype); other devices take a plain
    math path whose output stays float32 for the merge. (On CUDA a fused kernel that
    returns the log-sum-exp would be the faster choice; not measured here.)
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    return math_attention_with_lse(q, k, v, mask, scale)


def math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out, lse


def _cascade_decode(qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    plan: DecodeCascade, scale: float, in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qd [D, KVH, G, Dh] -> ([D, KVH, G, Dh], its log-sum-exp [D, KVH, G]): the tails of every
    row (read in place through ``kernels/decode_attention.cpp`` where ``in_place``, else gathered
    and padded), then each segment (a shared prefix, or a row's private blocks) in one call for
    its rows, merged into the running result through the log-sum-exp."""
    n, kvh, group, dim = qd.shape
    if in_place:
        out, lse = decode_kernel.decode_attention(qd.reshape(n, kvh * group, dim), k_cache, v_cache,
                                                  plan.tail_tables, plan.context_lens, scale,
                                                  first_pos=plan.tail_start)
        out, lse = out.view(qd.shape), lse.view(n, kvh, group)
    else:
        kt, vt = _gather_blocks(k_cache, v_cache, plan.tail_tables, qd.dtype)
        out, lse = attention_with_lse(qd, kt, vt, plan.tail_mask(qd.dtype), scale)
    out = out.float()
    for g in plan.segments:
        m = g.rows.shape[0]
        if kv_quant.is_quantized(k_cache):
            kp, vp = (kv_quant.read_blocks(cache, g.blocks, qd.dtype) for cache in (k_cache, v_cache))
        elif g.first_block is not None:
            blocks = slice(g.first_block, g.first_block + g.blocks.shape[0])
            kp, vp = k_cache[blocks], v_cache[blocks]
        else:
            kp, vp = k_cache.index_select(0, g.blocks), v_cache.index_select(0, g.blocks)
        kp = kp.view(1, -1, kvh, dim).transpose(1, 2)
        vp = vp.view(1, -1, kvh, dim).transpose(1, 2)
        # Every query of the segment's rows against its one K/V: [1, KVH, m * G, Dh].
        qg = qd.index_select(0, g.rows).permute(1, 0, 2, 3).reshape(1, kvh, m * group, dim)
        o, seg_lse = attention_with_lse(qg, kp, vp, None, scale)
        o = o.view(kvh, m, group, dim).permute(1, 0, 2, 3).float()
        seg_lse = seg_lse.view(kvh, m, group).permute(1, 0, 2)
        acc, acc_lse = out.index_select(0, g.rows), lse.index_select(0, g.rows)
        total = torch.logaddexp(acc_lse, seg_lse)
        merged = acc * torch.exp(acc_lse - total)[..., None] + o * torch.exp(seg_lse - total)[..., None]
        out.index_copy_(0, g.rows, merged)
        lse.index_copy_(0, g.rows, total)
    return out.to(qd.dtype), lse
