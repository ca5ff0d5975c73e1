"""Shared pytest fixtures: the default model, its tokenizer, tiny random-weight model folders and
transformers' reference copies of them.

Everything expensive is session-scoped so the whole suite pays for it once.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from memory_guard import register as register_memory_guard

import baton.engine.config as engine_config_module
from baton.engine.loader import Checkpoint, load_checkpoint, load_tokenizer
from baton.engine.loader import default_model_path as _default_model_path
from baton.engine.loader.gguf import gguf_metadata, read_gguf
from baton.engine.speculative_config import SpeculativeConfig
from baton.engine.tokenizer import Tokenizer

# The repository: a test builds its paths from here, whatever folder of tests/ it lives in.
ROOT = Path(__file__).resolve().parent.parent

# tests/ mirrors the package (tests/layout.py). pytest imports a test module by its file name
# (its default "prepend" import mode puts the module's folder on sys.path; the test folders have
# no __init__.py, and tests/repo/test_layout.py keeps file names unique). With every test folder
# on sys.path, a test may import another's helpers (``from test_scheduler import fake_output``)
# wherever each lives and whichever files the run collects. Appended, so they shadow nothing.
for _folder in sorted({path.parent for path in ROOT.joinpath("tests").rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def pytest_configure(config: pytest.Config) -> None:
    """Every pytest process of the suite bounds and, on request, records its resident memory
    per test file (tests/memory_guard.py)."""
    register_memory_guard(config)


# The real resolver of dtype="auto", for the tests that check it (see float32_by_default).
REAL_AUTO_DTYPE = engine_config_module.auto_dtype


def _float32_for_tests(device: str) -> tuple[torch.dtype, str]:
    return torch.float32, "tests: dtype='auto' resolves to float32 (see tests/conftest.py)"


@pytest.fixture(scope="session", autouse=True)
def float32_by_default() -> Iterator[None]:
    """In the suite, ``dtype="auto"`` means float32. Most tests compare tokens with
    transformers or across batch shapes, which only float32 makes exact; and on a loaded 2-core
    machine bfloat16 GEMMs, which oneDNN splits over both threads even for a tiny model, stall
    ~20 ms each whenever one thread is descheduled (measured: 20 ms vs 0.3 ms for a 960x576
    GEMV), which would slow the suite many times over. Tests of the bfloat16 and int8 paths ask
    for them explicitly; tests of ``auto`` itself use ``REAL_AUTO_DTYPE``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_config_module, "auto_dtype", _float32_for_tests)
        yield


# The KV cache an engine of the suite gets unless its test sets one: the product's default is
# 1 GiB, allocated zeroed (resident from the start), so every engine a test built held 1 GiB
# for KV blocks that no test fills (issue 52: an xdist worker reached 9.5 GB).
TEST_KV_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="session", autouse=True)
def small_kv_cache_by_default() -> Iterator[None]:
    """In the suite, ``EngineConfig.kv_cache_memory_bytes`` defaults to
    ``TEST_KV_CACHE_BYTES`` (still thousands of tokens for the default model in float32);
    tests that need a given cache set ``num_kv_blocks`` or ``kv_cache_memory_bytes``."""
    yield from _with_default(
        engine_config_module.EngineConfig, "kv_cache_memory_bytes", TEST_KV_CACHE_BYTES
    )


def _with_default(cls: type, name: str, value: Any) -> Iterator[None]:
    """``cls(...)`` defaults ``name`` to ``value`` while the generator is suspended."""
    init = cls.__init__
    code = init.__code__
    names = code.co_varnames[1 : code.co_argcount]
    defaults = list(init.__defaults__ or ())
    defaults[names.index(name) - (len(names) - len(defaults))] = value
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(init, "__defaults__", tuple(defaults))
        yield


@pytest.fixture(scope="session", autouse=True)
def fixed_drafts_by_default() -> Iterator[None]:
    """In the suite, ``SpeculativeConfig.adaptive`` defaults to False: the draft policy's
    choices follow wall-clock step times, and the tests that count drafts must see them on a
    loaded machine too. The policy is tested with given timings (``test_draft_policy.py``);
    tests of it in an engine ask for ``adaptive=True``."""
    yield from _with_default(SpeculativeConfig, "adaptive", False)


