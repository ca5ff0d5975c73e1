"""Tests of baton.kernels.bitmask: the Triton kernel (under the Triton interpreter and on CUDA)
against the torch reference, the reference against a numpy oracle, argument validation, and the
sampler's dispatch between the two."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

import baton.sampler.bitmask as sampler_bitmask
from baton.kernels import bitmask as kb

if TYPE_CHECKING:
    from conftest import InterpreterRun

Case = dict[str, Any]

# The interpreter is chosen when triton.jit runs, i.e. when baton.kernels.bitmask is imported,
# and this process may already have imported it (or triton, via xgrammar) without the variable:
# the interpreted runs happen in a fresh interpreter. It only loads the inputs, applies the
# kernel and saves the logits; the comparisons happen here.
_INTERPRETER_RUNNER = """
import sys, time, torch
from baton.kernels.bitmask import apply_token_bitmask_inplace_triton
cases = torch.load(sys.argv[1])
start = time.perf_counter()
for case in cases:
    apply_token_bitmask_inplace_triton(
        case["view"], case["bitmask"], case["indices"], block_size=case["block_size"]
    )
print(f"kernel time {time.perf_counter() - start:.3f}s for {len(cases)} cases")
torch.save([case["base"] for case in cases], sys.argv[2])
"""


def _random_bitmask(gen: torch.Generator, rows: int, words: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64).to(
        torch.int32
    )


def _case(
    seed: int,
    *,
    logit_rows: int,
    vocab: int,
    words: int,
    dtype: torch.dtype,
    rows: list[int] | None = None,
    index_dtype: torch.dtype = torch.int64,
    pad: int = 0,
    transposed: bool = False,
    block_size: int = 1024,
) -> Case:
    """Random logits and bitmask. Bitmask row 0 allows everything (sign bit included), row 1
    nothing, row 2 only bit 31 of each word; `rows` (logits row per bitmask row) becomes
    `indices`; `pad` extra logits columns and `transposed` storage test the strides."""
    gen = torch.Generator().manual_seed(seed)
    num_masks = logit_rows if rows is None else len(rows)
    bitmask = _random_bitmask(gen, num_masks, words)
    for row, word in enumerate((-1, 0, -(2**31))[:num_masks]):
        bitmask[row] = word
    shape = (vocab + pad, logit_rows) if transposed else (logit_rows, vocab + pad)
    return {
        "base": torch.randn(shape, generator=gen).to(dtype),
        "vocab": vocab,
        "transposed": transposed,
        "bitmask": bitmask,
        "indices": None if rows is None else torch.tensor(rows, dtype=index_dtype),
        "block_size": block_size,
    }


@functools.cache
def _cases() -> dict[str, Case]:
    """The shared inputs; callers must clone before writing."""
    cases = {
        f"vocab49152_{str(dtype).removeprefix('torch.')}": _case(
            1, logit_rows=4, vocab=49152, words=1536, dtype=dtype
        )
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    }
    # A bitmask wider than the vocabulary: the bits past it must not spill into the next row.
    cases["vocab49155_wide_indices_bf16"] = _case(
        2, logit_rows=5, vocab=49155, words=1540, dtype=torch.bfloat16, rows=[3, 0, 4]
    )
    # A bitmask narrower than the vocabulary: tokens 960..999 are disallowed everywhere.
    cases["vocab1000_narrow_int32_indices_f16"] = _case(
        3,
        logit_rows=6,
        vocab=1000,
        words=30,
        dtype=torch.float16,
        rows=[5, 1, 2, 0],
        index_dtype=torch.int32,
        block_size=128,
    )
    cases["vocab1000_padded_rows_f32"] = _case(
        4, logit_rows=3, vocab=1000, words=32, dtype=torch.float32, pad=40, block_size=256
    )
    cases["vocab1000_transposed_f32"] = _case(
        5, logit_rows=3, vocab=1000, words=32, dtype=torch.float32, transposed=True
    )
    cases["block32_indices_f32"] = _case(
        6, logit_rows=4, vocab=100, words=4, dtype=torch.float32, rows=[2, 3, 1], block_size=32
    )
    # Few listed rows: the CPU kernel gathers them instead of widening the bitmask.
    cases["sparse_indices_f64"] = _case(
        9, logit_rows=8, vocab=100, words=4, dtype=torch.float64, rows=[6, 1]
    )
    cases["zero_words_f32"] = _case(7, logit_rows=3, vocab=70, words=0, dtype=torch.float32)
    cases["empty_indices_f32"] = _case(8, logit_rows=3, vocab=64, words=2, dtype=torch.float32)
    cases["empty_indices_f32"]["bitmask"] = torch.zeros((0, 2), dtype=torch.int32)
    cases["empty_indices_f32"]["indices"] = torch.zeros(0, dtype=torch.int64)
    return cases


def _view(base: torch.Tensor, case: Case) -> torch.Tensor:
    """The [rows, vocab] logits the functions see: a view into `base`."""
    logits = base.t() if case["transposed"] else base
    return logits[:, : case["vocab"]]


def _reference(case: Case, device: str = "cpu") -> torch.Tensor:
    """`base` after the torch reference applied the case's bitmask."""
    base = case["base"].to(device, copy=True)
    indices = case["indices"]
    kb.apply_token_bitmask_inplace_torch(
        _view(base, case),
        case["bitmask"].to(device),
        None if indices is None else indices.to(device),
    )
    return base


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[str, torch.Tensor]:
    """Case name -> `base` after the Triton kernel ran on it under TRITON_INTERPRET=1."""
    folder = tmp_path_factory.mktemp("bitmask_interpreter")
    names = list(_cases())
    payload = []
    for name in names:
        case = _cases()[name]
        base = case["base"].clone()
        payload.append({**case, "base": base, "view": _view(base, case)})
    outputs = run_interpreted(_INTERPRETER_RUNNER, payload, folder)
    return dict(zip(names, outputs, strict=True))


