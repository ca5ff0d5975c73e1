"""bench/common.py: every result records the commit, date and machine it was measured on."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import pytest

from baton.bench import common


def test_run_info_names_the_checked_out_commit() -> None:
    here = Path(common.__file__).resolve().parent
    head = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    info = common.run_info(dtype="bfloat16")
    assert info["commit"].split("+")[0] == head
    assert info["dtype"] == "bfloat16"
    assert info["torch_threads"] >= 1 and info["cpu_cores"] >= 1
    assert info["date"].endswith("+00:00")


def test_write_results_adds_the_run_and_keeps_given_keys(tmp_path: Path) -> None:
    plotted: list[Path] = []
    out = tmp_path / "r" / "x.json"
    common.write_results(
        {"rows": [1], "run": {"dtype": "float32"}}, out, lambda r, p: plotted.append(p)
    )
    saved = json.loads(out.read_text())
    assert saved["rows"] == [1]
    assert saved["run"]["dtype"] == "float32" and "commit" in saved["run"]
    assert plotted == [out.with_suffix(".png")]


def test_common_args() -> None:
    p = argparse.ArgumentParser()
    common.add_common_args(p, "demo", dtype="bfloat16")
    args = p.parse_args([])
    assert args.model is None and args.dtype == "bfloat16"
    assert args.out == common.RESULTS_DIR / "demo.json"


def test_config_from_args_maps_fields_and_turns_validation_into_a_usage_error() -> None:
    import dataclasses

    import pytest

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        batches: tuple[int, ...] = (1,)
        repeats: int = 1

        def __post_init__(self) -> None:
            if self.repeats < 1:
                raise ValueError("repeats must be >= 1")

    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--unrelated", default="x")
    cfg = common.config_from_args(p, p.parse_args(["--batches", "2", "4"]), Cfg)
    assert cfg == Cfg(batches=(2, 4), repeats=1)
    with pytest.raises(SystemExit) as exc:
        common.config_from_args(p, p.parse_args(["--repeats", "0"]), Cfg)
    assert exc.value.code == 2


def test_git_commit_is_dirty_for_code_changes_only(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name in ("engine.py", "README.md", "docs/results.md", "bench/results/x.json"):
        (tmp_path / name).write_text("0\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git("rev-parse", "HEAD")
    assert common.git_commit(tmp_path) == head
    # What benchmarks write leaves the measured code clean.
    (tmp_path / "README.md").write_text("1\n")
    (tmp_path / "docs" / "results.md").write_text("1\n")
    (tmp_path / "bench" / "results" / "x.json").write_text("1\n")
    assert common.git_commit(tmp_path) == head
    (tmp_path / "engine.py").write_text("1\n")
    assert common.git_commit(tmp_path) == f"{head}+dirty"


_SAPPHIRE_RAPIDS = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\n"
    "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    "flags\t\t: fpu sse2 avx fma f16c avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 "
    "avx512_fp16 amx_bf16 amx_tile amx_int8\n\n"
    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu\n"
)
_ZEN3 = "model name\t: AMD EPYC 7763 64-Core Processor\nflags\t\t: fpu sse2 avx fma f16c avx2\n"


def test_run_info_records_the_cpu_model_and_its_flags() -> None:
    info = common.run_info()
    flags = info["cpu_flags"]
    assert info["cpu_model"] and info["cpu_model"] in info["cpu"]
    assert isinstance(info["torch_cpu_capability"], str) and info["torch_cpu_capability"]
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        assert flags == {}
        return
    # Against this machine's own /proc/cpuinfo: every flag that matters is named, true exactly
    # when the first CPU lists it.
    listed = set((common._cpuinfo_field(cpuinfo.read_text(), "flags", "Features") or "").split())
    arm = platform.machine().lower() in ("aarch64", "arm64")
    wanted = common.ARM_CPU_FLAGS if arm else common.X86_CPU_FLAGS
    assert flags == {flag: flag in listed for flag in wanted}


def test_cpu_features_reads_the_units_of_each_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in common.ISA_LIMIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    xeon = common.cpu_features(_SAPPHIRE_RAPIDS)
    assert xeon["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    if platform.machine().lower() in ("aarch64", "arm64"):
        return  # x86 flags are not looked for on an Arm machine
    on = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert on <= {f for f, present in xeon["cpu_flags"].items() if present}
    assert not xeon["cpu_flags"]["avx_vnni"]
    assert common.cpu_description(xeon) == "Intel(R) Xeon(R) Platinum 8480+ (AMX, AVX512-BF16)"
    zen3 = common.cpu_features(_ZEN3)
    assert zen3["cpu_flags"]["avx2"] and zen3["cpu_flags"]["fma"]
    assert not any(zen3["cpu_flags"][f] for f in ("avx512f", "avx512_bf16", "amx_tile"))
    assert common.cpu_description(zen3) == "AMD EPYC 7763 64-Core Processor (no bf16 units)"
    assert common.cpu_features("")["cpu_flags"] == {}
    assert xeon["isa_limits"] == {}


def test_cpu_features_record_the_isa_limits_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    xeon = common.cpu_features(_SAPPHIRE_RAPIDS)
    assert xeon["isa_limits"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert common.cpu_description(xeon).endswith("(AMX, AVX512-BF16, limited to AVX2/avx2)")


# bench modules with a ``main`` that write no result JSON of their own, and why.
_NO_RESULT_JSON = {
    "readme_results": "renders docs/results.md and the README's headline from the others",
    "gpu_profile": "writes text profiles, not a result",
    "gpu_check": "collects the results of others; its env.json records the host CPU itself",
    "llama_cpp_build": "builds llama.cpp for the benchmarks: measures nothing",
    "gguf_models": "writes model files for the benchmarks: measures nothing",
    "models_table": "writes docs/models.md from the tests' outcomes (commit and CPU in it)",
    "import_graph": "draws docs/imports.png from the source: measures nothing",
}


def test_every_benchmark_writes_its_result_with_the_run_info() -> None:
    bench = Path(common.__file__).resolve().parent
    writers = []
    for path in sorted(bench.rglob("*.py")):  # the top and every family folder
        source = path.read_text()
        if "\ndef main(" not in source or path.stem in _NO_RESULT_JSON:
            continue
        writers.append(path.stem)
        assert "write_results(" in source, f"{path.relative_to(bench)} writes no run info"
    assert len(writers) >= 15 and {"engine", "peers", "forward"} <= set(writers)
    assert "cpu_features()" in (bench / "gpu" / "gpu_check.py").read_text()
