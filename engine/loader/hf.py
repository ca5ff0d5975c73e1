"""Load a Llama-family model from a Hugging Face folder (config.json, *.safetensors, tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from baton.engine.loader.checkpoint import (
    FUSED_LEAVES,
    Checkpoint,
    check_shard_fits,
    expected_weight_shapes,
    split_fused,
)
from baton.engine.loader.errors import ModelLoadError
from baton.engine.loader.generation_config import hf_sampling_defaults
from baton.engine.loader.gpt_oss import EXPERT_TENSOR, unstack_experts
from baton.engine.models.architectures import ARCHITECTURES, HF_CLASSES, Architecture
from baton.engine.models.config import ModelConfig
from baton.engine.models.sharding import ShardSpec, weight_slice
from baton.engine.tokenizer import Tokenizer

# config.json "architectures" entry -> ModelConfig.architecture.
SUPPORTED_HF_ARCHITECTURES = HF_CLASSES


def read_hf_config(path: Path) -> dict[str, Any]:
    """The folder's config.json as a dict; ``ModelLoadError`` naming the file where it is
    missing or not a JSON object."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{path}: no config.json; expected a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer.json) or a .gguf file"
        )
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{config_file}: expected a JSON object")
    return data


def hf_architecture(path: Path, data: dict[str, Any]) -> str:
    """``ModelConfig.architecture`` of a Hugging Face ``config.json`` (parsed into ``data``):
    by its ``architectures`` classes, else its ``model_type``.

    Raises:
        ModelLoadError: naming the file, for an architecture baton does not run.
    """
    archs = data.get("architectures") or []
    model_type = data.get("model_type")
    known = [SUPPORTED_HF_ARCHITECTURES[a] for a in archs if a in SUPPORTED_HF_ARCHITECTURES]
    if known:
        return known[0]
    if not archs and model_type in SUPPORTED_HF_ARCHITECTURES.values():
        return str(model_type)
    raise ModelLoadError(
        f"{path / 'config.json'}: architecture {archs or model_type!r} is not supported; "
        f"expected one of {', '.join(SUPPORTED_HF_ARCHITECTURES)} "
        f"(model_type {', '.join(SUPPORTED_HF_ARCHITECTURES.values())})"
    )


def config_from_hf(path: Path, data: dict[str, Any], tokenizer: Tokenizer) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (already parsed into ``data``).

    Understands both the transformers 4 (``rope_theta``/``rope_scaling``) and 5
    (``rope_parameters``) spellings. Raises ``ModelLoadError`` naming the file and key for an
    unsupported architecture or a missing/invalid field.
    """
    config_file = path / "config.json"
    arch = hf_architecture(path, data)

    def field(name: str, default: Any = None) -> Any:
        value = data.get(name, default)
        if value is None:
            value = default
        if value is None:
            raise ModelLoadError(f"{config_file}: field {name!r} is missing")
        return value

    hidden = field("hidden_size")
    num_heads = field("num_attention_heads")
    head_dim = field(
        "head_dim", hidden // num_heads if isinstance(hidden, int) and num_heads else 0
    )

    theta, scaling, local_theta = _rope_from_hf(config_file, data, field)
    # Qwen2's q/k/v always carry a bias; the others only when the config says so.
    attention_bias = ARCHITECTURES[arch].qkv_bias or bool(data.get("attention_bias", False))
    experts = _experts_from_hf(arch, data, field)
    window, full_layers = _windows_from_hf(config_file, arch, data, field("num_hidden_layers"))
    gemma = _gemma_from_hf(config_file, data) if ARCHITECTURES[arch].gemma else {}
    bos = data.get("bos_token_id")
    eos = data.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=field("vocab_size"),
            hidden_size=hidden,
            intermediate_size=field("intermediate_size"),
            num_layers=field("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=field("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(field("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=field("max_position_embeddings", 4096),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=bos if isinstance(bos, int) else tokenizer.bos_token_id,
            eos_token_ids=tuple(dict.fromkeys(eos_ids + tokenizer.eos_token_ids)),
            sliding_window=window,
            full_attention_layers=full_layers,
            rope_local_theta=local_theta,
            hidden_act=data.get("hidden_activation") or data.get("hidden_act") or "silu",
            **experts,
            **gemma,
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_file}: invalid model hyper-parameters: {exc}") from exc


def _windows_from_hf(
    config_file: Path, arch: str, data: dict[str, Any], num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    """``(sliding_window, full_attention_layers)``: the window and the layers that attend to
    every earlier token in spite of it. ``layer_types`` says which layers are which where the
    config has it (transformers 5); else Gemma 2 alternates (every second layer full), Gemma 3
    makes every ``sliding_window_pattern``-th layer full (6), Qwen2/3 window the layers from
    ``max_window_layers`` on, and Mistral/Phi-3 every layer. No windowed layer: no window.

    Raises:
        ModelLoadError: a ``layer_types`` entry that is neither attention kind, or of another
            length than the layers.
    """
    window = data.get("sliding_window")
    # Qwen2/3 carry a window they do not use unless use_sliding_window says so.
    if not isinstance(window, int) or not data.get("use_sliding_window", True):
        return None, ()
    types = data.get("layer_types")
    if types is not None:
        kinds = {"sliding_attention", "full_attention"}
        if not isinstance(types, list) or len(types) != num_layers or set(types) - kinds:
            raise ModelLoadError(
                f"{config_file}: layer_types must list 'sliding_attention' or 'full_attention' "
                f"for each of the {num_layers} layers, got {types!r}"
            )
        full = tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    elif arch in ("gemma2", "gemma3_text"):
        default = 2 if arch == "gemma2" else 6
        pattern = data.get("sliding_window_pattern") or data.get("_sliding_window_pattern")
        pattern = pattern or default
        full = tuple(i for i in range(num_layers) if (i + 1) % pattern == 0)
    elif arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = data.get("max_window_layers") or 0
        full = tuple(range(min(first, num_layers)))
    else:
        full = ()
    if len(full) == num_layers:
        return None, ()
    return window, full


def _gemma_from_hf(config_file: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Gemma's query scale and soft-caps (``ModelConfig`` fields).

    Raises:
        ModelLoadError: bidirectional attention (EmbeddingGemma), which a decoder cannot run.
    """
    if data.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{config_file}: use_bidirectional_attention (an embedding model) is not supported; "
            "expected a causal language model"
        )
    return {
        key: float(data[key]) if data.get(key) is not None else None
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
    }


