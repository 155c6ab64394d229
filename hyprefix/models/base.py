"""What every model shares: embedding, final norm, LM head (tied or not), rotary
tables, loading HF tensors by name, prepacking weights for the CPU."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.kernels import decode_attention as decode_kernel
from hyprefix.kernels import invariant_linear as invariant_kernel
from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.kernels import recurrent_decode
from hyprefix.models import fused
from hyprefix.models.fused_moe import Experts, flat_experts
from hyprefix.models.layers import Embedding, GatedMLP, Linear, RMSNorm, Rotary, drop_plain
from hyprefix.models.quant import Int8Weight, quantize_low_bit
from hyprefix.models.weights import MatrixForms

log = logging.getLogger("hyprefix.models")

# (our parameter name, shard index, shard sizes along dim 0) or (name, None, None)
Target = tuple[str, int | None, list[int] | None]


@dataclass(frozen=True)
class KVLayout:
    """Shape of one attention layer's K (or V) cache per token, for pool sizing, and
    each attention layer's sliding window (None: full attention), in layer order. ``latent``
    (multi-head latent attention, ``models/deepseek.py``): one tensor a layer, its K and V the
    same (a block's bytes counted once). ``rotation_blocks``: an 8-bit cache's rotation
    (``kv_quant.rotation``) as blocks along the head dim, each its own R (the latent's c and
    k_pe apart: ``deepseek.LatentAttention.rotated``); () one R over the whole head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] = ()
    latent: bool = False
    rotation_blocks: tuple[int, ...] = ()

    @property
    def tensors_per_layer(self) -> int:
        """Cache tensors a layer holds: K and V, or the latent alone."""
        return 1 if self.latent else 2

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None