TINY_SEED = 1234
# Shared by the tiny models: small enough to build in well under a second, big enough that GQA
# (2 query heads per kv head), RoPE and the MLP all matter. The vocabulary is SmolLM2's real one.
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a deterministic, clearly non-trivial value.

    transformers' default init (std 0.02, norms = 1) leaves attention almost uniform and makes
    norm weights invisible, which would hide bugs in RoPE, masking or norm application.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def build_tiny_model_dir(
    directory: Path,
    tokenizer: Tokenizer,
    arch: str = "llama",
    seed: int = TINY_SEED,
    rope_scaling: dict[str, Any] | None = None,
    shape: Mapping[str, Any] | None = None,
) -> Path:
    """Write a tiny random-weight ``arch`` model ("llama": tied, no bias, ``shape`` overriding
    ``TINY_SHAPE``'s entries; "qwen2": q/k/v bias,
    untied lm_head; "qwen3": per-head q/k norms, tied; "mixtral", "qwen3_moe": experts) as a
    Hugging Face folder with
    ``tokenizer``'s files, and return the folder. ``rope_scaling`` (llama, qwen3): an HF-style
    RoPE scaling dict."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            rope_theta=100000.0,
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            tie_word_embeddings=True,
            **{**TINY_SHAPE, **(shape or {})},
            **special,
        )
        model = LlamaForCausalLM(config)
    elif arch == "qwen3":
        config = Qwen3Config(
            vocab_size=tokenizer.vocab_size,
            rope_theta=1000000.0,
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            tie_word_embeddings=True,
            **TINY_SHAPE,
            **special,
        )
        model = Qwen3ForCausalLM(config)
    elif arch == "phi3":  # fused q|k|v and gate|up; LongRoPE through rope_scaling
        shape = {k: v for k, v in TINY_SHAPE.items() if k != "head_dim"}  # Phi-3 derives it
        longrope = rope_scaling is not None and rope_scaling.get("rope_type") == "longrope"
        config = Phi3Config(
            vocab_size=tokenizer.vocab_size,
            rope_theta=10000.0,
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            original_max_position_embeddings=512
            if longrope
            else TINY_SHAPE["max_position_embeddings"],
            tie_word_embeddings=False,
            sliding_window=None,
            **shape,
            **special,
        )
        model = Phi3ForCausalLM(config)
    elif arch == "mixtral":  # 4 experts, top 2
        config = MixtralConfig(
            vocab_size=tokenizer.vocab_size,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
            **TINY_SHAPE,
            **special,
        )
        model = MixtralForCausalLM(config)
    elif arch == "qwen2_moe":  # 8 experts of width 32, top 2, a shared expert of width 48
        shape = {k: v for k, v in TINY_SHAPE.items() if k != "head_dim"}  # derived: 16
        config = Qwen2MoeConfig(
            vocab_size=tokenizer.vocab_size,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            **shape,
            **special,
        )
        model = Qwen2MoeForCausalLM(config)
    elif arch == "qwen3_moe":  # 8 experts of width 32, top 3 renormalised
        config = Qwen3MoeConfig(
            vocab_size=tokenizer.vocab_size,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            **TINY_SHAPE,
            **special,
        )
        model = Qwen3MoeForCausalLM(config)
    elif arch in ("gemma2", "gemma3"):
        model = _tiny_gemma(arch, tokenizer, rope_scaling, special)
    elif arch == "gpt_oss":
        model = _tiny_gpt_oss(tokenizer, rope_scaling, special)
    elif arch == "qwen2":
        shape = {k: v for k, v in TINY_SHAPE.items() if k != "head_dim"}  # Qwen2 derives it
        config = Qwen2Config(
            vocab_size=tokenizer.vocab_size,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            **shape,
            **special,
        )
        model = Qwen2ForCausalLM(config)
    else:
        raise ValueError(
            f"unknown tiny architecture {arch!r}; "
            "expected llama, qwen2, qwen3, phi3, mixtral, qwen2_moe, qwen3_moe, gemma2, gemma3 "
            "or gpt_oss"
        )
    _randomize(model, seed)
    if arch == "gpt_oss":  # sinks with a visible share of each softmax; gates the clamp bites
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.mul_(20.0)
                layer.mlp.experts.gate_up_proj.mul_(8.0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    names = tokenizer.special_tokens_map()
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_SHAPE["max_position_embeddings"],
        **names,
    }
    if tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


def _tiny_gemma(
    arch: str, tokenizer: Tokenizer, rope_scaling: dict[str, Any] | None, special: dict[str, Any]
) -> torch.nn.Module:
    """A tiny Gemma 2 (2 layers: windowed, full; caps that bite on these weights) or Gemma 3
    (6 layers: five windowed with their own RoPE base, one full with ``rope_scaling``) with a
    window of 8 and llama.cpp's query scale (head_dim)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    common = {
        **TINY_SHAPE,
        **special,
        "vocab_size": tokenizer.vocab_size,
        "sliding_window": 8,
        "query_pre_attn_scalar": TINY_SHAPE["head_dim"],
        "tie_word_embeddings": True,
    }
    if arch == "gemma2":
        config = Gemma2Config(**common, attn_logit_softcapping=4.0, final_logit_softcapping=5.0)
        return Gemma2ForCausalLM(config)
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0, **(rope_scaling or {})},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, rope_parameters=rope)
    return Gemma3ForCausalLM(config)


