"""The decoder architectures baton runs, one entry each: what the loaders and the model ask.

Every architecture here is a Llama-family pre-norm decoder (RMSNorm, RoPE, grouped-query
attention, a gated MLP). An entry says only how it departs from Llama: q/k/v biases, a
per-head norm of q and k, experts, Gemma's sandwich norms, and how llama.cpp's converter lays
out its weights. The loaders read their tables (Hugging Face class names, GGUF names) from
here, and ``models/causal_lm.py`` the model class, so an architecture is added in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """How one architecture departs from Llama.

    Attributes:
        name: ``ModelConfig.architecture``, the GGUF ``general.architecture`` and the
            Hugging Face ``model_type``.
        hf_classes: config.json ``architectures`` entries that name it.
        qkv_bias: True: q/k/v always carry a bias (Qwen2); False: as the config's
            ``attention_bias`` says.
        qk_norm: q and k pass through an RMSNorm over each head (``head_dim`` weights, shared
            by the heads) before RoPE (Qwen3).
        gguf_permuted_qk: llama.cpp's converter stores q/k rows permuted for its interleaved
            RoPE (Llama, Mistral); False where it keeps Hugging Face's half-split order.
        hf_renames: (pattern, replacement) regular expressions that turn the checkpoint's
            weight names into baton's (Hugging Face Llama/Qwen3-MoE names), applied in order.
        experts: its MLPs are mixtures of experts (the config gives their number).
        gguf_name: its ``general.architecture`` in GGUF files (llama.cpp writes Mixtral as
            "llama" with an expert count: ``gguf_architecture`` tells them apart).
        fused_projections: its checkpoints hold q|k|v as one ``qkv_proj`` and gate|up as one
            ``gate_up_proj`` (Phi-3), which the loaders cut into the parts (views, no copy).
        gemma: Gemma 2/3's block (``models/gemma.py``): embeddings scaled by sqrt(hidden),
            norms after attention and after the MLP besides those before them, norm weights
            stored as an offset from 1 (the Hugging Face loader adds the 1, as llama.cpp's
            converter does), layers with and without the sliding window, soft-capping.
        o_bias: o_proj carries a bias where the config's ``attention_bias`` says so (as q/k/v
            do); False: o_proj never has one.
        attention_sinks: each head has a learned sink logit that joins its softmax and takes
            a share of the weight (gpt-oss).
        expert_bias: the router and every expert carry biases, the experts' activation is
            gpt-oss's clamped SwiGLU (``ModelConfig.swiglu_limit``), and Hugging Face
            checkpoints stack the experts with gate and up interleaved (gpt-oss).
    """

    name: str
    hf_classes: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf_permuted_qk: bool = False
    hf_renames: tuple[tuple[str, str], ...] = ()
    experts: bool = False
    gguf_name: str = ""
    fused_projections: bool = False
    gemma: bool = False
    o_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if not self.gguf_name:
            object.__setattr__(self, "gguf_name", self.name)

    def hf_name(self, name: str) -> str:
        """A checkpoint weight name in baton's naming (``hf_renames``)."""
        for pattern, replacement in self.hf_renames:
            name = re.sub(pattern, replacement, name)
        return name


# Mixtral's checkpoints name the router and experts block_sparse_moe.{gate, experts.{e}.w1/w3/w2}.
_MIXTRAL_RENAMES = (
    (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
)


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", ("LlamaForCausalLM",), gguf_permuted_qk=True, o_bias=True),
        Architecture("mistral", ("MistralForCausalLM",), gguf_permuted_qk=True),
        Architecture("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True),
        Architecture("qwen3", ("Qwen3ForCausalLM",), qk_norm=True, o_bias=True),
        Architecture(
            "mixtral",
            ("MixtralForCausalLM",),
            gguf_permuted_qk=True,
            hf_renames=_MIXTRAL_RENAMES,
            experts=True,
            gguf_name="llama",
        ),
        Architecture(
            "qwen3_moe",
            ("Qwen3MoeForCausalLM",),
            qk_norm=True,
            experts=True,
            gguf_name="qwen3moe",
            o_bias=True,
        ),
        Architecture("phi3", ("Phi3ForCausalLM",), fused_projections=True),
        Architecture(
            "qwen2_moe", ("Qwen2MoeForCausalLM",), qkv_bias=True, experts=True, gguf_name="qwen2moe"
        ),
        Architecture("gemma2", ("Gemma2ForCausalLM",), gemma=True, o_bias=True),
        Architecture(
            "gemma3_text",
            ("Gemma3ForCausalLM",),
            qk_norm=True,
            gemma=True,
            gguf_name="gemma3",
            o_bias=True,
        ),
        Architecture(
            "gpt_oss",
            ("GptOssForCausalLM",),
            hf_renames=((r"\.mlp\.router\.", ".mlp.gate."),),
            experts=True,
            gguf_name="gpt-oss",
            o_bias=True,
            attention_sinks=True,
            expert_bias=True,
        ),
    )
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
# GGUF general.architecture values baton reads.
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(
    dict.fromkeys(a.gguf_name for a in ARCHITECTURES.values())
)

# config.json "architectures" entry -> architecture name.
HF_CLASSES: dict[str, str] = {c: a.name for a in ARCHITECTURES.values() for c in a.hf_classes}


def architecture(name: str) -> Architecture:
    """The entry of architecture ``name``.

    Raises:
        ValueError: ``name`` is not one baton runs (the message lists those it does).
    """
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unsupported architecture {name!r}; expected one of {', '.join(ARCHITECTURES)}"
        ) from None


def gguf_architecture(gguf_name: object, expert_count: int) -> Architecture:
    """The architecture of a GGUF file whose ``general.architecture`` is ``gguf_name`` and
    whose ``{arch}.expert_count`` is ``expert_count`` (0 when absent).

    Raises:
        ValueError: no architecture baton runs is written that way (the message lists those
            that are).
    """
    for a in ARCHITECTURES.values():
        if a.gguf_name == gguf_name and a.experts == (expert_count > 0):
            return a
    raise ValueError(
        f"unsupported GGUF architecture {gguf_name!r}"
        + (f" with {expert_count} experts" if expert_count else "")
        + f"; expected one of {', '.join(GGUF_ARCHITECTURES)}"
    )