def rope_tables(hf_config, max_positions: int, dtype: torch.dtype, device: torch.device,
                head_dim: int) -> Rotary:
    """Rotary tables from the checkpoint's RoPE parameters via transformers' own init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaling = 1.0
    elif rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' (length-dependent NTK scaling) is not supported")
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device=torch.device("cpu"))
    return Rotary(inv_freq, scaling, max_positions, dtype, device)


class CausalLM(nn.Module):
    """Base of the model classes. Subclasses build their blocks, then call
    ``_init_head`` and implement ``forward`` and ``map_name``.

    ``forward(batch, kv_caches, states)`` takes the step's ``ForwardBatch``
    (``hyprefix/forward.py``), gathers its rotary tables once and hands them and
    ``kernels`` (the elementwise kernels, eager or compiled by step size; eager until
    the owner, the runner, assigns ``Kernels(compile_enabled)``) to its layers.
    """

    kv_layout: KVLayout
    kernels: fused.Kernels
    state_layout = None  # recurrent layers' state shapes (models/recurrent_state.py)
    decode_kernel = False  # decode-only steps run in one kernel call (``use_decode_kernel``)
    # ``forward`` returns only the hidden rows ``batch.output_rows`` names, where it is set, and
    # runs the last layer's feed-forward part on those rows only (``last_layer_rows``).
    selects_output_rows = False
    # The logits' divisor (Granite's ``logits_scaling``); 1 where the family has none.
    logits_scaling = 1.0

    @property
    def head_forms(self) -> MatrixForms:
        """The LM head's matrix forms: its own, or the embedding table's when tied."""
        return self.lm_head.forms if self.lm_head is not None else self.embed.forms

    # No class-level default for ``rotary``: it would shadow the registered submodule.

    def _init_head(self, cfg, dtype: torch.dtype, device: torch.device, max_positions: int, norm_eps: float,
                   rotary_head_dim: int | None, can_tie: bool = True) -> None:
        """``can_tie`` False: the architecture never ties the LM head to the embedding,
        whatever ``tie_word_embeddings`` says (NemotronH in transformers)."""
        self.config = cfg
        self.dtype = dtype
        self.max_positions = max_positions
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.norm = RMSNorm(cfg.hidden_size, norm_eps, dtype, device)
        self.tie = can_tie and bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        self.kernels = fused.Kernels(compile_enabled=False)
        self._rotary_head_dim = rotary_head_dim
        self.rotary = None if rotary_head_dim is None else rope_tables(
            cfg, max_positions, dtype, device, rotary_head_dim)
        self.requires_grad_(False)

    def materialize(self, device: torch.device) -> None:
        """After construction on the meta device: allocate parameters (uninitialised;
        ``load_weights`` fills every one) and compute the rotary tables."""
        self.to_empty(device=device)
        if self._rotary_head_dim is not None:
            self.rotary = rope_tables(self.config, self.max_positions, self.dtype, device, self._rotary_head_dim)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for the selected hidden states; float32 logits. With a float32
        head (``use_fp32_head``) both run in float32: the norm's output is never rounded to
        the model's dtype, and the matmul reads the head's float32 copy. Every decode path
        ends here: eager steps, the compiled decode graphs, and the one-call decode kernel
        wherever its own head does not run (it computes logits itself only with an int8 head,
        which ``--lm-head-fp32`` refuses)."""
        forms = self.head_forms
        fp32 = forms.fp32
        if fp32 is not None:
            hidden = fused.rms_norm(hidden.float(), self.norm.weight.float(), self.norm.eps)
            # aten's matmul (an extern call in both compiled graphs); the batch-invariant mode's own kernel there
            logits = forms.matmul(hidden, fp32, None) if forms.invariant else F.linear(hidden, fp32)
        else:
            hidden = fused.rms_norm(hidden.to(self.dtype), self.norm.weight, self.norm.eps)
            head = self.lm_head if self.lm_head is not None else self.embed.logits
            logits = head(hidden).float()
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def use_fp32_head(self) -> bool:
        """``--lm-head-fp32``: keep a float32 copy of the LM head's weight (a tied head: of the
        embedding table) as the head's ``MatrixForms.fp32``, made once after loading and before
        ``pack_weights`` (which then leaves the head in its plain form); ``compute_logits``
        multiplies it instead. A float32 model is unchanged; an int8 head has no float32 form.
        Returns whether the head runs in float32 from now on."""
        if self.dtype == torch.float32:
            return False
        forms = self.head_forms
        if forms.quantized is not None:
            raise ValueError("--lm-head-fp32 cannot be used with a quantized LM head (--quantization int8, or a GGUF "
                             "file's quantized head: load it with --quantization none)")
        plain = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        if not plain.numel() or forms.bf16 is not None:
            raise RuntimeError("use_fp32_head runs before pack_weights, while the head's plain weight is there")
        forms.use_fp32(plain)
        log.info("the final norm and the LM head run in float32 (--lm-head-fp32): a float32 copy of the head, "
                 "%.1f MiB", forms.fp32.nbytes / 2**20)
        return True

    def _mixed_layers(self, batch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], states: list | None,
                      recurrent_kind: str) -> torch.Tensor:
        """The forward of a stack whose layers each hold either a recurrent mixer (``layer.kind``
        ``recurrent_kind``: it takes the next of ``states``) or attention (the next (K, V) of
        ``kv_caches``), called as ``layer(x, residual, batch, rope, cache, kernels)`` and returning
        (output, residual) as a Llama layer does: the hidden state, output plus residual."""
        x, residual = self.embed(batch.input_ids), None
        rope = self.rotary.tables(batch.positions)
        kv_iter, state_iter = iter(kv_caches), iter(states or [])
        for layer, rows in zip(self.layers, last_layer_rows(batch, len(self.layers)), strict=True):
            cache = next(state_iter) if layer.kind == recurrent_kind else next(kv_iter)
            x, residual = layer(x, residual, batch, rope, cache, self.kernels, rows)
        return x + residual

    def use_decode_kernel(self) -> bool:
        """Once its weights are final: run decode-only steps in one kernel call where
        the model and this CPU allow it (Llama-family int8, ``kernels/decode_layers.cpp``).
        Returns whether they will."""
        return False

    def takes_decode_kernel(self, batch) -> bool:
        """Whether ``forward`` runs this step's layers in the one-call decode kernel."""
        return False

    def decode_logits(self, batch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Float32 logits and greedy tokens of a decode-only step whose every row samples, in one
        kernel call where ``use_decode_kernel`` turned it on and the step fits; None: run
        ``forward`` and ``compute_logits``."""
        return None

    # Whether models with recurrent layers compile their decode steps where they can (a seam for
    # the test suite, where each hybrid shape would cost a cold compile; the tests of the hybrid
    # graphs turn it on).
    recurrent_decode_graphs = True

    @property
    def decode_graph_capable(self) -> bool:
        """Whether the runner compiles this model's decode steps (``runner/decode_graph.py``).
        Models with recurrent layers do where their mixers' fused decode ops run
        (``kernels/recurrent_decode``: a CPU with vector kernels), which the graph calls as
        extern ops updating the live states in place; elsewhere they decode eagerly. The loader
        keeps plain weights (or bf16 tiles) for it."""
        if self.state_layout is None:
            return True
        return self.recurrent_decode_graphs and self.embed.weight.device.type == "cpu" and recurrent_decode.available()

    def pack_weights(self, keep_plain: bool = False, eager_tiles: bool = False) -> None:
        """Add prepacked oneDNN weights to the linears where the device allows it (CPU). A
        tied LM head gets its own packed copy; the embedding keeps the plain one.
        ``keep_plain``: compiled decode steps will read the weights, so keep the plain ones
        too, or their bf16 tiles instead where the bf16 kernel runs (a tied head's tiles then
        replace the embedding table and serve the lookups, ``Embedding.pack_head``).
        ``eager_tiles``: eager decode steps will multiply bf16 tiles where the kernel takes them
        (``MatrixForms.tiles_take``), so add them beside the packed copies. A head with a float32
        copy (``use_fp32_head``) gets no other form."""
        fp32_head = self.head_forms.fp32 is not None  # the head multiplies its float32 copy: no other form
        for module in self.modules():
            if isinstance(module, Linear) and not (fp32_head and module is self.lm_head):
                module.pack(keep_plain, eager_tiles)
        if self.lm_head is None and not fp32_head:
            self.embed.pack_head(keep_plain, eager_tiles)

    def use_batch_invariant(self) -> None:
        """The batch-invariant mode (``EngineArgs.batch_invariant``), after loading and before
        packing: every matrix multiplies with a kernel whose result for a row does not depend on
        the other rows (``MatrixForms.use_batch_invariant``; a matrix it tiles drops its plain
        tensor, and a tied head's tiles serve the embedding lookups) and the gated MLPs'
        activation runs in ``kernels/invariant_linear``'s op;
        attention and the runner do their part through ``ForwardBatch.batch_invariant``.
        ValueError where the mode cannot hold: recurrent layers (Mamba2, Gated DeltaNet), int8
        weights, an MLP activation that op lacks, or a device where those kernels and the
        decode-attention kernel do not run (anything but an x86 CPU with AVX2 or AVX-512, or a
        failed build)."""
        if self.state_layout is not None:
            raise ValueError(f"--batch-invariant does not support models with recurrent layers (Mamba2, Gated "
                             f"DeltaNet): {type(self).__name__}")
        if self.embed.weight.device.type != "cpu" or not invariant_kernel.available() \
                or not decode_kernel.available(self.dtype):
            raise ValueError("--batch-invariant needs hyprefix's C++ kernels (invariant_linear, decode_attention) "
                             "on an x86 CPU with AVX2 or AVX-512, built with a C++ compiler; they do not run here")
        for module in self.modules():
            if isinstance(module, GatedMLP) and module.activation not in invariant_kernel.ACTIVATIONS:
                raise ValueError(f"--batch-invariant has no kernel for the MLP activation {module.activation!r}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_batch_invariant()
        if self.lm_head is None:
            self.embed.use_batch_invariant_head()

    def quantize_weights(self) -> None:
        """int8 for every linear layer and the LM head (``quant.py``; a tied head gets an
        int8 copy; the embedding lookup keeps the float table), and for MoE experts int8 with a
        scale per 32 columns (``Experts.quantize``)."""
        for module in self.modules():
            if isinstance(module, Linear) and module.forms.quantized is None and module.quantizable:
                module.quantize()
            elif isinstance(module, Experts):
                module.quantize(8)
        if self.lm_head is None and self.embed.forms.quantized is None:
            self.embed.forms.quantize(self.embed.weight)

    def quantize_weights_q4(self) -> None:
        """4-bit weights (``--quantization int4``): every linear layer and the LM head whose
        columns fill groups of 32 (``quant.quantize_low_bit``: Q4K tiles, Q4_K's two levels of
        scales, where they fill groups of 256, else Q4 with a float16 scale and offset per group;
        an unsigned code per weight over each group's range), MoE experts likewise
        (``Experts.quantize``); a tied head gets a 4-bit copy, the embedding lookup keeps the float
        table. Needs ``kernels/quant_linear`` (x86 with AVX2)."""
        if not quant_kernel.available():
            raise ValueError("--quantization int4 needs hyprefix's quant_linear kernel (an x86 CPU with AVX2 and a "
                             "C++ compiler); it does not run here")
        for module in self.modules():
            if (isinstance(module, Linear) and module.forms.quantized is None and module.quantizable
                    and module.in_features % 32 == 0):
                module.forms.use_quant(quantize_low_bit(module.weight))
                drop_plain(module.weight)
            elif isinstance(module, Experts):
                module.quantize(4)
        if self.lm_head is None and self.embed.forms.quantized is None and self.embed.embedding_dim % 32 == 0:
            self.embed.forms.use_quant(quantize_low_bit(self.embed.weight))

    def _whole_matrices(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, nn.Module | None, list]]:
        """(parameter name, its module, the matrix's shards in order) for each matrix of
        ``weights`` (HF names), once every shard of it (q/k/v, gate/up) came; tensors with no
        place in the model are skipped."""
        modules = dict(self.named_modules())
        shards: dict[str, dict[int, object]] = {}
        for name, weight in weights:
            target = self.map_name(name)
            if target is None:
                continue
            param_name, shard, sizes = target
            parts = shards.setdefault(param_name, {})
            parts[0 if shard is None else shard] = weight
            if len(parts) == (1 if sizes is None else len(sizes)):
                yield param_name, modules.get(param_name.rsplit(".", 1)[0]), [parts[i] for i in range(len(parts))]

    def load_int8_weights(self, weights: Iterable[tuple[str, Int8Weight]]) -> int:
        """Checkpoint int8 weights (GGUF Q8_0 blocks) straight into their linear layers,
        after ``load_weights``. Shards of a fused linear (q/k/v, gate/up) are joined once
        all of them came as int8 with one group size; a linear missing some keeps its
        float weight. A tied head's int8 copy is the embedding's int8 table (the lookup
        keeps the float one). Returns how many linears (and heads) switched."""
        switched = 0
        for param_name, module, ordered in self._whole_matrices(weights):
            if param_name == "embed.weight":
                if self.lm_head is None:
                    self.embed.forms.use_int8(ordered[0])
                    switched += 1
                continue
            if not param_name.endswith(".weight") or not isinstance(module, Linear):
                continue
            if len({part.group for part in ordered}) == 1:
                module.use_int8(Int8Weight(torch.cat([p.qweight for p in ordered]),
                                           torch.cat([p.scales for p in ordered])))
                switched += 1
        return switched

    def weight_memory_bytes(self) -> int:
        """Bytes the weights hold in memory: parameters, and each matrix's int8 weights, bf16
        tiles and prepacked copies."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total + sum(m.memory_bytes(self.dtype) for m in self.modules() if isinstance(m, MatrixForms))

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every linear layer and the LM head as
        stored (float or int8), the norms, MLA's W_UK and W_UV, and of a MoE block's experts the
        share one token reads (``active_expert_bytes``: top-k of them); the embedding lookup reads one row, not
        counted."""
        total = 0
        for module in self.modules():
            if isinstance(module, Linear):
                total += module.forms.decode_bytes(self.dtype)
                total += module.bias.numel() * module.bias.element_size() if module.bias is not None else 0
            elif isinstance(module, RMSNorm):
                total += module.weight.numel() * module.weight.element_size()
            elif hasattr(module, "active_expert_bytes"):  # a MoE block (``models/moe.py``)
                total += module.active_expert_bytes(self.dtype)
            elif hasattr(module, "absorb_bytes"):  # MLA's per-head W_UK, W_UV (``models/deepseek.py``)
                total += module.absorb_bytes(self.dtype)
        return total + (self.embed.forms.decode_bytes(self.dtype) if self.lm_head is None else 0)

    def map_name(self, name: str) -> Target | None:
        """Our parameter for an HF tensor name; None to skip the tensor. Names every
        decoder shares (embedding, final norm, LM head, rotary buffers, tensors outside
        the layers) are mapped here; ``map_layer`` maps the tensors of layer ``idx``."""
        name = self.relative_name(name)
        if name is None:
            return None
        head = self.map_head(name, "embed_tokens.weight", "norm.weight")
        if head is not None or name == "lm_head.weight" or "rotary_emb" in name:
            return head
        if not name.startswith("layers."):
            return name, None, None
        _, idx, rest = name.split(".", 2)
        return self.map_layer(int(idx), rest)

    def relative_name(self, name: str) -> str | None:
        """The name relative to the decoder (``layers.0...``); None to skip the tensor."""
        return strip_prefix(name)

    def converted(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoint tensors (transformers names) as ``map_name`` reads them: where a family's
        layout differs from transformers' (split or regrouped rows, norms stored as ``1 + w``),
        the tensors it makes of each. Row moves must be torch ops along the first dimension only,
        whatever the other dimensions hold: ``gguf_blocks`` passes tag columns through them to
        follow a quantized matrix's rows. Here: MoE expert stacks [E, rows, cols] flattened to the
        experts' [E * rows, cols] (``fused_moe.flat_experts``), every other tensor as it is."""
        return ((name, flat_experts(name, t)) for name, t in weights)

    def map_layer(self, idx: int, rest: str) -> Target:
        """Our parameter for tensor ``rest`` (``self_attn.q_proj.weight``, ...) of layer ``idx``."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     into: dict[str, torch.Tensor] | None = None, quantized: set[str] = frozenset()) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, or into ``into`` (parameter
        name -> a tensor of the parameter's shape, ``update_weights``' staging). Raises
        ValueError on a tensor with no place, a wrong shape, or a parameter left without one
        (``quantized``: parameters already held in a GGUF file's blocks, ``gguf_blocks``, which need none)."""
        params = {name: p.data for name, p in self.named_parameters()} if into is None else into
        loaded: set[str] = set()
        for name, tensor in self.converted(weights):
            target = self.map_name(name)
            if target is None:
                continue
            param_name, shard, sizes = target
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model ({param_name!r})")
            dst = params[param_name]
            if shard is not None and sizes is not None:
                dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
            _copy(dst, tensor, name)
            loaded.add(f"{param_name}#{shard}")
        missing = [n for n in params if n not in quantized and not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}")

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace every weight by the checkpoint tensors ``weights`` (HF names, as loading
        reads them) in place: each parameter, and each form a matrix has beside it (packed,
        int8, bf16 tiles: ``MatrixForms.refresh``), so compiled steps and kernels that hold
        those tensors compute with the new values. All of them are read and checked first
        (a name with no place, a wrong shape, a weight missing: ValueError); only then is
        anything changed. Returns how many parameters changed."""
        modules = dict(self.named_modules())
        staged: dict[str, torch.Tensor] = {}
        targets: list[tuple[nn.Parameter, MatrixForms | None, torch.Tensor]] = []
        for name, param in self.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            module = modules[module_name]
            forms = getattr(module, "forms", None) if leaf == "weight" else None  # Linear, Embedding, Experts
            shape = param.shape if forms is None else torch.Size((forms.rows, forms.cols))  # the plain may be emptied
            staged[name] = torch.empty(shape, dtype=param.dtype, device=param.device)
            targets.append((param, forms, staged[name]))
        self.load_weights(weights, into=staged)
        for param, forms, new in targets:
            if param.numel():
                param.data.copy_(new)
            if forms is not None:
                forms.refresh(new)
        self.weights_changed()
        return len(staged)

    def weights_changed(self) -> None:
        """Drop what was built from the old weights (a model's kernel state, a module's derived
        copy: ``forget_derived``); called by ``update_weights`` once the new ones are in place."""
        for module in self.modules():
            if module is not self and hasattr(module, "forget_derived"):
                module.forget_derived()

    def map_head(self, name: str, embed: str, norm: str) -> Target | None:
        """Names shared by every model: embedding, final norm, LM head."""
        if name == embed:
            return "embed.weight", None, None
        if name == norm:
            return "norm.weight", None, None
        if name == "lm_head.weight":
            return None if self.tie else ("lm_head.weight", None, None)
        return None


def last_layer_rows(batch, num_layers: int) -> list[torch.Tensor | None]:
    """Per layer, the rows whose output the next one reads after its token mixer (attention or
    a recurrent mixer, which every row's K/V or state needs): all (None) but in the last layer,
    where only ``batch.output_rows`` (None: all) reach the caller. A prefill samples one row of
    hundreds, so the last layer's output projection and MLP run on that row alone (in a 28-layer
    model, 2.6 % of the prefill's matmul work)."""
    return [None] * (num_layers - 1) + [batch.output_rows] if num_layers else []


def select_rows(h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h`` and ``residual`` at ``rows`` (None: as they are)."""
    return (h, residual) if rows is None else (h[rows], residual[rows])


def strip_prefix(name: str) -> str:
    for prefix in ("model.", "backbone."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def language_model_name(name: str) -> str | None:
    """An HF tensor name relative to the language model (``layers.0...``, ``norm.weight``,
    ``lm_head.weight``) for text and multimodal checkpoints; None for vision towers,
    projectors and multi-token-prediction heads."""
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return None if name.startswith(("vision_tower.", "multi_modal_projector.", "visual.", "mtp.")) else name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.dim() == 2 and src.dim() == 1 and dst.shape[1] == src.shape[0]:
        src = src.expand_as(dst)  # one per-head norm weight repeated for every head
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src.to(dtype=dst.dtype))
