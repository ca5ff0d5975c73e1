"""Helpers of the model tests (tests/engine/models/): tiny baton/transformers model pairs of each
architecture and their decode logits (test_model*.py, test_packed_weights.py), one decode step
after prompts and a Llama as hand-made K-quant blocks (test_cpu_decode.py, test_gguf_*.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers import LlamaForCausalLM as HFLlama
from transformers import MixtralForCausalLM as HFMixtral
from transformers import Phi3ForCausalLM as HFPhi3
from transformers import Qwen2ForCausalLM as HFQwen2
from transformers import Qwen2MoeForCausalLM as HFQwen2Moe
from transformers import Qwen3ForCausalLM as HFQwen3
from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.config import ModelConfig
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.models.llama import LlamaForCausalLM

BLOCK = 4


def _tiny_pair(arch: str = "llama", rope_scaling: dict | None = None, tied: bool = False):
    torch.manual_seed(0)
    rope_scaling = dict(rope_scaling) if rope_scaling else None  # transformers adds keys
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
    elif arch == "qwen3":
        hf = HFQwen3(Qwen3Config(head_dim=16, rope_scaling=rope_scaling, **common)).eval()
        # transformers initialises the per-head norms to ones: random ones test their use.
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif arch == "phi3":
        longrope = rope_scaling is not None and rope_scaling.get("rope_type") == "longrope"
        hf = HFPhi3(
            Phi3Config(
                rope_scaling=rope_scaling,
                original_max_position_embeddings=64 if longrope else 256,
                sliding_window=None,
                pad_token_id=0,
                eos_token_id=2,
                **common,
            )
        )
    elif arch == "mixtral":
        hf = HFMixtral(
            MixtralConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **common)
        )
    elif arch == "qwen2_moe":
        # Layer 0: 8 experts of width 32, top 2 not renormalised, a shared expert of 48.
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        hf = HFQwen2Moe(
            Qwen2MoeConfig(
                shared_expert_intermediate_size=48,
                norm_topk_prob=False,
                mlp_only_layers=[1],
                **moe,
                **common,
            )
        )
    elif arch == "qwen3_moe":
        # Layer 1 dense (mlp_only_layers), layer 0 of 8 experts of width 32, top 3 renormalised.
        moe = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)
        hf = HFQwen3Moe(
            Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, mlp_only_layers=[1], **moe, **common)
        )
    else:
        hf = HFLlama(LlamaConfig(head_dim=16, rope_scaling=rope_scaling, **common)).eval()
    hf.eval()
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):  # transformers' router init: near uniform
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if ".mlp." in name:
                    param.normal_(0.0, 0.3)
    experts = {}
    if arch == "mixtral":
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    elif arch == "qwen3_moe":
        experts = dict(
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, dense_layers=(1,)
        )
    elif arch == "qwen2_moe":
        experts = dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            dense_layers=(1,),
            norm_topk_prob=False,
            shared_expert_intermediate_size=48,
        )
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
        rope_scaling=(
            {**rope_scaling, "original_max_position_embeddings": 64, "factor": 4.0}  # as hf.py
            if rope_scaling and rope_scaling["rope_type"] == "longrope"
            else rope_scaling
        ),
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attention_bias=arch in ("qwen2", "qwen2_moe"),
        **experts,
    )
    state = dict(hf.state_dict())
    if rope_scaling and rope_scaling.get("rope_type") == "longrope":  # as hf.py fills it in
        cfg = dataclasses.replace(
            cfg,
            rope_scaling={**rope_scaling, "original_max_position_embeddings": 64, "factor": 4.0},
        )
    model = LlamaForCausalLM(cfg)
    model.load_weights(_unfused_experts(state))
    return hf, model


def _unfused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 holds experts stacked (``mlp.experts.gate_up_proj`` [E, 2ff, H],
    ``down_proj`` [E, H, ff]); checkpoints, and baton's loader, name them one by one."""
    out = {}
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, rows in enumerate(value):
                gate, up = rows.chunk(2)
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
        elif name.endswith("self_attn.qkv_proj.weight"):  # Phi-3: q (64 rows), k, v (32 each)
            prefix = name[: -len("qkv_proj.weight")]
            for part, rows in zip("qkv", value.split([64, 32, 32]), strict=True):
                out[f"{prefix}{part}_proj.weight"] = rows
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name[: -len("gate_up_proj.weight")]
            gate, up = value.chunk(2)
            out[f"{prefix}gate_proj.weight"], out[f"{prefix}up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, rows in enumerate(value):
                out[f"{prefix}{e}.down_proj.weight"] = rows
        else:
            out[name] = value
    return out


def _decode_logits(model, prompt: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Prefill ``prompt`` then decode ``steps`` greedy tokens one at a time; every step's
    logits ``[steps + 1, vocab]``."""
    n = prompt.numel()
    blocks = torch.tensor([list(range(1, 9))])
    kv = allocate_kv_cache(model.config, 9, BLOCK, dtype)
    meta = AttentionMetadata.build(torch.tensor([n]), torch.tensor([n]), blocks, BLOCK)
    rows = [model.compute_logits(model(prompt, torch.arange(n), kv, meta))[-1]]
    for i in range(steps):
        tok = rows[-1].argmax().view(1)
        meta = AttentionMetadata.build(torch.tensor([1]), torch.tensor([n + i + 1]), blocks, BLOCK)
        rows.append(model.compute_logits(model(tok, torch.tensor([n + i]), kv, meta))[0])
    return torch.stack(rows)


def decode_after_prompts(
    model: torch.nn.Module, prompts: torch.Tensor, which: list[int], dtype: torch.dtype, block: int
) -> torch.Tensor:
    """Logits of one decode step for sequences ``which`` of ``prompts`` ``[seqs, n + 1]``:
    each prompt's first n tokens prefilled alone into its own two cache blocks (block size
    ``block``), then its token n decoded, all of ``which`` in one step."""
    from baton.engine.models.attention import AttentionMetadata
    from baton.engine.models.kv_cache import allocate_kv_cache

    seqs, n = prompts.shape[0], prompts.shape[1] - 1
    tables = torch.tensor([[1 + 2 * s, 2 + 2 * s] for s in range(seqs)])
    kv = allocate_kv_cache(model.config, 1 + 2 * seqs, block, dtype)
    with torch.no_grad():
        for s in which:
            meta = AttentionMetadata.build(
                torch.tensor([n]), torch.tensor([n]), tables[s : s + 1], block
            )
            model(prompts[s, :n], torch.arange(n), kv, meta)
        k = len(which)
        meta = AttentionMetadata.build(
            torch.ones(k, dtype=torch.long), torch.full((k,), n + 1), tables[which], block
        )
        return model.compute_logits(model(prompts[which, n], torch.full((k,), n), kv, meta))


def kquant_llama_weights(
    config: Any, split_qkv: bool = False, qkv_bias: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A Llama of ``config`` (hidden and intermediate multiples of 256) as hand-made K-quant
    blocks (``bench.compute.quant_linear.random_blocks``: Q4_K projections, Q6_K down and LM head)
    plus random dense norms and embedding: (kernel weights by name, dense tensors by name).
    ``split_qkv``: q and k in Q4_K and v in Q6_K as three parts (a Q4_K_M file's layers with
    more bits for v); ``qkv_bias``: a QKV bias (Qwen2's)."""
    from baton.bench.compute.quant_linear import random_blocks
    from baton.kernels.quant_formats import repack

    rng = np.random.default_rng(0)

    def weight(fmt: str, n: int, k: int) -> Any:
        return repack(random_blocks(fmt, n, k, rng, scale=1e-4), fmt)

    c = config
    h, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    quantized: dict[str, Any] = {"lm_head.weight": weight("Q6_K", c.vocab_size, h)}
    gen = torch.Generator().manual_seed(0)
    dense = {"model.embed_tokens.weight": torch.randn(c.vocab_size, h, generator=gen)}
    dense["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        if split_qkv:
            quantized[p + "self_attn.q_proj.weight"] = weight("Q4_K", c.num_heads * c.head_dim, h)
            quantized[p + "self_attn.k_proj.weight"] = weight("Q4_K", kv, h)
            quantized[p + "self_attn.v_proj.weight"] = weight("Q6_K", kv, h)
        else:
            qkv = c.num_heads * c.head_dim + 2 * kv
            quantized[p + "self_attn.qkv_proj.weight"] = weight("Q4_K", qkv, h)
        if qkv_bias:
            for part, n in (("q", c.num_heads * c.head_dim), ("k", kv), ("v", kv)):
                dense[f"{p}self_attn.{part}_proj.bias"] = 0.1 * torch.randn(n, generator=gen)
        quantized[p + "self_attn.o_proj.weight"] = weight("Q4_K", h, c.num_heads * c.head_dim)
        quantized[p + "mlp.gate_up_proj.weight"] = weight("Q4_K", 2 * c.intermediate_size, h)
        quantized[p + "mlp.down_proj.weight"] = weight("Q6_K", h, c.intermediate_size)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[f"{p}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    return quantized, dense
