"""Helpers of the model loader's tests (tests/engine/loader/test_loader*.py): a handwritten
one-layer GGUF's metadata and tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf_files import encode_tensor, mini_tokenizer_metadata

MINI_VOCAB = len(mini_tokenizer_metadata()["tokenizer.ggml.tokens"])


def _tiny_metadata(arch: str) -> dict[str, Any]:
    return {
        f"{arch}.block_count": 1,
        f"{arch}.context_length": 64,
        f"{arch}.embedding_length": 32,
        f"{arch}.feed_forward_length": 64,
        f"{arch}.attention.head_count": 2,
        f"{arch}.attention.head_count_kv": 1,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        **mini_tokenizer_metadata(),
    }


def _tiny_tensors(
    vocab: int, type_of: dict[str, str] | None = None, drop: str | None = None
) -> dict[str, tuple[np.ndarray, Any]]:
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (vocab, 32),
        "output_norm.weight": (32,),
        "blk.0.attn_norm.weight": (32,),
        "blk.0.attn_q.weight": (32, 32),
        "blk.0.attn_k.weight": (16, 32),
        "blk.0.attn_v.weight": (16, 32),
        "blk.0.attn_output.weight": (32, 32),
        "blk.0.ffn_norm.weight": (32,),
        "blk.0.ffn_gate.weight": (64, 32),
        "blk.0.ffn_up.weight": (64, 32),
        "blk.0.ffn_down.weight": (32, 64),
    }
    out = {}
    for name, shape in shapes.items():
        if name == drop:
            continue
        values = rng.standard_normal(shape).astype(np.float32)
        out[name] = encode_tensor(values, (type_of or {}).get(name, "F32"))
    return out
