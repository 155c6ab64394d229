"""Per-step forward metadata: token positions, KV slots, block tables and masks.

Plain data that both sides of the forward share: ``runner/batch.py`` builds it
(``build_batch``), the models (``models/``) read it. It carries nothing but this
step's metadata: compile policy belongs to the model (``CausalLM.kernels``) and
values derived per step (rotary tables) are computed by the model's forward.

Token order inside a step: every single-token sequence (decodes) first, then the
multi-token sequences (prefill chunks), each contiguous. The runner keeps that
order; attention relies on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from hyprefix.outputs import ScheduledSeq


@dataclass
class PrefillSpan:
    token_start: int
    num_tokens: int
    start_pos: int
    block_table: torch.Tensor  # long [num_blocks]
    state_slot: int = -1  # live Mamba state slot
    state_taps: list[tuple[int, int]] = field(default_factory=list)  # (tokens into the span, checkpoint slot)

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens

    @property
    def token_slice(self) -> slice:
        return slice(self.token_start, self.token_start + self.num_tokens)


@dataclass
class DecodeSegment:
    rows: torch.Tensor  # long [m]: decode rows that read these blocks together
    blocks: torch.Tensor  # long [c]: block ids
    first_block: int | None  # set when the block ids form one range (read as a view from here)


@dataclass
class DecodeCascade:
    """Decode attention split into segments (shared prefixes read once per group,
    long private parts read per row) and per-row padded tails (see ``runner/cascade.py``)."""

    segments: list[DecodeSegment]
    tail_tables: torch.Tensor  # long [D, max_tail_blocks], padded with 0
    tail_start: torch.Tensor  # long [D]: position of each row's first tail token
    context_lens: torch.Tensor  # long [D]
    block_size: int
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    @cached_property
    def shares_prefix(self) -> bool:
        """Whether some segment is read by several rows at once. A plan of only single-row
        segments (long contexts' own runs) saves no bytes to a reader that reads each row's
        table in place (the decode-attention kernel, the compiled step)."""
        return any(seg.rows.numel() > 1 for seg in self.segments)

    def tail_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive [D, 1, 1, L] mask (0 visible, -inf hidden) over the padded tails."""
        if dtype not in self._masks:
            j = torch.arange(self.tail_tables.shape[1] * self.block_size, device=self.tail_tables.device)
            visible = (j[None, :] + self.tail_start[:, None]) < self.context_lens[:, None]
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[dtype] = mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        return self._masks[dtype]


@dataclass
class WindowKV:
    """Where the sliding-window layers' K/V lives when they have a block pool of their
    own: each sequence's block ids from the first block its tokens can see, whose
    first position is ``*_first_pos`` (earlier blocks left every window)."""

    slot_mapping: torch.Tensor  # long [W]: the same tokens as ``ForwardBatch.slot_mapping``
    decode_block_tables: torch.Tensor | None  # long [D, max_blocks], padded with 0
    decode_first_pos: torch.Tensor | None  # long [D]
    prefill_block_tables: list[torch.Tensor]  # long [blocks] per prefill span
    prefill_first_pos: list[int]


@dataclass
class ForwardBatch:
    seqs: list[ScheduledSeq]
    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    slot_mapping: torch.Tensor  # long [W]: KV slot of every token whose K/V is written
    write_index: torch.Tensor | None  # long [W]: which tokens those are (None: all, in order)
    block_size: int
    num_decode: int
    decode_block_tables: torch.Tensor | None  # long [D, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None  # long [D]
    decode_cascade: DecodeCascade | None  # set when some decode blocks are read as segments
    decode_state_slots: torch.Tensor | None  # long [D]: live recurrent-state slot of each decode
    decode_state_taps: list[tuple[int, int]]  # (decode row, checkpoint slot): save its state after the step
    prefills: list[PrefillSpan]
    logits_indices: torch.Tensor  # long [S]: tokens whose logits are sampled
    sample_seqs: list[ScheduledSeq]
    # The rows of the model's output the caller reads, in order (None: all); set only for a
    # model that ``selects_output_rows`` (``base.last_layer_rows``).
    output_rows: torch.Tensor | None = None
    window_kv: WindowKV | None = None  # sliding-window layers' own pool (None: they read the tables above)
    # (first, end) when the decode rows' state slots are first, first + 1, ...: their
    # states are one slice of the live tensor and are updated in place.
    decode_state_range: tuple[int, int] | None = None
    # The batch-invariant mode (``EngineArgs.batch_invariant``): every token attends as a row of
    # its own (``query_tables``), through the decode-attention kernel's fixed runs.
    batch_invariant: bool = False
    _masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)
    _query_tables: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def reads_tables_whole(self, apart_from_sharing: bool = False, window_pool: bool = False) -> bool:
        """A decode-only step whose every row samples and reads its K/V through its own whole
        block table: no prefill, every K/V written, no sliding-window pool (unless
        ``window_pool``: the window layers then read theirs through ``window_kv``), and (unless
        ``apart_from_sharing``) no prefix read once for several rows by a cascade plan (a plan
        of only single-row segments reads no fewer bytes). The fast decode paths (the one-call
        decode kernel; the compiled decode graphs, which take a window pool too) take exactly
        these steps (recurrent states, if any, are the graphs' to advance)."""
        return (not self.prefills and self.num_decode > 0 and self.write_index is None
                and (window_pool or self.window_kv is None)
                and len(self.sample_seqs) == self.num_decode
                and (apart_from_sharing or self.decode_cascade is None or not self.decode_cascade.shares_prefix))

    def kv_view(self, window: int | None) -> WindowKV | None:
        """The sliding-window pool's tables for a layer with ``window`` (None: the main tables)."""
        return self.window_kv if window is not None else None

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """Bool [D, 1, 1, L] over the decode tables of ``kv_view(window)``: the key in
        slot j (at position j + the row's first position) is visible to a decode token
        at position p when it is <= p and (no window or > p - window)."""
        view = self.kv_view(window)
        key = ("decode", int(view is not None), window)
        if key not in self._masks:
            assert self.decode_context_lens is not None
            tables = view.decode_block_tables if view is not None else self.decode_block_tables
            assert tables is not None
            pos = torch.arange(tables.shape[1] * self.block_size, device=self.input_ids.device)[None, :]
            if view is not None:
                pos = pos + view.decode_first_pos[:, None]
            ctx = self.decode_context_lens[:, None]
            mask = pos < ctx
            if window is not None:
                mask &= pos > ctx - 1 - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def query_tables(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every token of the step as a query row of its own, in the step's token order: the block
        table of its sequence in ``kv_view(window)`` (long [T, W], padded with 0), its context
        length (its position + 1, long [T]) and the position of its table's first slot (long [T];
        None: 0). A prefill token then attends exactly as a decode token at its position does."""
        view = self.kv_view(window)
        key = view is not None
        if key not in self._query_tables:
            decode = view.decode_block_tables if view is not None else self.decode_block_tables
            parts = [decode] if self.num_decode else []
            firsts = [view.decode_first_pos] if view is not None and self.num_decode else []
            for i, span in enumerate(self.prefills):
                table = view.prefill_block_tables[i] if view is not None else span.block_table
                parts.append(table.expand(span.num_tokens, -1))
                if view is not None:
                    firsts.append(table.new_full((span.num_tokens,), view.prefill_first_pos[i]))
            width = max(part.shape[1] for part in parts)
            tables = parts[0] if len(parts) == 1 and parts[0].shape[1] == width else torch.cat(
                [torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])
            first = (firsts[0] if len(firsts) == 1 else torch.cat(firsts)) if firsts else None
            self._query_tables[key] = (tables, self.positions + 1, first)
        return self._query_tables[key]

    def prefill_first_pos(self, index: int, window: int | None) -> int:
        """Position of the first key a prefill span's context gather holds."""
        view = self.kv_view(window)
        return view.prefill_first_pos[index] if view is not None else 0

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """Bool [n, context] for a prefill span (context from ``prefill_first_pos``), or
        None when plain causal attention over the span's own tokens is exact (no
        earlier context, no window cut)."""
        span = self.prefills[index]
        if span.start_pos == 0 and (window is None or span.num_tokens <= window):
            return None
        key = ("prefill", index, window)
        if key not in self._masks:
            device = self.input_ids.device
            q_pos = torch.arange(span.start_pos, span.context_len, device=device)[:, None]
            k_pos = torch.arange(self.prefill_first_pos(index, window), span.context_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[key] = mask
        return self._masks[key]
