"""Which model class runs an architecture (``models/architectures.py``)."""

from __future__ import annotations

from baton.engine.models.config import ModelConfig
from baton.engine.models.gemma import GemmaForCausalLM
from baton.engine.models.llama import LlamaForCausalLM


def causal_lm_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds ``config``'s model: Gemma's block for Gemma 2/3, else the Llama
    decoder (which covers the other architectures' departures through the config)."""
    return GemmaForCausalLM if config.arch.gemma else LlamaForCausalLM
