"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router, then each token through
its top-k SwiGLU experts, their outputs summed with the router's weights (plus Qwen2-MoE's
shared expert).

The experts' weights are stacked, ``[E, 2 * ff, hidden]`` (gate | up) and ``[E, hidden, ff]``;
on a CPU they are packed per expert for oneDNN like the dense layers (``pack_weights``).
A step sorts its (token, expert) pairs by expert once and runs one GEMM pair per expert that
got tokens, over all of that expert's tokens at once: the Python loop is over experts, never
over tokens, and an expert no token chose costs nothing. The expert counts are read on the host
to cut the sorted rows (on CUDA a synchronisation, so MoE models run their decode steps
without CUDA graphs: ``worker/build.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.models.packed import PackedWeight, pack_and_release, pack_linear, packed_linear
from baton.kernels.silu_mul import silu_mul


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights: softmax in float32 over the router's
    ``logits`` ``[T, E]``, the k largest (``torch.topk``, as transformers picks them), the k
    weights divided by their sum when ``renormalize``. Returns ``(weights [T, k] float32,
    experts [T, k] int64)``."""
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


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer: ``gate`` (the router, ``nn.Linear(hidden, E)``), the stacked
    expert weights and, with ``shared_ff``, a shared expert (Qwen2-MoE); loaded by
    ``LlamaForCausalLM.load_weights``."""

    def __init__(
        self,
        hidden: int,
        ff: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        shared_ff: int = 0,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        # Qwen2-MoE's shared expert (every token, scaled by sigmoid(shared_gate(x))), or None.
        self.shared_gate_up = nn.Linear(hidden, 2 * shared_ff, bias=False) if shared_ff else None
        self.shared_down = nn.Linear(shared_ff, hidden, bias=False) if shared_ff else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_ff else None
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ff, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ff), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize
        self.num_experts = num_experts

        # Each expert's (gate | up, down) packed for oneDNN (``pack_weights``), else None.
        self.packed: tuple[tuple[PackedWeight, PackedWeight], ...] | None = None
        self.gate_packed: PackedWeight | None = None
        self.shared_packed: tuple[PackedWeight, ...] | None = None  # gate_up, down, gate

    def pack_weights(self) -> None:
        """Packs the router and every expert for oneDNN (``models/packed.py``: the dense
        layers' CPU kernels) and releases the stacked weights, which no step uses from then on.

        Raises:
            ValueError: as ``pack_linear`` (not a CPU weight of a dtype oneDNN packs).
        """
        self.packed = tuple(
            (pack_linear(gate_up), pack_linear(down))
            for gate_up, down in zip(self.gate_up, self.down, strict=True)
        )
        self.gate_packed = pack_and_release(self.gate)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            self.shared_packed = tuple(
                pack_and_release(lin)
                for lin in (self.shared_gate_up, self.shared_down, self.shared_gate)
            )
        empty = self.gate_up.new_empty(0)
        self.gate_up = nn.Parameter(empty, requires_grad=False)
        self.down = nn.Parameter(empty.clone(), requires_grad=False)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            gate_up, down = self.packed[e]
            gate, up = packed_linear(rows, gate_up).chunk(2, dim=-1)
            return packed_linear(silu_mul(gate, up), down).float()
        gate, up = F.linear(rows, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(silu_mul(gate, up), self.down[e]).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` ``[T, hidden]``."""
        logits = self.gate(x) if self.gate_packed is None else packed_linear(x, self.gate_packed)
        weights, experts = route(logits, self.top_k, self.renormalize)
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
        g, u = self.shared_gate_up(x).chunk(2, dim=-1)
        return torch.sigmoid(self.shared_gate(x)) * self.shared_down(silu_mul(g, u))


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
    gate_up = [torch.cat([take(x + "gate_proj.weight"), take(x + "up_proj.weight")]) for x in e]
    put(mlp.gate_up, torch.stack(gate_up), prefix + "mlp.experts (gate | up)")
    down = torch.stack([take(x + "down_proj.weight") for x in e])
    put(mlp.down, down, prefix + "mlp.experts (down)")
    if mlp.shared_gate_up is not None:
        assert mlp.shared_down is not None and mlp.shared_gate is not None
        s = prefix + "mlp.shared_expert."
        gate_up = torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")])
        put(mlp.shared_gate_up.weight, gate_up, s + "gate | up")
        put(mlp.shared_down.weight, take(s + "down_proj.weight"), s + "down_proj.weight")
        gate = prefix + "mlp.shared_expert_gate.weight"
        put(mlp.shared_gate.weight, take(gate), gate)
