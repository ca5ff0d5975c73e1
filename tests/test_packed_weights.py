"""oneDNN-packed CPU weights (engine/models/packed.py): the kernel against F.linear, and the
model with its weights packed against the same model dense."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_model import _decode_logits, _tiny_pair

from baton.engine.models.packed import pack_linear, packed_linear, packing_available

needs_bf16 = pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="this CPU has no bfloat16 oneDNN kernels"
)
pytestmark = pytest.mark.skipif(
    not packing_available(torch.float32), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("rows", [0, 1, 3, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_float32_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    out = packed_linear(x, pack_linear(weight, bias))
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert torch.allclose(out.double(), ref, rtol=0, atol=1e-4)


@needs_bf16
def test_packed_linear_bfloat16_rounds_like_f_linear():
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 48, generator=gen).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16()
    # A strided view (every other column of a wider tensor) as the model's split outputs are.
    x = torch.randn(5, 96, generator=gen).bfloat16()[:, ::2]
    out = packed_linear(x, pack_linear(weight, bias))
    ref = F.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == torch.bfloat16
    # float32 accumulation, one bfloat16 rounding of the result: within 2**-8 relative.
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-2).all()


def test_pack_linear_names_what_it_cannot_pack():
    with pytest.raises(ValueError, match="cannot pack"):
        pack_linear(torch.randn(8))
    with pytest.raises(ValueError, match="cannot pack"):
        pack_linear(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cannot pack"):
        pack_linear(torch.randn(4, 4, device="meta"))


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_matches_dense_and_releases_dense_weights(tied):
    _, dense = _tiny_pair(tied=tied)
    packed = copy.deepcopy(dense)
    packed.pack_weights()
    prompt = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = _decode_logits(dense, prompt, 6, torch.float32)
        out = _decode_logits(packed, prompt, 6, torch.float32)
    assert (out - ref).abs().max().item() <= 1e-4
    for layer in packed.layers:
        assert layer.packed is not None
        assert all(lin.weight.numel() == 0 for lin in layer._linears)
    # The embedding still looks tokens up; an untied head's dense weight is gone.
    assert packed.embed_tokens.weight.numel() == dense.embed_tokens.weight.numel()
    if not tied:
        assert packed.lm_head.weight.numel() == 0


def test_pack_weights_refuses_a_model_off_the_cpu():
    _, model = _tiny_pair()
    model = model.to("meta")
    with pytest.raises(ValueError, match="CPU"):
        model.pack_weights()


def test_packing_is_once_and_never_with_int8():
    _, model = _tiny_pair()
    model.pack_weights()
    with pytest.raises(ValueError, match="packed already"):
        model.pack_weights()
    # int8 weights replace packing (quantization="int8"): one kernel for every step.
    with pytest.raises(ValueError, match="int8 replaces packing"):
        model.quantize_int8()
