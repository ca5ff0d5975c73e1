"""RMSNorm (with its residual add), RoPE and paged decode attention on the CPU in one C++ call
each (``csrc/cpu_ops.cpp``): what ``rms_norm``, ``rope`` and the model's decode steps run for
CPU tensors when the extension builds. Their references are ``rms_norm_torch``, ``rope_torch``
and ``paged_decode_attention_torch``: RoPE gives their bits, RMSNorm all but the mean's
summation order, attention its float32 value in another order (each one fixed, so a row's
result does not depend on the other rows or on the thread count).

Why: a small model's batch-1 decode step on the CPU is bound by dispatching torch ops, and the
torch forms are eight to ten ops per call (measured on the default model, AMD EPYC, 2 threads:
see the README's CPU section).
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

from baton.kernels.cpp_build import load_extension, runnable_isas

logger = logging.getLogger(__name__)

_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
ENABLED: bool = os.environ.get("BATON_CPU_OPS", "1") != "0"
"""Whether rms_norm and rope use this module on CPU tensors; ``BATON_CPU_OPS=0`` turns it off
(the torch ops then run), for side-by-side measurements."""
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def extension() -> ModuleType | None:
    """The compiled extension, or None when it cannot be built here (logged once; the torch ops
    then run instead). Compiles it on the first call."""
    try:
        return load_extension("baton_cpu_ops", "cpu_ops.cpp", _CFLAGS)
    except (RuntimeError, OSError, ImportError) as exc:
        logger.warning("the CPU ops extension did not build (%s); using torch ops", exc)
        return None


def rms_norm_fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether `rms_norm_cpu` takes these tensors (CPU, float32/bfloat16, contiguous rows)."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in _DTYPES
        and x.stride(-1) == 1
        and weight.dtype == x.dtype
        and weight.dim() == 1
        and weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
        and extension() is not None
    )


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm_torch(x, weight, eps, residual)`` in one call; see the module docstring.

    Raises:
        RuntimeError: tensors `rms_norm_fits` refuses, or no extension.
    """
    ext = extension()
    if ext is None:
        raise RuntimeError("the CPU ops extension is not available")
    out, summed = ext.rms_norm(x, weight, float(eps), residual)
    return out, (summed if residual is not None else None)


def rope_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope_cpu` takes these tensors (CPU, one float32/bfloat16 dtype, contiguous
    heads and angle rows)."""
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k.dtype == q.dtype == cos.dtype == sin.dtype
        and q.dim() == 3
        and k.dim() == 3
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
        and extension() is not None
    )


def rope_cpu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_torch(q, k, cos, sin)``'s bits in two calls; see the module docstring.

    Raises:
        RuntimeError: tensors `rope_fits` refuses, or no extension.
    """
    ext = extension()
    if ext is None:
        raise RuntimeError("the CPU ops extension is not available")
    return ext.rope(q, cos, sin), ext.rope(k, cos, sin)


@functools.cache
def decode_isas() -> tuple[str, ...]:
    """The instruction sets `paged_decode_cpu` runs here, narrowest first: "avx2" (AVX2 and
    FMA), "avx512" (and AVX-512 F/BW/VL, where torch's own probe agrees); none without the
    extension or AVX2. Every one gives the same bits."""
    ext = extension()
    if ext is None:
        return ()
    return runnable_isas(ext, DECODE_ISAS)


DECODE_ISAS = ("avx2", "avx512")
"""`paged_decode_cpu`'s instruction sets by code."""


def decode_isa_code(isa: str | None = None, caller: str = "paged attention") -> int:
    """The code of ``isa`` (one of `decode_isas`; None: the widest) that the attention calls
    take; the fused decode layer passes it on.

    Raises:
        RuntimeError: no extension or no AVX2 here (naming ``caller``).
        ValueError: ``isa`` is not one of `decode_isas`.
    """
    isas = decode_isas()
    if not isas:
        raise RuntimeError(f"{caller} needs the CPU ops extension and AVX2 with FMA")
    if isa is None:
        isa = isas[-1]
    elif isa not in isas:
        raise ValueError(f"isa {isa!r} is not available here; available: {', '.join(isas)}")
    return DECODE_ISAS.index(isa)


def paged_decode_fits(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_cpu` takes these tensors (CPU with AVX2 and FMA, one
    float32/bfloat16 dtype, q ``[B, H, D]`` with D a multiple of 16, contiguous caches
    ``[N, block_size, KVH, D]``)."""
    return (
        ENABLED
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and key_cache.dtype == value_cache.dtype == q.dtype
        and q.dim() == 3
        and q.shape[2] % 16 == 0
        and key_cache.dim() == 4
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and bool(decode_isas())
    )


def paged_decode_cpu(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    isa: str | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention_torch``'s value (``kernels/paged_attention.py``: one query
    token per sequence over its blocks) in one C++ call (``csrc/decode_attention.h``), float32
    math in one fixed order per (sequence, head): a row's result does not depend on the other
    sequences, their lengths, the thread count or the instruction set (``isa``, one of
    `decode_isas`; default the widest). Reads the lengths and block ids on the host (CPU
    tensors). ``window`` W: a sequence of length L attends to positions [L - W, L) only (the
    blocks before are not read); ``softcap`` c: scores become ``c * tanh(score / c)`` before
    the softmax (Gemma 2); ``sinks`` ``[heads]``: one logit per query head that joins the
    softmax as a key without a value (gpt-oss).

    Raises:
        RuntimeError: tensors `paged_decode_fits` refuses, a length outside [1, the table's
            capacity], a block id the window reads outside the cache, a window below 1, a
            softcap not above 0, sinks not one per query head, no extension or no AVX2.
        ValueError: ``isa`` is not one of `decode_isas`.
    """
    code = decode_isa_code(isa, "paged_decode_cpu")
    return extension().paged_decode(
        q.contiguous(),
        key_cache,
        value_cache,
        block_tables.long(),
        seq_lens.long(),
        float(scale),
        code,
        *_mods(window, softcap, sinks),
    )


