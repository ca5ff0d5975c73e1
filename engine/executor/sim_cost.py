"""The simulated accelerator's cost model: how long one step's work takes on a named GPU.

A roofline: a forward reads the weights once and each request's keys and values, writes the
new tokens' keys and values, and does two FLOPs per parameter per token plus attention's
FLOPs; it takes the larger of bytes over bandwidth and FLOPs over peak, plus a fixed per-step
overhead. Sampling reads the sampled rows' logits a few times. Spec-sheet peaks make the device
faster than a real one, so the host's share of a step is, if anything, overstated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from baton.engine.sim_specs import GpuSpec, ModelShape

# Logit passes of sampling (bitmask apply, softmax/argmax, top-k/p), each reading fp32 logits.
_SAMPLE_LOGIT_PASSES = 3


class ForwardWork(NamedTuple):
    """One request's share of a forward: new tokens and the context they attend to.

    A named tuple: the simulator makes one per request and step, on the engine's thread.
    """

    query_len: int
    context_len: int  # tokens already in the KV cache before this step


@dataclass(frozen=True)
class StepCost:
    """A forward's roofline terms and its time."""

    bytes: float
    flops: float
    seconds: float
    memory_bound: bool  # bytes over bandwidth outweigh FLOPs over peak


class CostModel:
    """Times of forwards and sampling passes of ``shape`` on ``gpu``."""

    def __init__(self, gpu: GpuSpec, shape: ModelShape) -> None:
        self.gpu = gpu
        self.shape = shape
        s = shape
        self._weight_bytes = float(s.weight_bytes_per_forward)
        self._kv_bytes = float(s.kv_bytes_per_token)
        self._flops_per_token = 2.0 * s.num_layers * s.layer_params
        self._lm_head_flops = 2.0 * s.lm_head_params
        # QK^T and PV: 2 FLOPs per multiply-add, two products, every layer and query head.
        self._attention_flops = 4.0 * s.num_layers * s.num_heads * s.head_dim

    def forward(self, work: Sequence[ForwardWork], num_sampled: int) -> StepCost:
        """One forward over ``work`` (one entry per scheduled request), computing logits for
        ``num_sampled`` rows."""
        tokens = 0
        kv_tokens = 0
        attended = 0
        for w in work:
            q, c = w.query_len, w.context_len
            tokens += q
            kv_tokens += c + q  # read the cached context, write the new tokens
            # Query j (0-based) attends to c + j + 1 keys.
            attended += q * c + q * (q + 1) // 2
        nbytes = self._weight_bytes + kv_tokens * self._kv_bytes
        flops = (
            tokens * self._flops_per_token
            + num_sampled * self._lm_head_flops
            + attended * self._attention_flops
        )
        return self._cost(nbytes, flops, self.gpu.forward_overhead_s)

    def sample(self, num_sampled: int) -> StepCost:
        """Sampling ``num_sampled`` rows (logits in fp32)."""
        nbytes = float(num_sampled * self.shape.vocab_size * 4 * _SAMPLE_LOGIT_PASSES)
        return self._cost(nbytes, 0.0, self.gpu.sample_overhead_s)

    def _cost(self, nbytes: float, flops: float, overhead: float) -> StepCost:
        memory_s = nbytes / self.gpu.memory_bandwidth
        compute_s = flops / self.gpu.bf16_flops
        return StepCost(nbytes, flops, max(memory_s, compute_s) + overhead, memory_s >= compute_s)
