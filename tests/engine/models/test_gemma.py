"""Gemma 2 and Gemma 3 against transformers at the model level: logits of a prompt longer than
the window in float32 and bfloat16, decode steps past the window, and each Gemma feature shown
to matter (a model without it gives other logits), so that the parity is no accident."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testing import prefill_logits, random_prompt
from model_files import build_tiny_model_dir

from baton.engine.loader import load_checkpoint
from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.causal_lm import causal_lm_class
from baton.engine.models.config import ModelConfig
from baton.engine.models.gemma import GemmaForCausalLM
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.tokenizer import Tokenizer

BLOCK = 4
LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory, tokenizer: Tokenizer) -> Path:
    scaling = LINEAR if request.param == "gemma3" else None
    return build_tiny_model_dir(
        tmp_path_factory.mktemp(request.param), tokenizer, request.param, rope_scaling=scaling
    )


def _hf(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _model(folder: Path, dtype: torch.dtype = torch.float32, **changes: Any) -> GemmaForCausalLM:
    checkpoint = load_checkpoint(folder, dtype=dtype)
    config: ModelConfig = dataclasses.replace(checkpoint.config, **changes)
    model = causal_lm_class(config)(config).to(dtype)
    model.load_weights(checkpoint.weights)
    assert isinstance(model, GemmaForCausalLM)
    return model


def test_config_reads_gemma_fields(folder):
    config = load_checkpoint(folder).config
    assert config.sliding_window == 8 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.attention_scale == 16**-0.5
    if config.architecture == "gemma2":
        assert config.full_attention_layers == (1,)
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (4.0, 5.0)
        assert config.rope_local_theta is None
    else:
        assert config.full_attention_layers == (5,)
        assert config.rope_local_theta == 10000.0 and config.rope_scaling == LINEAR
        assert config.attn_logit_softcapping is None and config.qk_norm


def test_logits_equal_transformers_float32(folder):
    model = _model(folder)
    ids = random_prompt(model.config.vocab_size)
    with torch.no_grad():
        ref = _hf(folder)(ids[None]).logits[0]
    out = prefill_logits(model, ids, torch.float32)
    assert (out - ref).abs().max().item() <= 1e-4


def test_logits_within_tolerance_bfloat16(folder):
    """bfloat16: baton holds the norm weights as 1 + w in bfloat16 and multiplies by them in
    bfloat16 where transformers adds the 1 and multiplies in float32, so the logits are not
    transformers' bit for bit. Stated tolerance: baton's distance from the float32 logits is
    at most twice transformers' own bfloat16 distance from them (measured on these models:
    gemma2 0.22 against 0.14, gemma3 0.77 against 0.85; Llama's are equal)."""
    model = _model(folder, torch.bfloat16)
    ids = random_prompt(model.config.vocab_size)
    with torch.no_grad():
        exact = _hf(folder)(ids[None]).logits[0]
        ref = _hf(folder, torch.bfloat16)(ids[None]).logits[0].float()
    out = prefill_logits(model, ids, torch.bfloat16)
    assert (out - exact).abs().max().item() <= 2 * (ref - exact).abs().max().item()


def _without(config: ModelConfig, feature: str) -> dict[str, Any]:
    if feature == "window":
        return {"sliding_window": None}
    if feature == "global layers":
        return {"full_attention_layers": ()}
    if feature == "attention softcap":
        return {"attn_logit_softcapping": None}
    if feature == "final softcap":
        return {"final_logit_softcapping": None}
    if feature == "local rope base":
        return {"rope_local_theta": None}
    assert feature == "query scale"
    return {"query_pre_attn_scalar": None, "head_dim": config.head_dim}


FEATURES = {
    "gemma2": ["window", "global layers", "attention softcap", "final softcap"],
    "gemma3": ["window", "global layers", "local rope base"],
}


def test_each_gemma_feature_changes_the_logits(folder):
    model = _model(folder)
    ids = random_prompt(model.config.vocab_size)
    base = prefill_logits(model, ids, torch.float32)
    name = "gemma2" if model.config.architecture == "gemma2" else "gemma3"
    for feature in FEATURES[name]:
        other = prefill_logits(
            _model(folder, **_without(model.config, feature)), ids, torch.float32
        )
        assert (other - base).abs().max().item() > 1e-2, feature


def test_decode_past_the_window_equals_full_recompute(folder):
    model = _model(folder)
    hf = _hf(folder)
    seq = random_prompt(model.config.vocab_size, 5).tolist()
    blocks = [9, 2, 14, 5, 11, 3, 8, 1, 12, 6]
    kv = allocate_kv_cache(model.config, 16, BLOCK, torch.float32)
    window = model.config.sliding_window
    for step in range(20):  # 5 prompt tokens, then one at a time to 25 (the window is 8)
        n = len(seq)
        new = n if step == 0 else 1
        meta = AttentionMetadata.build(
            torch.tensor([new]),
            torch.tensor([n]),
            torch.tensor([blocks]),
            BLOCK,
            None,
            None,
            window,
        )
        with torch.no_grad():
            logits = model.compute_logits(
                model(torch.tensor(seq[-new:]), torch.arange(n - new, n), kv, meta)
            )[-1]
            full = hf(torch.tensor([seq])).logits[0, -1]
        assert (logits - full).abs().max().item() <= 1e-4, step
        seq.append(int(logits.argmax()))


def test_packed_and_int8_weights_through_gemmas_block(folder):
    """The CPU kernels the engine puts under a dense model, through Gemma's block: oneDNN-packed
    weights give the dense logits, and int8 weight-only ones the logits of the dense model
    whose projections hold the int8 values (the same products: float32 tolerance both)."""
    from baton.engine.models.packed import packing_available
    from baton.engine.models.quant import quantize_int8

    ids = random_prompt(load_checkpoint(folder).config.vocab_size)
    if packing_available(torch.float32):
        packed = _model(folder)
        packed.pack_weights()
        ref = prefill_logits(_model(folder), ids, torch.float32)
        assert (prefill_logits(packed, ids, torch.float32) - ref).abs().max().item() <= 1e-4
    int8 = _model(folder)
    int8.quantize_int8()
    fake = _model(folder)  # the int8 values as dense weights, the same int8 LM head
    with torch.no_grad():
        for layer in fake.layers:
            for linear in layer._linears:
                q = quantize_int8(linear.weight, torch.float32)
                linear.weight.copy_(q.qweight.float() * q.scales[:, None])
    fake.lm_head_int8 = int8.lm_head_int8
    out, ref = prefill_logits(int8, ids, torch.float32), prefill_logits(fake, ids, torch.float32)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_eager_attention_in_query_blocks_equals_whole(monkeypatch):
    """A long prompt's soft-capped or sink attention runs a block of queries at a time (its
    float32 scores bounded): the same values as in one piece."""
    from baton.engine.models import attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=gen)
    k, v = torch.randn(2, 2, 37, 16, generator=gen), torch.randn(2, 2, 37, 16, generator=gen)
    mask = torch.ones(37, 37, dtype=torch.bool).tril()[None, None]
    sinks = torch.randn(4, generator=gen)
    whole = attention.eager_attention(q, k, v, mask, 0.25, softcap=3.0, sinks=sinks)
    monkeypatch.setattr(attention, "EAGER_SCORES_MAX", 2 * 4 * 37 * 5)  # blocks of 5 queries
    blocked = attention.eager_attention(q, k, v, mask, 0.25, softcap=3.0, sinks=sinks)
    assert torch.allclose(blocked, whole, atol=1e-6)
