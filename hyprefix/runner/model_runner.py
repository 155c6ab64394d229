"""SchedulerOutput -> tensors -> forward -> sampled token ids. Owns the KV tensors."""

from __future__ import annotations

import torch

from hyprefix.models.fused import Kernels
from hyprefix.outputs import SchedulerOutput
from hyprefix.runner.batch import build_batch
from hyprefix.runner.sampler import Sampler


class ModelRunner:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int, seed: int, compile_enabled: bool = True) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        layout = model.kv_layout
        shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(layout.num_layers)
        ]
        self.sampler = Sampler(seed, device)
        self.kernels = Kernels(compile_enabled)

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, dtype: torch.dtype, block_size: int) -> int:
        layout = model.kv_layout
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * layout.num_layers * block_size * layout.num_kv_heads * layout.head_dim * elem

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        self.sampler.forget(output.finished_ids)
        if output.is_empty:
            return {}
        batch = build_batch(output.seqs, self.block_size, self.device, self.kernels)
        hidden = self.model(batch, self.kv_caches)
        if not batch.sample_seqs:
            return {}
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        tokens = self.sampler.sample(logits, batch.sample_seqs)
        return {seq.request_id: tok for seq, tok in zip(batch.sample_seqs, tokens, strict=True)}
