"""One decoder block of the Llama family (attention with fused QKV, then a SwiGLU or
mixture-of-experts MLP), with its dense, int8, packed and GGUF-quantised projections."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.models.attention import (
    AttentionMetadata,
    paged_attention,
)
from baton.engine.models.config import ModelConfig
from baton.engine.models.gguf_linear import (
    PROJECTIONS,
    QuantParts,
)
from baton.engine.models.layers import RMSNorm, apply_rope, dense_linear
from baton.engine.models.moe import SparseMoeBlock
from baton.engine.models.packed import (
    PackedWeight,
    pack_and_release,
    packed_linear,
)
from baton.engine.models.quant import (
    Int8Weight,
    int8_linear,
    quantize_and_release,
)
from baton.kernels.quant_linear import QuantProjection
from baton.kernels.silu_mul import silu_mul


class DecoderLayer(nn.Module):
    """One pre-norm block: attention with fused QKV (q and k normed per head where the
    architecture says so, Qwen3), then a SwiGLU MLP with fused gate/up.

    Under tensor parallelism ``config`` is the rank's shard shape and ``reduce`` sums the
    row-parallel projections' partial outputs over the ranks. ``quant``: per projection (qkv,
    o, gate_up, down) its GGUF-quantised kernel weights (``models/gguf_linear.py``) or None;
    a quantised projection's module gets no dense weight at all (an empty one: a call that
    reached it would fail), only its bias. ``window``: the layer's attention window
    (``ModelConfig.layer_window``; None: every earlier token). ``experts``: an MoE layer's
    experts in their GGUF blocks (``gguf_linear.expert_projections``), or None.
    """

    def __init__(
        self,
        config: ModelConfig,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        quant: tuple[QuantParts | None, ...] | None = None,
        quant_activations: str = "float32",
        moe: bool = False,
        window: int | None = None,
        experts: tuple[tuple[QuantParts, QuantParts], ...] | None = None,
    ) -> None:
        super().__init__()
        c = config
        # Whether this layer keeps to the model's sliding window (``ModelConfig.layer_window``).
        self.windowed = window is not None
        # On the CPU, attend prefill token by token in the decode kernel's order, so that a
        # token's result does not depend on its prompt's chunking or the batch
        # (``paged_attention(token_order=True)``, windows, soft caps and sinks included);
        # ``LlamaForCausalLM.set_batch_invariant``.
        self.token_order = True
        # On CUDA, the dense projections through the batch-invariant kernel instead of cuBLAS,
        # which picks its kernel by the row count (``LlamaForCausalLM.set_invariant_gemm``).
        self.invariant_gemm = False
        self.quant_activations = quant_activations
        self.reduce = reduce
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.attention_scale
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # Qwen3: q and k normed per head (one head_dim weight each, shared by the heads).
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        q = quant or (None,) * len(PROJECTIONS)
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_proj = make_linear(c.hidden_size, qkv, c.attention_bias, q[0] is not None)
        self.o_proj = make_linear(self.q_size, c.hidden_size, c.o_bias, q[1] is not None)
        # Scores soft-capped before the softmax (Gemma 2's block sets it), or None.
        self.softcap: float | None = None
        # gpt-oss: each head's sink logit, which joins its softmax (``paged_attention``).
        self.sinks = (
            nn.Parameter(torch.zeros(c.num_heads), requires_grad=False)
            if c.arch.attention_sinks
            else None
        )
        self._init_mlp(c, q, moe, experts)
        # The projections as int8 weights (set by ``quantize_int8``), in the order qkv, o,
        # gate_up, down: then every step multiplies with these.
        self.int8: tuple[Int8Weight, ...] | None = None
        # The projections packed for oneDNN, same order (set by ``pack_weights``): then every
        # step multiplies with these.
        self.packed: tuple[PackedWeight, ...] | None = None
        # The projections kept in their GGUF blocks (None: all dense), same order; a None
        # entry is a dense projection (a type the kernel does not take, dequantised at load).
        self.quant: tuple[QuantParts | None, ...] | None = (
            tuple(q) if any(p is not None for p in q) else None
        )
        # Their kernel calls, each checked once here (None: a dense projection).
        self.quant_calls: tuple[QuantProjection | None, ...] = tuple(
            None if parts is None else QuantProjection(parts, activations=quant_activations)
            for parts in q
        )

    def _init_mlp(
        self,
        c: ModelConfig,
        q: tuple[QuantParts | None, ...],
        moe: bool,
        experts: tuple[tuple[QuantParts, QuantParts], ...] | None,
    ) -> None:
        """The MLP's modules: an MoE layer's experts (``mlp``), else fused gate/up and down;
        and ``_linears``, the projections in the order of ``int8`` and ``packed``."""
        self.intermediate_size = c.intermediate_size
        # A mixture-of-experts layer has its experts here instead of gate_up/down (which are
        # then None: its MLP is never quantised, packed or fused).
        self.mlp: SparseMoeBlock | None = None
        self.gate_up_proj: nn.Linear | None = None
        self.down_proj: nn.Linear | None = None
        if moe:
            self.mlp = SparseMoeBlock(
                c.hidden_size,
                c.moe_intermediate_size,
                c.num_experts,
                c.num_experts_per_tok,
                c.norm_topk_prob,
                c.shared_expert_intermediate_size,
                biased=c.arch.expert_bias,
                swiglu=None if c.swiglu_limit is None else (c.swiglu_alpha, c.swiglu_limit),
                quant=experts,
                quant_activations=self.quant_activations,
            )
            # The projections in the order of ``int8`` and ``packed`` (a plain tuple: the
            # modules are registered above).
            self._linears: tuple[nn.Linear, ...] = (self.qkv_proj, self.o_proj)
        else:
            self.gate_up_proj = make_linear(
                c.hidden_size, 2 * c.intermediate_size, False, q[2] is not None
            )
            self.down_proj = make_linear(
                c.intermediate_size, c.hidden_size, False, q[3] is not None
            )
            self._linears = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

    def extra_weights(self) -> dict[str, nn.Parameter]:
        """The weights besides the norms, projections and experts, by Hugging Face name inside
        ``model.layers.{i}`` (``load_weights`` fills them): o_proj's bias and the attention
        sinks where the model has them; a subclass's block adds its own."""
        extra: dict[str, nn.Parameter] = {}
        if self.o_proj.bias is not None:
            extra["self_attn.o_proj.bias"] = self.o_proj.bias
        if self.sinks is not None:
            extra["self_attn.sinks"] = self.sinks
        return extra

    def quantize_int8(self) -> None:
        """Replaces the projections' weights by int8 weight-only ones (``quant.py``) for every
        step and releases their dense weights (the biases stay).

        Raises:
            ValueError: a projection the int8 kernel cannot take (``check_int8_weight``).
        """
        self.int8 = tuple(quantize_and_release(lin) for lin in self._linears)

    def pack_weights(self, batch_invariant: bool = True) -> None:
        """Packs the projections for oneDNN (``models/packed.py``; ``batch_invariant`` as
        ``pack_linear``) and releases their dense weights, which no step uses from then on (a
        call that reached one would fail on its empty weight)."""
        self.packed = tuple(pack_and_release(lin, batch_invariant) for lin in self._linears)
        if self.mlp is not None:
            self.mlp.pack_weights(batch_invariant)

    @property
    def _plain(self) -> bool:
        """Whether the projections are plain dense ``nn.Linear``s (none packed or quantised)."""
        return self.int8 is None and self.packed is None and self.quant is None

    def _project(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Projection ``i`` (qkv, o, gate_up, down) of ``x`` with the model's kernel."""
        linear = self._linears[i]
        if (call := self.quant_calls[i]) is not None:
            # The bias after the kernel (which has none), in x's dtype as nn.Linear's would be.
            return call(x) if linear.bias is None else call(x) + linear.bias
        if self.int8 is not None:
            return int8_linear(x, self.int8[i], linear.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed[i])
        return dense_linear(x, linear.weight, linear.bias, self.invariant_gemm)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block over ``x + residual`` (``x`` alone for the first block, ``residual`` None).

        Returns ``(mlp output, residual stream)``: the next block, or the final norm, adds
        them, inside its norm (one fused kernel on CUDA).
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        out = self.attention(h, rope, kv, meta)
        h, residual = self.post_attention_layernorm.forward_add(out, residual)
        if self.mlp is not None:
            out = self.mlp(h)
            return (out if self.reduce is None else self.reduce(out)), residual
        gate, up = self.gate_up(h)
        out = self._project(3, silu_mul(gate, up))  # silu_mul: one kernel on CUDA
        return (out if self.reduce is None else self.reduce(out)), residual

    def attention(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention half of the block on the normed ``h`` ``[T, hidden]``: q/k/v (q and
        k normed per head where the model says so), RoPE, paged attention (this layer's window,
        ``softcap`` and sinks) and o_proj, summed over the ranks under tensor parallelism."""
        t = h.shape[0]
        sizes = (self.q_size, self.kv_size, self.kv_size)
        if self._plain and not self.invariant_gemm:
            q, k, v = fused_linear(h, self.qkv_proj, sizes)
        else:
            q, k, v = self._project(0, h).split(sizes, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(k.shape)
        q, k = apply_rope(q, k, *rope)
        attn = paged_attention(
            q,
            k,
            v,
            kv[0],
            kv[1],
            meta,
            self.scale,
            token_order=self.token_order,
            windowed=self.windowed,
            softcap=self.softcap,
            sinks=self.sinks,
        ).reshape(t, self.q_size)
        out = self._project(1, attn)
        return out if self.reduce is None else self.reduce(out)

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense MLP's gate and up projections of ``h``."""
        sizes = (self.intermediate_size, self.intermediate_size)
        if self._plain and not self.invariant_gemm:
            assert self.gate_up_proj is not None
            gate, up = fused_linear(h, self.gate_up_proj, sizes)
            return gate, up
        gate, up = self._project(2, h).split(sizes, dim=-1)
        return gate, up


def make_linear(in_features: int, out_features: int, bias: bool, quantized: bool) -> nn.Linear:
    """``nn.Linear(in, out, bias)``; ``quantized``: its weight held elsewhere (GGUF blocks), so
    the module gets an empty weight, never allocated at full size, and a zero bias to load."""
    if not quantized:
        return nn.Linear(in_features, out_features, bias)
    linear = nn.Linear(in_features, out_features, bias, device="meta")
    linear.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    if bias:
        linear.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False)
    return linear


# Below this many tokens, one GEMM per output part beat the fused GEMM on this
# CPU's float32 BLAS (decode batch 1-8: 3-8% per step); above it the fused one
# wins. The weight stays fused either way: its row slices are free views.
SPLIT_GEMM_MAX_TOKENS = 16


def fused_linear(x: torch.Tensor, linear: nn.Linear, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """``linear(x)`` split into ``sizes`` along the last dim (QKV, gate/up)."""
    # On a GPU one launch beats several (a small model's decode step is bound by launches).
    if x.shape[0] > SPLIT_GEMM_MAX_TOKENS or x.is_cuda:
        return list(linear(x).split(sizes, dim=-1))
    weights = linear.weight.split(sizes)
    biases = (None,) * len(sizes) if linear.bias is None else linear.bias.split(sizes)
    return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
