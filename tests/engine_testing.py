"""Helpers shared by the engine tests: run a set of requests to the end."""

from __future__ import annotations

import pytest
import torch

from baton.engine import SamplingParams
from baton.engine.models import llama as llama_module
from baton.engine.models.quant import Int8Weight
from baton.engine.processing.llm_engine import LLMEngine


def run_to_end(
    engine: LLMEngine,
    requests: list[tuple[str, SamplingParams]],
    abort: dict[str, int] | None = None,
) -> dict[str, tuple]:
    """Adds ``requests`` as r0, r1, ... and steps the engine until none is left; aborts
    ``abort[rid]`` once it has shown that many tokens. Returns each request's
    (token ids, finish reason or "abort", text, error)."""
    abort = dict(abort or {})
    for i, (prompt, sp) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, sp)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            if out.finished:
                final[out.request_id] = (c.token_ids, c.finish_reason, c.text, c.error)
            elif out.request_id in abort and len(c.token_ids) >= abort[out.request_id]:
                engine.abort_request(out.request_id)
                final[out.request_id] = (c.token_ids, "abort", c.text, None)
                del abort[out.request_id]
    return final


def spy_int8_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every ``int8_linear`` call the model makes from now on (in this
    process: an in-process executor's model)."""
    rows: list[int] = []
    real = llama_module.int8_linear

    def spy(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None):
        rows.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(llama_module, "int8_linear", spy)
    return rows