def _oracle(case: Case) -> torch.Tensor:
    """`base` masked token by token from numpy's little-endian bit unpacking."""
    out = case["base"].clone()
    logits = _view(out, case)
    vocab = case["vocab"]
    bits = np.unpackbits(case["bitmask"].numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = np.zeros((bits.shape[0], vocab), dtype=bool)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].astype(bool)
    indices = case["indices"]
    rows = range(logits.shape[0]) if indices is None else indices.tolist()
    for mask_row, row in enumerate(rows):
        logits[row, torch.from_numpy(~allowed[mask_row])] = float("-inf")
    return out


@pytest.mark.parametrize("name", list(_cases()))
def test_torch_reference_matches_numpy_oracle(name: str) -> None:
    case = _cases()[name]
    expected = _oracle(case)
    assert torch.equal(_reference(case), expected)
    if case["bitmask"].shape[0] > 1:
        assert not torch.equal(expected, case["base"]), "the case masks nothing"


@pytest.mark.parametrize("name", list(_cases()))
def test_cpu_kernel_matches_torch_reference(name: str) -> None:
    case = _cases()[name]
    base = case["base"].clone()
    kb.apply_token_bitmask_inplace_cpu(_view(base, case), case["bitmask"], case["indices"])
    assert torch.equal(base, _reference(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_cpu_kernel_matches_torch_reference_across_row_chunks(
    dtype: torch.dtype, transposed: bool
) -> None:
    """Rows enough for several of the kernel's chunks (a last one short), listed or not."""
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 41, 49152 - 5
    step = kb._CHUNK_BYTES // (vocab * torch.tensor([], dtype=dtype).element_size())
    assert rows / step > 2 and rows % step, "the case spans several chunks, the last short"
    base = torch.randn(rows, vocab, generator=gen).to(dtype)
    if transposed:
        base = base.t().contiguous().t()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=gen)
    bitmask = bitmask.to(torch.int32)
    for indices in (None, torch.randperm(rows, generator=gen)[: rows - 3]):
        mask = bitmask if indices is None else bitmask[: len(indices)]
        got, want = base.clone(), base.clone()
        kb.apply_token_bitmask_inplace_cpu(got, mask, indices)
        kb.apply_token_bitmask_inplace_torch(want, mask, indices)
        assert torch.equal(got, want)
        assert not torch.equal(got, base)


@pytest.mark.parametrize("rows", [None, [2, 0, 1], [1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cpu_kernel_keeps_the_reference_bits_for_special_values(
    dtype: torch.dtype, rows: list[int] | None
) -> None:
    """NaN, infinities and -0.0, allowed and disallowed: the same bits as masked_fill."""
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.5])
    logits = special.repeat(3, 11)[:, :64].to(dtype)
    bitmask = torch.tensor([[0x5555_5555, -0x3333_3334]] * (3 if rows is None else len(rows)))
    bitmask = bitmask.to(torch.int32)
    indices = None if rows is None else torch.tensor(rows)
    expected, got = logits.clone(), logits.clone()
    kb.apply_token_bitmask_inplace_torch(expected, bitmask, indices)
    kb.apply_token_bitmask_inplace_cpu(got, bitmask, indices)
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16}[logits.element_size()]
    assert torch.equal(got.view(width), expected.view(width))
    assert not torch.equal(got.view(width), logits.view(width))


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(
    name: str, interpreted: dict[str, torch.Tensor]
) -> None:
    case = _cases()[name]
    got = interpreted[name]
    assert got.dtype == case["base"].dtype and got.shape == case["base"].shape
    assert torch.equal(got, _reference(case))


def test_interpreted_kernel_leaves_unlisted_rows_and_padding_alone(
    interpreted: dict[str, torch.Tensor],
) -> None:
    narrow = _cases()["vocab1000_narrow_int32_indices_f16"]
    got = interpreted["vocab1000_narrow_int32_indices_f16"]
    assert torch.equal(got[[3, 4]], narrow["base"][[3, 4]])
    assert bool(torch.isinf(got[[5, 1, 2, 0], 960:]).all())  # past the 30-word bitmask
    assert bool(torch.isfinite(got[5, :960]).all())  # the all-allowed bitmask row
    padded = _cases()["vocab1000_padded_rows_f32"]
    assert torch.equal(interpreted["vocab1000_padded_rows_f32"][:, 1000:], padded["base"][:, 1000:])


_BAD_ARGUMENTS = [
    (torch.zeros(64), torch.zeros(1, 2, dtype=torch.int32), None, "logits"),
    (torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), None, "logits"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), None, "bitmask"),
    (torch.zeros(2, 64), torch.zeros(4, dtype=torch.int32), None, "bitmask"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32, device="meta"), None, "bitmask"),
    (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), None, "rows"),
    (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0.0]), "indices"),
    (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([[0]]), "indices"),
    (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1]), "indices"),
    (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2]), "indices"),
    (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([-1]), "indices"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([1, 1]), "indices"),
    (torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), [0], "indices"),
]


