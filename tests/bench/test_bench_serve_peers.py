"""The llama.cpp comparison's parts that need no llama.cpp: the build recipe's CMake patch, the
random-weight GGUF shapes and writer, the cell summaries, ratios and goals."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from baton.bench.llama_server.gguf_models import SHAPES, LlamaShape, write_random_gguf
from baton.bench.llama_server.llama_cpp_build import LlamaCppBuild, keep_variants, loaded_variant
from baton.bench.llama_server.serve_peers import (
    ServePeersConfig,
    kv_cache_bytes,
    summarize,
    tree_pss_bytes,
)
from baton.bench.llama_server.serve_peers_report import goals, ratios, readme_table, table
from baton.bench.serving.serve import LevelRun, RequestRecord
from baton.engine import LLM, SamplingParams

CMAKELISTS = """\
if (GGML_CPU_ALL_VARIANTS)
    if (GGML_SYSTEM_ARCH STREQUAL "x86")
        ggml_add_cpu_backend_variant(x64)
        ggml_add_cpu_backend_variant(sse42              SSE42)
        ggml_add_cpu_backend_variant(haswell            SSE42 AVX F16C FMA AVX2 BMI2)
        if (NOT MSVC)
            ggml_add_cpu_backend_variant(zen4           SSE42 AVX AVX512)
        endif()
    elseif(GGML_SYSTEM_ARCH STREQUAL "ARM")
            ggml_add_cpu_backend_variant(armv8.0_1)
    endif()
