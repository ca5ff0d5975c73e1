"""baton's Llama forward pass against transformers, paged-cache consistency, bfloat16 decode
attention, packed experts (int8 linears: test_model_int8.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from model_testing import BLOCK, _tiny_pair
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from baton.engine.models.attention import AttentionMetadata, paged_attention
from baton.engine.models.config import ModelConfig
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.models.sharding import check_tensor_parallel

# YaRN stretching an original context of 64 positions to the tiny models' 256: with head_dim 16
# the ramp falls inside the dimensions, so interpolated, extrapolated and blended frequencies all
# take part.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


# LongRoPE over an original context of 64 (of the tiny models' 256): its short factors, one
# per frequency (head_dim 16), and the attention factor sqrt(1 + ln 4 / ln 64).
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
}


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
        ("qwen3", None, True),
        ("qwen3", None, False),
        ("llama", YARN, False),
        ("qwen3", YARN, True),
        ("mixtral", None, False),
        ("qwen3_moe", None, True),
        ("qwen2_moe", None, False),
        ("phi3", None, False),
        ("phi3", LONGROPE, False),
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


def test_llama_attention_bias_includes_o_proj_bias():
    """A Llama config with attention_bias has biases on q, k, v and o (transformers' Llama):
    the o bias is loaded and used, and a checkpoint without it is refused by name."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
    )
    hf = HFLlama(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.bias.normal_(0.0, 0.5)
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=config.rms_norm_eps,
        attention_bias=True,
    )
    assert cfg.o_bias
    model = LlamaForCausalLM(cfg)
    state = dict(hf.state_dict())
    model.load_weights(state)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = allocate_kv_cache(cfg, 16, BLOCK, torch.float32)
    assert (_prefill(model, ids, kv, list(range(1, 6))) - ref).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="o_proj has a bias cannot be cut"):
        check_tensor_parallel(cfg, 2)
    del state["model.layers.1.self_attn.o_proj.bias"]
    with pytest.raises(ValueError, match="missing weight 'model.layers.1.self_attn.o_proj.bias'"):
        LlamaForCausalLM(cfg).load_weights(state)


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


DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_checkpoint, hf_default_model):
    ckpt = default_checkpoint
    model = LlamaForCausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    for text in DEFAULT_PROMPTS:
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


# bfloat16 rounds every activation to 8 bits of mantissa, so baton and transformers (which
# round in different places: baton keeps norms in float32) do not agree token for token.
# Measured on these prompts: baton bf16 vs transformers bf16 at most 0.7 (logits span about
# +-30); transformers bf16 vs its own float32 is as far (0.5).
BF16_LOGIT_TOLERANCE = 1.0


@pytest.mark.slow
def test_default_model_bfloat16_logits_near_transformers_bfloat16(
    default_checkpoint, hf_default_model
):
    ckpt = default_checkpoint
    model = LlamaForCausalLM(ckpt.config).to(torch.bfloat16)
    model.load_weights(ckpt.weights)
    hf = copy.deepcopy(hf_default_model).to(torch.bfloat16)
    for text in DEFAULT_PROMPTS:
        ids = torch.tensor(ckpt.tokenizer.encode(text))
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        kv = allocate_kv_cache(ckpt.config, 8, 16, torch.bfloat16)
        out = _prefill_block(model, ids, kv)
        assert (out - ref).abs().max().item() <= BF16_LOGIT_TOLERANCE, text


