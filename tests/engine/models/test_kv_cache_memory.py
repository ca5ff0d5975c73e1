"""The CPU KV cache holds memory only for what is written: ``allocate_kv_cache`` takes its zeros
from fresh anonymous pages (``untouched_zeros``, ``mmap``), resident only once written."""

from __future__ import annotations

import os

import pytest
import torch

from baton.engine.models.config import ModelConfig
from baton.engine.models.kv_cache import allocate_kv_cache, untouched_zeros

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux")


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untouched_zeros_are_zeros_that_take_memory_when_written(dtype: torch.dtype) -> None:
    before = _resident_mib()
    t = untouched_zeros((256, 1024, 256), dtype)  # 256 or 128 MiB
    mib = t.numel() * t.element_size() / 2**20
    assert t.shape == (256, 1024, 256) and t.dtype == dtype and t.is_contiguous()
    assert _resident_mib() - before < mib / 4
    assert not t[::17, ::31].any()  # reads see zeros (and map few pages)
    t[: t.shape[0] // 2].fill_(1)
    assert _resident_mib() - before > mib / 3
    assert int(t.sum()) == t.numel() // 2


def test_the_cpu_kv_cache_is_untouched_zeros() -> None:
    config = ModelConfig(
        architecture="llama",
        vocab_size=10,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    before = _resident_mib()
    caches = allocate_kv_cache(config, 4096, 16, torch.float32)  # 4 x 8 MiB
    assert len(caches) == 2 and all(k.shape == (4096, 16, 2, 16) for k, _ in caches)
    assert all(not k.any() and not v.any() for k, v in caches)
    assert _resident_mib() - before < 16
