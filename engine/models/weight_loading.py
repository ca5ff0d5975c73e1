"""Copying a checkpoint's Hugging Face-named weights into a built decoder
(``LlamaForCausalLM.load_weights``): q/k/v and gate/up fused, experts stacked, every name
accounted for."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from baton.engine.models.gguf_linear import PROJECTIONS
from baton.engine.models.layers import RMSNorm
from baton.engine.models.moe import load_experts
from baton.kernels.quant_formats import QuantWeight


class DecoderWeights(Protocol):
    """The parts of a decoder that ``load_decoder_weights`` fills (``LlamaForCausalLM``'s):
    its layers are ``DecoderLayer``s."""

    embed_tokens: nn.Embedding
    embed_quant: QuantWeight | None
    norm: RMSNorm
    lm_head: nn.Linear | None
    lm_head_quant: QuantWeight | None
    layers: nn.ModuleList


def load_decoder_weights(model: DecoderWeights, weights: dict[str, torch.Tensor]) -> None:
    """Copies ``weights`` (Hugging Face names) into ``model``: the embedding (taken as it is
    where the model was built for GGUF weights), norms, LM head, each layer's projections
    (q|k|v and gate|up concatenated; those held in GGUF blocks skipped), experts, the layer's
    extra weights (``DecoderLayer.extra_weights``), q/k norms and biases.

    Raises:
        ValueError: naming any missing, unexpected or wrongly shaped weight.
    """
    remaining = dict(weights)

    def take(name: str) -> torch.Tensor:
        if name not in remaining:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return remaining.pop(name)

    def check(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if param.shape != value.shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
            )

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        check(param, value, name)
        param.copy_(value)

    with torch.no_grad():
        embedding = take("model.embed_tokens.weight") if model.embed_quant is None else None
        remaining.pop("model.embed_tokens.weight", None)  # in blocks: lookups decode them
        if embedding is None:
            pass
        elif model.embed_tokens.weight.is_meta:  # built for quantised weights: no copy
            check(model.embed_tokens.weight, embedding, "embed_tokens")
            model.embed_tokens.weight = nn.Parameter(
                embedding.to(model.embed_tokens.weight.dtype).contiguous(), requires_grad=False
            )
        else:
            put(model.embed_tokens.weight, embedding, "embed_tokens")
        put(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if model.lm_head is not None and model.lm_head_quant is None:
            put(model.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        else:
            remaining.pop("lm_head.weight", None)
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p)
            put(
                layer.post_attention_layernorm.weight,
                take(p + "post_attention_layernorm.weight"),
                p,
            )
            quant = layer.quant or (None,) * len(PROJECTIONS)
            projections = PROJECTIONS[: len(layer._linears)]  # an MoE layer: qkv and o
            for linear, (fused, parts), q in zip(
                layer._linears, projections, quant[: len(projections)], strict=True
            ):
                if q is None:
                    dense = [take(p + part) for part in parts]
                    put(linear.weight, torch.cat(dense), p + fused)
            if layer.mlp is not None:
                load_experts(layer.mlp, p, take, put)
            for leaf, param in layer.extra_weights().items():
                put(param, take(p + leaf), p + leaf)
            if layer.q_norm is not None and layer.k_norm is not None:
                for norm, n in ((layer.q_norm, "q"), (layer.k_norm, "k")):
                    name = f"{p}self_attn.{n}_norm.weight"
                    put(norm.weight, take(name), name)
            if layer.qkv_proj.bias is not None:
                bias = [take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
                put(layer.qkv_proj.bias, torch.cat(bias), p + "self_attn.qkv bias")
    # Rotary inverse-frequency buffers are derived from the config.
    extra = [k for k in remaining if not k.endswith("rotary_emb.inv_freq")]
    if extra:
        raise ValueError(f"checkpoint has unexpected weights: {sorted(extra)[:5]}")
