"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's block.

What departs from ``llama.py``, as transformers' Gemma2/Gemma3 models compute it:

- the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype;
- each block norms its attention output and its MLP output too (sandwich norms) before they
  join the residual stream; the norm weights are held as 1 + w (``load_hf`` adds the 1 that
  Gemma's RMSNorm adds on every call; llama.cpp's converter stores them so);
- the MLP is GeGLU (tanh-approximated GELU of the gate times the up projection);
- q.k is scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps the scores and the
  final logits (``cap * tanh(x / cap)``);
- the layers alternate between a sliding window and full attention (``layer_types``), and
  Gemma 3's windowed layers use RoPE of their own base (``rope_local_base_freq``) without the
  model's rope scaling; Gemma 3 norms q and k per head (``qk_norm``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.models.attention import (
    AttentionMetadata,
    StepMetadata,
    layer_metadata,
    sdpa_backends,
)
from baton.engine.models.config import ModelConfig
from baton.engine.models.decoder_layer import DecoderLayer
from baton.engine.models.gguf_linear import QuantParts
from baton.engine.models.kv_cache import KVCache
from baton.engine.models.layers import RMSNorm, RotaryEmbedding
from baton.engine.models.llama import LlamaForCausalLM
from baton.kernels.quant_formats import QuantWeight


class GemmaDecoderLayer(DecoderLayer):
    """One Gemma block: ``input_layernorm`` -> attention -> ``post_attention_layernorm`` ->
    residual add -> ``pre_feedforward_layernorm`` -> GeGLU MLP -> ``post_feedforward_layernorm``
    (the Hugging Face names). ``window``: this layer's attention window (None: full)."""

    def __init__(
        self,
        config: ModelConfig,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None,
        quant: tuple[QuantParts | None, ...] | None,
        quant_activations: str,
        window: int | None,
    ) -> None:
        super().__init__(config, reduce, quant, quant_activations, window=window)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.softcap = config.attn_logit_softcapping
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def extra_weights(self) -> dict[str, nn.Parameter]:
        """The base block's, and the two norms Gemma adds: before and after the MLP."""
        return {
            **super().extra_weights(),
            "pre_feedforward_layernorm.weight": self.pre_feedforward_layernorm.weight,
            "post_feedforward_layernorm.weight": self.post_feedforward_layernorm.weight,
        }

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block over ``x + residual`` (``x`` alone for the first block); returns ``(mlp
        output after its norm, residual stream)``, summed by the next block's norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        out = self.attention(h, rope, kv, meta)
        h, residual = self.pre_feedforward_layernorm.forward_add(
            self.post_attention_layernorm(out), residual
        )
        gate, up = self.gate_up(h)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out = self._project(3, act * up)
        out = out if self.reduce is None else self.reduce(out)
        return self.post_feedforward_layernorm(out), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text model: ``LlamaForCausalLM`` with Gemma's blocks, scaled
    embeddings, a second RoPE table for Gemma 3's windowed layers and soft-capped logits.
    Its decode steps never take the fused C++ layer call (which has no sandwich norms)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: object = None,
        quantized: dict[str, QuantWeight] | None = None,
        quant_activations: str = "float32",
    ) -> None:
        super().__init__(config, tp, quantized, quant_activations)  # type: ignore[arg-type]
        self._fusable = False
        self.local_rope: RotaryEmbedding | None = (
            None
            if config.rope_local_theta is None
            else RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_local_theta, None
            )
        )

    def build_layer(
        self,
        index: int,
        config: ModelConfig,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None,
        quant: tuple[QuantParts | None, ...] | None,
        quant_activations: str,
        experts: tuple[tuple[QuantParts, QuantParts], ...] | None = None,
    ) -> DecoderLayer:
        """Gemma block ``index``, windowed as ``config.layer_window`` says (no experts)."""
        window = self.config.layer_window(index)
        return GemmaDecoderLayer(config, reduce, quant, quant_activations, window)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        meta: StepMetadata,
    ) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``, with Gemma's scaled embeddings and per-layer RoPE."""
        x = self.embed(input_ids)
        # Gemma multiplies by sqrt(hidden) rounded to the model's dtype, as transformers does.
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rope = self.rope.cos_sin(positions, x.dtype)
        local = rope if self.local_rope is None else self.local_rope.cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        with sdpa_backends(x.device):
            metas = layer_metadata(meta, len(self.layers))
            for layer, kv, layer_meta in zip(self.layers, kv_caches, metas, strict=True):
                assert isinstance(layer, GemmaDecoderLayer)
                cos_sin = local if layer.windowed else rope
                x, residual = layer(x, residual, cos_sin, kv, layer_meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.forward_add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """As ``LlamaForCausalLM.compute_logits``, soft-capped where the model says so (Gemma 2:
        ``cap * tanh(logits / cap)`` in float32)."""
        logits = super().compute_logits(hidden, out)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return logits.div_(cap).tanh_().mul_(cap)
