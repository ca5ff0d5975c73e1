"""oneDNN-packed CPU weights (engine/models/packed.py): the kernel against F.linear, and the
model with its weights packed against the same model dense."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from model_testing import _decode_logits, _tiny_pair

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


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)], ids=str
)
@pytest.mark.parametrize("shape", [(96, 40), (64, 1280), (576, 1536), (40, 2100)])
def test_a_packed_row_gets_the_same_bits_alone_at_any_row_count_and_thread_count(shape, dtype):
    """What ``batch_invariant`` promises of every packed GEMM: a lone row (padded where the
    probe saw oneDNN's one-row kernel differ, as it does here past 1024 input features) and
    the same row among 2-300 others, on one thread and two, are equal bit for bit."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features)
    weight = (0.05 * torch.randn(shape, generator=gen)).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    packed = pack_linear(weight, bias)
    x = torch.randn(300, in_features, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            lone = torch.cat([packed_linear(x[i : i + 1].clone(), packed) for i in range(12)])
            for rows in (2, 5, 33, 300):
                batch = packed_linear(x[:rows], packed)
                n = min(rows, 12)
                assert torch.equal(batch[:n], lone[:n]), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_probe_pads_what_differs_alone_and_warns_where_padding_cannot_help(caplog):
    from baton.engine.models.row_invariance import probe_rows

    weight = torch.randn(24, 8, generator=torch.Generator().manual_seed(3))

    def exact(x: torch.Tensor) -> torch.Tensor:
        # Each output its own sum over one row's products (no GEMM kernel choice).
        return (x[:, None, :] * weight[None]).sum(-1)

    def lone_differs(x: torch.Tensor) -> torch.Tensor:
        return exact(x) + 1e-3 if x.shape[0] == 1 else exact(x)

    def count_differs(x: torch.Tensor) -> torch.Tensor:
        return exact(x) + 1e-3 * x.shape[0]

    threads = torch.get_num_threads()
    probe = probe_rows(lone_differs, 8, 24, torch.float32, key=("test", "lone"))
    assert probe.lone_row_differs and not probe.rows_differ
    assert not caplog.records
    probe = probe_rows(count_differs, 8, 24, torch.float32, key=("test", "count"))
    assert probe.rows_differ
    assert "other bits at other row counts" in caplog.text
    same = probe_rows(exact, 8, 24, torch.float32, key=("test", "exact"))
    assert not same.lone_row_differs and not same.rows_differ
    assert torch.get_num_threads() == threads