def _tiny_gpt_oss(
    tokenizer: Tokenizer, rope_scaling: dict[str, Any] | None, special: dict[str, Any]
) -> torch.nn.Module:
    """A tiny gpt-oss: 4 experts of width 32, top 2, a window of 8 on layer 0, YaRN as gpt-oss
    has it (no truncation) unless ``rope_scaling`` says otherwise."""
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = rope_scaling or {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }
    config = GptOssConfig(
        **{**TINY_SHAPE, "intermediate_size": 32},
        **special,
        vocab_size=tokenizer.vocab_size,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_theta": 150000.0, **rope},
    )
    return GptOssForCausalLM(config)


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


@pytest.fixture(scope="session")
def default_gguf_metadata(default_model_path: Path) -> dict[str, Any]:
    """Every metadata key of the default GGUF as plain Python values."""
    return gguf_metadata(read_gguf(default_model_path), default_model_path)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default SmolLM2-135M-Instruct GGUF file."""
    return _default_model_path()


TOKENIZER_ENV = "BATON_TEST_TOKENIZER"


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """baton's tokenizer of the default model: from its GGUF file, or from the Hugging Face
    folder in $BATON_TEST_TOKENIZER where the 98 MB file cannot go (the prepared GPU check)."""
    folder = os.environ.get(TOKENIZER_ENV)
    if folder:
        return load_tokenizer(folder)
    return Tokenizer.from_gguf_metadata(request.getfixturevalue("default_gguf_metadata"))


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path: Path) -> Checkpoint:
    """baton's float32 ``Checkpoint`` of the default model, loaded once per session; tests must
    not modify its weights."""
    return load_checkpoint(default_model_path)


def run_shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The folder that every xdist worker of this test run shares (the parent of each worker's
    base temporary folder, new for every run); None when pytest runs without xdist."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return None
    return tmp_path_factory.getbasetemp().parent


def built_once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]
) -> tuple[Path, Any]:
    """``build(folder)`` run once per test run: under xdist the first worker that asks builds
    ``name`` in the run's shared folder under a file lock and the others wait for it and reuse
    the folder (each worker would otherwise pay for the same build); without xdist it builds
    in a fresh temporary folder. Returns the folder and what ``build`` returned (None in a
    worker that found the folder already built). A build that raises leaves no folder, so the
    next worker tries again and sees the same error."""
    shared = run_shared_folder(tmp_path_factory)
    if shared is None:
        folder = tmp_path_factory.mktemp(name)
        return folder, build(folder)
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if folder.is_dir():
            return folder, None
        partial = shared / f"{name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            built = build(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        partial.rename(folder)
        return folder, built


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """A tiny random-weight Llama (2 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, tied
    embeddings, SmolLM2's tokenizer and chat template) saved as a Hugging Face folder, built
    once per test run (read-only: copy it to change it)."""
    folder, _ = built_once_per_run(
        tmp_path_factory,
        "tiny_llama",
        lambda folder: build_tiny_model_dir(folder, tokenizer, "llama"),
    )
    return folder


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """Like ``tiny_model_dir`` but Qwen2: q/k/v biases and an untied lm_head."""
    folder, _ = built_once_per_run(
        tmp_path_factory,
        "tiny_qwen2",
        lambda folder: build_tiny_model_dir(folder, tokenizer, "qwen2"),
    )
    return folder


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF import, unchanged but for two repeats it makes: it parses the file's
    metadata twice (for the config, then for the tensors; 3-7 s each for the default model's 49k
    tokens and merges) and rebuilds gguf's tensor-name table once per module of the model (~400
    times, 4-7 s). Inside this context ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map``
    (which transformers looks up at each call) return the first result for the same arguments:
    gguf's reader is read-only and the name table is only read."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.cache
    def cached_reader(path: Any, mode: str = "r") -> Any:
        return reader(path, mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", cached_reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(name_map))
        yield


@pytest.fixture(scope="session")
def hf_default_model_dir(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The default GGUF as transformers imports it (its reader, names and dequantisation;
    never baton's), saved as a float32 safetensors folder once per test run.

    That import takes 7-25 s (see ``gguf_parsed_once``); loading the folder takes under a
    second (float32 round-trips exactly)."""
    from safetensors.torch import save_model
    from transformers import LlamaForCausalLM

    def convert(folder: Path) -> None:
        with gguf_parsed_once():
            model = LlamaForCausalLM.from_pretrained(
                default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
            )
        # save_pretrained refuses a model loaded from GGUF; its weights are plain float32
        # tensors by now, so the config without the GGUF entry describes them.
        config = copy.deepcopy(model.config)
        del config.quantization_config
        config.save_pretrained(folder)
        save_model(model, str(folder / "model.safetensors"))  # the tied head stored once

    folder, _ = built_once_per_run(tmp_path_factory, "hf_default_model", convert)
    return folder


@pytest.fixture
def hf_default_model(hf_default_model_dir: Path) -> Any:
    """transformers' ``LlamaForCausalLM`` of the default GGUF (float32, eval mode): the reference
    for weights and logits. Loaded for each test that asks (from ``hf_default_model_dir``, about
    a second): a session-wide copy kept 0.5 GB resident in a worker for the rest of the run,
    and a module-wide one sat beside the engines that tests/engine/entrypoints/test_engine.py
    starts (issue 52)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf_default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path) -> Any:
    """transformers' tokenizer built from the default GGUF: the reference for encode/decode and
    chat templates."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name
    )


