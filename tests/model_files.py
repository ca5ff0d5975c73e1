"""Tiny random-weight model folders for the tests (Llama, Qwen, Gemma, gpt-oss, MoE ... in
Hugging Face's layout, SmolLM2's tokenizer), and building one once per test run under xdist."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.engine.tokenizer import Tokenizer

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
