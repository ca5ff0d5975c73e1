"""A GGUF file's block-quantised linear weights kept in their blocks (``quantization="gguf"``).

Each linear weight of a type the kernel multiplies (``kernels/quant_formats.FORMATS``) is
taken as raw block bytes from the memory map (``[rows, row_bytes]``), its q/k rows put back in
Hugging Face order (llama.cpp's permutation moves whole rows), the parts of a fused projection
concatenated row-wise when they share a type, and repacked for the kernel: never a float copy.
So is the embedding (an untied one under its own name; a tied one is the LM head's blocks),
which the model looks up in its blocks. Everything else (norms, biases, linears of other
types, an embedding of another type) is left to the dense loader.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from baton.engine.loader.errors import ModelLoadError
from baton.engine.loader.gguf_names import EXPERTS_MARK, qk_heads, unpermute_qk
from baton.engine.loader.gguf_reader import GGUFTensor
from baton.engine.models.config import ModelConfig
from baton.engine.models.gguf_linear import (
    EMBEDDING,
    EXPERT_PROJECTIONS,
    LM_HEAD,
    PROJECTIONS,
    type_counts,
)
from baton.kernels.quant_formats import FORMATS, QuantWeight, repack
from baton.kernels.quant_linear import available_isas, repack_native

logger = logging.getLogger(__name__)

# Unquantised types: a linear stored so is loaded dense as it always was, without a warning.
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def _raw_rows(path: Path, tensor: GGUFTensor, config: ModelConfig) -> np.ndarray:
    """``tensor``'s block bytes ``[rows, row_bytes]`` (a view of the map), q/k rows unpermuted
    (then a copy)."""
    raw = tensor.data
    rows = tensor.shape[-1]  # GGUF lists dims fastest-first
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[0] != rows:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) is not a 2-D weight of "
            f"whole blocks per row: its data is {raw.dtype} {raw.shape}"
        )
    heads = qk_heads(path, config, tensor.name, rows)
    return raw if heads is None else unpermute_qk(raw, heads)


def _repack(path: Path, raw: np.ndarray, kind: str, name: str, huge_pages: bool) -> QuantWeight:
    # The C++ repack (the same bytes) where the kernel runs: numpy's took 8 of the 1B-shape
    # Q4_K_M file's 13.6 s load.
    try:
        return repack_native(raw, kind, huge_pages) if available_isas() else repack(raw, kind)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: cannot repack {name} ({kind}): {exc}") from exc


def _dense_bytes(tensors: list[GGUFTensor], dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return sum(int(np.prod(t.shape)) * element for t in tensors)


def _keep_group(
    path: Path, config: ModelConfig, name: str, parts: dict[str, GGUFTensor], huge_pages: bool
) -> dict[str, QuantWeight]:
    """A projection's parts (HF name -> tensor, in row order) as kernel weights: one fused
    weight ``name`` when they share a type, else one per part."""
    kinds = {t.tensor_type.name for t in parts.values()}
    raws = {hf: _raw_rows(path, t, config) for hf, t in parts.items()}
    if len(kinds) == 1:
        raw = next(iter(raws.values())) if len(raws) == 1 else np.concatenate(list(raws.values()))
        kept = {name: _repack(path, raw, kinds.pop(), name, huge_pages)}
    else:
        kept = {
            hf: _repack(path, raws[hf], t.tensor_type.name, hf, huge_pages)
            for hf, t in parts.items()
        }
    for t in parts.values():  # copied: the file's pages need not stay resident beside them
        t.release_pages()
    return kept


def keep_quantized(
    path: Path,
    tensors: Mapping[str, GGUFTensor],
    config: ModelConfig,
    dtype: torch.dtype,
    huge_pages: bool = True,
) -> tuple[dict[str, QuantWeight], frozenset[str]]:
    """The linear weights of ``tensors`` (by Hugging Face name) kept quantised, named as
    ``models/gguf_linear.py`` says, and the Hugging Face names the dense loader must skip.

    A projection is kept when all its parts have a kernel type; one with a part of another
    quantised type is dequantised whole (logged as a warning naming the type and the memory it
    takes in ``dtype``). The LM head (``output.weight``, or the embedding when tied) is kept
    when its type has a kernel, and so is an untied embedding (``EMBEDDING``); the model looks
    up a kept embedding's rows in its blocks (a tied one's in the head's), so it is not loaded
    dense. A mixture-of-experts model's routed experts are kept per expert where their types
    have a kernel (``_keep_experts``); other expert tensors (and Qwen2-MoE's shared expert)
    are dequantised, logged as a warning with the memory they take. Logs what was kept.
    Missing tensors are left for the checkpoint's check to report. ``huge_pages``: the
    repacked weights in memory advised for huge pages (``kernels/huge_pages.py``), for a
    process that multiplies them; else plain memory.

    Raises:
        ModelLoadError: no linear weight has a kernel type (naming the types found), or a
            tensor's blocks cannot be repacked.
    """
    quantized: dict[str, QuantWeight] = {}
    skip: set[str] = set()
    fallback: list[tuple[str, list[GGUFTensor]]] = []
    groups = [
        (f"model.layers.{i}.{fused}", f"model.layers.{i}.", parts)
        for i in range(config.num_layers)
        for fused, parts in PROJECTIONS
    ]
    for name, prefix, parts in groups:
        group = {prefix + p: tensors[prefix + p] for p in parts if prefix + p in tensors}
        if len(group) != len(parts):
            continue  # reported as missing by the checkpoint's check
        kinds = {t.tensor_type.name for t in group.values()}
        if kinds <= FORMATS.keys():
            quantized.update(_keep_group(path, config, name, group, huge_pages))
            skip.update(group)
        elif not kinds <= _FLOAT_TYPES:
            fallback.append((name, list(group.values())))
    kept, skipped, refused = _keep_ends(path, tensors, config, huge_pages)
    quantized.update(kept)
    skip.update(skipped)
    fallback.extend(refused)
    if not quantized:
        raise _no_kernel_types(path, tensors, groups)
    for layer in range(config.num_layers):
        if config.moe_layer(layer):
            kept, stacked = _keep_experts(path, tensors, layer, config.num_experts, huge_pages)
            quantized.update(kept)
            skip.update(stacked)
    dense_embedding = None if EMBEDDING in skip else tensors.get(EMBEDDING)
    _log(path, quantized, fallback, dense_embedding, dtype)
    _warn_dense_experts(path, tensors, skip, dtype)
    return quantized, frozenset(skip)


def _keep_ends(
    path: Path, tensors: Mapping[str, GGUFTensor], config: ModelConfig, huge_pages: bool
) -> tuple[dict[str, QuantWeight], set[str], list[tuple[str, list[GGUFTensor]]]]:
    """The LM head (or the tied embedding that serves as one) and an untied embedding, kept
    where their types have a kernel: the kept weights, the names not to load dense, and what
    falls back to dense (for the log)."""
    kept: dict[str, QuantWeight] = {}
    skip: set[str] = set()
    fallback: list[tuple[str, list[GGUFTensor]]] = []
    head_name = LM_HEAD if LM_HEAD in tensors else EMBEDDING
    head = tensors.get(head_name)
    if head is not None and head.tensor_type.name in FORMATS:
        kept[LM_HEAD] = _repack(
            path, _raw_rows(path, head, config), head.tensor_type.name, LM_HEAD, huge_pages
        )
        head.release_pages()
        # the model looks up a tied embedding's rows in the head's blocks: not loaded dense
        skip.add(head_name)
    elif head is not None and head.tensor_type.name not in _FLOAT_TYPES:
        fallback.append((f"the LM head ({head.name})", [head]))
    embedding = tensors.get(EMBEDDING)
    if head_name == LM_HEAD and embedding is not None and embedding.tensor_type.name in FORMATS:
        kept[EMBEDDING] = _repack(
            path,
            _raw_rows(path, embedding, config),
            embedding.tensor_type.name,
            EMBEDDING,
            huge_pages,
        )
        embedding.release_pages()
        skip.add(EMBEDDING)
    return kept, skip, fallback


def _no_kernel_types(
    path: Path, tensors: Mapping[str, GGUFTensor], groups: list[tuple[str, str, tuple[str, ...]]]
) -> ModelLoadError:
    """The error for a file none of whose linear weights has a kernel type, naming its types."""
    linear_types = sorted(
        {
            tensors[pre + p].tensor_type.name
            for _, pre, ps in groups
            for p in ps
            if pre + p in tensors
        }
    )
    return ModelLoadError(
        f"{path}: quantization='gguf' keeps linear weights of the types "
        f"{', '.join(FORMATS)} quantised, but this file's linear weights are "
        f"{', '.join(linear_types) or 'absent'}; use quantization=None to load it dequantised"
    )


def _warn_dense_experts(
    path: Path, tensors: Mapping[str, GGUFTensor], skip: set[str], dtype: torch.dtype
) -> None:
    """Logs the expert tensors no kernel multiplies (dequantised), with the memory they take."""
    dense_experts = [
        t
        for name, t in tensors.items()
        if (".mlp.experts." in name or ".mlp.shared_expert" in name)
        and name not in skip
        and t.tensor_type.name not in _FLOAT_TYPES
    ]
    if dense_experts:
        logger.warning(
            "%s: %d expert tensors have types the quantised kernel does not multiply (%s); "
            "dequantised to %s: %.1f MiB",
            path,
            len(dense_experts),
            ", ".join(sorted({t.tensor_type.name for t in dense_experts})),
            str(dtype).removeprefix("torch."),
            _dense_bytes(dense_experts, dtype) / 2**20,
        )


def _keep_experts(
    path: Path,
    tensors: Mapping[str, GGUFTensor],
    layer: int,
    num_experts: int,
    huge_pages: bool,
) -> tuple[dict[str, QuantWeight], set[str]]:
    """Layer ``layer``'s routed experts as kernel weights, one ``gate_up`` (gate | up, or the
    two parts where their types differ) and one ``down`` per expert, cut from llama.cpp's
    stacked ``[experts, rows, row_bytes]`` tensors; and the stacked tensors' names for the
    dense loader to skip. Nothing when a projection has no kernel type (then they are
    dequantised, as ``keep_quantized`` logs).

    Raises:
        ModelLoadError: a stacked tensor that is not one block row set per expert.
    """
    prefix = f"model.layers.{layer}.mlp.experts.{EXPERTS_MARK}."
    leaves = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    found = [tensors.get(prefix + leaf) for leaf in leaves]
    stacked = {leaf: t for leaf, t in zip(leaves, found, strict=True) if t is not None}
    if len(stacked) != len(leaves) or any(
        t.tensor_type.name not in FORMATS for t in stacked.values()
    ):
        return {}, set()
    for tensor in stacked.values():
        if tensor.data.ndim != 3 or tensor.data.shape[0] != num_experts:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) holds "
                f"{tuple(tensor.data.shape)} bytes, expected [{num_experts} experts, rows, "
                "row bytes]"
            )
    kept: dict[str, QuantWeight] = {}
    for e in range(num_experts):
        expert = f"model.layers.{layer}.mlp.experts.{e}."
        for fused, parts in EXPERT_PROJECTIONS:
            kinds = {stacked[part].tensor_type.name for part in parts}
            raws = [np.asarray(stacked[part].data[e]) for part in parts]
            if len(kinds) == 1:
                raw = raws[0] if len(raws) == 1 else np.concatenate(raws)
                kept[expert + fused] = _repack(path, raw, kinds.pop(), expert + fused, huge_pages)
                continue
            for part, raw in zip(parts, raws, strict=True):
                kind = stacked[part].tensor_type.name
                kept[expert + part] = _repack(path, raw, kind, expert + part, huge_pages)
    for tensor in stacked.values():
        tensor.release_pages()
    return kept, {prefix + leaf for leaf in leaves}


def _log(
    path: Path,
    quantized: dict[str, QuantWeight],
    fallback: list[tuple[str, list[GGUFTensor]]],
    embedding: GGUFTensor | None,
    dtype: torch.dtype,
) -> None:
    dtype_name = str(dtype).removeprefix("torch.")
    for name, group in fallback:
        kinds = ", ".join(sorted({t.tensor_type.name for t in group}))
        logger.warning(
            "%s: %s has type %s, which the quantised kernel does not multiply (it takes %s); "
            "dequantised to %s instead: %.1f MiB",
            path,
            name,
            kinds,
            ", ".join(FORMATS),
            dtype_name,
            _dense_bytes(group, dtype) / 2**20,
        )
    counts = ", ".join(f"{k} x{v}" for k, v in type_counts(quantized).items())
    lookups = (
        "looked up in its blocks"
        if embedding is None
        else f"dense in {dtype_name} for lookups: {_dense_bytes([embedding], dtype) / 2**20:.1f}"
        " MiB"
    )
    logger.info(
        "%s: %d weights kept quantised (%s): %.1f MiB; the embedding is %s",
        path,
        len(quantized),
        counts,
        sum(w.nbytes for w in quantized.values()) / 2**20,
        lookups,
    )