def shared_data_dir() -> Path | None:
    """The shared schema data (maskbench format): $BATON_DATA_DIR or ../shared/data."""
    env = os.environ.get("BATON_DATA_DIR")
    path = Path(env) if env else ROOT.parent / "shared" / "data"
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Directory of the shared schema files; skips the test when it is absent."""
    path = shared_data_dir()
    if path is None:
        pytest.skip("shared schema data not found (set BATON_DATA_DIR)")
    return path


InterpreterRun = Callable[[str, Any, Path], Any]


@pytest.fixture(scope="session")
def run_interpreted() -> InterpreterRun:
    """``run(code, payload, folder)``: saves ``payload`` to ``folder``, runs ``code`` in a fresh
    Python with TRITON_INTERPRET=1 (the interpreter is chosen when a kernel module is imported,
    which this process may already have done) as ``code cases.pt out.pt``, and returns what it
    saved to out.pt. Fails the test with the child's output when it exits non-zero."""
    pytest.importorskip("triton")

    def run(code: str, payload: Any, folder: Path) -> Any:
        torch.save(payload, folder / "cases.pt")
        result = subprocess.run(
            [sys.executable, "-c", code, str(folder / "cases.pt"), str(folder / "out.pt")],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, f"interpreter run failed:\n{result.stdout}\n{result.stderr}"
        return torch.load(folder / "out.pt")

    return run


@contextlib.contextmanager
def serve_in_thread(app: Any, log_level: str = "warning") -> Iterator[str]:
    """Serves the ASGI ``app`` with uvicorn on a free loopback port, in a daemon thread; yields
    its base URL and stops the server on exit. uvicorn is imported here, so that test modules
    that serve nothing do not need it."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


DEFAULT_SERVED_MODEL = "smol"


@pytest.fixture(scope="module")
def default_model_engine(default_checkpoint: Checkpoint) -> Iterator[Any]:
    """An ``AsyncLLM`` of the default model (8 sequences, 2048 tokens) for the test module,
    shut down after it; the engine behind ``default_model_server``, for modules that serve it
    under other settings too. Module-scoped: a session-wide engine (0.8 GB) stayed resident in
    a worker for the rest of the run (issue 52), and starting one from the loaded
    ``default_checkpoint`` takes seconds."""
    from baton.engine.entrypoints.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        None, checkpoint=default_checkpoint, max_num_seqs=8, max_model_len=2048
    )
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def default_model_server(default_model_engine: Any) -> Iterator[str]:
    """``baton serve``'s app on the default model (no API key, served as "smol"), in a uvicorn
    thread for the test module; yields its base URL."""
    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig

    config = ServerConfig(served_model_name=DEFAULT_SERVED_MODEL)
    with serve_in_thread(build_app(default_model_engine, config)) as base:
        yield base


@pytest.fixture(scope="module")
def parser_servers(default_model_engine: Any) -> Iterator[dict[str, str]]:
    """The base URL of an app per ``--tool-call-parser`` name (``TOOL_CALL_FORMATS``), all
    on the module's ``default_model_engine`` (served as "smol")."""
    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig
    from baton.grammar.tool_formats import TOOL_CALL_FORMATS

    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(
                serve_in_thread(
                    build_app(
                        default_model_engine,
                        ServerConfig(served_model_name=DEFAULT_SERVED_MODEL, tool_call_parser=name),
                    )
                )
            )
            for name in TOOL_CALL_FORMATS
        }


