"""GGUF block-quantised linear layers in the model: ``EngineConfig(quantization="gguf")``.

The loader (``loader/gguf.py``) keeps a GGUF file's linear weights of a type the kernel
multiplies (``kernels/quant_formats.FORMATS``) in their blocks, repacked for
``kernels/quant_linear.py``, as ``QuantWeight``s keyed by name: a fused projection's name
(``self_attn.qkv_proj.weight``, ``mlp.gate_up_proj.weight``) when its parts share a type and
their rows could be concatenated, else each part under its Hugging Face name (one
``QuantProjection`` call multiplies the parts and writes their outputs side by side);
``lm_head.weight`` for the LM head, tied or not, and ``model.embed_tokens.weight`` for an
untied embedding of a kernel type. The model multiplies these on every step, looks up the
embedding's rows in its blocks (a tied one in the head's), and holds no dense copy of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from baton.kernels.quant_formats import QuantWeight

# A decoder layer's projections in the model's order (qkv, o, gate_up, down): the fused name
# and its Hugging Face parts, in row order.
PROJECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "self_attn.qkv_proj.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    ("self_attn.o_proj.weight", ("self_attn.o_proj.weight",)),
    ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.down_proj.weight", ("mlp.down_proj.weight",)),
)
# A mixture-of-experts layer's experts, each kept as its own kernel weights under
# ``mlp.experts.{e}.`` + the fused name (gate | up when they share a type, else the parts).
EXPERT_PROJECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),
    ("down_proj.weight", ("down_proj.weight",)),
)
_EXPERT_NAME = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.\d+)\.(.+)$")
LM_HEAD = "lm_head.weight"
# An untied embedding kept in its blocks (lookups decode its rows); a tied one is the LM head's.
EMBEDDING = "model.embed_tokens.weight"

# The parts of a projection held as kernel weights (one fused weight, or one per part).
QuantParts = tuple[QuantWeight, ...]


def layer_projections(
    quantized: Mapping[str, QuantWeight], layer: int
) -> tuple[QuantParts | None, ...]:
    """Layer ``layer``'s projections (qkv, o, gate_up, down) as kernel weights: each the fused
    weight, or its parts' weights in row order, or None where the projection is dense.

    Raises:
        ValueError: a projection has some of its parts quantised and not the others.
    """
    prefix = f"model.layers.{layer}."
    return tuple(_parts(quantized, prefix, fused, parts) for fused, parts in PROJECTIONS)


def _parts(
    quantized: Mapping[str, QuantWeight],
    prefix: str,
    fused: str,
    parts: tuple[str, ...],
) -> QuantParts | None:
    """The kernel weights of projection ``prefix + fused``: the fused weight, or its parts in
    row order, or None where it is dense.

    Raises:
        ValueError: some of its parts are quantised and not the others.
    """
    if prefix + fused in quantized:
        return (quantized[prefix + fused],)
    held = [prefix + p for p in parts if prefix + p in quantized]
    if held and len(held) != len(parts):
        raise ValueError(
            f"{prefix}{fused}: parts {held} are quantised and the others are not; a "
            "projection is quantised whole or not at all"
        )
    return tuple(quantized[name] for name in held) if held else None


def expert_projections(
    quantized: Mapping[str, QuantWeight], layer: int, num_experts: int
) -> tuple[tuple[QuantParts, QuantParts], ...] | None:
    """Layer ``layer``'s experts as kernel weights, ``(gate_up, down)`` per expert, or None
    where they are dense.

    Raises:
        ValueError: some experts or parts are quantised and not the others.
    """
    out = []
    for e in range(num_experts):
        prefix = f"model.layers.{layer}.mlp.experts.{e}."
        pair = [_parts(quantized, prefix, fused, parts) for fused, parts in EXPERT_PROJECTIONS]
        out.append(pair)
    kept = [pair for pair in out if None not in pair]
    if not kept and all(p is None for pair in out for p in pair):
        return None
    if len(kept) != num_experts:
        raise ValueError(
            f"model.layers.{layer}: some experts' projections are quantised and others are not"
        )
    return tuple((gate_up, down) for gate_up, down in kept)  # type: ignore[misc]


def covered_weights(quantized: Mapping[str, QuantWeight]) -> dict[str, tuple[str, ...]]:
    """Each key of ``quantized`` -> the Hugging Face weight names it stands for (a fused
    name's parts, an expert's too; any other name itself). Pure function."""
    fused = dict(PROJECTIONS)
    expert_fused = dict(EXPERT_PROJECTIONS)
    out: dict[str, tuple[str, ...]] = {}
    for name in quantized:
        if match := _EXPERT_NAME.match(name):
            prefix, leaf = match.groups()
            parts = expert_fused.get(leaf)
            out[name] = (name,) if parts is None else tuple(f"{prefix}.{p}" for p in parts)
            continue
        layer = ".".join(name.split(".")[:3])  # model.layers.{i}
        leaf = name[len(layer) + 1 :]
        parts = fused.get(leaf) if name.startswith("model.layers.") else None
        out[name] = (name,) if parts is None else tuple(f"{layer}.{p}" for p in parts)
    return out


def type_counts(quantized: Mapping[str, QuantWeight]) -> dict[str, int]:
    """Kernel weights by GGUF type, e.g. ``{"Q4_1": 120, "Q8_0": 1}``; sorted by type."""
    counts: dict[str, int] = {}
    for weight in quantized.values():
        counts[weight.format] = counts.get(weight.format, 0) + 1
    return dict(sorted(counts.items()))