def test_bfloat16_decode_attention_upcast_computes_in_float32(monkeypatch):
    """Where a CPU's half-precision SDPA is slow (no AMX), decode attends in float32."""
    from baton.engine.models import attention

    monkeypatch.setattr(attention, "HALF_DECODE_SDPA_FAST", False)
    gen = torch.Generator().manual_seed(5)
    kv = allocate_kv_cache(_tiny_pair()[1].config, 8, BLOCK, torch.bfloat16)[0]
    kv[0].copy_(torch.randn(kv[0].shape, generator=gen))
    kv[1].copy_(torch.randn(kv[1].shape, generator=gen))
    seq_lens = torch.tensor([7, 3])
    meta = AttentionMetadata.build(
        torch.tensor([1, 1]), seq_lens, torch.tensor([[1, 2], [3, 4]]), BLOCK
    )
    q = torch.randn(2, 4, 16, generator=gen).bfloat16()
    k = torch.randn(2, 2, 16, generator=gen).bfloat16()
    v = torch.randn(2, 2, 16, generator=gen).bfloat16()
    out = paged_attention(q, k, v, kv[0], kv[1], meta, 0.25)
    assert out.dtype == torch.bfloat16
    # The same attention done by hand in float32 on the bfloat16 values, rounded once.
    flat_k, flat_v = kv[0].view(-1, 2, 16).float(), kv[1].view(-1, 2, 16).float()
    for i, n in enumerate(seq_lens.tolist()):
        slots = meta.kv_index[i, :n]
        keys = flat_k[slots].repeat_interleave(2, dim=1)  # [n, 4, 16]
        values = flat_v[slots].repeat_interleave(2, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), keys) * 0.25, dim=-1)
        ref = torch.einsum("hn,nhd->hd", weights, values)
        # Within one bfloat16 rounding of the float32 result.
        assert ((out[i].float() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()


@pytest.mark.parametrize("half_fast", [False, True])
def test_bf16_decode_attention_either_way_matches_float64(monkeypatch, half_fast):
    """A bfloat16 decode step attends in bfloat16 (CPUs with AMX) or upcast to float32
    (elsewhere); either way it is the float64 attention to bfloat16 rounding."""
    from baton.engine.models import attention

    monkeypatch.setattr(attention, "HALF_DECODE_SDPA_FAST", half_fast)
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, lens = 4, 2, 16, [3, 9, 14]
    tables = torch.tensor([[1 + 4 * i + j for j in range(4)] for i in range(len(lens))])
    kc = torch.randn(16, BLOCK, kv_heads, dim, generator=gen).to(torch.bfloat16)
    vc = torch.randn(16, BLOCK, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(len(lens), kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(len(lens), kv_heads, dim, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata.build(
        torch.ones(len(lens), dtype=torch.long), torch.tensor(lens), tables, BLOCK
    )
    assert meta.query_index is None  # the one-query decode layout
    out = paged_attention(q, k, v, kc, vc, meta, dim**-0.5)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lens):
        slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
        keys = kc.view(-1, kv_heads, dim)[slots].double().repeat_interleave(2, dim=1)
        values = vc.view(-1, kv_heads, dim)[slots].double().repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,shd->hs", q[i].double(), keys) * dim**-0.5
        ref = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
        assert (out[i].double() - ref).abs().max().item() <= 2e-2


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "onednn"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_packed_experts_compute_the_unpacked_logits(arch, grouped, monkeypatch):
    """The CPU default lays the experts out for the grouped kernel (kernels/moe_experts.py)
    where it runs, else packs each expert for oneDNN, and releases the stacked weights: the
    same logits as the plain experts, within float32 rounding."""
    from baton.engine.models.packed import packing_available
    from baton.kernels import moe_experts

    if grouped and not moe_experts.available_isas():
        pytest.skip("the grouped MoE kernel does not run here")
    monkeypatch.setattr(moe_experts, "ENABLED", grouped)

    if not packing_available(torch.float32):
        pytest.skip("this torch build packs no CPU weights (no oneDNN)")
    _, model = _tiny_pair(arch)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3))
    kv = allocate_kv_cache(model.config, 16, BLOCK, torch.float32)
    with torch.no_grad():
        plain = _prefill(model, ids, kv, list(range(1, 7)))
        model.pack_weights()
        packed = _prefill(model, ids, kv, list(range(1, 7)))
    mlp = model.layers[0].mlp
    assert mlp is not None and mlp.gate_up.numel() == 0
    assert (mlp.grouped is not None, mlp.packed is not None) == (grouped, not grouped)
    assert (packed - plain).abs().max().item() <= 1e-4 * plain.abs().max().item()


def test_an_moe_block_takes_a_step_without_tokens():
    from baton.engine.models.moe import SparseMoeBlock

    block = SparseMoeBlock(16, 8, 4, 2, True)
    with torch.no_grad():
        block.gate_up.normal_()
        block.down.normal_()
    assert block(torch.empty(0, 16)).shape == (0, 16)
    assert block(torch.randn(3, 16)).shape == (3, 16)
    block.pack_weights()
    assert block(torch.empty(0, 16)).shape == (0, 16)
    assert block(torch.randn(3, 16)).shape == (3, 16)
