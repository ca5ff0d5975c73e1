"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): a router, then each token
through its top-k SwiGLU experts, their outputs summed with the router's weights (plus
Qwen2-MoE's shared expert; gpt-oss's router and experts carry biases and its SwiGLU is
clamped).

The experts' weights are stacked, ``[E, 2 * ff, hidden]`` (gate | up) and ``[E, hidden, ff]``;
on a CPU, experts up to ``GROUPED_MAX_FF`` wide run a whole layer in one call of the grouped
kernel (``kernels/moe_experts.py``), wider ones are packed per expert for oneDNN like the dense
layers (``pack_weights``). Otherwise a step sorts its (token, expert) pairs by expert once
and runs one GEMM pair per expert that got tokens, over all of that expert's tokens at once:
the Python loop is over experts, never over tokens, and an expert no token chose costs
nothing. The expert counts are read on the host to cut the sorted rows (on CUDA a
synchronisation, so MoE models run their decode steps without CUDA graphs: ``worker/build.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from baton.engine.models.gguf_linear import QuantParts
from baton.engine.models.layers import dense_linear
from baton.engine.models.packed import PackedWeight, pack_and_release, pack_linear, packed_linear
from baton.kernels.moe_experts import (
    GroupedExperts,
    group_experts,
    grouping_available,
    moe_experts_cpu,
)
from baton.kernels.quant_linear import QuantProjection
from baton.kernels.silu_mul import silu_mul

GROUPED_MAX_FF = 1024
"""The widest experts that run on the grouped CPU kernel (``kernels/moe_experts.py``); wider
ones keep a oneDNN GEMM pair per expert. Measured per layer, bfloat16, 2 threads of an AMD EPYC
Genoa (shared machine, median of 5 interleaved trials, 2026-12-07): 64 experts of width 256,
top 8 (Qwen3-MoE-like, hidden 1024): 0.86 -> 0.24 ms at 1 row, 8.98 -> 7.05 at 16, 20.8 ->
15.1 at 128; 8 experts of width 2816, top 2 (Mixtral-like): 1.48 -> 1.42 at 1 row but 6.45 ->
9.72 at 16 and 15.8 -> 22.9 at 128, where oneDNN's blocked kernel keeps the lead."""


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, softmax_after: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights: softmax in float32 over the router's
    ``logits`` ``[T, E]``, the k largest (``torch.topk``, as transformers picks them), the k
    weights divided by their sum when ``renormalize``; with ``softmax_after`` (gpt-oss) the
    k largest logits first, then the softmax over those k (the same weights as renormalising,
    in gpt-oss's order of operations). Returns ``(weights [T, k] float32, experts [T, k]
    int64)``."""
    if softmax_after:
        top, experts = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert(experts[t, j], x[t])`` for every token ``t`` of ``x``
    ``[T, hidden]``, ``expert(e, rows)`` being expert ``e``'s MLP over a block of rows
    (returning float32 ``[rows, hidden]``). The weighted sum runs in float32 in the order of
    the token's k choices, whatever else the step holds; only the experts' GEMMs see row
    counts that depend on the batch."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x[order // k]
    out_rows = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        stop = start + count
        out_rows[start:stop] = expert(e, rows[start:stop])
        start = stop
    # Back to (token, choice) order, then the weighted sum over the k choices in that order.
    unsorted = torch.empty_like(out_rows)
    unsorted[order] = out_rows
    mixed = unsorted.view(t, k, x.shape[1]) * weights.unsqueeze(-1)
    total = mixed[:, 0]
    for j in range(1, k):
        total = total + mixed[:, j]
    return total.to(x.dtype)


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's expert activation: ``(up + 1) * gate * sigmoid(alpha * gate)`` with the gate
    clamped to at most ``limit`` and up to ``[-limit, limit]``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer: ``gate`` (the router, ``nn.Linear(hidden, E)``), the stacked
    expert weights and, with ``shared_ff``, a shared expert (Qwen2-MoE); loaded by
    ``LlamaForCausalLM.load_weights``. ``biased``: the router and experts carry biases and
    routing takes the softmax over the top k (gpt-oss); ``swiglu``: ``(alpha, limit)`` of
    ``clamped_swiglu`` instead of plain SwiGLU."""

    def __init__(
        self,
        hidden: int,
        ff: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        shared_ff: int = 0,
        biased: bool = False,
        swiglu: tuple[float, float] | None = None,
        quant: tuple[tuple[QuantParts, QuantParts], ...] | None = None,
        quant_activations: str = "float32",
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=biased)
        # The experts in their GGUF blocks, (gate_up, down) kernel calls per expert: then the
        # stacked dense weights are empty (never allocated at full size).
        self.quant_calls: tuple[tuple[QuantProjection, QuantProjection], ...] | None = (
            None
            if quant is None
            else tuple(
                (
                    QuantProjection(gate_up, activations=quant_activations),
                    QuantProjection(down, activations=quant_activations),
                )
                for gate_up, down in quant
            )
        )
        self.swiglu = swiglu
        self.gate_up_bias = (
            nn.Parameter(torch.zeros(num_experts, 2 * ff), requires_grad=False) if biased else None
        )
        self.down_bias = (
            nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False) if biased else None
        )
        # Qwen2-MoE's shared expert (every token, scaled by sigmoid(shared_gate(x))), or None.
        self.shared_gate_up = nn.Linear(hidden, 2 * shared_ff, bias=False) if shared_ff else None
        self.shared_down = nn.Linear(shared_ff, hidden, bias=False) if shared_ff else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_ff else None
        dense = quant is None
        self.gate_up = nn.Parameter(
            torch.empty((num_experts, 2 * ff, hidden) if dense else (num_experts, 0, 0)),
            requires_grad=False,
        )
        self.down = nn.Parameter(
            torch.empty((num_experts, hidden, ff) if dense else (num_experts, 0, 0)),
            requires_grad=False,
        )
        self.top_k = top_k
        self.renormalize = renormalize
        self.num_experts = num_experts

        # Each expert's (gate | up, down) packed for oneDNN (``pack_weights``), else None.
        self.packed: tuple[tuple[PackedWeight, PackedWeight], ...] | None = None
        self.gate_packed: PackedWeight | None = None
        self.shared_packed: tuple[PackedWeight, ...] | None = None  # gate_up, down, gate
        # The experts for the grouped CPU kernel (``kernels/moe_experts.py``), else None.
        self.grouped: GroupedExperts | None = None
        # On CUDA, the dense router, experts and shared expert through the batch-invariant
        # kernel (``LlamaForCausalLM.set_invariant_gemm``): an expert's row count follows the
        # batch, and cuBLAS's kernel follows the row count.
        self.invariant_gemm = False

    def pack_weights(self, batch_invariant: bool = True) -> None:
        """Packs the router for oneDNN (``models/packed.py``: the dense layers' CPU kernels;
        ``batch_invariant`` as ``pack_linear``) and the experts for the grouped kernel
        (``kernels/moe_experts.py``, batch-invariant always) where it runs here, else each
        expert for oneDNN; releases the stacked weights, which no step uses from then on.

        Raises:
            ValueError: as ``pack_linear`` (not a CPU weight of a dtype oneDNN packs).
        """
        if self.quant_calls is not None:  # the experts stay on the GGUF kernel
            self.gate_packed = pack_and_release(self.gate, batch_invariant)
            return
        ff = self.down.shape[2]
        cpu = self.gate_up.device.type == "cpu"
        if cpu and ff <= GROUPED_MAX_FF and grouping_available(self.gate_up.dtype):
            # One native call a layer instead of a oneDNN GEMM pair per expert (see
            # GROUPED_MAX_FF); batch-invariant by construction. Chosen per layer at load,
            # never per step, so a row's bits never depend on the batch.
            self.grouped = group_experts(
                self.gate_up, self.down, self.gate_up_bias, self.down_bias, self.swiglu
            )
        else:
            self.packed = self._pack_experts(batch_invariant)
        self.gate_packed = pack_and_release(self.gate, batch_invariant)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            self.shared_packed = tuple(
                pack_and_release(lin, batch_invariant)
                for lin in (self.shared_gate_up, self.shared_down, self.shared_gate)
            )
        empty = self.gate_up.new_empty(0)
        self.gate_up = nn.Parameter(empty, requires_grad=False)
        self.down = nn.Parameter(empty.clone(), requires_grad=False)

    def _pack_experts(self, batch_invariant: bool) -> tuple[tuple[PackedWeight, PackedWeight], ...]:
        """Every expert's (gate | up, down) packed for oneDNN."""
        n = self.gate_up.shape[0]
        gate_up_bias = [None] * n if self.gate_up_bias is None else list(self.gate_up_bias)
        down_bias = [None] * n if self.down_bias is None else list(self.down_bias)
        return tuple(
            (
                pack_linear(gate_up, gate_up_b, batch_invariant),
                pack_linear(down, down_b, batch_invariant),
            )
            for gate_up, down, gate_up_b, down_b in zip(
                self.gate_up, self.down, gate_up_bias, down_bias, strict=True
            )
        )

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        down_bias = None if self.down_bias is None else self.down_bias[e]
        if self.quant_calls is not None:
            return self._quant_expert(e, rows, gate_up_bias, down_bias)
        if self.packed is not None:
            gate_up, down = self.packed[e]
            gate, up = packed_linear(rows, gate_up).chunk(2, dim=-1)
        else:
            gate_up = dense_linear(rows, self.gate_up[e], gate_up_bias, self.invariant_gemm)
            gate, up = gate_up.chunk(2, dim=-1)
        swiglu = self.swiglu
        act = silu_mul(gate, up) if swiglu is None else clamped_swiglu(gate, up, *swiglu)
        if self.packed is not None:
            return packed_linear(act, down).float()
        return dense_linear(act, self.down[e], down_bias, self.invariant_gemm).float()

    def _quant_expert(
        self,
        e: int,
        rows: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Expert ``e`` on the GGUF kernel (``QuantProjection``), its biases added after."""
        assert self.quant_calls is not None
        gate_up_call, down_call = self.quant_calls[e]
        h = gate_up_call(rows)
        gate, up = (h if gate_up_bias is None else h + gate_up_bias).chunk(2, dim=-1)
        swiglu = self.swiglu
        act = silu_mul(gate, up) if swiglu is None else clamped_swiglu(gate, up, *swiglu)
        out = down_call(act.contiguous())
        return (out if down_bias is None else out + down_bias).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` ``[T, hidden]``."""
        logits = (
            dense_linear(x, self.gate.weight, self.gate.bias, self.invariant_gemm)
            if self.gate_packed is None
            else packed_linear(x, self.gate_packed)
        )
        biased = self.gate_up_bias is not None
        weights, experts = route(logits, self.top_k, self.renormalize, softmax_after=biased)
        if self.grouped is not None:
            out = moe_experts_cpu(x, weights, experts, self.grouped)
        else:
            out = experts_forward(x, weights, experts, self.num_experts, self._expert)
        if self.shared_gate_up is None:
            return out
        return out + self._shared(x)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, scaled by sigmoid of its gate (as transformers)."""
        if self.shared_packed is not None:
            gate_up, down, gate = self.shared_packed
            g, u = packed_linear(x, gate_up).chunk(2, dim=-1)
            return torch.sigmoid(packed_linear(x, gate)) * packed_linear(silu_mul(g, u), down)
        assert self.shared_down is not None and self.shared_gate is not None
        assert self.shared_gate_up is not None
        inv = self.invariant_gemm
        g, u = dense_linear(x, self.shared_gate_up.weight, None, inv).chunk(2, dim=-1)
        scale = torch.sigmoid(dense_linear(x, self.shared_gate.weight, None, inv))
        return scale * dense_linear(silu_mul(g, u), self.shared_down.weight, None, inv)


def load_experts(
    mlp: SparseMoeBlock,
    prefix: str,
    take: Callable[[str], torch.Tensor],
    put: Callable[[torch.Tensor, torch.Tensor, str], None],
) -> None:
    """An MoE layer's router and experts (``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``)
    stacked into ``mlp``'s tensors, gate then up, and its shared expert where it has one;
    ``take(name)`` pops a checkpoint weight, ``put(param, value, name)`` checks and copies
    (``LlamaForCausalLM.load_weights``'s)."""
    put(mlp.gate.weight, take(prefix + "mlp.gate.weight"), prefix + "mlp.gate.weight")
    n = mlp.gate_up.shape[0]
    e = [f"{prefix}mlp.experts.{i}." for i in range(n)]
    kinds = (
        ("weight", mlp.gate_up if mlp.quant_calls is None else None, mlp.down),
        ("bias", mlp.gate_up_bias, mlp.down_bias),
    )
    for kind, gate_up_param, down_param in kinds:
        if gate_up_param is None or down_param is None:
            continue
        gate_up = [torch.cat([take(f"{x}gate_proj.{kind}"), take(f"{x}up_proj.{kind}")]) for x in e]
        put(gate_up_param, torch.stack(gate_up), f"{prefix}mlp.experts (gate | up {kind})")
        down = torch.stack([take(f"{x}down_proj.{kind}") for x in e])
        put(down_param, down, f"{prefix}mlp.experts (down {kind})")
    if mlp.gate.bias is not None:
        put(mlp.gate.bias, take(prefix + "mlp.gate.bias"), prefix + "mlp.gate.bias")
    if mlp.shared_gate_up is not None:
        assert mlp.shared_down is not None and mlp.shared_gate is not None
        s = prefix + "mlp.shared_expert."
        gate_up = torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")])
        put(mlp.shared_gate_up.weight, gate_up, s + "gate | up")
        put(mlp.shared_down.weight, take(s + "down_proj.weight"), s + "down_proj.weight")
        gate = prefix + "mlp.shared_expert_gate.weight"
        put(mlp.shared_gate.weight, take(gate), gate)
