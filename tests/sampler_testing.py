"""Helpers of baton.sampler's tests (tests/sampler/test_sampler*.py): the samplers every path is
checked with, sampling metadata with defaults."""

from __future__ import annotations

from baton.sampler import Sampler, SamplingMetadata

MASK64 = (1 << 64) - 1
SAMPLERS = [Sampler(), Sampler(allow_host_sync=False), Sampler(top_p_window=4)]
SAMPLER_IDS = ["host", "device-path", "narrow-window"]


def _meta(n: int, **kwargs: object) -> SamplingMetadata:
    defaults: dict[str, object] = {
        "temperature": [1.0] * n,
        "seeds": list(range(n)),
        "positions": [0] * n,
    }
    defaults.update(kwargs)
    return SamplingMetadata.build(**defaults)  # type: ignore[arg-type]
