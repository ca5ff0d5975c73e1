"""The paged KV cache's storage: one (key, value) pair of block tensors per layer."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from baton.engine.models.config import ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> KVCache:
    """Per-layer (key, value) caches of shape ``[num_blocks, block_size, kv_heads, head_dim]``,
    zeros. On the CPU their pages are mapped by the OS on first write (`untouched_zeros`), so a
    cache sized for the worst case holds memory only for the blocks used so far."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)

    def zeros() -> torch.Tensor:
        if torch.device(device).type == "cpu":
            return untouched_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    return [(zeros(), zeros()) for _ in range(config.num_layers)]


def copy_kv_blocks(kv_caches: KVCache, copies: Sequence[tuple[int, int]]) -> None:
    """Copies whole blocks ``source -> destination`` in every layer's keys and values, in
    the order given, on the caches' device (queued on the current stream there). A block
    both written and read in one call reads what the earlier copies left."""
    for src, dst in copies:
        for keys, values in kv_caches:
            keys[dst].copy_(keys[src])
            values[dst].copy_(values[src])


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in fresh anonymous pages of its own (``mmap``), zero by the
    kernel's guarantee and resident only once written (``torch.zeros`` writes every byte, and
    ``calloc`` clears memory it reuses). The tensor keeps the mapping alive. Measured: an
    engine on a 1B-shape Q4_K_M GGUF with a 1 GiB cache held 2265 MiB (PSS) after loading with
    ``torch.zeros`` and 1244 with fresh pages (AMD EPYC Genoa)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
