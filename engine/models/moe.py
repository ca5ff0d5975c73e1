"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router, then each token through its top-k
SwiGLU experts, their outputs summed with the router's weights.

The experts' weights are stacked, ``[E, 2 * ff, hidden]`` (gate | up) and ``[E, hidden, ff]``.
A step sorts its (token, expert) pairs by expert once and runs one GEMM pair per expert that
got tokens, over all of that expert's tokens at once: the Python loop is over experts, never
over tokens, and an expert no token chose costs nothing. The expert counts are read on the host
to cut the sorted rows (on CUDA a synchronisation, so MoE models run their decode steps
without CUDA graphs: ``worker/build.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels.silu_mul import silu_mul


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights: softmax in float32 over the router's
    ``logits`` ``[T, E]``, the k largest (ties to the lower expert id, as ``torch.topk``), the k
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
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for every token ``t`` of ``x``
    ``[T, hidden]``, each expert a SwiGLU MLP with weights ``gate_up[e]`` ``[2 ff, hidden]``
    and ``down[e]`` ``[hidden, ff]``. Each expert's rows are weighted in float32 and summed
    in the token's order of its k choices, so a token's result does not depend on which other
    tokens share the step's experts in float32 (the GEMMs see different row counts)."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x[order // k]
    out_rows = torch.empty(t * k, down.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        stop = start + count
        gate, up = F.linear(rows[start:stop], gate_up[expert]).chunk(2, dim=-1)
        out_rows[start:stop] = F.linear(silu_mul(gate, up), down[expert]).float()
        start = stop
    # Back to (token, choice) order, then the weighted sum over the k choices in that order.
    unsorted = torch.empty_like(out_rows)
    unsorted[order] = out_rows
    mixed = unsorted.view(t, k, -1) * weights.unsqueeze(-1)
    total = mixed[:, 0]
    for j in range(1, k):
        total = total + mixed[:, j]
    return total.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer: ``gate`` (the router, ``nn.Linear(hidden, E)``) and the
    stacked expert weights, loaded by ``LlamaForCausalLM.load_weights``."""

    def __init__(
        self, hidden: int, ff: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ff, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ff), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` ``[T, hidden]``."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        return experts_forward(x, weights, experts, self.gate_up, self.down)
