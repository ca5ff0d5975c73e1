"""The loaded form of a model (config, weights, tokenizer) and the weight layout it must have."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton.engine.loader.errors import ModelLoadError
from baton.engine.models.config import ModelConfig
from baton.engine.models.gguf_linear import EMBEDDING, LM_HEAD, covered_weights, type_counts
from baton.engine.models.sharding import ShardSpec, check_tensor_parallel, weight_slice
from baton.engine.tokenizer import Tokenizer
from baton.kernels.quant_formats import QuantWeight


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint for ``config`` must hold, by Hugging Face name, with its shape.

    Shapes follow ``torch.nn.Linear``: ``[out_features, in_features]``. ``lm_head.weight`` is
    listed only for an untied model, the q/k/v biases only when ``config.attention_bias`` (o's
    when ``config.o_bias``), the per-head q/k norms only when ``config.qk_norm``, Gemma's norms
    before and after the MLP for a Gemma architecture, the attention sinks where the
    architecture has them; a mixture-of-experts layer lists its router (``mlp.gate``) and each
    expert's gate/up/down (``mlp.experts.{e}.*_proj``), with their biases for gpt-oss, and a
    shared expert's (``mlp.shared_expert.*_proj``, ``mlp.shared_expert_gate``) where it has one.
    Pure function, no side effects.
    """
    hidden = config.hidden_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_rows, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_rows, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_rows, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_rows)
        if config.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (config.head_dim,)
        if config.attention_bias:
            shapes[f"{prefix}.self_attn.q_proj.bias"] = (q_rows,)
            shapes[f"{prefix}.self_attn.k_proj.bias"] = (kv_rows,)
            shapes[f"{prefix}.self_attn.v_proj.bias"] = (kv_rows,)
        if config.o_bias:
            shapes[f"{prefix}.self_attn.o_proj.bias"] = (hidden,)
        if config.arch.attention_sinks:
            shapes[f"{prefix}.self_attn.sinks"] = (config.num_heads,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        if config.arch.gemma:  # the norms before and after Gemma's MLP
            shapes[f"{prefix}.pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[f"{prefix}.post_feedforward_layernorm.weight"] = (hidden,)
        if config.moe_layer(i):
            ff = config.moe_intermediate_size
            shapes[f"{prefix}.mlp.gate.weight"] = (config.num_experts, hidden)
            biased = config.arch.expert_bias
            if biased:
                shapes[f"{prefix}.mlp.gate.bias"] = (config.num_experts,)
            for e in range(config.num_experts):
                expert = f"{prefix}.mlp.experts.{e}"
                shapes[f"{expert}.gate_proj.weight"] = (ff, hidden)
                shapes[f"{expert}.up_proj.weight"] = (ff, hidden)
                shapes[f"{expert}.down_proj.weight"] = (hidden, ff)
                if biased:
                    shapes[f"{expert}.gate_proj.bias"] = (ff,)
                    shapes[f"{expert}.up_proj.bias"] = (ff,)
                    shapes[f"{expert}.down_proj.bias"] = (hidden,)
            shared = config.shared_expert_intermediate_size
            if shared:
                shapes[f"{prefix}.mlp.shared_expert_gate.weight"] = (1, hidden)
                shapes[f"{prefix}.mlp.shared_expert.gate_proj.weight"] = (shared, hidden)
                shapes[f"{prefix}.mlp.shared_expert.up_proj.weight"] = (shared, hidden)
                shapes[f"{prefix}.mlp.shared_expert.down_proj.weight"] = (hidden, shared)
            continue
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


# Fused weights some architectures store (``Architecture.fused_projections``).
FUSED_LEAVES = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")


def split_fused(
    path: Path, name: str, whole: torch.Tensor, config: ModelConfig, shard: ShardSpec | None
) -> dict[str, torch.Tensor]:
    """A fused q|k|v or gate|up weight (Phi-3's ``qkv_proj``, ``gate_up_proj``) as its parts'
    Hugging Face names and rows (views of ``whole``), each cut to rank ``shard.rank``'s part
    where ``shard`` is given. Used by both loaders.

    Raises:
        ModelLoadError: ``whole`` does not have the parts' rows.
    """
    if name.endswith("qkv_proj.weight"):
        prefix = name[: -len("qkv_proj.weight")]
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        sizes, leaves = [q, kv, kv], ["q_proj", "k_proj", "v_proj"]
    else:
        prefix = name[: -len("gate_up_proj.weight")]
        sizes, leaves = [config.intermediate_size] * 2, ["gate_proj", "up_proj"]
    if whole.dim() != 2 or whole.shape[0] != sum(sizes):
        raise ModelLoadError(
            f"{path}: weight {name} has shape {tuple(whole.shape)}, expected {sum(sizes)} rows "
            f"({' + '.join(map(str, sizes))})"
        )
    out = {}
    for leaf, part in zip(leaves, whole.split(sizes), strict=True):
        part_name = f"{prefix}{leaf}.weight"
        if shard is not None:
            cut = weight_slice(part_name, tuple(part.shape), config, shard)
            if cut.dim is not None:
                part = cut.pad(part.narrow(cut.dim, cut.start, cut.stop - cut.start))
        out[part_name] = part
    return out


def shard_weight_shapes(config: ModelConfig, shard: ShardSpec) -> dict[str, tuple[int, ...]]:
    """``expected_weight_shapes`` of rank ``shard.rank``'s part of the model (as
    ``sharding.weight_slice`` cuts it). Pure function; ``ValueError`` when ``shard.size`` does not
    fit the model (``sharding.check_tensor_parallel``)."""
    return {
        name: weight_slice(name, shape, config, shard).shape(shape)
        for name, shape in expected_weight_shapes(config).items()
    }


def check_shard_fits(path: Path, config: ModelConfig, shard: ShardSpec) -> None:
    """Raise ``ModelLoadError`` naming ``path`` when ``config``'s model cannot be cut into
    ``shard.size`` shards (``sharding.check_tensor_parallel`` says which dimension)."""
    try:
        check_tensor_parallel(config, shard.size)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: cannot be cut into {shard.size} shards: {exc}") from exc


def check_weights(
    path: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    shard: ShardSpec | None = None,
    quantized: dict[str, QuantWeight] | None = None,
) -> None:
    """Raise ``ModelLoadError`` naming ``path`` unless ``weights`` holds exactly the expected names
    and shapes for ``config`` (see ``expected_weight_shapes``), or for rank ``shard.rank``'s part
    of it when ``shard`` is given (``shard_weight_shapes``). ``quantized`` weights (see
    ``models/gguf_linear.py``) stand for the names they cover, with their rows and columns, and
    may hold a tied model's ``lm_head.weight``."""
    if shard is None:
        expected = expected_weight_shapes(config)
    else:
        check_shard_fits(path, config, shard)
        expected = shard_weight_shapes(config, shard)
    if quantized:
        if shard is not None:
            raise ModelLoadError(f"{path}: quantised weights cannot be sharded")
        _check_quantized(path, config, expected, quantized)
        weights = dict(weights)
        for parts in covered_weights(quantized).values():
            for part in parts:
                weights[part] = torch.empty(expected.get(part, (0,)), device="meta")
        if config.tie_word_embeddings:
            weights.pop(LM_HEAD, None)
            if LM_HEAD in quantized:  # its blocks serve the embedding's lookups too
                weights.setdefault(
                    EMBEDDING, torch.empty(expected.get(EMBEDDING, (0,)), device="meta")
                )
    missing = [name for name in expected if name not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"{path}: missing weights {shown} (expected by the model config)")
    extra = [name for name in weights if name not in expected]
    if extra:
        raise ModelLoadError(f"{path}: unexpected weights {', '.join(extra[:5])}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{path}: weight {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )


def _check_quantized(
    path: Path,
    config: ModelConfig,
    expected: dict[str, tuple[int, ...]],
    quantized: dict[str, QuantWeight],
) -> None:
    """Raise ``ModelLoadError`` unless each quantised weight covers expected names (or is a
    tied LM head) and has their rows (summed) and columns."""
    expected = dict(expected)
    if config.tie_word_embeddings:
        expected[LM_HEAD] = (config.vocab_size, config.hidden_size)
    for name, parts in covered_weights(quantized).items():
        unknown = [p for p in parts if p not in expected]
        if unknown:
            raise ModelLoadError(f"{path}: unexpected quantised weight {name} ({unknown[0]})")
        rows = sum(expected[p][0] for p in parts)
        cols = {expected[p][1] for p in parts}
        weight = quantized[name]
        if (weight.n, weight.k) != (rows, *cols):
            raise ModelLoadError(
                f"{path}: quantised weight {name} is [{weight.n}, {weight.k}], expected "
                f"[{rows}, {next(iter(cols))}]"
            )


@dataclass(frozen=True)
class Checkpoint:
    """A model ready to build: where it came from, its config, its weights and its tokenizer.

    ``weights`` maps Hugging Face Llama names (see ``expected_weight_shapes``) to contiguous CPU
    tensors, all of one floating dtype. With ``shard`` they are only rank ``shard.rank``'s part
    of each weight (``sharding.weight_slice``: what ``shard_weights`` would cut from the full
    ones), while ``config`` stays the whole model's. ``sampling_defaults`` are the
    ``SamplingParams`` fields the model ships defaults for (its generation config; see
    ``generation_config``). ``quantized``: the linear weights kept in their GGUF blocks
    (``EngineConfig(quantization="gguf")``, ``models/gguf_linear.py`` names them), which
    ``weights`` then lacks (a tied LM head's embedding stays in ``weights``). Construction
    checks names and shapes and raises ``ModelLoadError`` when they do not fit ``config``.
    """

    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    shard: ShardSpec | None = None
    quantized: dict[str, QuantWeight] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_weights(self.path, self.config, self.weights, self.shard, self.quantized)
        dtypes = {tensor.dtype for tensor in self.weights.values()}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ModelLoadError(
                f"{self.path}: weights must share one floating dtype, got {dtypes}"
            )
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ModelLoadError(
                f"{self.path}: tokenizer has {self.tokenizer.vocab_size} tokens but the model's "
                f"embedding has only {self.config.vocab_size} rows"
            )

    def quantized_types(self) -> dict[str, int]:
        """The quantised weights by GGUF type, e.g. ``{"Q4_1": 120, "Q8_0": 1}`` (fused
        projections count once); empty without any."""
        return type_counts(self.quantized)
