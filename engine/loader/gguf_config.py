"""The ``ModelConfig`` a GGUF file's metadata describes (llama.cpp's keys)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from baton.engine.loader.errors import ModelLoadError
from baton.engine.models.architectures import Architecture, gguf_architecture
from baton.engine.models.config import ModelConfig
from baton.engine.tokenizer import Tokenizer


def _llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp writes as ``rope_freqs`` for Llama 3.1 scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _rope_scaling_from_freqs(
    path: Path, factors: np.ndarray, theta: float, head_dim: int
) -> dict[str, Any]:
    # GGUF keeps only the computed factors, not the Llama 3 parameters behind them; recover the
    # parameters by matching the published settings (Llama 3.1 / 3.2 / 3.3 families).
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        candidate = _llama3_rope_factors(theta, head_dim, factor, 1.0, 4.0, 8192)
        if candidate.shape == factors.shape and np.allclose(candidate, factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
    raise ModelLoadError(
        f"{path}: tensor rope_freqs.weight holds RoPE factors that match no known Llama 3 "
        "rope_scaling setting; expected factor 2/4/8/16/32 with low 1, high 4, original 8192"
    )


def config_from_gguf(
    path: Path,
    metadata: Mapping[str, Any],
    tensor_names: Collection[str],
    rope_tensors: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
) -> ModelConfig:
    """The ``ModelConfig`` a GGUF file describes.

    Reads ``{arch}.block_count``, ``embedding_length``, ``feed_forward_length``,
    ``attention.head_count(_kv)``, ``attention.key_length``, ``rope.freq_base``,
    ``rope.scaling.*``, ``attention.layer_norm_rms_epsilon``, ``context_length`` and
    ``vocab_size``; ties the embeddings when there is no ``output.weight`` and turns on the
    attention bias when ``blk.0.attn_q.bias`` exists. ``rope_tensors``: the values of the
    file's RoPE factor tensors by name: ``rope_freqs.weight`` becomes a Llama 3
    ``rope_scaling``, ``rope_factors_short/long.weight`` Phi-3's LongRoPE (``_longrope``).
    Gemma's keys as ``_gemma`` reads them, gpt-oss's as ``_gpt_oss``.

    Raises ``ModelLoadError`` naming ``path`` and the key for an unsupported architecture or a
    missing/invalid hyper-parameter."""
    model = architecture_of(path, metadata)
    arch = model.gguf_name  # the metadata keys' prefix

    def get(key: str, kind: type, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        value = metadata.get(full, default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata key {full!r} is missing")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ModelLoadError(
                f"{path}: metadata key {full!r} is {value!r}, expected a {kind.__name__}"
            )
        return value

    tensors = frozenset(tensor_names)
    hidden = get("embedding_length", int)
    num_heads = get("attention.head_count", int)
    num_kv_heads = get("attention.head_count_kv", int, num_heads)
    head_dim = get("attention.key_length", int, hidden // num_heads if num_heads else 0)
    rope_dims = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{path}: {arch}.rope.dimension_count is {rope_dims} but the head size is {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(metadata.get("tokenizer.ggml.tokens") or ())
    theta = get("rope.freq_base", float, 10000.0)

    rope_scaling = _rope_scaling(path, metadata, arch, get)
    rope_freqs = rope_tensors.get("rope_freqs.weight")
    if rope_freqs is not None:
        if rope_scaling is not None:
            raise ModelLoadError(f"{path}: both rope_freqs.weight and rope.scaling.type are set")
        factors = rope_freqs.astype(np.float32).reshape(-1)
        rope_scaling = _rope_scaling_from_freqs(path, factors, theta, head_dim)
    if any(name.startswith("rope_factors_") for name in rope_tensors):
        rope_scaling = _longrope(path, metadata, arch, rope_tensors, get)
    experts = _experts(model, get) if model.experts else {}
    layers = get("block_count", int)
    gemma = _gemma(path, model, metadata, get, layers) if model.gemma else {}
    if model.name == "gpt_oss":
        gemma = _gpt_oss(path, model, metadata, layers)
        if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
            rope_scaling["truncate"] = False  # gpt-oss's YaRN ramp, as its config.json says
    try:
        return ModelConfig(
            architecture=model.name,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length", int),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=get("context_length", int, 4096),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            # llama.cpp writes 0 for no window (Phi-3's converter does).
            sliding_window=metadata.get(f"{arch}.attention.sliding_window") or None,
            **experts,
            **gemma,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: invalid model hyper-parameters: {exc}") from exc


def _rope_scaling(
    path: Path, metadata: Mapping[str, Any], arch: str, get: Callable[..., Any]
) -> dict[str, Any] | None:
    """The HF-style rope_scaling of ``{arch}.rope.scaling.*`` (None: plain RoPE).

    Raises:
        ModelLoadError: a scaling type other than none, linear or yarn.
    """
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": get("rope.scaling.factor", float)}
    if scaling_type != "yarn":
        raise ModelLoadError(
            f"{path}: {arch}.rope.scaling.type {scaling_type!r} is not supported; "
            "expected none, linear or yarn"
        )
    scaling = {
        "rope_type": "yarn",
        "factor": get("rope.scaling.factor", float),
        "original_max_position_embeddings": get("rope.scaling.original_context_length", int),
    }
    for beta in ("beta_fast", "beta_slow"):  # llama.cpp's defaults are YaRN's: 32 and 1
        if f"{arch}.rope.scaling.yarn_{beta}" in metadata:
            scaling[beta] = get(f"rope.scaling.yarn_{beta}", float)
    return scaling


def _experts(model: Architecture, get: Callable[..., Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` from ``{arch}.expert_*``."""
    return {
        "num_experts": get("expert_count", int),
        "num_experts_per_tok": get("expert_used_count", int),
        # Mixtral's experts are feed_forward_length wide; Qwen2/3-MoE say it apart.
        "moe_intermediate_size": get(
            "expert_feed_forward_length", int, get("feed_forward_length", int)
        ),
        # llama.cpp renormalises the top-k weights of Mixtral and Qwen3-MoE, not of Qwen2-MoE
        # (norm_w in its MoE graph), as transformers does for their checkpoints.
        "norm_topk_prob": model.name != "qwen2_moe",
        "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", int, 0),
    }