def _rope_from_hf(
    config_file: Path, data: dict[str, Any], field: Callable[..., Any]
) -> tuple[float, dict[str, Any] | None, float | None]:
    """``(rope_theta, rope_scaling, rope_local_theta)`` of a config in the transformers 4
    (``rope_theta`` / ``rope_scaling``) or 5 (``rope_parameters``) spelling; rope_scaling None
    for plain RoPE; rope_local_theta the base of Gemma 3's windowed layers (transformers 4:
    ``rope_local_base_freq``; 5: ``rope_parameters["sliding_attention"]``), else None.

    Raises:
        ModelLoadError: a partial rotary factor other than 1, or scaled RoPE on windowed layers.
    """
    partial = data.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(
            f"{config_file}: partial_rotary_factor {partial!r} (RoPE on part of each head) is not "
            "supported; expected 1.0"
        )
    rope = data.get("rope_parameters")
    local_theta = data.get("rope_local_base_freq")
    if isinstance(rope, dict) and "full_attention" in rope:  # per layer kind (Gemma 3)
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(
                f"{config_file}: rope_parameters['sliding_attention'] has rope_type "
                f"{local['rope_type']!r}; expected 'default' (plain RoPE on windowed layers)"
            )
        local_theta = local.get("rope_theta", local_theta)
        rope = rope["full_attention"]
    theta, scaling = _rope_parameters(config_file, data, rope, field)
    return theta, scaling, None if local_theta is None else float(local_theta)


def _rope_parameters(
    config_file: Path, data: dict[str, Any], rope: Any, field: Callable[..., Any]
) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of one RoPE: ``rope`` (transformers 5's
    ``rope_parameters``) where it is a dict, else the config's ``rope_theta`` /
    ``rope_scaling``."""
    if isinstance(rope, dict):
        theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
        # partial_rotary_factor is checked on its own (check_rope_scaling refuses any but 1).
        scaling: dict[str, Any] | None = {
            k: v
            for k, v in rope.items()
            if k != "rope_theta" and (k, v) != ("partial_rotary_factor", 1.0)
        }
    else:
        theta = field("rope_theta", 10000.0)
        scaling = data.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        # transformers 4 wrote the kind as "type"; "default" is plain RoPE.
        kind = scaling.pop("type", None)
        scaling.setdefault("rope_type", kind or "default")
        if scaling["rope_type"] == "default":
            scaling = None
    if scaling is not None and scaling["rope_type"] == "longrope":
        # Phi-3 keeps the original context beside the scaling, and its factor as the ratio.
        original = scaling.get("original_max_position_embeddings")
        original = original or field("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = field("max_position_embeddings") / original
    return float(theta), scaling


def _experts_from_hf(arch: str, data: dict[str, Any], field: Callable[..., Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` (none for a dense architecture).

    Mixtral: ``num_local_experts`` experts of width ``intermediate_size`` in every layer, the
    top-k weights always renormalised; gpt-oss the same, with its clamped SwiGLU's
    ``swiglu_limit`` and ``swiglu_alpha``. Qwen2/3-MoE: ``num_experts`` experts of width
    ``moe_intermediate_size``; a layer is dense where ``mlp_only_layers`` lists it or
    ``(layer + 1) % decoder_sparse_step`` is not 0; renormalised when ``norm_topk_prob``;
    Qwen2-MoE adds a shared expert of ``shared_expert_intermediate_size``.
    """
    if not ARCHITECTURES[arch].experts:
        return {}
    count = data.get("num_experts") or field("num_local_experts")
    top_k = field("num_experts_per_tok")
    if arch in ("mixtral", "gpt_oss"):
        swiglu = (
            {
                "swiglu_limit": float(field("swiglu_limit")),
                "swiglu_alpha": float(field("swiglu_alpha")),
            }
            if arch == "gpt_oss"
            else {}
        )
        return {
            "num_experts": count,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": field("intermediate_size"),
            "norm_topk_prob": True,
            **swiglu,
        }
    layers = field("num_hidden_layers")
    step = data.get("decoder_sparse_step") or 1
    only = set(data.get("mlp_only_layers") or ())
    return {
        "num_experts": count,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": field("moe_intermediate_size"),
        "norm_topk_prob": bool(data.get("norm_topk_prob", False)),
        "dense_layers": tuple(i for i in range(layers) if i in only or (i + 1) % step),
        "shared_expert_intermediate_size": (
            field("shared_expert_intermediate_size") if arch == "qwen2_moe" else 0
        ),
    }


