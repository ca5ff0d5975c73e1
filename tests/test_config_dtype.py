"""``dtype="auto"``: what it resolves to and why, and where the choice is shown."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import REAL_AUTO_DTYPE

import baton.engine.config as config_module
from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import DTYPE_CHOICES, engine_config


def _cpu_has_native_bf16() -> bool:
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def test_auto_picks_bfloat16_exactly_where_the_cpu_has_it(monkeypatch, caplog) -> None:
    monkeypatch.setattr(config_module, "auto_dtype", REAL_AUTO_DTYPE)
    with caplog.at_level(logging.INFO, logger="baton.engine.config"):
        cfg = EngineConfig()
    expected = torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
    assert cfg.dtype == expected
    assert cfg.dtype_reason.startswith("auto: ")
    assert cfg.int8_small_batches is (expected == torch.bfloat16)
    assert f"dtype {str(expected).removeprefix('torch.')}" in caplog.text
    # A CPU without AMX and AVX512-BF16: float32, and no int8 kernels.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    cfg = EngineConfig()
    assert cfg.dtype == torch.float32 and cfg.int8_small_batches is False
    assert "neither AMX nor AVX512-BF16" in cfg.dtype_reason
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    cfg = EngineConfig()
    assert cfg.dtype == torch.bfloat16 and "AMX" in cfg.dtype_reason


def test_explicit_dtypes_and_bad_ones() -> None:
    cfg = engine_config(dtype="float32")
    assert cfg.dtype == torch.float32 and cfg.dtype_reason == "asked for"
    assert cfg.int8_small_batches is False
    cfg = engine_config(dtype="bfloat16")
    assert cfg.dtype == torch.bfloat16 and cfg.int8_small_batches is True
    assert engine_config(dtype="bfloat16", int8_small_batches=False).int8_small_batches is False
    assert "auto" in DTYPE_CHOICES
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine_config(dtype="float64")
    with pytest.raises(ValueError, match="EngineConfig.dtype"):
        EngineConfig(dtype="half")
    with pytest.raises(ValueError, match="int8_small_batches"):
        EngineConfig(int8_small_batches="yes")
    with pytest.raises(ValueError, match="dtype_reason"):
        engine_config(dtype_reason="mine")  # set by the config, not an argument


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_bfloat16_engine_reports_its_kernels_and_generates(
    tiny_model_dir: Path, executor: str
) -> None:
    llm = LLM(
        str(tiny_model_dir),
        dtype="bfloat16",
        executor=executor,
        async_scheduling=executor == "mp",
        max_model_len=64,
        num_kv_blocks=16,
    )
    try:
        stats = llm.stats()
        assert stats["dtype"] == "bfloat16" and stats["dtype_reason"] == "asked for"
        assert stats["int8_small_batches"] == 1
        # Batch 1: every decode step takes the int8 kernels; the prefill (more rows) does not.
        out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1
    finally:
        llm.shutdown()
