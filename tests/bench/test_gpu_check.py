"""The prepared GPU check's CPU-side behaviour: it refuses cleanly without CUDA, picks the
GPU-marked test files, and summarises the files a run leaves behind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from baton.bench.gpu import gpu_check

SCRIPT = Path(gpu_check.__file__).resolve().parent / "gpu_check.sh"


def test_the_shell_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_pack_leaves_one_archive_and_the_run_s_exit_code(tmp_path: Path) -> None:
    """--pack turns the output folder into one archive (the device tool brings back at most 8
    files) and keeps the run's exit code (2: no CUDA)."""
    import os
    import sys
    import tarfile

    out = tmp_path / "r"
    env = {**os.environ, "PYTHON": sys.executable, "BATON_GPU_CHECK_PREP": str(tmp_path / "p")}
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--pack"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not out.exists() and (tmp_path / "r.tgz").exists()
    with tarfile.open(tmp_path / "r.tgz") as tar:
        assert tar.getnames() == ["r"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_nothing_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.run(tmp_path / "out", tmp_path / "prep") == 2
    assert "no CUDA device" in capsys.readouterr().out
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_an_unknown_stage_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such stage: profiles"):
        gpu_check.run(tmp_path / "out", tmp_path / "prep", frozenset({"profile", "profiles"}))


def test_only_files_with_gpu_tests_are_collected() -> None:
    files = {Path(f).name for f in gpu_check.gpu_test_files()}
    assert "test_kernels_paged_attention.py" in files and "test_kernels_step_state.py" in files
    assert "test_server.py" not in files  # imports the server's packages


def test_stages_fit_the_time_budget(tmp_path: Path) -> None:
    stages = gpu_check.stages(tmp_path, "/models/x")
    assert sum(s.timeout_s for s in stages) < 7.5 * 60  # the check must end within 8 minutes
    engine = next(s for s in stages if s.name == "bench engine").argv
    assert engine[engine.index("--device") + 1] == "cuda"
    assert engine[engine.index("--model") + 1] == "/models/x"
    eager = next(s for s in stages if s.name == "bench engine eager").argv
    assert "--enforce-eager" in eager and "--enforce-eager" not in engine
    assert eager[eager.index("--out") + 1].endswith("engine_eager.json")
    assert engine[engine.index("--out") + 1].endswith("engine.json")
    assert engine[engine.index("--repeats") + 1] == "2"
    assert eager[eager.index("--repeats") + 1] == "1"
    (tmp_path / "prep" / "tokenizer").mkdir(parents=True)
    tests = next(
        s for s in gpu_check.stages(tmp_path, None, tmp_path / "prep") if s.log.startswith("gpu")
    )
    assert dict(tests.env) == {"BATON_TEST_TOKENIZER": str(tmp_path / "prep" / "tokenizer")}
    default = next(s for s in gpu_check.stages(tmp_path, None) if s.name == "bench engine")
    assert "--model" not in default.argv  # the default model, when it is installed


def test_summary_reads_the_results(tmp_path: Path) -> None:
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1">'
        '<testcase name="test_a"/><testcase name="test_b"><failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )

    def row(async_on: bool, tok_per_s: float) -> dict[str, object]:
        return {
            "batch": 32,
            "json_fraction": 1.0,
            "async": async_on,
            "tok_per_s": tok_per_s,
            "tpot_ms": 4.0,
            "steady_device_busy": 0.97,
        }

    engine = {"rows": [row(True, 3000.0), row(False, 2000.0)], "goals": []}
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    results = [{"stage": "gpu tests", "status": "exit 1", "seconds": 12.0}]
    text = gpu_check.summary(tmp_path, {"device": "H200", "torch": "2.11", "cuda": "13"}, results)
    assert "3 passed, 1 failed, 0 errors, 1 skipped (failing: test_b)" in text
    line = next(t for t in text.splitlines() if t.split()[:2] == ["32", "100%"])
    assert line.split()[2:5] == ["3000", "2000", "1.50"]
    assert "paged_attention.json:\n(not written)" in text


def test_collect_gathers_a_run_into_one_file_the_readme_renders(tmp_path: Path) -> None:
    from baton.bench.gpu.gpu_report import gpu_check_table

    src = tmp_path / "out"
    src.mkdir()
    env = {"device": "H200", "torch": "2.11", "cuda": "13.0", "python": "3.12"}
    (src / "env.json").write_text(json.dumps({**env, "default_model": False}))
    (src / "summary.txt").write_text(
        "GPU check\n- gpu tests: ok in 50 s\n- profile: exit 1 in 3 s\n"
    )

    def engine(tok_on: float, tok_off: float) -> dict[str, object]:
        rows = [
            {"batch": 8, "json_fraction": 1.0, "async": a, "tok_per_s": t, "tpot_ms": 2.0}
            for a, t in ((True, tok_on), (False, tok_off))
        ]
        return {"rows": rows, "goals": [], "run": {"commit": "abc+dirty", "date": "D"}}

    (src / "engine.json").write_text(json.dumps(engine(900.0, 300.0)))
    (src / "engine_eager.json").write_text(json.dumps(engine(100.0, 90.0)))
    (src / "engine.png").write_bytes(b"png")
    out = tmp_path / "results" / "gpu_check.json"
    data = gpu_check.collect(src, out, commit="0123456789abcdef")
    assert json.loads(out.read_text()) == data
    assert out.with_suffix(".png").read_bytes() == b"png"
    assert data["commit"] == "0123456789abcdef" and data["run"]["commit"] == "abc+dirty"
    assert [s["stage"] for s in data["stages"]] == ["gpu tests", "profile"]
    assert data["gpu_tests"] is None  # no junit file: no counts invented
    text = gpu_check_table(data)
    assert "commit `0123456789ab`" in text and "profile exit 1 (3 s)" in text
    row = next(line for line in text.splitlines() if line.startswith("| 8 |"))
    assert row.split(" | ")[2:6] == ["900", "300", "3.00", "2.0"] and row.endswith("| 9.00 |")
    assert "No eager run" not in text
    (src / "engine_eager.json").unlink()
    text = gpu_check_table(gpu_check.collect(src, out))
    row = next(line for line in text.splitlines() if line.startswith("| 8 |"))
    assert row.split(" | ")[2:6] == ["900", "300", "3.00", "2.0 |"] and "eager" not in row
    assert "No eager run in this check" in text and "eager async" not in text
    with pytest.raises(FileNotFoundError, match="not the output of a GPU check"):
        gpu_check.collect(tmp_path / "results", tmp_path / "x.json")


def test_the_invariance_cell_is_a_stage_and_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    from baton.bench.gpu import invariance_check

    stage = next(s for s in gpu_check.stages(tmp_path, None) if s.name == "invariance")
    assert "baton.bench.gpu.invariance_check" in stage.argv
    assert stage.argv[stage.argv.index("--out") + 1] == str(tmp_path / "invariance.json")
    assert stage.timeout_s <= 60
    if torch.cuda.is_available():
        return
    assert invariance_check.main(["--out", str(tmp_path / "invariance.json")]) == 0
    data = json.loads((tmp_path / "invariance.json").read_text())
    assert data["skipped"] == "no CUDA device visible to torch"
    assert set(data) == {"skipped", "run"} and data["run"]["cpu"]  # the run info, as every result
    text = gpu_check.summary(tmp_path, {"device": "-"}, [])
    assert "invariance.json:\nskipped: no CUDA device visible to torch" in text


def test_the_invariance_cell_summary_reads_its_rows() -> None:
    from baton.bench.gpu.invariance_check import summarize

    counts = {"decode_logits_identical": 16, "decode_tokens_identical": 16}
    data = {
        "invariance_kernel": {**counts, "prefill_logits_identical": 3},
        "invariance_cublas": {"decode_logits_identical": 2, "decode_tokens_identical": 9,
                              "prefill_logits_identical": 1},
        "gemm": [{"rows": 8, "kernel_ms": 0.5, "cublas_ms": 0.25, "kernel_over_cublas": 2.0}],
        "step": [{"batch": 8, "kernel_ms": 3.0, "cublas_ms": 2.0, "kernel_over_cublas": 1.5,
                  "graphed": True}],
    }  # fmt: skip
    lines = summarize(data)
    assert lines[1].split() == ["kernel", "16", "16", "3"]
    assert lines[2].split() == ["cublas", "2", "9", "1"]
    assert lines[4].split() == ["8", "0.500", "0.250", "2.00"]
    assert lines[6].split() == ["8", "3.000", "2.000", "1.50", "True"]


def test_the_invariance_cells_counts_on_a_tiny_cpu_model() -> None:
    """The cell's bookkeeping (metadata, caches, greedy tokens, counts) runs here on a tiny
    model with CPU linears, so that a GPU sitting is not spent finding its bugs."""
    from baton.bench.gpu import invariance_check as ic
    from baton.engine.models.config import ModelConfig
    from baton.engine.models.llama import LlamaForCausalLM

    config = ModelConfig(
        architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    prompts = torch.randint(0, 96, (ic.PROMPTS, ic.PROMPT_LEN))
    counts = ic.invariance(LlamaForCausalLM(config).eval(), prompts)
    assert set(counts) == {
        "sequences",
        "decode_logits_identical",
        "decode_tokens_identical",
        "prefill_logits_identical",
    }
    assert counts["sequences"] == ic.PROMPTS
    # Identical logits at every step make identical greedy tokens.
    assert ic.PROMPTS >= counts["decode_tokens_identical"] >= counts["decode_logits_identical"]