@pytest.mark.parametrize(
    "apply",
    [
        kb.apply_token_bitmask_inplace_torch,
        kb.apply_token_bitmask_inplace_cpu,
        kb.apply_token_bitmask_inplace_triton,
    ],
)
@pytest.mark.parametrize(("logits", "bitmask", "indices", "named"), _BAD_ARGUMENTS)
def test_bad_arguments_raise_value_error_naming_them(
    apply: Any, logits: torch.Tensor, bitmask: torch.Tensor, indices: Any, named: str
) -> None:
    before = logits.clone()
    with pytest.raises(ValueError, match=named):
        apply(logits, bitmask, indices)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("block_size", [0, 16, 48, 1000])
def test_triton_block_size_must_be_a_power_of_two_of_at_least_32(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        kb.apply_token_bitmask_inplace_triton(
            torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int32), block_size=block_size
        )


@pytest.mark.skipif(kb._INTERPRETED, reason="this process runs Triton interpreted")
def test_triton_refuses_cpu_logits_outside_the_interpreter() -> None:
    logits = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="CUDA"):
        kb.apply_token_bitmask_inplace_triton(logits, torch.zeros(1, 2, dtype=torch.int32))
    assert torch.equal(logits, torch.zeros(1, 64))


def test_triton_without_triton_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kb, "HAS_TRITON", False)
    with pytest.raises(ImportError, match="triton"):
        kb.apply_token_bitmask_inplace_triton(
            torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int32)
        )