def decode_after_prompts(
    model: torch.nn.Module, prompts: torch.Tensor, which: list[int], dtype: torch.dtype, block: int
) -> torch.Tensor:
    """Logits of one decode step for sequences ``which`` of ``prompts`` ``[seqs, n + 1]``:
    each prompt's first n tokens prefilled alone into its own two cache blocks (block size
    ``block``), then its token n decoded, all of ``which`` in one step."""
    from baton.engine.models.attention import AttentionMetadata
    from baton.engine.models.kv_cache import allocate_kv_cache

    seqs, n = prompts.shape[0], prompts.shape[1] - 1
    tables = torch.tensor([[1 + 2 * s, 2 + 2 * s] for s in range(seqs)])
    kv = allocate_kv_cache(model.config, 1 + 2 * seqs, block, dtype)
    with torch.no_grad():
        for s in which:
            meta = AttentionMetadata.build(
                torch.tensor([n]), torch.tensor([n]), tables[s : s + 1], block
            )
            model(prompts[s, :n], torch.arange(n), kv, meta)
        k = len(which)
        meta = AttentionMetadata.build(
            torch.ones(k, dtype=torch.long), torch.full((k,), n + 1), tables[which], block
        )
        return model.compute_logits(model(prompts[which, n], torch.full((k,), n), kv, meta))


def kquant_llama_weights(
    config: Any, split_qkv: bool = False, qkv_bias: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A Llama of ``config`` (hidden and intermediate multiples of 256) as hand-made K-quant
    blocks (``bench.quant_linear.random_blocks``: Q4_K projections, Q6_K down and LM head)
    plus random dense norms and embedding: (kernel weights by name, dense tensors by name).
    ``split_qkv``: q and k in Q4_K and v in Q6_K as three parts (a Q4_K_M file's layers with
    more bits for v); ``qkv_bias``: a QKV bias (Qwen2's)."""
    from baton.bench.quant_linear import random_blocks
    from baton.kernels.quant_formats import repack

    rng = np.random.default_rng(0)

    def weight(fmt: str, n: int, k: int) -> Any:
        return repack(random_blocks(fmt, n, k, rng, scale=1e-4), fmt)

    c = config
    h, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    quantized: dict[str, Any] = {"lm_head.weight": weight("Q6_K", c.vocab_size, h)}
    gen = torch.Generator().manual_seed(0)
    dense = {"model.embed_tokens.weight": torch.randn(c.vocab_size, h, generator=gen)}
    dense["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        if split_qkv:
            quantized[p + "self_attn.q_proj.weight"] = weight("Q4_K", c.num_heads * c.head_dim, h)
            quantized[p + "self_attn.k_proj.weight"] = weight("Q4_K", kv, h)
            quantized[p + "self_attn.v_proj.weight"] = weight("Q6_K", kv, h)
        else:
            qkv = c.num_heads * c.head_dim + 2 * kv
            quantized[p + "self_attn.qkv_proj.weight"] = weight("Q4_K", qkv, h)
        if qkv_bias:
            for part, n in (("q", c.num_heads * c.head_dim), ("k", kv), ("v", kv)):
                dense[f"{p}self_attn.{part}_proj.bias"] = 0.1 * torch.randn(n, generator=gen)
        quantized[p + "self_attn.o_proj.weight"] = weight("Q4_K", h, c.num_heads * c.head_dim)
        quantized[p + "mlp.gate_up_proj.weight"] = weight("Q4_K", 2 * c.intermediate_size, h)
        quantized[p + "mlp.down_proj.weight"] = weight("Q6_K", h, c.intermediate_size)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[f"{p}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    return quantized, dense
