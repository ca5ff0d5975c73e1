"""GGUF files for the tests: a Hugging Face folder converted as llama.cpp would (its tensor
names, q/k permutation and tokenizer metadata), tensors encoded in GGML types, a mini
tokenizer's metadata, a GGUF written from metadata and tensors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Hugging Face name (inside model.layers.{i}) -> llama.cpp name (inside blk.{i}). Written out here
# rather than imported so the tests check the loader's own table.
_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: llama.cpp keeps gate|up in ffn_up
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Metadata keys that GGUFReader synthesises or GGUFWriter writes by itself.
_WRITER_OWNED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


# Gemma's four norms: its post_attention_layernorm follows attention (not the MLP's norm).
_GEMMA_NORMS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(hf_name: str, gemma: bool = False) -> str:
    """llama.cpp's tensor name for a Hugging Face weight name (``gemma``: of a Gemma model)."""
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, leaf = hf_name.split(".", 3)
    table = {**_HF_TO_GGUF_LAYER, **_GEMMA_NORMS} if gemma else _HF_TO_GGUF_LAYER
    return f"blk.{layer}.{table[leaf]}"


def _gemma_gguf_metadata(arch: str, config: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Gemma's keys as llama.cpp's converter writes them, and the layer pattern as a bool
    array (which the converter leaves to llama.cpp's default)."""
    rope = config.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    metadata[f"{arch}.rope.freq_base"] = float(full.get("rope_theta", 10000.0))
    if "sliding_attention" in rope:
        metadata[f"{arch}.rope.freq_base_swa"] = float(rope["sliding_attention"]["rope_theta"])
    if full.get("rope_type") == "linear":
        metadata[f"{arch}.rope.scaling.type"] = "linear"
        metadata[f"{arch}.rope.scaling.factor"] = float(full["factor"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            metadata[f"{arch}.{key}"] = float(config[key])
    types = config["layer_types"]
    metadata[f"{arch}.attention.sliding_window_pattern"] = [
        kind == "sliding_attention" for kind in types
    ]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (interleaved RoPE layout)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def encode_tensor(values: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """``values`` (float32) stored as GGML type ``type_name``: the array to write and its type."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[type_name]
    values = np.ascontiguousarray(values, dtype=np.float32)
    if kind == GGMLQuantizationType.F32:
        return values, kind
    if kind == GGMLQuantizationType.F16:
        return values.astype(np.float16), kind
    return quants.quantize(values, kind), kind


def mini_tokenizer_metadata() -> dict[str, Any]:
    """A 262-token byte-level BPE (3 specials, the 256 byte symbols, 3 merges): enough for the
    loader, and a thousand times cheaper to write and parse than SmolLM2's 49152 tokens."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols = {b: chr(b) for b in printable}
    symbols.update(
        {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in symbols)}
    )
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols.values(), "Ġt", "he", "Ġthe"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }


def write_gguf(
    path: Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, tuple[np.ndarray, Any]],
) -> Path:
    """Write a GGUF file: ``metadata`` values typed by their Python type (str, bool, int ->
    uint32, float -> float32, lists), ``tensors`` as (array, GGML type) from ``encode_tensor``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if key in _WRITER_OWNED_KEYS:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            raise TypeError(f"cannot write metadata {key}={value!r}")
    for name, (array, kind) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tokenizer_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of a GGUF metadata dict."""
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def gguf_from_hf_dir(
    hf_dir: Path,
    path: Path,
    base_metadata: Mapping[str, Any],
    tensor_type: Callable[[str], str] = lambda name: "F32",
) -> Path:
    """Convert a tiny Hugging Face folder (conftest's architectures) to GGUF the way llama.cpp
    does (names, reversed dims, q/k permuted for llama and mixtral, YaRN as rope.scaling keys,
    LongRoPE as rope_factors tensors, Mixtral as "llama" with an expert count, each
    projection's experts stacked in one tensor, Gemma's norms as 1 + w), each tensor stored as
    ``tensor_type(gguf_name)``, with the tokenizer metadata of ``base_metadata``."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config["model_type"]
    # llama.cpp writes Mistral and Mixtral as "llama" (Mixtral with an expert count).
    arch = {
        "mistral": "llama",
        "mixtral": "llama",
        "qwen2_moe": "qwen2moe",
        "qwen3_moe": "qwen3moe",
        "gemma3_text": "gemma3",
        "gpt_oss": "gpt-oss",
    }.get(model_type, model_type)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {}
    metadata: dict[str, Any] = {
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", config.get("rope_theta", 1e4))),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.vocab_size": config["vocab_size"],
        **tokenizer_metadata(base_metadata),
    }
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"):
        metadata[f"{arch}.expert_count"] = config.get("num_experts") or config["num_local_experts"]
        metadata[f"{arch}.expert_used_count"] = config["num_experts_per_tok"]
        if model_type == "gpt_oss":
            metadata[f"{arch}.expert_feed_forward_length"] = config["intermediate_size"]
        elif model_type != "mixtral":
            metadata[f"{arch}.expert_feed_forward_length"] = config["moe_intermediate_size"]
        if model_type == "qwen2_moe":
            metadata[f"{arch}.expert_shared_feed_forward_length"] = config[
                "shared_expert_intermediate_size"
            ]
    gemma = model_type in ("gemma2", "gemma3_text")
    if gemma:
        _gemma_gguf_metadata(arch, config, metadata)
    if arch in ("llama", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "gpt-oss"):
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        metadata[f"{arch}.rope.dimension_count"] = head_dim
        metadata[f"{arch}.attention.key_length"] = head_dim
        metadata[f"{arch}.attention.value_length"] = head_dim
    if config.get("sliding_window"):
        metadata[f"{arch}.attention.sliding_window"] = config["sliding_window"]
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes YaRN
        metadata[f"{arch}.rope.scaling.type"] = "yarn"
        metadata[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
        metadata[f"{arch}.rope.scaling.original_context_length"] = int(
            rope["original_max_position_embeddings"]
        )
    tensors = {}
    if rope.get("rope_type") == "longrope":  # as llama.cpp's converter writes Phi-3's
        original = rope.get("original_max_position_embeddings")
        original = original or config["original_max_position_embeddings"]
        metadata[f"{arch}.rope.scaling.original_context_length"] = int(original)
        for kind in ("short", "long"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            tensors[f"rope_factors_{kind}.weight"] = encode_tensor(factors, "F32")
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, value in load_file(str(hf_dir / "model.safetensors")).items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = value.float().numpy()
        if model_type == "gpt_oss" and (".mlp." in hf_name or "sinks" in hf_name):
            tensors.update(
                (name, encode_tensor(part, tensor_type(name)))
                for name, part in _gpt_oss_gguf_tensors(hf_name, array)
            )
            continue
        match = _EXPERT_NAME.match(hf_name)
        if match:  # stacked below, one tensor per layer and projection
            layer, expert, proj = match.groups()
            proj = {"w1": "gate", "w3": "up", "w2": "down"}.get(proj, proj.removesuffix("_proj"))
            experts.setdefault(f"blk.{layer}.ffn_{proj}_exps.weight", {})[int(expert)] = array
            continue
        name = gguf_name(hf_name, gemma or model_type == "gpt_oss")
        if gemma and hf_name.endswith("norm.weight"):  # as llama.cpp's converter stores them
            array = array + 1.0
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            array = llama_cpp_permute(array, heads if ".attn_q." in name else kv_heads)
        tensors[name] = encode_tensor(array, tensor_type(name))
    for name, by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        tensors[name] = encode_tensor(stacked, tensor_type(name))
    return write_gguf(path, arch, metadata, tensors)


def _gpt_oss_gguf_tensors(hf_name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A gpt-oss MLP tensor or attention sink as llama.cpp's converter writes it: the stacked
    experts cut into gate and up (alternate columns) and turned to [experts, out, in]."""
    layer = hf_name.split(".")[2]
    leaf = hf_name.split(".", 3)[3]
    blk = f"blk.{layer}."
    if leaf == "self_attn.sinks":
        return [(blk + "attn_sinks.weight", array)]
    if leaf.startswith("mlp.router."):
        return [(blk + "ffn_gate_inp." + leaf.rsplit(".", 1)[1], array)]
    if leaf == "mlp.experts.gate_up_proj":
        weight = array.transpose(0, 2, 1)
        return [
            (blk + "ffn_gate_exps.weight", weight[:, ::2]),
            (blk + "ffn_up_exps.weight", weight[:, 1::2]),
        ]
    if leaf == "mlp.experts.gate_up_proj_bias":
        return [
            (blk + "ffn_gate_exps.bias", array[:, ::2]),
            (blk + "ffn_up_exps.bias", array[:, 1::2]),
        ]
    if leaf == "mlp.experts.down_proj":
        return [(blk + "ffn_down_exps.weight", array.transpose(0, 2, 1))]
    assert leaf == "mlp.experts.down_proj_bias", hf_name
    return [(blk + "ffn_down_exps.bias", array)]


# An expert's weight in a Mixtral or Qwen3-MoE checkpoint: layer, expert and projection.
_EXPERT_NAME = re.compile(
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
