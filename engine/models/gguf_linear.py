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
    out: list[QuantParts | None] = []
    for fused, parts in PROJECTIONS:
        if prefix + fused in quantized:
            out.append((quantized[prefix + fused],))
            continue
        held = [prefix + p for p in parts if prefix + p in quantized]
        if held and len(held) != len(parts):
            raise ValueError(
                f"{prefix}{fused}: parts {held} are quantised and the others are not; a "
                "projection is quantised whole or not at all"
            )
        out.append(tuple(quantized[name] for name in held) if held else None)
    return tuple(out)


def covered_weights(quantized: Mapping[str, QuantWeight]) -> dict[str, tuple[str, ...]]:
    """Each key of ``quantized`` -> the Hugging Face weight names it stands for (a fused
    name's parts; any other name itself). Pure function."""
    fused = dict(PROJECTIONS)
    out: dict[str, tuple[str, ...]] = {}
    for name in quantized:
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
