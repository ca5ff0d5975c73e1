"""How a Llama-family decoder is cut into tensor-parallel shards: which model shapes allow
``N`` shards, each rank's shape, and each rank's slice of every weight.

Megatron-style: q/k/v and gate/up are column-parallel (each rank keeps its rows: its heads, its
part of the MLP), o_proj and down_proj are row-parallel (each rank keeps the matching input
columns, and the partial outputs are summed across ranks), the embedding and LM head are
vocabulary-parallel (each rank keeps ``ceil(vocab / N)`` rows, the last one padded with zeros),
norms are replicated. Query heads and key/value heads are split in contiguous runs, so each
rank's query heads still share their own key/value heads (grouped-query attention).

``weight_slice`` states these rules once, per weight, as a ``WeightSlice`` (a dimension, a
range, a padded length): ``shard_weights`` cuts loaded weights with it, and the loaders
(``load_checkpoint(..., shard=ShardSpec(rank, size))``) read only that range from the file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from baton.engine.models.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Checks that ``config``'s model can be cut into ``size`` shards (no side effects).

    Raises:
        ValueError: naming each dimension that ``size`` does not divide (query heads,
            key/value heads, MLP width), a ``size`` below 1, or above 1 for a
            mixture-of-experts or Gemma model or one with an o_proj bias.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    if size > 1 and config.o_bias:
        raise ValueError(
            f"tensor_parallel_size={size}: a model whose o_proj has a bias cannot be cut into "
            "shards yet (each rank would add it); sizes that fit this model: [1]"
        )
    if size > 1 and config.arch.gemma:
        raise ValueError(
            f"tensor_parallel_size={size}: {config.architecture} models cannot be cut into "
            "shards yet; sizes that fit this model: [1]"
        )
    if size > 1 and config.is_moe:
        raise ValueError(
            f"tensor_parallel_size={size}: a mixture-of-experts model ({config.num_experts} "
            "experts) cannot be cut into shards yet; sizes that fit this model: [1]"
        )
    problems = [
        f"{what} ({value})"
        for what, value in (
            ("attention heads", config.num_heads),
            ("key/value heads", config.num_kv_heads),
            ("MLP intermediate size", config.intermediate_size),
        )
        if value % size
    ]
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's {' and '.join(problems)}; "
            f"sizes that fit this model: {_fitting_sizes(config)}"
        )


def _fitting_sizes(config: ModelConfig) -> list[int]:
    return [
        n
        for n in range(1, config.num_kv_heads + 1)
        if not (config.num_heads % n or config.num_kv_heads % n or config.intermediate_size % n)
    ]


def vocab_shard_rows(config: ModelConfig, size: int) -> int:
    """Rows of the embedding (and LM head) each of ``size`` ranks holds: ``ceil(vocab / size)``."""
    return -(-config.vocab_size // size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank's modules have: its heads, its MLP width, its vocabulary rows.

    Raises:
        ValueError: as ``check_tensor_parallel``.
    """
    check_tensor_parallel(config, size)
    if size == 1:
        return config
    return replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
        vocab_size=vocab_shard_rows(config, size),
    )


@dataclass(frozen=True)
class ShardSpec:
    """Which shard to load: rank ``rank`` of ``size`` tensor-parallel ranks.

    Raises:
        ValueError: ``size`` below 1 or ``rank`` outside ``[0, size)``.
    """

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank!r}")


@dataclass(frozen=True)
class WeightSlice:
    """One rank's part of one weight: indices ``[start, stop)`` of dimension ``dim`` of the full
    tensor, then zeros up to ``length`` (only the last rank's vocabulary rows are padded).
    ``dim`` None: the whole tensor (replicated, or a single rank)."""

    dim: int | None
    start: int = 0
    stop: int = 0
    length: int = 0

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this slice of a tensor of shape ``full`` (padding included)."""
        if self.dim is None:
            return tuple(full)
        return (*full[: self.dim], self.length, *full[self.dim + 1 :])

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        """``part`` (indices ``[start, stop)`` along ``dim``, however they were read) with the
        zero padding up to ``length``: ``part`` itself when there is none, else a new tensor."""
        if self.dim is None or self.stop - self.start == self.length:
            return part
        shape = list(part.shape)
        shape[self.dim] = self.length
        padded = part.new_zeros(shape)
        padded.narrow(self.dim, 0, self.stop - self.start).copy_(part)
        return padded


# Hugging Face names (inside ``model.layers.{i}.``) by how they are cut.
_COLUMN = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
_ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def weight_slice(
    name: str, shape: tuple[int, ...], config: ModelConfig, shard: ShardSpec
) -> WeightSlice:
    """What rank ``shard.rank`` holds of the Hugging Face-named weight ``name`` of full shape
    ``shape``: the one place the cutting rules live (``shard_weights`` and the loaders that
    read only a rank's part both ask here). Pure function.

    Column-parallel q/k/v/gate/up (weights and biases): its run of output rows; row-parallel
    o_proj/down_proj: its run of input columns; embedding and LM head: its
    ``vocab_shard_rows`` vocabulary rows, the last rank's padded with zeros; anything else
    (norms): the whole tensor.

    Raises:
        ValueError: as ``check_tensor_parallel``.
    """
    size, rank = shard.size, shard.rank
    check_tensor_parallel(config, size)
    if size == 1:
        return WeightSlice(None)
    leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    if name in _VOCAB:
        rows = vocab_shard_rows(config, size)
        start = min(rank * rows, shape[0])
        return WeightSlice(0, start, min(start + rows, shape[0]), rows)
    if leaf.rsplit(".", 1)[0] in _COLUMN:
        part = shape[0] // size
        return WeightSlice(0, rank * part, (rank + 1) * part, part)
    if leaf in _ROW:
        part = shape[1] // size
        return WeightSlice(1, rank * part, (rank + 1) * part, part)
    return WeightSlice(None)  # norms: every rank needs all of them


def shard_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of full Hugging Face-named ``weights`` (see ``expected_weight_shapes``).

    The slices are views of ``weights`` (no copy), except the last rank's vocabulary rows when
    ``size`` does not divide the vocabulary (a zero-padded copy of those rows only), so the
    full model is never copied per rank. (The loaders can also read a rank's part alone, from
    the same ``weight_slice``, without the full weights: ``load_checkpoint(..., shard=)``.)

    Raises:
        ValueError: ``rank`` out of range, or as ``check_tensor_parallel``.
    """
    check_tensor_parallel(config, size)
    shard = ShardSpec(rank, size)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        sl = weight_slice(name, tuple(w.shape), config, shard)
        out[name] = w if sl.dim is None else sl.pad(w.narrow(sl.dim, sl.start, sl.stop - sl.start))
    return out
