"""Tests of baton.kernels.paged_attention: the torch reference against a dense float64 oracle and
the engine's paged attention, the Triton kernel against the reference (under the Triton
interpreter, compiled for Hopper, and on CUDA), argument validation and the dispatch."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from baton.engine.models.attention import AttentionMetadata, paged_attention
from baton.kernels import paged_attention as kpa

if TYPE_CHECKING:
    from conftest import InterpreterRun

Case = dict[str, Any]

_ARGS = ("q", "key_cache", "value_cache", "block_tables", "seq_lens")

# The interpreter is chosen when triton.jit runs, i.e. when baton.kernels.paged_attention is
# imported, and this process may already have imported it without the variable: the interpreted
# runs happen in a fresh interpreter. It only loads the inputs, runs the kernel and saves what it
# returned; the comparisons happen here.
_INTERPRETER_RUNNER = """
import sys, time, torch
from baton.kernels import paged_attention as kpa
assert kpa._INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
cases = torch.load(sys.argv[1])
start = time.perf_counter()
results = {}
for name, case in cases.items():
    out = None if case["out"] is None else case["out"].clone()
    got = kpa.paged_decode_attention_triton(
        case["q"], case["key_cache"], case["value_cache"], case["block_tables"],
        case["seq_lens"], case["scale"], out, block_n=case["block_n"],
    )
    results[name] = (got, out)
print(f"kernel time {time.perf_counter() - start:.3f}s")
torch.save(results, sys.argv[2])
"""


def _case(
    seed: int,
    seq_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int = 64,
    block_size: int = 16,
    spare_columns: int = 0,
    dtype: torch.dtype = torch.float32,
    table_dtype: torch.dtype = torch.int64,
    lens_dtype: torch.dtype = torch.int64,
    unused_entry: int | None = None,
    strided: bool = False,
    with_out: bool = False,
    scale: float | None = None,
    block_n: int = 16,
) -> Case:
    """Random inputs: every sequence gets distinct shuffled cache blocks (plus spare ones no table
    uses), the table has `spare_columns` extra columns, and table entries past a sequence's
    length hold `unused_entry` when given. `strided` makes q a view with padded heads and the
    caches the key/value halves of one interleaved buffer."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    used = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    max_blocks = max(used, default=1) + spare_columns
    num_blocks = batch * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
    if unused_entry is not None:
        for b, count in enumerate(used):
            tables[b, count:] = unused_entry
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    if strided:
        q = torch.randn(batch, heads + 1, head_dim, generator=gen)[:, 1:]
        kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen)
        key_cache, value_cache = kv[:, 0], kv[:, 1]
    else:
        q = torch.randn(batch, heads, head_dim, generator=gen)
        key_cache = torch.randn(cache_shape, generator=gen)
        value_cache = torch.randn(cache_shape, generator=gen)
    out = None
    if with_out:
        out = torch.full((batch, heads + 2, head_dim), 7.0, dtype=dtype)[:, 2:]
    return {
        "q": q.to(dtype),
        "key_cache": key_cache.to(dtype),
        "value_cache": value_cache.to(dtype),
        "block_tables": tables.to(table_dtype),
        "seq_lens": torch.tensor(seq_lens, dtype=lens_dtype),
        "scale": 1.0 / math.sqrt(head_dim) if scale is None else scale,
        "out": out,
        "block_n": block_n,
    }


@functools.cache
def _cases() -> dict[str, Case]:
    """The shared inputs; callers must clone `out` before writing."""
    return {
        "mha_fp32": _case(1, [1, 20, 33], heads=2, kv_heads=2),
        "gqa_fp32_int32_padded_tables": _case(
            2,
            [17, 5, 48],
            heads=6,
            kv_heads=2,
            table_dtype=torch.int32,
            spare_columns=1,
            unused_entry=-1,
            block_n=32,
        ),
        "smollm2_bf16": _case(
            3, [1, 31, 70], heads=9, kv_heads=3, dtype=torch.bfloat16, block_n=64
        ),
        "fp16_head128_block8_int32_lens": _case(
            4,
            [9, 24],
            heads=4,
            kv_heads=1,
            head_dim=128,
            block_size=8,
            dtype=torch.float16,
            lens_dtype=torch.int32,
        ),
        "strided_views_out_block4": _case(
            5, [13, 3], heads=4, kv_heads=2, head_dim=32, block_size=4, strided=True, with_out=True
        ),
        "one_long_sequence_peaky": _case(6, [300], heads=3, kv_heads=1, head_dim=16, scale=1.5),
    }


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.float16: {"atol": 2e-3, "rtol": 2e-3},
        torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    }[dtype]


