"""``EngineConfig.gguf_activations``: the model's K-quant linears with int8 activations
(llama.cpp's numerics, the default) or float32 ones, reaching ``kernels/quant_linear.py``.

The tiny test models are too narrow for K-quant blocks (256 weights), so the model here is a
Llama of hidden 256 built from hand-made Q4_K/Q6_K blocks
(``bench.compute.quant_linear.random_blocks``) and random dense norms and embedding.
"""

from __future__ import annotations

import argparse
import platform

import pytest
import torch
from model_testing import decode_after_prompts, kquant_llama_weights

from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import add_engine_args, config_from_args
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM
from baton.kernels.quant_formats import QuantWeight

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the kernel is built for x86-64 only"
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
    tie_word_embeddings=False,  # the dense embedding below is used for lookups
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def kquant_weights() -> tuple[dict[str, QuantWeight], dict[str, torch.Tensor]]:
    return kquant_llama_weights(CONFIG)


def _model(weights, activations: str, dtype: torch.dtype) -> LlamaForCausalLM:
    quantized, dense = weights
    model = LlamaForCausalLM(CONFIG, quantized=quantized, quant_activations=activations)
    model = model.to(dtype)
    model.load_weights(dense)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_reach_the_kernel_and_stay_batch_invariant(kquant_weights, dtype) -> None:
    """A decode step's row alone equals it in a batch of 4, bit for bit, with int8
    activations; the logits differ from float32 activations' (the int8 path ran) by the
    rounding of x only: close (argmax kept on most rows), not equal."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=gen)
    int8 = _model(kquant_weights, "int8", dtype)
    batch = decode_after_prompts(int8, prompts, [0, 1, 2, 3], dtype, BLOCK)
    for s in range(4):
        assert torch.equal(decode_after_prompts(int8, prompts, [s], dtype, BLOCK)[0], batch[s]), s
    exact = decode_after_prompts(
        _model(kquant_weights, "float32", dtype), prompts, [0, 1, 2, 3], dtype, BLOCK
    )
    assert not torch.equal(batch, exact)
    spread = exact.float().std().item()
    assert (batch.float() - exact.float()).abs().max().item() < 0.2 * spread
    assert (batch.argmax(-1) == exact.argmax(-1)).sum().item() >= 3


def test_config_and_cli_take_the_choice_and_name_a_bad_one() -> None:
    assert EngineConfig().gguf_activations == "int8"
    assert EngineConfig(gguf_activations="float32").gguf_activations == "float32"
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        EngineConfig(gguf_activations="int4")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--quantization", "gguf", "--gguf-activations", "float32"])
    assert config_from_args(args).gguf_activations == "float32"
    assert config_from_args(parser.parse_args([])).gguf_activations == "int8"
