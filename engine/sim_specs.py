"""The simulated accelerator's tables: named GPUs (spec-sheet figures) and named model shapes.

Plain values that both the configuration (to validate ``device="sim:<gpu>"`` and
``sim_shape``) and the simulated executor's cost model read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """A GPU as the roofline sees it.

    Attributes:
        name: its product name.
        memory_bandwidth: HBM/GDDR bandwidth in bytes/s (spec sheet).
        bf16_flops: dense bf16 tensor-core peak in FLOP/s (spec sheet, no sparsity).
        memory_bytes: device memory.
        forward_overhead_s: fixed cost of one forward on top of the roofline (launching a
            captured graph plus the few kernels outside it).
        sample_overhead_s: fixed cost of one sampling pass (bitmask apply, sampler kernels).
    """

    name: str
    memory_bandwidth: float
    bf16_flops: float
    memory_bytes: int
    forward_overhead_s: float = 20e-6
    sample_overhead_s: float = 10e-6


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: what its weights and KV cache weigh and its FLOPs per token."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype_bytes: int = 2  # bf16

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention projections, MLP, two norms)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads
        attention = h * q + 2 * h * kv * self.head_dim + q * h
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes_per_forward(self) -> int:
        """Weights read by one forward: every layer, the final norm and the LM head (the
        embedding rows of the step's tokens are negligible)."""
        params = self.num_layers * self.layer_params + self.hidden_size + self.lm_head_params
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


# Spec-sheet figures: bandwidth and dense bf16 peak (without sparsity).
GPUS: dict[str, GpuSpec] = {
    "h200": GpuSpec("NVIDIA H200 SXM", 4.8e12, 989e12, 141 * 10**9),
    "h100": GpuSpec("NVIDIA H100 SXM", 3.35e12, 989e12, 80 * 10**9),
    "l4": GpuSpec("NVIDIA L4", 300e9, 121e12, 24 * 10**9),
}

# From each model's config.json.
SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape(
        name="SmolLM2-135M",
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "llama-3.1-8b": ModelShape(
        name="Llama-3.1-8B",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "qwen2.5-7b": ModelShape(
        name="Qwen2.5-7B",
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
}
DEFAULT_SHAPE = "smollm2-135m"  # the default model's own shape


def sim_gpu(device: str) -> GpuSpec | None:
    """The GPU a ``sim:<gpu>`` device names, None for any other device.

    Raises:
        ValueError: ``sim:`` with a GPU that is not in ``GPUS``.
    """
    if not device.startswith("sim:"):
        return None
    name = device[4:]
    if name not in GPUS:
        raise ValueError(f"unknown simulated GPU {name!r}; expected one of {', '.join(GPUS)}")
    return GPUS[name]


def sim_shape(name: str) -> ModelShape:
    """The model shape called ``name``.

    Raises:
        ValueError: a name that is not in ``SHAPES``.
    """
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; expected one of {', '.join(SHAPES)}")
    return SHAPES[name]