def _args(case: Case) -> tuple[Any, ...]:
    return (*(case[name] for name in _ARGS), case["scale"])


def _oracle(case: Case) -> torch.Tensor:
    """float64 [B, H, D]: each sequence's keys picked position by position, a dense softmax."""
    q = case["q"].double()
    key_cache, value_cache = case["key_cache"].double(), case["value_cache"].double()
    tables = case["block_tables"].tolist()
    block_size = key_cache.shape[1]
    group = q.shape[1] // key_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, length in enumerate(case["seq_lens"].tolist()):
        where = [(tables[b][p // block_size], p % block_size) for p in range(length)]
        keys = torch.stack([key_cache[block, offset] for block, offset in where])
        values = torch.stack([value_cache[block, offset] for block, offset in where])
        for h in range(q.shape[1]):
            weights = torch.softmax(keys[:, h // group] @ q[b, h] * case["scale"], dim=0)
            out[b, h] = weights @ values[:, h // group]
    return out


def _reference(case: Case) -> torch.Tensor:
    return kpa.paged_decode_attention_torch(*_args(case))


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("with_out", [False, True])
def test_reference_matches_dense_oracle(name: str, with_out: bool) -> None:
    case = _cases()[name]
    out = torch.full_like(case["q"], 7.0) if with_out else None
    got = kpa.paged_decode_attention_torch(*_args(case), out)
    assert got.dtype == case["q"].dtype and got.shape == case["q"].shape
    expected = _oracle(case)
    # The reference computes in float32 and rounds once to the output dtype.
    torch.testing.assert_close(got.double(), expected, **_tolerance(got.dtype))
    if with_out:
        assert got is out


def test_reference_attends_only_to_the_first_seq_len_keys() -> None:
    """Changing a cached key past a sequence's length, or in a block no table uses, changes
    nothing; changing one inside it does."""
    case = _cases()["gqa_fp32_int32_padded_tables"]
    before = _reference(case)
    key_cache = case["key_cache"].clone()
    table = case["block_tables"][1].long()
    key_cache[table[0], 5:] += 100.0  # sequence 1 has length 5: offsets 5.. are past it
    spare = sorted(set(range(key_cache.shape[0])) - set(case["block_tables"].flatten().tolist()))
    key_cache[spare] += 100.0
    after = _reference({**case, "key_cache": key_cache})
    assert torch.equal(after, before)
    key_cache[table[0], 4] += 100.0
    changed = _reference({**case, "key_cache": key_cache})
    assert not torch.allclose(changed[1], before[1])
    assert torch.equal(changed[[0, 2]], before[[0, 2]])


@pytest.mark.parametrize("name", ["mha_fp32", "strided_views_out_block4", "smollm2_bf16"])
def test_reference_matches_engine_paged_attention_on_pure_decode(name: str) -> None:
    """The engine writes the new token's key and value, then attends: hand it the ones already
    at each sequence's last position, so the cache ends up as it was."""
    case = _cases()[name]
    key_cache = case["key_cache"].contiguous()
    value_cache = case["value_cache"].contiguous()
    seq_lens = case["seq_lens"].long()
    meta = AttentionMetadata.build(
        torch.ones_like(seq_lens), seq_lens, case["block_tables"].long(), key_cache.shape[1]
    )
    num_kv_heads, head_dim = key_cache.shape[2:]
    new_k = key_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping].clone()
    new_v = value_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping].clone()
    k_before, v_before = key_cache.clone(), value_cache.clone()
    q = case["q"].contiguous()
    expected = paged_attention(q, new_k, new_v, key_cache, value_cache, meta, case["scale"])
    assert torch.equal(key_cache, k_before) and torch.equal(value_cache, v_before)
    got = kpa.paged_decode_attention_torch(
        q, key_cache, value_cache, case["block_tables"], case["seq_lens"], case["scale"]
    )
    # The engine attends in the cache dtype, the reference in float32.
    torch.testing.assert_close(got, expected, **_tolerance(q.dtype))


def test_reference_of_an_empty_batch_is_empty() -> None:
    q = torch.zeros(0, 4, 16)
    cache = torch.zeros(3, 4, 2, 16)
    got = kpa.paged_decode_attention_torch(
        q, cache, cache, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 1
    )
    assert got.shape == (0, 4, 16)


_HOST_READS = ("item", "tolist", "nonzero", "numpy", "__bool__", "__int__", "__index__", "__iter__")


def _forbid_host_read(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the torch reference read a tensor value on the host")


def test_reference_reads_no_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a host read is a sync; on the CPU, catch the Python-level ones that would be."""
    case = _cases()["gqa_fp32_int32_padded_tables"]
    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, _forbid_host_read)
    got = _reference(case)
    monkeypatch.undo()
    torch.testing.assert_close(got.double(), _oracle(case), **_tolerance(torch.float32))


def _bad_values_case() -> Case:
    """Three sequences whose values the kernel does not trust: a length past the table's
    capacity, a length of 0 and a used block id outside the cache."""
    case = _case(7, [40, 1, 20], heads=2, kv_heads=1, head_dim=16, block_n=16)
    case["seq_lens"] = torch.tensor([500, 0, 20])
    case["block_tables"][2, 0] = case["key_cache"].shape[0] + 5
    return case


def _rows(case: Case, row: int, *, seq_len: int) -> Case:
    """Sequence `row` of `case` alone, attending to `seq_len` keys."""
    picked = {name: case[name][row : row + 1] for name in ("q", "block_tables")}
    return {**case, **picked, "seq_lens": torch.tensor([seq_len])}


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory, run_interpreted: InterpreterRun
) -> dict[str, tuple[Any, Any]]:
    """name -> (returned tensor, out) after the Triton kernel ran on the cases under
    TRITON_INTERPRET=1; the untrusted-values case is named "bad_values", the empty batch
    "empty"."""
    folder = tmp_path_factory.mktemp("paged_attention_interpreter")
    cases = dict(_cases())
    cases["bad_values"] = _bad_values_case()
    cases["empty"] = _case(8, [], heads=2, kv_heads=1, head_dim=16)
    return run_interpreted(_INTERPRETER_RUNNER, cases, folder)


@pytest.mark.parametrize("name", list(_cases()))
def test_interpreted_kernel_matches_torch_reference(
    name: str, interpreted: dict[str, tuple[Any, Any]]
) -> None:
    case = _cases()[name]
    got, out = interpreted[name]
    assert got.dtype == case["q"].dtype and got.shape == case["q"].shape
    tolerance = _tolerance(got.dtype)
    torch.testing.assert_close(got, _reference(case), **tolerance)
    torch.testing.assert_close(got.double(), _oracle(case), **tolerance)
    if case["out"] is not None:
        assert torch.equal(out, got)


def test_interpreted_kernel_never_reads_out_of_bounds(
    interpreted: dict[str, tuple[Any, Any]],
) -> None:
    got, _ = interpreted["bad_values"]
    case = _bad_values_case()
    capacity = case["block_tables"].shape[1] * case["key_cache"].shape[1]
    clamped = _oracle(_rows(case, 0, seq_len=capacity))
    torch.testing.assert_close(got[:1].double(), clamped, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    # Sequence 2's first block is outside the cache: only its second block's 4 keys count.
    second_block = _rows(case, 2, seq_len=4)
    second_block["block_tables"] = second_block["block_tables"][:, 1:]
    torch.testing.assert_close(got[2:].double(), _oracle(second_block), atol=1e-5, rtol=1e-5)
    assert interpreted["empty"][0].shape == (0, 2, 16)


def _ok() -> Case:
    return {
        "q": torch.zeros(2, 4, 16),
        "key_cache": torch.zeros(5, 4, 2, 16),
        "value_cache": torch.zeros(5, 4, 2, 16),
        "block_tables": torch.zeros(2, 3, dtype=torch.int64),
        "seq_lens": torch.ones(2, dtype=torch.int64),
        "scale": 0.25,
        "out": None,
    }


_BAD = [
    ("q", torch.zeros(2, 4, 16, dtype=torch.float64), "q"),
    ("q", torch.zeros(2, 4, 16, dtype=torch.int64), "q"),
    ("q", torch.zeros(8, 16), "q"),
    ("q", [[0.0] * 16] * 8, "q"),
    ("key_cache", torch.zeros(5, 4, 2, 16, dtype=torch.bfloat16), "key_cache"),
    ("key_cache", torch.zeros(5, 4, 32), "key_cache"),
    ("key_cache", torch.zeros(5, 4, 2, 32), "key_cache"),
    ("key_cache", torch.zeros(5, 4, 3, 16), "key_cache"),
    ("value_cache", torch.zeros(5, 4, 2, 16, dtype=torch.float16), "value_cache"),
    ("value_cache", torch.zeros(6, 4, 2, 16), "value_cache"),
    ("value_cache", torch.zeros(5, 4, 2, 16, device="meta"), "value_cache"),
    ("block_tables", torch.zeros(2, 3), "block_tables"),
    ("block_tables", torch.zeros(2, 3, dtype=torch.int16), "block_tables"),
    ("block_tables", torch.zeros(3, 3, dtype=torch.int64), "block_tables"),
    ("block_tables", torch.zeros(2, 0, dtype=torch.int64), "block_tables"),
    ("block_tables", torch.zeros(6, dtype=torch.int64), "block_tables"),
    ("seq_lens", torch.ones(2, 1, dtype=torch.int64), "seq_lens"),
    ("seq_lens", torch.ones(3, dtype=torch.int32), "seq_lens"),
    ("seq_lens", torch.ones(2), "seq_lens"),
    ("seq_lens", torch.ones(2, dtype=torch.int64, device="meta"), "seq_lens"),
    ("scale", float("nan"), "scale"),
    ("scale", torch.tensor(0.25), "scale"),
    ("scale", True, "scale"),
    ("out", torch.zeros(2, 4, 16, dtype=torch.float16), "out"),
    ("out", torch.zeros(2, 4, 8), "out"),
    ("out", torch.zeros(2, 4, 16, device="meta"), "out"),
]


@pytest.mark.parametrize(
    "attend",
    [
        kpa.paged_decode_attention_torch,
        kpa.paged_decode_attention_triton,
        kpa.paged_decode_attention,
    ],
)
@pytest.mark.parametrize(("argument", "value", "named"), _BAD)
def test_bad_arguments_raise_value_error_naming_them(
    attend: Any, argument: str, value: Any, named: str
) -> None:
    if attend is kpa.paged_decode_attention_triton and not kpa.HAS_TRITON:
        pytest.skip("triton is not installed")
    args = {**_ok(), argument: value}
    with pytest.raises(ValueError, match=f"^{named} "):
        attend(*_args(args), args["out"])


@pytest.mark.skipif(not kpa.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_n", [0, 8, 48, 1000])
def test_triton_block_n_must_be_a_power_of_two_of_at_least_16(block_n: int) -> None:
    with pytest.raises(ValueError, match="block_n"):
        kpa.paged_decode_attention_triton(*_args(_ok()), block_n=block_n)


@pytest.mark.parametrize("head_dim", [8, 48, 512])
def test_triton_refuses_head_dims_the_reference_accepts(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(9)
    case = {
        **_case(9, [3, 6], heads=2, kv_heads=1, head_dim=16),
        "q": torch.randn(2, 2, head_dim, generator=gen),
        "key_cache": torch.randn(4, 16, 1, head_dim, generator=gen),
        "value_cache": torch.randn(4, 16, 1, head_dim, generator=gen),
        "block_tables": torch.tensor([[0], [2]]),
    }
    got = kpa.paged_decode_attention(*_args(case))
    torch.testing.assert_close(got.double(), _oracle(case), atol=1e-5, rtol=1e-5)
    if kpa.HAS_TRITON:
        with pytest.raises(ValueError, match="^head dim .* power of two"):
            kpa.paged_decode_attention_triton(*_args(case))


@pytest.mark.skipif(not kpa.HAS_TRITON or kpa._INTERPRETED, reason="needs triton, compiled")
def test_triton_refuses_cpu_tensors_outside_the_interpreter() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        kpa.paged_decode_attention_triton(*_args(_ok()))


def test_triton_without_triton_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kpa, "HAS_TRITON", False)
    with pytest.raises(ImportError, match="triton"):
        kpa.paged_decode_attention_triton(*_args(_ok()))


def _forbid_triton(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the dispatcher used the Triton kernel on CPU tensors")


def test_dispatcher_uses_the_torch_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kpa, "paged_decode_attention_triton", _forbid_triton)
    case = _cases()["strided_views_out_block4"]
    out = case["out"].clone()
    got = kpa.paged_decode_attention(*_args(case), out)
    assert got is out
    torch.testing.assert_close(got.double(), _oracle(case), atol=1e-5, rtol=1e-5)


_TRITON_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}


@pytest.mark.skipif(not kpa.HAS_TRITON or kpa._INTERPRETED, reason="needs the Triton compiler")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(
    ("dtype", "table", "group", "head_dim", "block_n"),
    [
        (torch.bfloat16, "*i64", 3, 64, 64),
        (torch.float16, "*i32", 4, 128, 32),
        (torch.float32, "*i64", 1, 64, 64),
    ],
    ids=["smollm2_bf16", "fp16_head128_int32", "mha_fp32"],
)
def test_kernel_compiles_for_hopper(
    dtype: torch.dtype,
    table: str,
    group: int,
    head_dim: int,
    block_n: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interpreter accepts things the compiler rejects: build the sm_90 cubin here (no GPU
    needed), with the runtime arguments as Triton types them for a launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = kpa._paged_decode_kernel
    constexprs: dict[str, Any] = {
        "DOT_DTYPE": kpa._dot_dtype(dtype),
        "GROUP": group,
        "GROUP_PAD": max(16, 1 << (group - 1).bit_length()),
        "HEAD_DIM": head_dim,
        "BLOCK_N": block_n,
    }
    pointers = {
        "q_ptr": _TRITON_TYPES[dtype],
        "k_cache_ptr": _TRITON_TYPES[dtype],
        "v_cache_ptr": _TRITON_TYPES[dtype],
        "block_tables_ptr": table,
        "seq_lens_ptr": "*i64",
        "out_ptr": _TRITON_TYPES[dtype],
        "qk_scale": "fp32",
    }
    signature = {
        name: "constexpr" if name in constexprs else pointers.get(name, "i32")
        for name in fn.arg_names
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]


_needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kpa.HAS_TRITON), reason="needs CUDA and triton"
)


def _to_cuda(case: Case) -> Case:
    return {
        name: value.cuda() if isinstance(value, torch.Tensor) else value
        for name, value in case.items()
    }


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_kernel_matches_torch_reference(name: str) -> None:
    case = _to_cuda(_cases()[name])
    out = None if case["out"] is None else case["out"].clone()
    torch.cuda.set_sync_debug_mode("error")  # neither path may read a value on the host
    try:
        expected = kpa.paged_decode_attention_torch(*_args(case))
        got = kpa.paged_decode_attention_triton(*_args(case), out, block_n=case["block_n"])
        dispatched = kpa.paged_decode_attention(*_args(case))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tolerance = _tolerance(got.dtype)
    assert got.is_cuda and got.dtype == case["q"].dtype
    torch.testing.assert_close(got, expected, **tolerance)
    torch.testing.assert_close(dispatched, expected, **tolerance)
    torch.testing.assert_close(got.double().cpu(), _oracle(_cases()[name]), **tolerance)
    if out is not None:
        assert got is out


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_cuda_kernel_matches_reference_on_long_smollm2_batches(
    dtype: torch.dtype, block_n: int
) -> None:
    case = _to_cuda(
        _case(10, [4096, 1, 17, 1000, 2049], heads=9, kv_heads=3, dtype=dtype, block_n=block_n)
    )
    expected = kpa.paged_decode_attention_torch(*_args(case))
    got = kpa.paged_decode_attention_triton(*_args(case), block_n=block_n)
    torch.testing.assert_close(got, expected, **_tolerance(dtype))


@pytest.mark.gpu
@_needs_cuda
def test_cuda_kernel_never_reads_out_of_bounds() -> None:
    case = _bad_values_case()
    got = kpa.paged_decode_attention_triton(*_args(_to_cuda(case))).cpu()
    assert torch.isfinite(got).all()
    assert torch.equal(got[1], torch.zeros_like(got[1]))
