"""The batch-invariant linears for CUDA, checked on the CPU: with
``LlamaForCausalLM.set_invariant_gemm(True)`` every dense linear of a tiny model (projections
with a QKV bias, a mixture of experts' router and experts, the LM head) runs on
``kernels/invariant_matmul.py``, which the Triton interpreter runs on CPU tensors. The routed
model decodes what the ``F.linear`` model decodes (within float32 rounding), and a sequence's
logits decoded alone are the bits of its row in a step of three. ``set_batch_invariant``
routes nothing: the engine keeps ``F.linear`` until the GPU check has measured the kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from conftest import InterpreterRun

# Runs in a fresh Python under TRITON_INTERPRET=1 (the run_interpreted fixture): per config,
# three prompts prefilled alone, then one decode step of all three and one of each alone,
# with the kernel (counting its launches) and with F.linear.
_RUNNER = """
import sys, torch
from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.models.llama import LlamaForCausalLM
from baton.kernels import invariant_matmul as im
assert im._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
payload = torch.load(sys.argv[1], weights_only=False)
launches = [0]
launch = im._launch
def counted(*args):
    launches[0] += 1
    return launch(*args)
im._launch = counted

def decode(model, prompts, which):
    seqs, n = prompts.shape[0], prompts.shape[1] - 1
    tables = torch.tensor([[1 + 2 * s, 2 + 2 * s] for s in range(seqs)])
    kv = allocate_kv_cache(model.config, 1 + 2 * seqs, 4, torch.float32)
    with torch.no_grad():
        for s in range(seqs):
            meta = AttentionMetadata.build(torch.tensor([n]), torch.tensor([n]), tables[s:s+1], 4)
            model(prompts[s, :n], torch.arange(n), kv, meta)
        out = []
        for rows in which:
            k = len(rows)
            meta = AttentionMetadata.build(
                torch.ones(k, dtype=torch.long), torch.full((k,), n + 1), tables[rows], 4)
            hidden = model(prompts[rows, n], torch.full((k,), n), kv, meta)
            out.append(model.compute_logits(hidden))
    return out

results = {}
for name, config in payload["configs"].items():
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    for layer in model.layers:  # stacked experts are not initialised by their module
        if layer.mlp is not None:
            layer.mlp.gate_up.normal_(0, 0.2)
            layer.mlp.down.normal_(0, 0.2)
    prompts = payload["prompts"]
    steps = [[0, 1, 2], [0], [1], [2]]
    results[name, "linear"] = decode(model, prompts, steps)
    model.set_invariant_gemm(True)
    before = launches[0]
    results[name, "kernel"] = decode(model, prompts, steps)
    results[name, "launches"] = launches[0] - before
torch.save(results, sys.argv[2])
"""

_COMMON: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=64,
)  # fmt: skip
_CONFIGS = {
    "qwen2": ModelConfig(architecture="qwen2", attention_bias=True, **_COMMON),
    # Layer 0: 4 experts of width 32, top 2; layer 1 dense.
    "qwen3_moe": ModelConfig(
        architecture="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        dense_layers=(1,),
        **_COMMON,
    ),
}
_PROMPT_LEN = 5


@pytest.fixture(scope="module")
def decoded(tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun) -> Any:
    pytest.importorskip("triton")
    folder: Path = tmp_path_factory.mktemp("invariant_gemm_model")
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, _COMMON["vocab_size"], (3, _PROMPT_LEN + 1), generator=gen)
    return run_interpreted(_RUNNER, {"configs": _CONFIGS, "prompts": prompts}, folder)


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_every_dense_linear_runs_on_the_kernel(name: str, decoded: Any) -> None:
    # Per forward: 3 prompts prefilled + 4 decode steps, each layer's linears and a logits call.
    per_layer = {"qwen2": (4, 4), "qwen3_moe": (2 + 1, 4)}[name]  # attention + router; dense
    experts_calls = decoded[name, "launches"] - 7 * sum(per_layer) - 4
    if name == "qwen3_moe":  # gate_up and down per expert a step's tokens chose
        assert experts_calls > 0 and experts_calls % 2 == 0, experts_calls
    else:
        assert experts_calls == 0


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_the_kernel_decodes_what_f_linear_decodes(name: str, decoded: Any) -> None:
    for got, want in zip(decoded[name, "kernel"], decoded[name, "linear"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_a_sequence_alone_gets_the_bits_of_its_row_in_a_batch(name: str, decoded: Any) -> None:
    together, *alone = decoded[name, "kernel"]
    for row, logits in enumerate(alone):
        assert torch.equal(logits, together[row : row + 1]), row


def test_only_set_invariant_gemm_routes_the_linears() -> None:
    # The engine's batch invariance leaves them on F.linear (cuBLAS on CUDA) until the GPU
    # check has measured the kernel; set_invariant_gemm reaches every linear's owner.
    torch.manual_seed(0)
    model = LlamaForCausalLM(_CONFIGS["qwen3_moe"])

    def flags() -> list[bool]:
        out = [model.invariant_gemm, *(layer.invariant_gemm for layer in model.layers)]
        return out + [layer.mlp.invariant_gemm for layer in model.layers if layer.mlp is not None]

    model.set_batch_invariant(True)
    assert not any(flags())
    model.set_invariant_gemm(True)
    assert all(flags()) and len(flags()) == 4
    model.set_invariant_gemm(False)
    assert not any(flags())
