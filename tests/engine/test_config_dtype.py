"""``dtype="auto"``: what it resolves to and why, and where the choice is shown; and
``quantization``: never switched by load, int8 only when asked for, and reported."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch
from conftest import REAL_AUTO_DTYPE
from engine_testing import spy_int8_rows

import baton.engine.config as config_module
from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import (
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    add_engine_args,
    config_from_args,
    engine_config,
)


def _cpu_has_native_bf16() -> bool:
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def test_auto_picks_bfloat16_exactly_where_the_cpu_has_it(monkeypatch, caplog) -> None:
    monkeypatch.setattr(config_module, "auto_dtype", REAL_AUTO_DTYPE)
    with caplog.at_level(logging.INFO, logger="baton.engine.config"):
        cfg = EngineConfig()
    expected = torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
    assert cfg.dtype == expected
    assert cfg.dtype_reason.startswith("auto: ")
    assert cfg.quantization is None  # whatever the dtype: never quantised unasked
    assert f"dtype {str(expected).removeprefix('torch.')}" in caplog.text
    # A CPU without AMX and AVX512-BF16: float32.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    cfg = EngineConfig()
    assert cfg.dtype == torch.float32 and cfg.quantization is None
    assert "neither AMX nor AVX512-BF16" in cfg.dtype_reason
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    cfg = EngineConfig()
    assert cfg.dtype == torch.bfloat16 and "AMX" in cfg.dtype_reason


def test_explicit_dtypes_and_bad_ones() -> None:
    cfg = engine_config(dtype="float32")
    assert cfg.dtype == torch.float32 and cfg.dtype_reason == "asked for"
    cfg = engine_config(dtype="bfloat16")
    assert cfg.dtype == torch.bfloat16 and cfg.quantization is None
    assert "auto" in DTYPE_CHOICES
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine_config(dtype="float64")
    with pytest.raises(ValueError, match="EngineConfig.dtype"):
        EngineConfig(dtype="half")
    with pytest.raises(ValueError, match="dtype_reason"):
        engine_config(dtype_reason="mine")  # set by the config, not an argument


def test_quantization_choices_and_bad_ones() -> None:
    assert EngineConfig().quantization is None
    for dtype in ("float32", "bfloat16"):
        assert engine_config(dtype=dtype, quantization="int8").quantization == "int8"
    assert engine_config(dtype="bfloat16", quantization="gguf").quantization == "gguf"
    assert QUANTIZATION_CHOICES == ("none", "int8", "gguf")
    for bad in ("int4", "INT8", "GGUF", "none", True):
        with pytest.raises(ValueError, match=r"quantization must be None .* \['int8', 'gguf'\]"):
            EngineConfig(quantization=bad)
    for quantization in ("int8", "gguf"):
        with pytest.raises(ValueError, match=f"quantization='{quantization}' needs device='cpu'"):
            EngineConfig(device="sim:h200", quantization=quantization)
    with pytest.raises(ValueError, match="quantization='gguf' runs on one rank.*size=2"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)


def test_the_removed_int8_small_batches_names_its_replacement() -> None:
    for value in (True, False, None):
        with pytest.raises(ValueError, match="int8_small_batches.*quantization='int8'"):
            engine_config(dtype="bfloat16", int8_small_batches=value)
    with pytest.raises(ValueError, match="int8_small_batches.*quantization='int8'"):
        LLM(int8_small_batches=True)


def test_quantization_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).quantization is None
    args = parser.parse_args(["--quantization", "int8"])
    assert config_from_args(args).quantization == "int8"
    assert config_from_args(parser.parse_args(["--quantization", "none"])).quantization is None
    args = parser.parse_args(["--quantization", "gguf"])
    assert config_from_args(args).quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


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
        assert stats["quantization"] == "none"
        if executor == "uni":  # the model is in this process: no int8 weights at any size
            model = llm.engine.core.executor.runner.model
            assert model.lm_head_int8 is None
            assert all(layer.int8 is None for layer in model.layers)
        out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1
    finally:
        llm.shutdown()


def test_int8_engine_runs_every_step_on_int8_weights(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        str(tiny_model_dir),
        dtype="bfloat16",
        quantization="int8",
        executor="uni",
        async_scheduling=False,
        structured_drafts=False,
        max_model_len=64,
        num_kv_blocks=64,
        max_num_seqs=16,
    )
    try:
        assert llm.stats()["quantization"] == "int8"
        model = llm.engine.core.executor.runner.model
        for layer in model.layers:
            assert layer.int8 is not None and layer.packed is None
            assert all(lin.weight.numel() == 0 for lin in layer._linears)  # no dense copies
        assert model.lm_head_int8 is not None and model.lm_head_packed is None
        rows = spy_int8_rows(monkeypatch)
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        # Every step's forward: 4 int8 projections per layer and the int8 LM head.
        per_step = 4 * len(model.layers) + 1
        steps = llm.stats()["steps"]
        llm.generate("hello", greedy, use_tqdm=False)  # decode steps of 1 row
        assert 1 in rows
        llm.generate([f"prompt number {i}" for i in range(16)], greedy, use_tqdm=False)
        assert 16 in rows  # decode steps of 16 rows (and their 16-row LM head) as well
        assert len(rows) == per_step * (llm.stats()["steps"] - steps)
    finally:
        llm.shutdown()
