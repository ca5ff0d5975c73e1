"""baton.engine: the engine, in rooms (core, executor, worker, models, loader, processing,
entrypoints, server) around shared values (config, sampling params, outputs, tokenizer).

The public names are imported lazily so that importing a submodule (the
tokenizer, the loader) does not load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "baton.engine.entrypoints.llm",
    "AsyncLLM": "baton.engine.entrypoints.async_llm",
    "LLMEngine": "baton.engine.processing.llm_engine",
    "EngineBusyError": "baton.engine.errors",
    "EngineConfig": "baton.engine.config",
    "SamplingParams": "baton.engine.sampling_params",
    "StructuredOutputsParams": "baton.grammar.spec",
    "RequestOutput": "baton.engine.outputs",
    "CompletionOutput": "baton.engine.outputs",
    "Logprob": "baton.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'baton.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
