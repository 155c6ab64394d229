"""Scheduled sequences -> ``ForwardBatch`` (``hyprefix/forward.py``): flat token ids
and positions, KV slots, decode block tables (with the cascade plan of
``cascade.py``), prefill spans and logits indices.

Token order inside a step: every single-token sequence (decodes) first, then the
multi-token sequences (prefill chunks), each contiguous; attention relies on it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from hyprefix.forward import DecodeCascade, DecodeSegment, ForwardBatch, PrefillSpan, WindowKV
from hyprefix.outputs import ScheduledSeq
from hyprefix.runner import cascade, verify
from hyprefix.runner.cascade import CascadeThresholds, FastPathCost


def build_batch(seqs: list[ScheduledSeq], block_size: int, device: torch.device,
                thresholds: CascadeThresholds, fast_path: FastPathCost | None = None,
                batch_invariant: bool = False) -> ForwardBatch:
    """``thresholds``: when decode blocks are read as cascade segments (``cascade.py``).
    ``fast_path``: the runner's fast decode path, which takes a decode-only step only when no
    prefix is read once for several rows: a plan that shares prefixes is dropped for one that
    does not unless it is ``FastPathCost.worth_sharing``. ``batch_invariant``: the batch-invariant
    mode (``ForwardBatch.batch_invariant``), whose attention reads every row whole: no cascade plan."""
    decodes = [s for s in seqs if s.num_tokens == 1]
    prefills = [s for s in seqs if s.num_tokens > 1]
    ordered = decodes + prefills

    rows = _token_rows(ordered, block_size, device)
    input_ids, positions, slots, write_index = rows.input_ids, rows.positions, rows.slots, rows.write_index
    all_write, logits_indices, sample_seqs, spans = rows.all_write, rows.logits_indices, rows.sample_seqs, rows.spans

    def as_long(values: list) -> torch.Tensor:
        return _long(values, device)

    decode_slots = [s.state_slot for s in decodes]
    decode_tables = decode_lens = decode_cascade = None
    if decodes:
        tables = [s.block_table[: -(-s.context_len // block_size)] for s in decodes]
        lens = [s.context_len for s in decodes]
        decode_tables = as_long(_pad(tables))
        decode_lens = as_long(lens)
        if not batch_invariant:
            segments, covered = cascade.plan_segments(tables, lens, block_size, thresholds)
            decode_cascade = _decode_cascade(segments, covered, tables, decode_lens, block_size, device)

    batch = ForwardBatch(
        seqs=ordered,
        input_ids=as_long(input_ids),
        positions=as_long(positions),
        slot_mapping=as_long(slots),
        write_index=None if all_write else as_long(write_index),
        block_size=block_size,
        num_decode=len(decodes),
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        decode_cascade=decode_cascade,
        decode_state_slots=as_long(decode_slots) if decodes and decode_slots[0] >= 0 else None,
        decode_state_taps=[(row, slot) for row, s in enumerate(decodes) for _, slot in s.state_taps],
        prefills=spans,
        logits_indices=as_long(logits_indices),
        sample_seqs=sample_seqs,
        window_kv=_window_kv(ordered, len(decodes), block_size, device)
        if ordered and ordered[0].window_blocks is not None else None,
        decode_state_range=_slot_range(decode_slots),
        batch_invariant=batch_invariant,
    )
    if (fast_path is not None and decode_cascade is not None and decode_cascade.shares_prefix
            and batch.reads_tables_whole(apart_from_sharing=True)
            and not fast_path.worth_sharing(segments, lens, block_size)):
        unshared = CascadeThresholds(min_saved_tokens=sys.maxsize, min_solo_run_tokens=thresholds.min_solo_run_tokens)
        segments, covered = cascade.plan_segments(tables, lens, block_size, unshared)
        batch.decode_cascade = _decode_cascade(segments, covered, tables, decode_lens, block_size, device)
    return batch


@dataclass
class _TokenRows:
    """The step's tokens, decodes first, as flat lists (``build_batch`` makes tensors of them)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    write_index: list[int] = field(default_factory=list)  # rows that write KV, unless all do
    all_write: bool = True
    logits_indices: list[int] = field(default_factory=list)
    sample_seqs: list[ScheduledSeq] = field(default_factory=list)
    spans: list[PrefillSpan] = field(default_factory=list)


