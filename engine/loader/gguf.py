"""Load a Llama-family model from a GGUF file (llama.cpp's format) into Hugging Face layout."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from baton.engine.loader.checkpoint import Checkpoint, check_shard_fits, split_fused
from baton.engine.loader.errors import ModelLoadError
from baton.engine.loader.generation_config import gguf_sampling_defaults
from baton.engine.loader.gguf_config import architecture_of, config_from_gguf
from baton.engine.loader.gguf_names import (
    EXPERTS_MARK,
    ROPE_TENSORS,
    hf_names,
    qk_heads,
    unpermute_qk,
)
from baton.engine.loader.gguf_reader import GGUFFile, GGUFFormatError, GGUFTensor, read_gguf_file
from baton.engine.models.architectures import ARCHITECTURES
from baton.engine.models.config import ModelConfig
from baton.engine.models.sharding import ShardSpec, WeightSlice, weight_slice
from baton.engine.tokenizer import Tokenizer
from baton.kernels.quant_formats import FORMATS, QuantWeight
from baton.kernels.quant_linear import available_isas, dequantize_native

# Tensor types this loader dequantises (gguf.quants implements each; the block formats are the
# ones common in published files). Anything else is refused by name rather than guessed at.
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",  # gpt-oss's experts
)


def read_gguf(path: Path) -> GGUFFile:
    """Read ``path``'s metadata and map its tensors (``gguf_reader``). Raises
    ``ModelLoadError`` for an unreadable, corrupt or truncated file."""
    try:
        return read_gguf_file(path)
    except (GGUFFormatError, OSError) as exc:
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({exc}); expected a complete GGUF v2/v3 file"
        ) from exc


def gguf_metadata(reader: GGUFFile, path: Path) -> dict[str, Any]:
    """Every metadata key of the file as a plain Python value (lists for arrays); a copy."""
    return dict(reader.metadata)


def load_gguf_tokenizer(path: Path, metadata: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata; ``ModelLoadError`` naming ``path`` when
    it is unsupported or inconsistent."""
    try:
        return Tokenizer.from_gguf_metadata(metadata)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer: {exc}") from exc


def _fused_name(config: ModelConfig, hf_name: str, shape: tuple[int, ...]) -> str | None:
    """The fused Hugging Face name a tensor stands for (Phi-3's q|k|v, and its ``ffn_up``
    that llama.cpp stores as gate|up, twice the MLP's width), else None."""
    if not ARCHITECTURES[config.architecture].fused_projections:
        return None
    if hf_name.endswith("self_attn.qkv_proj.weight"):
        return hf_name
    if hf_name.endswith("mlp.up_proj.weight") and shape[0] == 2 * config.intermediate_size:
        return hf_name[: -len("up_proj.weight")] + "gate_up_proj.weight"
    return None


def _native_decodes(kind: str, data: np.ndarray) -> bool:
    """Whether the quantised kernel's C++ decodes these block bytes ``[rows, row_bytes]``."""
    if kind not in FORMATS or data.ndim != 2 or data.dtype != np.uint8 or data.shape[0] == 0:
        return False
    fmt = FORMATS[kind]
    return data.shape[1] % fmt.block_bytes == 0 and bool(available_isas())


def _dequantize(path: Path, tensor: GGUFTensor, part: WeightSlice | None = None) -> np.ndarray:
    """The values of one GGUF tensor as float32 numpy, in row-major HF order of dims; with
    ``part``, only indices ``[part.start, part.stop)`` of dimension ``part.dim`` (no padding),
    decoded from those bytes of the memory map alone (see ``_select``)."""
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} has type {kind}, which is not supported; expected one "
            f"of {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
    shape = tuple(reversed(tensor.shape))
    data, decoded, trim = tensor.data, shape, None
    if part is not None and part.dim is not None:
        data, decoded, trim = _select(tensor, shape, part)
    try:
        if _native_decodes(kind, data):
            # C++ on torch's threads, the same values (only zeros' signs may differ): numpy's
            # decode was most of a dense GGUF load.
            values = dequantize_native(np.ascontiguousarray(data), kind).numpy()
        else:
            values = np.asarray(quants.dequantize(data, tensor.tensor_type), dtype=np.float32)
        values = values.reshape(decoded)
    except Exception as exc:  # bad block sizes surface as numpy errors
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} ({kind}, shape {shape}) cannot be decoded: {exc}"
        ) from exc
    if trim is not None:
        values = values[..., trim]
    # F32 data comes back as a read-only view of the memory-mapped file (and a trimmed slice
    # as a strided view); own a contiguous copy instead.
    if values.flags.writeable and values.flags.c_contiguous:
        return values
    return values.copy(order="C")


