"""The sampling defaults a model ships: ``generation_config.json`` in a Hugging Face folder,
``general.sampling.*`` keys in a GGUF file (llama.cpp's names).

Like vLLM's ``--generation-config auto``: these become the defaults of requests that do not
set the field themselves; a request's own value always wins.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from baton.engine.loader.errors import ModelLoadError
from baton.engine.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field (same names).
HF_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# GGUF metadata key -> SamplingParams field.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = {"top_k"}


def _checked(source: str, values: dict[str, Any]) -> dict[str, float | int]:
    """``values`` as SamplingParams keywords of the right type; raises ``ModelLoadError``
    naming ``source`` and the field when SamplingParams refuses one."""
    out: dict[str, float | int] = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{source}: {name} must be a number, got {value!r}")
        out[name] = int(value) if name in _INT_FIELDS else float(value)
    try:
        SamplingParams(**out)
    except ValueError as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc
    return out


def hf_sampling_defaults(path: Path) -> dict[str, float | int]:
    """The sampling fields of ``path/generation_config.json`` (empty when the folder has
    none). Raises ``ModelLoadError`` for unreadable JSON or a value out of range."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object")
    return _checked(str(file), {k: data[k] for k in HF_KEYS if data.get(k) is not None})


def gguf_sampling_defaults(path: Path, metadata: Mapping[str, Any]) -> dict[str, float | int]:
    """The sampling fields among a GGUF file's metadata (empty when it has none). Raises
    ``ModelLoadError`` for a value out of range."""
    values = {field: metadata[key] for key, field in GGUF_KEYS.items() if key in metadata}
    return _checked(str(path), values)
