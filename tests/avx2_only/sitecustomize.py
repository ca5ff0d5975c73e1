"""An AVX2-only CPU (AMD EPYC before Zen 4: no AVX-512, no AMX, no native bfloat16) for torch's
feature probes, in every Python process started with this folder on ``PYTHONPATH`` (engine
workers and compile workers included): ``torch.cpu``'s AVX-512 and AMX probes answer False.
With ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2`` torch's kernels and oneDNN
dispatch as on such a CPU too (``make test-avx2-only``), so that an AVX-512 machine can check
that the tests hold, or skip naming the feature, where the features are missing.

The probes are replaced when ``baton`` is first imported: torch is fully initialised by then,
and baton's own checks (``engine/config.py``'s ``auto_dtype``, ``models/attention.py``) have
not run yet.
"""

from __future__ import annotations

import builtins
from typing import Any

_PROBES = (
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
)
_real_import = builtins.__import__


def _absent() -> bool:
    return False


def _import(name: str, *args: Any, **kwargs: Any) -> Any:
    if name.startswith("baton"):
        builtins.__import__ = _real_import
        import torch.cpu

        for probe in _PROBES:
            if hasattr(torch.cpu, probe):
                setattr(torch.cpu, probe, _absent)
    return _real_import(name, *args, **kwargs)


builtins.__import__ = _import