endif()
"""


def test_keep_variants_comments_out_the_others_only_in_the_x86_block() -> None:
    patched = keep_variants(CMAKELISTS, ("x64", "haswell", "zen4"))
    assert "ggml_add_cpu_backend_variant(x64)" in patched
    assert "ggml_add_cpu_backend_variant(haswell " in patched
    assert "ggml_add_cpu_backend_variant(zen4 " in patched
    assert "ggml_add_cpu_backend_variant(sse42" not in patched
    assert "# (baton: not built) sse42" in patched
    assert "ggml_add_cpu_backend_variant(armv8.0_1)" in patched  # not x86: untouched
    assert keep_variants(patched, ("x64", "haswell", "zen4")) == patched  # idempotent


def test_keep_variants_names_a_missing_variant() -> None:
    with pytest.raises(ValueError, match="icelake"):
        keep_variants(CMAKELISTS, ("x64", "icelake"))


def test_loaded_variant_reads_the_server_log() -> None:
    log = "load_backend: loaded CPU backend from /x/build/bin/libggml-cpu-zen4.so\nmain: ok"
    assert loaded_variant(log) == "zen4"
    assert loaded_variant("main: ok") is None


def test_one_variant_leaves_the_server_only_that_cpu_variant(tmp_path: Path) -> None:
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    names = ["llama-server", "llama-quantize", "libggml-base.so", "libggml-base.so.0"]
    names += [f"libggml-cpu-{v}.so" for v in ("x64", "haswell", "zen4")]
    for name in names:
        (bin_dir / name).write_text(name)
    build = LlamaCppBuild(source=tmp_path, bin_dir=bin_dir)
    server = build.one_variant("haswell")
    assert server.is_file() and not server.is_symlink()  # llama.cpp resolves its own path
    assert server.read_text() == "llama-server" and server.parent != bin_dir
    assert sorted(p.name for p in server.parent.glob("libggml-cpu-*")) == ["libggml-cpu-haswell.so"]
    assert (server.parent / "libggml-base.so.0").resolve() == bin_dir / "libggml-base.so.0"
    assert build.one_variant("haswell") == server  # a second call replaces the folder
    with pytest.raises(ValueError, match="'skylakex' is not built; built: haswell, x64, zen4"):
        build.one_variant("skylakex")


def test_shapes_have_the_real_parameter_counts() -> None:
    # Llama-3.2-1B: 1.236e9 parameters (tied); Llama-3.1-8B: 8.030e9.
    assert SHAPES["llama-1b"].parameters() == pytest.approx(1.2358e9, rel=1e-3)
    assert SHAPES["llama-8b"].parameters() == pytest.approx(8.0301e9, rel=1e-3)


def test_random_gguf_loads_with_its_padded_vocabulary(tmp_path: Path) -> None:
    shape = LlamaShape(64, 2, 4, 2, 128, 49200, tied=False)
    path = write_random_gguf(tmp_path / "m.gguf", shape, seed=3)
    reader = GGUFReader(path)
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49200
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {name for name, _ in shape.tensors()}
    embed = np.asarray(tensors["token_embd.weight"].data, np.float32)
    assert embed.shape == (49200, 64) and 0.015 < embed.std() < 0.025
    llm = LLM(str(path), dtype="float32", executor="uni", num_kv_blocks=16)
    try:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
        ids = out[0].outputs[0].token_ids
        assert len(ids) == 4 and all(0 <= i < 49200 for i in ids)
    finally:
        llm.shutdown()


def _record(index: int, structured: bool, tokens: int, valid: bool | None, finish: str):
    return RequestRecord(1, index, structured, 0.1, 0.01, 1.0, tokens, finish, valid, None)


def test_summarize_counts_valid_objects_and_cut_requests() -> None:
    run = LevelRun(1, 3, 2.0)
    run.records = [
        _record(0, True, 40, True, "stop"),
        _record(1, True, 50, False, "stop"),
        _record(2, True, 64, None, "length"),
    ]
    cell = summarize(run, "json")
    assert cell["tok_per_s"] == pytest.approx(77.0)
    assert cell["objects_per_s"] == pytest.approx(0.5)
    assert cell["valid_share"] == pytest.approx(1 / 3)
    assert cell["length_cut"] == 1


def _engine(name: str, tok_s: float, obj_s: float) -> dict:
    cells = [
        {"mode": "free", "concurrency": 1, "tok_per_s": tok_s, "objects_per_s": None},
        {"mode": "json", "concurrency": 1, "tok_per_s": tok_s, "objects_per_s": obj_s},
        {"mode": "json", "concurrency": 8, "tok_per_s": tok_s, "objects_per_s": 4 * obj_s},
    ]
    for c in cells:
        c.update(valid_share=1.0, ttft_p50_ms=1.0, ttft_p99_ms=2.0, tpot_p50_ms=3.0)
    return {
        "engine": name,
        "cells": cells,
        "load_s": 1.0,
        "pss_after_load_mib": 500.0,
        "peak_pss_mib": 600.0,
        "kv_cache_mib": 100.0,
        "cpu_variant": "zen4" if name == "llama-server" else None,
    }


def test_ratios_and_goals_against_the_peer() -> None:
    engines = [_engine("baton", 20.0, 1.0), _engine("llama-server", 10.0, 0.5)]
    result = {
        "engines": engines,
        "ratios": ratios(engines),
        "model_file_mib": 400.0,
        "config": {
            "concurrency": [1, 8],
            "threads": 2,
            "free_tokens": 64,
            "json_tokens": 256,
            "min_requests": 4,
        },
        "model": "/x/m.gguf",
        "load_avg": [1.0, 1.5],
        "run": {"cpu": "AMD EPYC (AVX512-BF16)", "commit": "abcdef123"},
    }
    by = {(r["mode"], r["concurrency"]): r for r in result["ratios"]}
    assert by[("free", 1)]["tok_per_s"] == pytest.approx(2.0)
    assert by[("json", 8)]["objects_per_s"] == pytest.approx(2.0)
    judged = {g["goal"]: g for g in goals(result)}
    assert judged["baton free c1 tok/s / llama-server"]["met"] is True
    assert judged["baton JSON c>=8 objects/s / llama-server"]["met"] is False  # 2 < 3
    # 600 / (1.25 * 400 + 100 + 300) = 0.667
    assert judged["baton peak PSS / (1.25 file + KV + 300 MiB)"]["value"] == pytest.approx(
        600 / 900
    )
    assert "| llama-server | 1.0 | 500 | 600 | 100 | zen4 |" in table(result)
    result["goals"] = goals(result)
    text = readme_table(result)
    assert "`m.gguf` (400 MiB)" in text and "AMD EPYC (AVX512-BF16)" in text
    assert "- MISSED: baton JSON c>=8 objects/s / llama-server >= 3: 2.00" in text


def test_config_and_kv_size_errors_and_parsing() -> None:
    with pytest.raises(ValueError, match="engines"):
        ServePeersConfig(engines=("vllm",))
    with pytest.raises(ValueError, match="json_tokens"):
        ServePeersConfig(json_tokens=0)
    with pytest.raises(ValueError, match="settle_s"):
        ServePeersConfig(settle_s=-1.0)
    log = "llama_kv_cache: CPU KV buffer size = 256.00 MiB\n"
    assert kv_cache_bytes("llama-server", log) == 256 * 2**20
    assert kv_cache_bytes("llama-server", "") is None
    assert tree_pss_bytes(os.getpid()) > 0