def architecture_of(path: Path, metadata: Mapping[str, Any]) -> Architecture:
    """The file's architecture (``general.architecture``, and its expert count).

    Raises:
        ModelLoadError: naming ``path`` and the architectures baton reads.
    """
    name = metadata.get("general.architecture")
    experts = metadata.get(f"{name}.expert_count", 0)
    try:
        return gguf_architecture(name, experts if isinstance(experts, int) else 0)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


# llama.cpp's window patterns where a file has no sliding_window_pattern key: a layer is
# windowed unless (layer + 1) is a multiple of the pattern.
_WINDOW_PATTERN = {"gemma2": 2, "gemma3_text": 6, "gpt_oss": 2}
# Layer counts of the 27B models, whose queries llama.cpp scales by (hidden / heads) ** -0.5
# instead of head_dim ** -0.5 (GGUF has no query_pre_attn_scalar key).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _gemma(
    path: Path,
    model: Architecture,
    metadata: Mapping[str, Any],
    get: Callable[..., Any],
    layers: int,
) -> dict[str, Any]:
    """Gemma's ``ModelConfig`` fields from a GGUF file, as llama.cpp reads them: the soft-caps,
    the windowed layers (``attention.sliding_window_pattern``: an int or a bool per layer,
    else the architecture's default), the windowed layers' RoPE base (``rope.freq_base_swa``;
    Gemma 3's default 10000, Gemma 2's the model's) and the query scale (head_dim, or hidden /
    heads for the 27B models).

    Raises:
        ModelLoadError: a pattern that is neither an int nor one bool per layer.
    """
    arch = model.gguf_name
    full = _full_layers(path, model, metadata, layers)
    hidden, heads = get("embedding_length", int), get("attention.head_count", int)
    scalar = (
        hidden // heads
        if layers == _GEMMA_27B_LAYERS[model.name]
        else get("attention.key_length", int, hidden // heads)
    )
    local_theta = get("rope.freq_base_swa", float, 10000.0) if model.name == "gemma3_text" else None
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = metadata.get(f"{arch}.{name}")
        caps[name] = float(cap) if cap else None  # 0: none, as llama.cpp reads it
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": float(scalar),
        "full_attention_layers": full,
        "rope_local_theta": local_theta,
        **caps,
    }


