"""Architecture hyper-parameters of a Llama-family decoder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.engine.models.architectures import SUPPORTED_ARCHITECTURES, Architecture, architecture
from baton.engine.models.rope_scaling import check_rope_scaling

__all__ = ["HIDDEN_ACTS", "SUPPORTED_ARCHITECTURES", "ModelConfig"]

# MLP gate activations baton computes (Hugging Face's names).
HIDDEN_ACTS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, Mixtral,
    Qwen2/3-MoE, Gemma 2/3; ``models/architectures.py`` says how each departs from Llama).

    Raises ``ValueError`` at construction when the architecture or RoPE scaling is one baton
    does not run (``rope_scaling.check_rope_scaling``), a field is out of range or the head
    layout is inconsistent.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # "original_max_position_embeddings": 8192}; None means plain RoPE. Types: linear,
    # llama3, yarn (``models/rope_scaling.py``).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (Mixtral, Qwen3-MoE): 0 experts is a dense model. Each token goes to
    # its ``num_experts_per_tok`` best experts (softmax over the router's logits, top k, the k
    # weights renormalised to sum 1 when ``norm_topk_prob``); an expert is a SwiGLU MLP of
    # width ``moe_intermediate_size``. ``dense_layers``: layers of an MoE model that keep a
    # dense MLP of width ``intermediate_size`` (Qwen3-MoE's mlp_only_layers / sparse step).
    # Attention over the last ``sliding_window`` tokens only (Mistral v0.1, Phi-3): a query at
    # position p sees keys p - W + 1 .. p (``AttentionMetadata``); None: full causal attention.
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # Qwen2-MoE: beside the routed experts, a shared SwiGLU expert of this width that every
    # token goes through, scaled by sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_intermediate_size: int = 0
    # The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU).
    hidden_act: str = "silu"
    # Gemma: queries scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); scores
    # and final logits soft-capped, cap * tanh(x / cap) (None: not); the layers listed in
    # full_attention_layers attend to every earlier token whatever sliding_window says; the
    # others (the windowed ones) use plain RoPE of base rope_local_theta where it is set
    # (Gemma 3's local layers), the model's rope_theta and rope_scaling otherwise.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    full_attention_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    # gpt-oss's experts: (up + 1) * gate * sigmoid(alpha * gate), the gate clamped to at most
    # swiglu_limit and up to +-swiglu_limit; None: plain SwiGLU.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        architecture(self.architecture)  # raises, naming the supported ones
        check_rope_scaling(self.rope_scaling)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(scaling[key]) != self.head_dim // 2:
                    raise ValueError(
                        f"rope_scaling 'longrope' has {len(scaling[key])} {key} entries, "
                        f"expected {self.head_dim // 2} (one per frequency of head_dim "
                        f"{self.head_dim})"
                    )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
        self._check_experts()
        self._check_gemma()

    def _check_gemma(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; expected one of "
                f"{', '.join(HIDDEN_ACTS)}"
            )
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_theta",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        if not self.arch.gemma:  # Gemma's block (models/gemma.py) is the one that has these
            if self.hidden_act != "silu":
                raise ValueError(
                    f"hidden_act {self.hidden_act!r}: {self.architecture} models run SwiGLU "
                    "MLPs; expected 'silu'"
                )
            for name in ("attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for Gemma models, not {self.architecture}")
        if self.swiglu_limit is not None and not self.arch.expert_bias:
            raise ValueError(f"swiglu_limit is for gpt-oss's experts, not {self.architecture}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0 or None, got {self.swiglu_limit!r}")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"full_attention_layers {bad} are not layers of a {self.num_layers}-layer model"
            )

    def _check_experts(self) -> None:
        if not self.num_experts:
            if self.num_experts_per_tok or self.dense_layers:
                raise ValueError("num_experts_per_tok and dense_layers need num_experts > 0")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                f"({self.num_experts})"
            )
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(
                f"ModelConfig.shared_expert_intermediate_size must be an int >= 0, got {shared!r}"
            )
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"dense_layers {bad} are not layers of a {self.num_layers}-layer model"
            )

    @property
    def arch(self) -> Architecture:
        """How this architecture departs from Llama (``models/architectures.py``)."""
        return architecture(self.architecture)

    @property
    def qk_norm(self) -> bool:
        """Whether q and k pass through a per-head RMSNorm before RoPE (Qwen3)."""
        return self.arch.qk_norm

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and len(set(self.dense_layers)) < self.num_layers

    def moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (else a dense SwiGLU)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def o_bias(self) -> bool:
        """Whether o_proj carries a bias (``attention_bias`` where the architecture says so)."""
        return self.attention_bias and self.arch.o_bias

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by: ``query_pre_attn_scalar ** -0.5`` where set (Gemma),
        else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer``: ``sliding_window``, or None (every earlier
        token) where there is none or the layer is one of ``full_attention_layers``."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's ``layer_window``, in order (what ``kv_cache_layout`` groups)."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def max_context(self) -> int:
        """The longest sequence baton computes exactly as the model's reference does:
        ``max_position_embeddings``, or the original context of a LongRoPE scaling where that
        is shorter (baton applies its short factors)."""
        limit = self.max_position_embeddings
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "longrope":
            limit = min(limit, int(self.rope_scaling["original_max_position_embeddings"]))
        return limit