def _read_safetensors(
    path: Path, config: ModelConfig, dtype: torch.dtype, shard: ShardSpec | None
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files; expected the model weights")
    wanted = set(expected_weight_shapes(config))
    arch = ARCHITECTURES[config.architecture]
    weights: dict[str, torch.Tensor] = {}
    stacked: dict[str, torch.Tensor] = {}  # gpt-oss's stacked experts, as stored
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for stored in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    name = arch.hf_name(stored)
                    if arch.expert_bias and EXPERT_TENSOR.match(name):
                        stacked[name] = handle.get_tensor(stored)
                        continue
                    if arch.fused_projections and name.endswith(FUSED_LEAVES):
                        whole = _read_weight(handle, file, stored, config, dtype, None)
                        weights.update(split_fused(path, name, whole, config, shard))
                        continue
                    if name not in wanted:
                        # Buffers such as rotary inv_freq, or a tied lm_head copy, are not needed.
                        continue
                    if name in weights:
                        raise ModelLoadError(f"{path}: weight {name} appears in two files")
                    weight = _read_weight(handle, file, stored, config, dtype, shard, arch)
                    weights[name] = weight
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from exc
    if stacked:
        weights.update(unstack_experts(path, stacked, dtype))
    return weights


def _read_weight(
    handle: Any,
    file: Path,
    name: str,
    config: ModelConfig,
    dtype: torch.dtype,
    shard: ShardSpec | None,
    arch: Architecture | None = None,
) -> torch.Tensor:
    """Weight ``name`` of an open safetensors file in ``dtype``: all of it, or with ``shard``
    only that rank's part (``sharding.weight_slice``). safetensors maps the file and copies
    out only the indexed elements, so the rest of the tensor is never read. A Gemma norm's
    weight (``arch.gemma``) comes back as 1 + w, added in float32 before the cast: Gemma's
    RMSNorm multiplies by 1 + w, baton's by its weight."""
    part = None
    if shard is None:
        tensor = handle.get_tensor(name)
    else:
        view = handle.get_slice(name)
        shape = tuple(view.get_shape())
        part = weight_slice(name, shape, config, shard)
        if part.dim is None:
            tensor = handle.get_tensor(name)
        else:
            index = [slice(None)] * len(shape)
            index[part.dim] = slice(part.start, part.stop)
            tensor = view[tuple(index)]
    if not tensor.is_floating_point():
        raise ModelLoadError(
            f"{file}: weight {name} has dtype {tensor.dtype}, expected a floating "
            "dtype (quantized safetensors are not supported)"
        )
    if arch is not None and arch.gemma and name.endswith("norm.weight"):
        tensor = tensor.float() + 1.0
    tensor = tensor.to(dtype).contiguous()
    return tensor if part is None else part.pad(tensor)


def load_hf(
    path: Path, dtype: torch.dtype = torch.float32, shard: ShardSpec | None = None
) -> Checkpoint:
    """Load a Hugging Face folder of an architecture in ``models/architectures.py`` as a
    ``Checkpoint`` with weights in ``dtype``.

    Reads config.json, every ``*.safetensors`` file and the tokenizer files; with ``shard``,
    only rank ``shard.rank``'s part of each weight (``sharding.weight_slice``), equal to
    ``shard_weights`` of the full load. Raises ``ModelLoadError`` naming the path for a missing
    or unsupported config, missing tokenizer, unreadable weights, missing or misshapen tensors,
    and a ``shard.size`` that does not fit the model.
    """
    data = read_hf_config(path)
    try:
        tokenizer = Tokenizer.from_files(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer: {exc}") from exc
    config = config_from_hf(path, data, tokenizer)
    if shard is not None:
        check_shard_fits(path, config, shard)
    weights = _read_safetensors(path, config, dtype, shard)
    return Checkpoint(
        path=path,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        sampling_defaults=hf_sampling_defaults(path),
        shard=shard,
    )