def _full_layers(
    path: Path, model: Architecture, metadata: Mapping[str, Any], layers: int
) -> tuple[int, ...]:
    """The layers without the sliding window: ``{arch}.attention.sliding_window_pattern`` (an
    int, as llama.cpp's set_swa_pattern reads it, or a bool per layer, True = windowed), else
    the architecture's default pattern.

    Raises:
        ModelLoadError: a pattern that is neither an int >= 0 nor one bool per layer.
    """
    key = f"{model.gguf_name}.attention.sliding_window_pattern"
    pattern = metadata.get(key, _WINDOW_PATTERN[model.name])
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        # llama.cpp's set_swa_pattern: 0 windows every layer, 1 none.
        windowed = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    elif isinstance(pattern, list) and len(pattern) == layers:
        windowed = [bool(w) for w in pattern]
    else:
        raise ModelLoadError(
            f"{path}: metadata key {key!r} is {pattern!r}, expected an int >= 0 or a bool "
            f"for each of the {layers} layers"
        )
    return tuple(i for i, w in enumerate(windowed) if not w)


def _gpt_oss(
    path: Path, model: Architecture, metadata: Mapping[str, Any], layers: int
) -> dict[str, Any]:
    """gpt-oss's ``ModelConfig`` fields from a GGUF file: its windowed layers, and the clamped
    SwiGLU's constants, which llama.cpp fixes at 7.0 and 1.702 (GGUF has no key for them)."""
    return {
        "full_attention_layers": _full_layers(path, model, metadata, layers),
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    }


def _longrope(
    path: Path,
    metadata: Mapping[str, Any],
    arch: str,
    rope_tensors: Mapping[str, np.ndarray],
    get: Callable[..., Any],
) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the factors in the
    ``rope_factors_short/long.weight`` tensors, the original context in
    ``rope.scaling.original_context_length``, the factor as ``context_length`` over it, and
    ``rope.scaling.attn_factor`` kept only where it differs from LongRoPE's own
    sqrt(1 + ln(factor) / ln(original)).

    Raises:
        ModelLoadError: one factor tensor without the other, or another scaling type set too.
    """
    if metadata.get(f"{arch}.rope.scaling.type", "none") not in ("none", "longrope"):
        raise ModelLoadError(f"{path}: both rope_factors_* tensors and rope.scaling.type are set")
    try:
        short, long = (
            rope_tensors[f"rope_factors_{kind}.weight"].astype(np.float32).reshape(-1)
            for kind in ("short", "long")
        )
    except KeyError as exc:
        raise ModelLoadError(
            f"{path}: tensor {exc.args[0]} is missing; LongRoPE needs rope_factors_short.weight "
            "and rope_factors_long.weight"
        ) from None
    original = get("rope.scaling.original_context_length", int)
    factor = get("context_length", int) / original
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "short_factor": short.tolist(),
        "long_factor": long.tolist(),
        "original_max_position_embeddings": original,
        "factor": factor,
    }
    attention = metadata.get(f"{arch}.rope.scaling.attn_factor")
    default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    if isinstance(attention, float) and abs(attention - default) > 1e-6:
        scaling["attention_factor"] = attention
    return scaling
