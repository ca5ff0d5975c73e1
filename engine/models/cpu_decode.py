"""A CPU decode step's decoder layers in one C++ call each (``decode_layer`` in
``kernels/csrc/quant_linear.cpp``), where every projection is in GGUF blocks.

Why: a batch-1 decode step of a GGUF model is bound by reading the weights, and between two
weight reads the layer's small ops (RMSNorm, RoPE, the cache write, attention, SiLU) and their
Python run with caches the weights have just swept: measured on a 1B-shape Q4_K_M model (AMD
EPYC Genoa, 2 threads), a layer's ops other than its four projections took 74 us with warm
caches and 205 us after a 64 MB sweep, 16 layers a step. One C++ call per layer runs the same
ops, in the same order, with no Python between them.

The fused call computes the unfused layer's bits (the same C++ ops, built with the same flags;
``tests/engine/models/test_cpu_decode.py``), so a step may take either path without changing a
token. It is taken only where the unfused path would take exactly those ops: a pure-decode step
whose attention is the CPU paged decode kernel (``models/attention.py``), RMSNorm and RoPE
through ``kernels/cpu_ops.py``, and a layer with all four projections quantised and no tensor
parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from baton.kernels import cpu_ops
from baton.kernels.cpu_ops import decode_isa_code, decode_isas, paged_decode_fits
from baton.kernels.quant_linear import extension as quant_extension

if TYPE_CHECKING:
    from baton.engine.models.attention import AttentionMetadata
    from baton.engine.models.decoder_layer import DecoderLayer


class FusedLayer:
    """One decoder layer's ``decode_layer`` call with its weights bound (built once)."""

    __slots__ = ("_args", "_scale", "_tail")

    def __init__(self, layer: DecoderLayer) -> None:
        calls = layer.quant_calls
        assert all(c is not None for c in calls)
        qkv, o, gate_up, down = (c.call_args for c in calls)  # type: ignore[union-attr]
        bias = layer.qkv_proj.bias
        self._args = (
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            float(layer.input_layernorm.eps),
            *qkv[:3],
            bias,
            *o[:3],
            *gate_up[:3],
            *down[:3],
            [layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.intermediate_size],
        )
        self._scale = float(layer.scale)
        self._tail = (qkv[4], qkv[5])  # isa and activations codes

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attention_isa: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(mlp output, residual stream)``, as ``DecoderLayer.forward``."""
        out, summed = quant_extension().decode_layer(
            x,
            residual,
            *self._args,
            rope[0],
            rope[1],
            kv[0],
            kv[1],
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            self._scale,
            *self._tail,
            attention_isa,
        )
        return out, summed


def fused_layers(layers: Sequence[DecoderLayer]) -> tuple[FusedLayer, ...] | None:
    """Every layer's fused call, or None when one cannot fuse (a dense projection, tensor
    parallelism, a per-head q/k norm, experts, a norm weight or head dim the CPU ops do not take, no
    extension)."""
    if not layers or not decode_isas() or cpu_ops.extension() is None:
        return None
    for layer in layers:
        if layer.reduce is not None or any(c is None for c in layer.quant_calls):
            return None
        # No q/k norm, experts nor attention sinks in C++.
        if layer.q_norm is not None or layer.mlp is not None or layer.sinks is not None:
            return None
        if layer.head_dim % 16 or any(
            lin.bias is not None for lin in (layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ):
            return None
    return tuple(FusedLayer(layer) for layer in layers)


def step_fits(
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    norm_dtype: torch.dtype,
) -> bool:
    """Whether this step's layers take exactly the fused call's ops unfused: a pure-decode
    step on the CPU with the CPU paged decode kernel (``paged_attention``'s branch), and x,
    the norms' weights, cos/sin and the caches as `cpu_ops`' RMSNorm and RoPE take them."""
    cos, sin = rope
    heads_dim = kv[0].shape[-1]
    return (
        cpu_ops.ENABLED
        and meta.query_index is None
        and meta.kv_index is not None
        and meta.sliding_window is None  # the C++ decode attends to every key
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.is_contiguous()
        and x.dtype in (torch.float32, torch.bfloat16)
        and norm_dtype == x.dtype
        and cos.dtype == sin.dtype == x.dtype
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
        and paged_decode_fits(x.new_empty(0, 1, heads_dim), kv[0], kv[1])
    )


def attention_isa() -> int:
    """The paged decode kernel's instruction set code, as ``paged_decode_cpu`` picks it."""
    return decode_isa_code()
