"""The decoder architectures baton runs, one entry each: what the loaders and the model ask.

Every architecture here is a Llama-family pre-norm decoder (RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP). An entry says only how it departs from Llama: q/k/v biases, a
per-head norm of q and k, and how llama.cpp's converter lays out its q/k weights. The
loaders read their tables (Hugging Face class names, GGUF names) from here, so an
architecture is added in one place.
"""

from __future__ import annotations

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
    """

    name: str
    hf_classes: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf_permuted_qk: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", ("LlamaForCausalLM",), gguf_permuted_qk=True),
        Architecture("mistral", ("MistralForCausalLM",), gguf_permuted_qk=True),
        Architecture("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True),
        Architecture("qwen3", ("Qwen3ForCausalLM",), qk_norm=True),
    )
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)

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
