"""How a Llama-family decoder is cut into tensor-parallel shards: which model shapes allow
``N`` shards, each rank's shape, and each rank's slice of every weight.

Megatron-style: q/k/v and gate/up are column-parallel (each rank keeps its rows: its heads, its
part of the MLP), o_proj and down_proj are row-parallel (each rank keeps the matching input
columns, and the partial outputs are summed across ranks), the embedding and LM head are
vocabulary-parallel (each rank keeps ``ceil(vocab / N)`` rows, the last one padded with zeros),
norms are replicated. Query heads and key/value heads are split in contiguous runs, so each
rank's query heads still share their own key/value heads (grouped-query attention).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from baton.engine.models.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Checks that ``config``'s model can be cut into ``size`` shards (no side effects).

    Raises:
        ValueError: naming each dimension that ``size`` does not divide (query heads,
            key/value heads, MLP width), or a ``size`` below 1.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
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


def shard_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of full Hugging Face-named ``weights`` (see ``expected_weight_shapes``).

    The slices are views of ``weights`` (no copy), except the last rank's vocabulary rows when
    ``size`` does not divide the vocabulary (a zero-padded copy of those rows only), so the
    full model is never copied per rank.

    Raises:
        ValueError: ``rank`` out of range, or as ``check_tensor_parallel``.
    """
    check_tensor_parallel(config, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    if size == 1:
        return dict(weights)
    rows = vocab_shard_rows(config, size)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if name in _VOCAB:
            out[name] = _vocab_rows(w, rank * rows, rows)
        elif leaf.rsplit(".", 1)[0] in _COLUMN:
            part = w.shape[0] // size
            out[name] = w.narrow(0, rank * part, part)
        elif leaf in _ROW:
            part = w.shape[1] // size
            out[name] = w.narrow(1, rank * part, part)
        else:
            out[name] = w  # norms: every rank needs all of them
    return out


def _vocab_rows(w: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    end = min(start + rows, w.shape[0])
    if end - start == rows:
        return w.narrow(0, start, rows)
    padded = w.new_zeros(rows, *w.shape[1:])
    padded[: end - start].copy_(w[start:end])
    return padded
