"""baton's Llama forward pass against transformers, and paged-cache consistency."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM, allocate_kv_cache

BLOCK = 4


def _tiny_pair(arch: str = "llama", rope_scaling: dict | None = None, tied: bool = False):
    torch.manual_seed(0)
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    if arch == "qwen2":
        hf = HFQwen2(Qwen2Config(**common)).eval()
    else:
        hf = HFLlama(LlamaConfig(head_dim=16, rope_scaling=rope_scaling, **common)).eval()
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=hf.config.rms_norm_eps,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attention_bias=arch == "qwen2",
    )
    model = LlamaForCausalLM(cfg)
    model.load_weights(dict(hf.state_dict()))
    return hf, model


def _prefill(model, ids: torch.Tensor, kv, blocks: list[int]) -> torch.Tensor:
    n = ids.numel()
    meta = AttentionMetadata.build(
        torch.tensor([n]), torch.tensor([n]), torch.tensor([blocks]), BLOCK
    )
    return model.compute_logits(model(ids, torch.arange(n), kv, meta))


@pytest.mark.parametrize(
    "arch,scaling,tied",
    [
        ("llama", None, False),
        ("llama", None, True),
        (
            "llama",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            False,
        ),
        ("qwen2", None, False),
    ],
)
def test_tiny_logits_match_transformers(arch, scaling, tied):
    hf, model = _tiny_pair(arch, scaling, tied)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = allocate_kv_cache(model.config, 32, BLOCK, torch.float32)
    out = _prefill(model, ids, kv, list(range(3, 13)))
    assert (out - ref).abs().max().item() <= 1e-4


def test_paged_decode_equals_full_recompute():
    hf, model = _tiny_pair()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 512, (7,), generator=gen)
    blocks = [9, 2, 14, 5, 11, 3, 8, 1]  # scattered on purpose
    kv = allocate_kv_cache(model.config, 16, BLOCK, torch.float32)
    logits = _prefill(model, prompt, kv, blocks)[-1]
    seq = prompt.tolist()
    for _ in range(20):
        nxt = int(logits.argmax())
        seq.append(nxt)
        n = len(seq)
        meta = AttentionMetadata.build(
            torch.tensor([1]), torch.tensor([n]), torch.tensor([blocks]), BLOCK
        )
        logits = model.compute_logits(model(torch.tensor([nxt]), torch.tensor([n - 1]), kv, meta))[
            0
        ]
        with torch.no_grad():
            full = hf(torch.tensor([seq])).logits[0, -1]
        assert (logits - full).abs().max().item() <= 1e-4


def test_mixed_batch_equals_each_sequence_alone():
    _, model = _tiny_pair()
    gen = torch.Generator().manual_seed(3)
    # Three sequences already decoding (contexts of 5, 9, 13 tokens) and one
    # prefill chunk (tokens 6..15 of a prompt whose first 6 are cached).
    specs = [(5, 1), (9, 1), (6, 10), (13, 1)]
    seqs = [torch.randint(0, 512, (c + q,), generator=gen) for c, q in specs]
    tables = [[1 + 5 * i + j for j in range(5)] for i in range(len(specs))]

    def run_context(kv):
        for (ctx, _), seq, table in zip(specs, seqs, tables, strict=True):
            meta = AttentionMetadata.build(
                torch.tensor([ctx]), torch.tensor([ctx]), torch.tensor([table]), BLOCK
            )
            model(seq[:ctx], torch.arange(ctx), kv, meta)

    alone = []
    kv = allocate_kv_cache(model.config, 24, BLOCK, torch.float32)
    run_context(kv)
    for (ctx, q), seq, table in zip(specs, seqs, tables, strict=True):
        meta = AttentionMetadata.build(
            torch.tensor([q]), torch.tensor([ctx + q]), torch.tensor([table]), BLOCK
        )
        alone.append(model.compute_logits(model(seq[ctx:], torch.arange(ctx, ctx + q), kv, meta)))

    kv = allocate_kv_cache(model.config, 24, BLOCK, torch.float32)
    run_context(kv)
    meta = AttentionMetadata.build(
        torch.tensor([q for _, q in specs]),
        torch.tensor([c + q for c, q in specs]),
        torch.tensor(tables),
        BLOCK,
    )
    ids = torch.cat([s[c:] for (c, _), s in zip(specs, seqs, strict=True)])
    pos = torch.cat([torch.arange(c, c + q) for c, q in specs])
    batched = model.compute_logits(model(ids, pos, kv, meta))
    assert (batched - torch.cat(alone)).abs().max().item() <= 1e-5


def test_load_weights_names_the_problem():
    _, model = _tiny_pair()
    hf, _ = _tiny_pair()
    weights = dict(hf.state_dict())
    weights.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        model.load_weights(weights)
    weights = dict(hf.state_dict())
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(weights)


def test_attention_metadata_rejects_bad_lengths():
    with pytest.raises(ValueError):
        AttentionMetadata.build(torch.tensor([3]), torch.tensor([2]), torch.tensor([[1]]), BLOCK)
    with pytest.raises(ValueError):
        AttentionMetadata.build(torch.tensor([1]), torch.tensor([9]), torch.tensor([[1, 2]]), BLOCK)


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_checkpoint, hf_default_model):
    ckpt = default_checkpoint
    model = LlamaForCausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    prompts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in prompts:
        ids = torch.tensor(ckpt.tokenizer.encode(text))
        with torch.no_grad():
            ref = hf_default_model(ids[None]).logits[0]
        kv = allocate_kv_cache(ckpt.config, 8, 16, torch.float32)
        out = _prefill_block(model, ids, kv)
        assert (out - ref).abs().max().item() <= 1e-3, text


def _prefill_block(model, ids, kv):
    n = ids.numel()
    meta = AttentionMetadata.build(
        torch.tensor([n]), torch.tensor([n]), torch.tensor([list(range(1, 8))]), 16
    )
    return model.compute_logits(model(ids, torch.arange(n), kv, meta))