def _token_rows(ordered: list[ScheduledSeq], block_size: int, device: torch.device) -> _TokenRows:
    rows = _TokenRows(all_write=all(seq.write_kv for seq in ordered))
    for seq in ordered:
        start = len(rows.input_ids)
        rows.input_ids.extend(seq.token_ids)
        table = seq.block_table
        rows.positions.extend(range(seq.start_pos, seq.context_len))
        if seq.write_kv:
            rows.slots.extend(table[pos // block_size] * block_size + pos % block_size
                              for pos in range(seq.start_pos, seq.context_len))
            if not rows.all_write:
                rows.write_index.extend(range(start, start + seq.num_tokens))
        if seq.sample and seq.num_drafts:  # every token of a row verifying drafts samples
            rows.logits_indices.extend(range(start, len(rows.input_ids)))
            rows.sample_seqs.extend(verify.sample_rows(seq))
        elif seq.sample:
            rows.logits_indices.append(len(rows.input_ids) - 1)
            rows.sample_seqs.append(seq)
        if seq.num_tokens > 1:
            n_blocks = -(-seq.context_len // block_size)
            rows.spans.append(PrefillSpan(
                token_start=start, num_tokens=seq.num_tokens, start_pos=seq.start_pos,
                block_table=torch.tensor(table[:n_blocks], dtype=torch.long, device=device),
                state_slot=seq.state_slot,
                state_taps=[(pos - seq.start_pos, slot) for pos, slot in seq.state_taps]))
    return rows


def _decode_cascade(segments: list[cascade.Segment], covered: list[int], tables: list[list[int]],
                    context_lens: torch.Tensor, block_size: int, device: torch.device) -> DecodeCascade | None:
    """The tensors of a cascade plan (``cascade.plan_segments``), or None for an empty one."""
    if not segments:
        return None
    return DecodeCascade(
        segments=[DecodeSegment(rows=_long(g.rows, device), blocks=_long(g.blocks, device),
                                first_block=min(g.blocks) if g.contiguous else None) for g in segments],
        tail_tables=_long(_pad([t[n:] for t, n in zip(tables, covered, strict=True)]), device),
        tail_start=_long([n * block_size for n in covered], device),
        context_lens=context_lens,
        block_size=block_size)


def _slot_range(slots: list[int]) -> tuple[int, int] | None:
    if not slots or slots[0] < 0 or slots != list(range(slots[0], slots[0] + len(slots))):
        return None
    return slots[0], slots[0] + len(slots)


def _window_kv(ordered: list[ScheduledSeq], num_decode: int, block_size: int,
               device: torch.device) -> WindowKV:
    """Slots and tables of the sliding-window layers' own pool (same token order and
    written tokens as the main slot mapping)."""
    slots: list[int] = []
    tables: list[list[int]] = []
    for seq in ordered:
        assert seq.window_blocks is not None
        base = seq.window_first_block
        table = seq.window_blocks[: -(-seq.context_len // block_size) - base]
        tables.append(table)
        if seq.write_kv:
            slots.extend(table[pos // block_size - base] * block_size + pos % block_size
                         for pos in range(seq.start_pos, seq.context_len))
    first_pos = [seq.window_first_block * block_size for seq in ordered]
    return WindowKV(
        slot_mapping=_long(slots, device),
        decode_block_tables=_long(_pad(tables[:num_decode]), device) if num_decode else None,
        decode_first_pos=_long(first_pos[:num_decode], device) if num_decode else None,
        prefill_block_tables=[_long(t, device) for t in tables[num_decode:]],
        prefill_first_pos=first_pos[num_decode:])


def _long(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _pad(tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]