def test_unpack_bitmask_is_the_sampler_one_and_checks_vocab_size() -> None:
    assert sampler_bitmask.unpack_bitmask is kb.unpack_bitmask
    words = torch.tensor([[-(2**31), 5]], dtype=torch.int32)
    allowed = kb.unpack_bitmask(words, 70)
    assert allowed.nonzero()[:, 1].tolist() == [31, 32, 34]
    with pytest.raises(ValueError, match="vocab_size"):
        kb.unpack_bitmask(words, -1)


def _forbid_triton(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the sampler used the Triton kernel on CPU logits")


def test_sampler_uses_the_cpu_kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_bitmask, "apply_token_bitmask_inplace_triton", _forbid_triton)
    used: list[str] = []
    cpu_kernel = kb.apply_token_bitmask_inplace_cpu

    def spy(*args: Any) -> None:
        used.append("cpu")
        cpu_kernel(*args)

    monkeypatch.setattr(sampler_bitmask, "apply_token_bitmask_inplace_cpu", spy)
    case = _cases()["block32_indices_f32"]
    base = case["base"].clone()
    sampler_bitmask.apply_token_bitmask_(_view(base, case), case["bitmask"], case["indices"])
    assert torch.equal(base, _reference(case))
    assert used == ["cpu"]


_TRITON_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}


@pytest.mark.skipif(not kb.HAS_TRITON or kb._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("with_indices", [True, False])
@pytest.mark.parametrize("dtype", list(_TRITON_TYPES))
def test_kernel_compiles_for_hopper_without_shared_memory(
    dtype: torch.dtype,
    with_indices: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interpreter accepts things the compiler rejects: build the sm_90 cubin here (no GPU
    needed) and check the bit expansion's reshape costs no trip through shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    signature = {
        "logits_ptr": _TRITON_TYPES[dtype],
        "bitmask_ptr": "*i32",
        "indices_ptr": "*i64" if with_indices else "constexpr",
        "num_logit_rows": "i32",
        "vocab_size": "i32",
        "num_words": "i32",
        "logits_row_stride": "i32",
        "logits_col_stride": "constexpr",
        "bitmask_row_stride": "i32",
        "bitmask_col_stride": "constexpr",
        "BLOCK_SIZE": "constexpr",
    }
    constexprs = {"logits_col_stride": 1, "bitmask_col_stride": 1, "BLOCK_SIZE": 1024}
    if not with_indices:
        constexprs["indices_ptr"] = None
    source = ASTSource(
        fn=kb._apply_token_bitmask_kernel, signature=signature, constexprs=constexprs
    )
    kernel = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm["cubin"]
    assert kernel.metadata.shared == 0
    assert "convert_layout" not in kernel.asm["ttgir"]


_needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kb.HAS_TRITON), reason="needs CUDA and triton"
)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_kernel_matches_torch_reference(name: str) -> None:
    case = _cases()[name]
    expected = _reference(case, "cuda")
    base = case["base"].to("cuda", copy=True)
    indices = case["indices"]  # left on the host: the kernel copies them over
    kb.apply_token_bitmask_inplace_triton(
        _view(base, case), case["bitmask"].cuda(), indices, block_size=case["block_size"]
    )
    assert torch.equal(base, expected)
    assert torch.equal(base.cpu(), _reference(case))


@pytest.mark.gpu
@_needs_cuda
def test_cuda_sampler_dispatches_to_triton_and_skips_bad_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        kb.apply_token_bitmask_inplace_triton(*args, **kwargs)

    monkeypatch.setattr(sampler_bitmask, "apply_token_bitmask_inplace_triton", spy)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 151_936, generator=gen).cuda()
    bitmask = _random_bitmask(gen, 64, 4748).cuda()
    expected = logits.clone()
    kb.apply_token_bitmask_inplace_torch(expected, bitmask)
    sampler_bitmask.apply_token_bitmask_(logits, bitmask)
    assert calls == [1]
    assert torch.equal(logits, expected)
    # Device indices are not checked (no sync): an out-of-range row must be skipped, not written.
    logits = torch.randn(2, 1000, generator=gen).cuda()
    before = logits.clone()
    bitmask = torch.zeros((2, 32), dtype=torch.int32, device="cuda")
    kb.apply_token_bitmask_inplace_triton(logits, bitmask, torch.tensor([7, 1], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(logits[0], before[0])
    assert bool(torch.isinf(logits[1]).all())