# Rows of a large block-quantised tensor decoded at once: gguf's numpy dequantisation holds
# temporaries of about twice its float32 output (measured on the default model's 49152 x 576
# Q8_0 embedding: 246 MiB of peak RSS for its 108 MiB of float32 values), so a whole
# embedding decoded in one piece set the loader's peak memory.
_DECODE_CHUNK_ROWS = 4096


def _dequantize_to(path: Path, tensor: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole of ``tensor`` in ``dtype`` (as ``_dequantize`` then ``.to(dtype)``, bit for
    bit): a 2-D block-quantised one decoded ``_DECODE_CHUNK_ROWS`` rows at a time straight
    into the result, so the float32 temporaries stay a chunk's."""
    shape = tuple(reversed(tensor.shape))
    if len(shape) != 2 or shape[0] <= _DECODE_CHUNK_ROWS or tensor.data.shape == shape:
        return torch.from_numpy(_dequantize(path, tensor)).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    for start in range(0, shape[0], _DECODE_CHUNK_ROWS):
        stop = min(start + _DECODE_CHUNK_ROWS, shape[0])
        rows = WeightSlice(0, start, stop, stop - start)
        out[start:stop].copy_(torch.from_numpy(_dequantize(path, tensor, rows)))
    return out


def _select(
    tensor: GGUFTensor, shape: tuple[int, ...], part: WeightSlice
) -> tuple[np.ndarray, tuple[int, ...], slice | None]:
    """The part of ``tensor.data`` (a view of the memory map) that holds ``part``: the array to
    decode, its decoded shape, and the slice of the decoded last dimension to keep (None: all).

    ``tensor.data`` is shaped like ``shape`` except that a block-quantised type stores its
    last dimension as whole blocks of bytes (each block encodes ``block`` consecutive elements
    of one row). A slice along any other dimension (output rows, vocabulary rows) is whole
    rows: a plain index. A slice along the last dimension (the input columns of o_proj and
    down_proj) is cut on block boundaries: when both ends fall on one (e.g. 192 of 576 columns
    in Q4_1's 32-element blocks) exactly its blocks are decoded; otherwise (e.g. Q6_K's
    256-element blocks) the blocks that cover it are decoded and the extra columns trimmed,
    since a block can only be decoded whole. Nothing else of the tensor is read: the bytes come
    straight from the map, so only the pages they lie on are touched (a column slice of rows
    shorter than a page still touches every page of the tensor).
    """
    dim, start, stop = part.dim, part.start, part.stop
    assert dim is not None
    decoded = (*shape[:dim], stop - start, *shape[dim + 1 :])
    index: list[slice] = [slice(None)] * len(shape)
    last = len(shape) - 1
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    # A whole-row slice, or plain numbers (F32/F16/...: the map is shaped like the tensor).
    if dim < last or tensor.data.shape == shape:
        index[dim] = slice(start, stop)
        return tensor.data[tuple(index)], decoded, None
    first, end = start // block, -(-stop // block)
    index[last] = slice(first * type_size, end * type_size)
    covered = (*shape[:last], (end - first) * block)
    offset = start - first * block
    trim = None if covered == decoded else slice(offset, offset + stop - start)
    # The blocks of a column slice are strided in the map; decode them as one dense array.
    return np.ascontiguousarray(tensor.data[tuple(index)]), covered, trim


def load_gguf(
    path: Path,
    dtype: torch.dtype = torch.float32,
    shard: ShardSpec | None = None,
    keep_quantized: bool = False,
    huge_pages: bool = True,
) -> Checkpoint:
    """Load a GGUF file of an architecture in ``models/architectures.py`` as a ``Checkpoint``
    with weights in ``dtype``.

    Maps the file and dequantises every weight; with ``shard``, only rank ``shard.rank``'s part
    of each (``sharding.weight_slice``), read and dequantised from those bytes of the map alone,
    so no rank holds the whole model (the result equals ``shard_weights`` of the full load, bit
    for bit). With ``keep_quantized`` (``quantization="gguf"``) the linear weights of a type
    the quantised kernel multiplies are not dequantised but repacked from the file's blocks
    into ``Checkpoint.quantized`` (``gguf_quant.keep_quantized``; logs what it kept and what it
    dequantised instead), on memory advised for huge pages unless ``huge_pages`` is False
    (weights another process will copy: ``kernels/huge_pages.py``). Raises ``ModelLoadError``
    naming the path for an unreadable file, an unsupported architecture, tokenizer or tensor
    type, missing or misshapen tensors, a ``shard.size`` that does not fit the model, and with
    ``keep_quantized`` a ``shard`` or a file without any linear of a type the kernel
    multiplies.
    """
    reader = read_gguf(path)
    metadata = gguf_metadata(reader, path)
    model = architecture_of(path, metadata)
    tokenizer = load_gguf_tokenizer(path, metadata)
    tensors = {t.name: t for t in reader.tensors}
    rope_tensors = {
        name: _dequantize(path, tensors[name]) for name in ROPE_TENSORS if name in tensors
    }
    config = config_from_gguf(path, metadata, tensors, rope_tensors, tokenizer)
    if shard is not None:
        if keep_quantized:
            raise ModelLoadError(
                f"{path}: quantised weights (quantization='gguf') cannot be cut into "
                f"{shard.size} shards yet; load them whole (tensor_parallel_size=1)"
            )
        check_shard_fits(path, config, shard)
    named = hf_names(path, reader, model)
    quantized: dict[str, QuantWeight] = {}
    kept: frozenset[str] = frozenset()
    if keep_quantized:
        from baton.engine.loader.gguf_quant import keep_quantized as keep

        quantized, kept = keep(path, {hf: t for t, hf in named}, config, dtype, huge_pages)
    weights: dict[str, torch.Tensor] = {}
    for tensor, hf_name in named:
        if hf_name in kept:
            continue
        shape = tuple(reversed(tensor.shape))
        fused = _fused_name(config, hf_name, shape)
        if fused is not None:  # Phi-3: read whole, cut into the parts (each rank's if sharded)
            value = _dequantize_to(path, tensor, dtype).contiguous()
            weights.update(split_fused(path, fused, value, config, shard))
            continue
        part = None if shard is None else weight_slice(hf_name, shape, config, shard)
        if part is None:
            value = _dequantize_to(path, tensor, dtype)
        else:
            value = torch.from_numpy(_dequantize(path, tensor, part))
        heads = qk_heads(path, config, tensor.name, shape[0])
        if heads is not None:
            # The permutation stays inside each head and a shard holds whole heads (a run of
            # head_dim-row blocks), so the shard's rows are unpermuted with its own head count.
            value = unpermute_qk(value, heads * value.shape[0] // shape[0])
        value = value.to(dtype).contiguous()
        if EXPERTS_MARK in hf_name:  # views of the one dequantised tensor, no copy
            bias = hf_name.endswith(".bias")
            if value.dim() != (2 if bias else 3):
                raise ModelLoadError(
                    f"{path}: tensor {tensor.name} has shape {tuple(value.shape)}, expected "
                    + ("[experts, rows]" if bias else "[experts, rows, columns]")
                )
            for e, expert in enumerate(value):
                weights[hf_name.replace(EXPERTS_MARK, str(e))] = expert
            continue
        weights[hf_name] = value if part is None else part.pad(value)
    return Checkpoint(
        path=path,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        sampling_defaults=gguf_sampling_defaults(path, metadata),
        shard=shard,
        quantized=quantized,
    )
