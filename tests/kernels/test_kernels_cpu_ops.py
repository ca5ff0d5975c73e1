"""The CPU's one-call RMSNorm, RoPE and paged decode attention (``kernels/cpu_ops.py``) against
their torch references: RoPE bit for bit, RMSNorm within the mean's rounding, attention within
float32 rounding; all batch-invariant."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import cpu_ops
from baton.kernels.paged_attention import paged_decode_attention_torch
from baton.kernels.rms_norm import rms_norm, rms_norm_torch
from baton.kernels.rope import rope, rope_torch

pytestmark = pytest.mark.skipif(
    cpu_ops.extension() is None, reason="the CPU ops extension does not build here"
)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _angles(tokens: int, half: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(tokens, dtype=torch.float32)[:, None]
    freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = (pos * freq)[:, None, :]
    return angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 7, 9, 3, 64
    # q and k as views of one fused projection, as the model passes them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    cos, sin = _angles(tokens, dim // 2, dtype)
    assert cpu_ops.rope_fits(q, k, cos, sin)
    got_q, got_k = cpu_ops.rope_cpu(q, k, cos, sin)
    want_q, want_k = rope_torch(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert all(
        torch.equal(a, b) for a, b in zip(rope(q, k, cos, sin), (want_q, want_k), strict=True)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 576, generator=gen).to(dtype)
    residual = torch.randn(5, 576, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    out, summed = cpu_ops.rms_norm_cpu(x, weight, 1e-5, residual)
    want, want_summed = rms_norm_torch(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(summed, want_summed)  # the residual stream: exact
    else:
        assert summed is None
    # Only the mean's summation order differs: float32 to a few ulps, bfloat16 at most one
    # bfloat16 rounding step on a few elements.
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(rms_norm(x, weight, 1e-5, residual)[0], out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_are_batch_invariant(dtype: torch.dtype, restore_threads: None) -> None:
    gen = torch.Generator().manual_seed(2)
    hidden, heads, dim = 2048, 4, 64
    weight = torch.randn(hidden, generator=gen).to(dtype)
    row = torch.randn(1, hidden, generator=gen).to(dtype)
    res = torch.randn(1, hidden, generator=gen).to(dtype)
    torch.set_num_threads(1)
    alone = cpu_ops.rms_norm_cpu(row, weight, 1e-6, res)[0]
    head = row[:, : heads * dim].reshape(1, heads, dim)
    cos, sin = _angles(1, dim // 2, dtype)
    rot_alone = cpu_ops.rope_cpu(head, head, cos, sin)[0]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for others in (1, 7, 63):
            batch = torch.randn(others + 1, hidden, generator=gen).to(dtype)
            resb = torch.randn(others + 1, hidden, generator=gen).to(dtype)
            batch[others // 2], resb[others // 2] = row[0], res[0]
            out = cpu_ops.rms_norm_cpu(batch, weight, 1e-6, resb)[0]
            assert torch.equal(out[others // 2], alone[0]), f"{threads} threads, {others}"
            heads_b = batch[:, : heads * dim].reshape(others + 1, heads, dim)
            cosb, sinb = _angles(others + 1, dim // 2, dtype)
            cosb[others // 2], sinb[others // 2] = cos[0], sin[0]
            rot = cpu_ops.rope_cpu(heads_b, heads_b, cosb, sinb)[0]
            assert torch.equal(rot[others // 2], rot_alone[0])


def test_shapes_the_ops_refuse_fall_back_to_torch() -> None:
    x = torch.randn(4, 8)[:, ::2]  # strided rows
    weight = torch.ones(4)
    assert not cpu_ops.rms_norm_fits(x, weight, None)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5)[0], rms_norm_torch(x, weight, 1e-5)[0])
    half = torch.randn(3, 2, 8, dtype=torch.float16)
    cos, sin = _angles(3, 4, torch.float16)
    assert not cpu_ops.rope_fits(half, half, cos, sin)
    assert all(
        torch.equal(a, b)
        for a, b in zip(rope(half, half, cos, sin), rope_torch(half, half, cos, sin), strict=True)
    )


def _decode_case(
    dtype: torch.dtype, seed: int = 0, batch: int = 6, heads: int = 9, kv_heads: int = 3
):
    """q [B, H, 64], caches of 48 blocks of 16, shuffled tables, lengths from 1 to a full table."""
    gen = torch.Generator().manual_seed(seed)
    blocks, block_size, width = 48, 16, 7
    q = torch.randn(batch, heads, 64, generator=gen).to(dtype)
    kc = torch.randn(blocks, block_size, kv_heads, 64, generator=gen).to(dtype)
    vc = torch.randn(blocks, block_size, kv_heads, 64, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width)
    lens = torch.tensor([1, 16, 17, width * block_size, 50, 3][:batch])
    return q, kc, vc, tables, lens


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_matches_the_reference(dtype: torch.dtype) -> None:
    """float32: within a few ulps of the reference's float32 SDPA (another summation order);
    bfloat16: the same float32 value rounded once, so within one bfloat16 ulp of it."""
    q, kc, vc, tables, lens = _decode_case(dtype)
    ref = paged_decode_attention_torch(q.float(), kc.float(), vc.float(), tables, lens, 0.125)
    out = cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    assert ((out.float() - ref).abs() <= tol * (1 + ref.abs())).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_is_batch_invariant(dtype: torch.dtype, restore_threads: None) -> None:
    """Each sequence alone, at 1 and 2 threads, gives the bits it gets among the others."""
    q, kc, vc, tables, lens = _decode_case(dtype, seed=1)
    torch.set_num_threads(2)
    batch = cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, 0.125)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for b in range(q.shape[0]):
            alone = cpu_ops.paged_decode_cpu(
                q[b : b + 1], kc, vc, tables[b : b + 1], lens[b : b + 1], 0.125
            )
            assert torch.equal(alone[0], batch[b]), (threads, b)


def test_paged_decode_names_bad_lengths_and_blocks() -> None:
    q, kc, vc, tables, lens = _decode_case(torch.float32, batch=2)
    with pytest.raises(RuntimeError, match="seq_lens"):
        cpu_ops.paged_decode_cpu(q, kc, vc, tables, torch.tensor([0, 3]), 0.125)
    with pytest.raises(RuntimeError, match="seq_lens"):
        cpu_ops.paged_decode_cpu(q, kc, vc, tables, torch.tensor([3, 7 * 16 + 1]), 0.125)
    bad = tables.clone()
    bad[1, 0] = 48
    with pytest.raises(RuntimeError, match="block id"):
        cpu_ops.paged_decode_cpu(q, kc, vc, bad, lens, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_gives_the_same_bits_on_every_instruction_set(dtype: torch.dtype) -> None:
    isas = cpu_ops.decode_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only {isas}: nothing to compare")
    q, kc, vc, tables, lens = _decode_case(dtype, seed=2)
    outs = [cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, 0.125, isa=isa) for isa in isas]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_paged_decode_takes_head_dims_of_multiples_of_16_and_long_contexts() -> None:
    """Head dim 128 (Llama 8B's) over 1000 positions, and the scores far apart (one key much
    closer to q): the float32 reference within a few ulps (another summation order)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 128, generator=gen)
    kc = torch.randn(130, 16, 2, 128, generator=gen)
    vc = torch.randn(130, 16, 2, 128, generator=gen)
    tables = torch.randperm(130, generator=gen)[:126].view(2, 63)
    kc[tables[0, 10], 3, 0] = q[0, 0] * 4  # a dominant score
    lens = torch.tensor([1000, 37])
    ref = paged_decode_attention_torch(q, kc, vc, tables, lens, 0.088).double()
    out = cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, 0.088)
    assert ((out.double() - ref).abs() <= 1e-5 * (1 + ref.abs())).all()
    assert not cpu_ops.paged_decode_fits(q[..., :40], kc[..., :40], vc[..., :40])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_prefill_gives_each_token_the_bits_of_a_decode_step(dtype: torch.dtype) -> None:
    """Three sequences' prompt tokens (40, 1 and 70 of them: runs longer than the kernel's run
    of 32, and a lone token) in one call, each equal to a decode call of its length, bit for
    bit, and close to the reference."""
    gen = torch.Generator().manual_seed(4)
    kc = torch.randn(48, 16, 3, 64, generator=gen).to(dtype)
    vc = torch.randn(48, 16, 3, 64, generator=gen).to(dtype)
    tables = torch.randperm(48, generator=gen)[:21].view(3, 7)
    counts, ends = [40, 1, 70], [45, 1, 112]  # tokens this step; length after it
    seqs = torch.cat([torch.full((n,), s) for s, n in enumerate(counts)])
    lens = torch.cat([torch.arange(e - n + 1, e + 1) for n, e in zip(counts, ends, strict=True)])
    q = torch.randn(len(seqs), 9, 64, generator=gen).to(dtype)
    out = cpu_ops.paged_prefill_cpu(q, kc, vc, tables, seqs, lens, 0.125)
    for i in range(len(seqs)):
        one = cpu_ops.paged_decode_cpu(
            q[i : i + 1], kc, vc, tables[seqs[i] : seqs[i] + 1], lens[i : i + 1], 0.125
        )
        assert torch.equal(out[i], one[0]), i
    ref = paged_decode_attention_torch(q.float(), kc.float(), vc.float(), tables[seqs], lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    assert ((out.float() - ref).abs() <= tol * (1 + ref.abs())).all()
    with pytest.raises(RuntimeError, match="token_seqs"):
        cpu_ops.paged_prefill_cpu(q, kc, vc, tables, seqs + 3, lens, 0.125)
    with pytest.raises(RuntimeError, match="token_lens"):
        cpu_ops.paged_prefill_cpu(q, kc, vc, tables, seqs, lens * 0, 0.125)


def _eager_reference(q, kc, vc, tables, lens, scale, window, softcap, sinks):
    """``eager_attention`` (models/attention.py) over each row's gathered keys: the masked
    torch path these kernels replace on the CPU; float32."""
    from baton.engine.models.attention import eager_attention

    outs = []
    bs = kc.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.tensor([int(tables[b, t // bs]) * bs + t % bs for t in range(n)])
        keys = kc.flatten(0, 1)[slots].float().permute(1, 0, 2)[None]  # [1, kvh, n, d]
        values = vc.flatten(0, 1)[slots].float().permute(1, 0, 2)[None]
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
        if window is not None:
            mask[..., : max(0, n - window)] = False
        out = eager_attention(q[b : b + 1, :, None].float(), keys, values, mask, scale,
                              softcap, sinks)  # fmt: skip
        outs.append(out[0, :, 0])
    return torch.stack(outs)


MODS = [
    {"window": 20},
    {"softcap": 1.5},
    {"sinks": torch.linspace(-2.0, 3.0, 9)},
    {"window": 5, "softcap": 30.0, "sinks": torch.linspace(1.0, -1.0, 9)},
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mods", MODS, ids=lambda m: "+".join(m))
def test_windows_soft_caps_and_sinks_match_the_eager_path(dtype: torch.dtype, mods) -> None:
    """Decode with a sliding window (Mistral, Gemma, gpt-oss), soft-capped scores (Gemma 2)
    and sink logits (gpt-oss): the eager torch path's values within float32 rounding (the
    kernel's tanh is Cephes' polynomial), and prefill tokens each the bits of a decode step
    of their length. The blocks before a window are never read: they hold a bad id here."""
    q, kc, vc, tables, lens = _decode_case(dtype, seed=5)
    scale = 0.3 if "softcap" in mods else 0.125  # scores large enough for the cap to bend
    clean = tables
    if "window" in mods:  # a window's early blocks may be back in the pool
        tables = tables.clone()
        for b in range(len(lens)):
            tables[b, : max(0, int(lens[b]) - mods["window"]) // 16] = 10**6
    out = cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, scale, **mods)
    ref = _eager_reference(q, kc, vc, clean, lens, scale, mods.get("window"),
                           mods.get("softcap"), mods.get("sinks"))  # fmt: skip
    tol = 2e-5 if dtype == torch.float32 else 2**-8
    assert ((out.float() - ref).abs() <= tol * (1 + ref.abs())).all()
    # Prefill: a run of sequence 3's last 40 positions, each as a decode step.
    seq, tables = 3, clean
    token_lens = torch.arange(int(lens[seq]) - 39, int(lens[seq]) + 1)
    qs = torch.randn(40, 9, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    seqs = torch.full((40,), seq)
    pre = cpu_ops.paged_prefill_cpu(qs, kc, vc, tables, seqs, token_lens, scale, **mods)
    for i in (0, 17, 39):
        one = cpu_ops.paged_decode_cpu(
            qs[i : i + 1], kc, vc, tables[seq : seq + 1], token_lens[i : i + 1], scale, **mods
        )
        assert torch.equal(pre[i], one[0]), i


def test_bad_windows_caps_and_sinks_are_named() -> None:
    q, kc, vc, tables, lens = _decode_case(torch.float32, batch=2)
    with pytest.raises(RuntimeError, match="window"):
        cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, 0.125, window=0)
    with pytest.raises(RuntimeError, match="softcap"):
        cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, 0.125, softcap=-1.0)
    with pytest.raises(RuntimeError, match="sinks"):
        cpu_ops.paged_decode_cpu(q, kc, vc, tables, lens, 0.125, sinks=torch.zeros(4))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("nbytes", [0, 7, 8, 33, 4096 + 3, 1 << 20])
def test_read_words_is_the_xor_of_the_words(nbytes: int, threads: int, restore_threads) -> None:
    import numpy as np

    torch.set_num_threads(threads)
    t = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    words = np.frombuffer(t.numpy().tobytes()[: nbytes // 8 * 8], dtype="<u8")
    expected = int(np.bitwise_xor.reduce(words).view(np.int64)) if words.size else 0
    assert cpu_ops.read_words(t) == expected
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        cpu_ops.read_words(t.to(torch.int16))