def _mods(
    window: int | None, softcap: float | None, sinks: torch.Tensor | None
) -> tuple[int, float, torch.Tensor | None]:
    """The C++ calls' (window, softcap, sinks): 0 for none; sinks as float32. A window of 0
    or less, or a cap of 0 or less, is refused there, not taken as none."""
    return (
        -1 if window is not None and window <= 0 else (window or 0),
        -1.0 if softcap is not None and softcap <= 0 else (softcap or 0.0),
        None if sinks is None else sinks.detach().float().contiguous(),
    )


def paged_prefill_cpu(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seqs: torch.Tensor,
    token_lens: torch.Tensor,
    scale: float,
    isa: str | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of prefill (or mixed) tokens ``q`` ``[T, H, D]`` over their sequences'
    blocks: token i reads row ``token_seqs[i]`` of ``block_tables`` and positions
    ``[0, token_lens[i])`` (causal), each token computed exactly as `paged_decode_cpu`
    computes a decode step of that length with the same ``window``, ``softcap`` and
    ``sinks`` (the same bits: a token's result does not depend on how its prompt was
    chunked, on the other tokens or on the thread count). Takes what `paged_decode_fits`
    takes.

    Raises:
        RuntimeError: tensors `paged_decode_fits` refuses, a sequence index or length out of
            range, a used block id outside the cache, no extension or no AVX2.
        ValueError: ``isa`` is not one of `decode_isas`.
    """
    code = decode_isa_code(isa, "paged_prefill_cpu")
    return extension().paged_prefill(
        q.contiguous(),
        key_cache,
        value_cache,
        block_tables.long(),
        token_seqs.long(),
        token_lens.long(),
        float(scale),
        code,
        *_mods(window, softcap, sinks),
    )


def read_words(t: torch.Tensor) -> int:
    """The XOR of a contiguous uint8 CPU tensor's 8-byte words (little-endian; the last
    ``numel % 8`` bytes left out), read by torch's threads in contiguous shares: a streaming
    read for measuring memory bandwidth (``bench/compute/memory_bandwidth.py``).

    Raises:
        RuntimeError: no extension, or not a contiguous uint8 CPU tensor.
    """
    ext = extension()
    if ext is None:
        raise RuntimeError("the CPU ops extension is not available")
    return int(ext.read_words(t))
