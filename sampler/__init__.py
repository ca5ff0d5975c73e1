"""baton.sampler: logits -> tokens (bitmask apply, penalties, temperature, min-p,
top-k, top-p, seeded sampling, logprobs). Takes tensors and parameters only."""

from __future__ import annotations

from baton.sampler.bitmask import apply_token_bitmask_, unpack_bitmask
from baton.sampler.metadata import SamplingMetadata
from baton.sampler.outputs import LogprobsTensors, SamplerOutput
from baton.sampler.sampler import Sampler

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_token_bitmask_",
    "unpack_bitmask",
]
