"""GGUF tensor names and Hugging Face ones: which GGUF tensor is which weight of the decoder
(``hf_names``), and llama.cpp's q/k row permutation that the Hugging Face layout undoes
(``qk_heads``, ``unpermute_qk``). Shared by the dequantising loader (``gguf.py``) and the one
that keeps the blocks (``gguf_quant.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from baton.engine.loader.errors import ModelLoadError
from baton.engine.loader.gguf_reader import GGUFFile, GGUFTensor
from baton.engine.models.architectures import ARCHITECTURES, Architecture
from baton.engine.models.config import ModelConfig

# GGUF leaf name -> Hugging Face name inside model.layers.{i}.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3: q|k|v in one tensor
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # an MoE layer's router
    "ffn_gate_inp.bias": "mlp.gate.bias",  # gpt-oss's router bias, o bias, sinks, norm
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    # Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# An MoE layer's experts, stacked in one tensor [experts, rows, columns] per projection: loaded
# as the Hugging Face names of each expert (EXPERTS_MARK stands for its index).
EXPERTS_MARK = "{expert}"
_EXPERT_TENSORS = {
    "ffn_gate_exps.weight": f"mlp.experts.{EXPERTS_MARK}.gate_proj.weight",
    "ffn_up_exps.weight": f"mlp.experts.{EXPERTS_MARK}.up_proj.weight",
    "ffn_down_exps.weight": f"mlp.experts.{EXPERTS_MARK}.down_proj.weight",
    "ffn_gate_exps.bias": f"mlp.experts.{EXPERTS_MARK}.gate_proj.bias",
    "ffn_up_exps.bias": f"mlp.experts.{EXPERTS_MARK}.up_proj.bias",
    "ffn_down_exps.bias": f"mlp.experts.{EXPERTS_MARK}.down_proj.bias",
}
# Gemma's four norms per layer: post_attention_norm follows attention, ffn_norm precedes the
# MLP (its pre_feedforward_layernorm), post_ffw_norm follows it. (gpt-oss's
# post_attention_norm is the norm before its MLP, as in every other architecture here.)
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Present in some files but carrying nothing the model needs: RoPE factors, which are turned
# into config (rope_freqs: Llama 3; rope_factors_*: Phi-3's LongRoPE).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_IGNORED_TENSORS = frozenset(ROPE_TENSORS)


_Rows = TypeVar("_Rows", torch.Tensor, np.ndarray)


def unpermute_qk(weight: _Rows, num_heads: int) -> _Rows:
    """Undo llama.cpp's per-head RoPE permutation of a q/k weight ([rows, cols]) or bias ([rows]).

    llama.cpp interleaves the two rotary halves of every head; Hugging Face keeps them split.
    The permutation moves whole rows, so it applies to a torch tensor or a numpy array of rows
    of any trailing shape (a block-quantised tensor's raw bytes ``[rows, row_bytes]`` too).
    """
    rows = weight.shape[0]
    rest = tuple(weight.shape[1:])
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(rows, *rest)
    )


def hf_names(path: Path, reader: GGUFFile, model: Architecture) -> list[tuple[GGUFTensor, str]]:
    """Each tensor the model takes with its Hugging Face name (ignored ones left out).

    Raises:
        ModelLoadError: a tensor that is no decoder tensor of ``model``.
    """
    arch = model.gguf_name
    layer_tensors = _GEMMA_LAYER_TENSORS if model.gemma else _LAYER_TENSORS
    out = []
    for tensor in reader.tensors:
        name = tensor.name
        if name in _IGNORED_TENSORS:
            continue
        hf_name = _GLOBAL_TENSORS.get(name)
        if hf_name is None:
            parts = name.split(".", 2)
            leaf = parts[2] if len(parts) == 3 and parts[0] == "blk" else None
            if leaf in layer_tensors:
                hf_name = f"model.layers.{parts[1]}.{layer_tensors[leaf]}"
            elif leaf in _EXPERT_TENSORS:
                hf_name = f"model.layers.{parts[1]}.{_EXPERT_TENSORS[leaf]}"
            else:
                raise ModelLoadError(
                    f"{path}: unexpected tensor {name}; expected only {arch} decoder tensors"
                )
        out.append((tensor, hf_name))
    return out


def qk_heads(path: Path, config: ModelConfig, name: str, rows: int) -> int | None:
    """The head count to undo llama.cpp's q/k permutation of GGUF tensor ``name`` with, or None
    when it is no permuted q/k tensor.

    Raises:
        ModelLoadError: its ``rows`` are not whole pairs of rows per head.
    """
    # llama.cpp's converter permutes q/k for its interleaved RoPE where the registry says so;
    # the others keep the Hugging Face (half-split) order.
    if not ARCHITECTURES[config.architecture].gguf_permuted_qk:
        return None
    if ".attn_q." not in name and ".attn_k." not in name:
        return None
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    if rows % (2 * heads):
        raise ModelLoadError(
            f"{path}: tensor {name} has {rows} rows, expected a multiple of 2 x {heads} heads"
        )
    return heads
