"""The fused CPU decode layer (``models/cpu_decode.py``, ``decode_layer`` in
``kernels/csrc/quant_linear.cpp``): a pure-decode step of a GGUF model runs each decoder layer
in one C++ call, and its logits are the unfused layers' bit for bit (so a step may take either
path without changing a token), for both dtypes and activation kinds, q/k/v in one weight or in
parts of two types, with and without a QKV bias. Steps with prefill rows do not take it.
"""

from __future__ import annotations

import platform

import pytest
import torch
from model_testing import decode_after_prompts, kquant_llama_weights

from baton.engine.models import cpu_decode
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the kernels are built for x86-64 only"
)

BLOCK = 4
CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=300,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)


def _model(dtype: torch.dtype, activations: str, split_qkv: bool, bias: bool) -> LlamaForCausalLM:
    quantized, dense = kquant_llama_weights(CONFIG, split_qkv=split_qkv, qkv_bias=bias)
    # q/k/v biases without an o_proj one: Qwen2's layout.
    qwen2 = {"architecture": "qwen2", "attention_bias": True}
    config = CONFIG if not bias else ModelConfig(**{**CONFIG.__dict__, **qwen2})
    model = LlamaForCausalLM(config, quantized=quantized, quant_activations=activations)
    model = model.to(dtype)
    model.load_weights(dense)
    return model.eval()


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the fused layer calls (the steps that took the fused path)."""
    calls: list[int] = []
    original = cpu_decode.FusedLayer.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cpu_decode.FusedLayer, "__call__", counted)
    return calls


@pytest.mark.parametrize(
    "dtype,activations,split_qkv,bias",
    [
        (torch.bfloat16, "int8", True, False),
        (torch.bfloat16, "float32", False, True),
        (torch.float32, "int8", False, False),
        (torch.float32, "float32", True, True),
    ],
)
def test_the_fused_layers_give_the_unfused_bits(
    dtype: torch.dtype, activations: str, split_qkv: bool, bias: bool, fused_calls: list[int]
) -> None:
    model = _model(dtype, activations, split_qkv, bias)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, CONFIG.vocab_size, (3, 7), generator=gen)
    fused = decode_after_prompts(model, prompts, [0, 1, 2], dtype, BLOCK)
    assert len(fused_calls) == CONFIG.num_layers  # the decode step only: prefills do not fuse
    model.fuse_cpu_decode = False
    unfused = decode_after_prompts(model, prompts, [0, 1, 2], dtype, BLOCK)
    assert len(fused_calls) == CONFIG.num_layers
    assert torch.equal(fused, unfused)


def test_a_model_with_a_dense_projection_never_fuses(fused_calls: list[int]) -> None:
    quantized, dense = kquant_llama_weights(CONFIG)
    dense["model.layers.1.mlp.down_proj.weight"] = torch.randn(256, 512) * 0.01
    del quantized["model.layers.1.mlp.down_proj.weight"]
    model = LlamaForCausalLM(CONFIG, quantized=quantized, quant_activations="int8")
    model.load_weights(dense)
    prompts = torch.randint(0, CONFIG.vocab_size, (1, 5), generator=torch.Generator())
    decode_after_prompts(model.eval(), prompts, [0], torch.float32, BLOCK)
    assert fused_calls == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_tokens_do_not_depend_on_chunking_or_the_batch(dtype: torch.dtype) -> None:
    """On GGUF kernels the CPU attends prefill token by token (``token_order``): a prompt's
    last logits are the same bits prefilled whole, in two chunks, or beside another prompt in
    one step."""
    from baton.engine.models.attention import AttentionMetadata
    from baton.engine.models.kv_cache import allocate_kv_cache

    model = _model(dtype, "int8", True, False)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, CONFIG.vocab_size, (90,), generator=gen)
    b = torch.randint(0, CONFIG.vocab_size, (140,), generator=gen)
    tables = torch.arange(80).view(2, 40)

    def run(steps: list[list[tuple[int, torch.Tensor, int]]]) -> dict[int, torch.Tensor]:
        """steps: per step, (sequence, its new tokens, tokens it had before); -> each
        sequence's logits for its last new token of its last step."""
        kv = allocate_kv_cache(CONFIG, 80, BLOCK, dtype)
        last: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for step in steps:
                seqs = [s for s, _, _ in step]
                meta = AttentionMetadata.build(
                    torch.tensor([len(t) for _, t, _ in step]),
                    torch.tensor([before + len(t) for _, t, before in step]),
                    tables[seqs],
                    BLOCK,
                )
                ids = torch.cat([t for _, t, _ in step])
                pos = torch.cat([torch.arange(before, before + len(t)) for _, t, before in step])
                hidden = model(ids, pos, kv, meta)
                ends = torch.cumsum(torch.tensor([len(t) for _, t, _ in step]), 0) - 1
                logits = model.compute_logits(hidden[ends])
                for i, s in enumerate(seqs):
                    last[s] = logits[i]
        return last

    whole = run([[(0, a, 0)]])[0]
    chunked = run([[(0, a[:37], 0)], [(0, a[37:], 37)]])[0]
    beside = run([[(1, b, 0), (0, a, 0)]])[0]
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, beside)
