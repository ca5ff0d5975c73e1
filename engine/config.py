"""Engine configuration, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance.

    Attributes:
        model: path of a GGUF file or Hugging Face folder; None = default model.
        dtype: weights and activations dtype (float32 is fastest on CPU).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: longest sequence (prompt + output); None = the model's context.
        block_size: tokens per KV cache block.
        kv_cache_memory_bytes: memory for the KV cache; sets the number of blocks.
        num_kv_blocks: explicit number of KV blocks (overrides kv_cache_memory_bytes).
        enable_prefix_caching: reuse cached blocks of identical prefixes.
        seed: base of the seeds drawn for requests that bring none.
        device: torch device of the model.
        grammar_compile_timeout_s: time limit of one grammar compile.
        grammar_dynamic_compilation: let xgrammar compile JSON schemas lazily
            (much faster compiles, slower first mask fills).
    """

    model: str | None = None
    dtype: torch.dtype = torch.float32
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "cpu"
    grammar_compile_timeout_s: float = 10.0
    grammar_dynamic_compilation: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "kv_cache_memory_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(
                f"EngineConfig.max_model_len must be an int >= 2, got {self.max_model_len!r}"
            )
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise ValueError(
                f"EngineConfig.num_kv_blocks must be an int >= 2, got {self.num_kv_blocks!r}"
            )
        if not isinstance(self.grammar_compile_timeout_s, (int, float)) or not (
            self.grammar_compile_timeout_s > 0
        ):
            raise ValueError(
                "EngineConfig.grammar_compile_timeout_s must be > 0, "
                f"got {self.grammar_compile_timeout_s!r}"
            )
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"EngineConfig.dtype must be float32, float16 or bfloat16, got {self.dtype}"
            )
