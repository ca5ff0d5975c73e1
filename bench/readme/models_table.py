"""The table of supported models (architectures x formats x features), generated from the
tests: runs ``tests/engine/models/test_architectures.py``,
``tests/engine/test_tokenizer_sentencepiece.py``, ``tests/engine/models/test_gemma.py`` and
``tests/engine/models/test_gpt_oss.py``, reads each test's outcome from pytest's JUnit report,
and writes ``docs/models.md``.

A cell says what a test checked on this machine, never what should work: "ok" (passed),
"FAILED", or "not tested" with the skip reason. The features come from the architecture
registry (``engine/models/architectures.py``) and the refusals the tests pin.

    python -m baton.bench.readme.models_table [--out docs/models.md]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from baton.bench.common import cpu_description, git_commit
from baton.bench.tables import COMPACT, markdown_table
from baton.engine.models.architectures import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]
TESTS = (
    "tests/engine/models/test_architectures.py",
    "tests/engine/test_tokenizer_sentencepiece.py",
    "tests/engine/models/test_gemma.py",
    "tests/engine/models/test_gpt_oss.py",
)
OUT = ROOT / "docs" / "models.md"

# Test function -> the column it fills (per variant id in brackets).
COLUMNS = {
    "test_greedy_tokens_equal_transformers_from_folder_and_gguf": (
        "folder + GGUF: greedy = transformers"
    ),
    "test_gguf_config_equals_folder_config": "GGUF (tests' writer) = folder",
    "test_llama_cpp_converter_output_loads_as_its_folder": "llama.cpp converter's GGUF = folder",
}
# Single tests beside the table: what each checks -> its test id.
ALSO = {
    "SentencePiece GGUF tokenizer = transformers' ids": (
        "test_gguf_sentencepiece_ids_equal_transformers"
    ),
    "JSON schema through a SentencePiece vocabulary": (
        "test_json_schema_through_a_sentencepiece_vocabulary"
    ),
    "Phi-3 from llama.cpp's converter = folder": "test_phi3_from_llama_cpp_converter[False]",
    "Phi-3 LongRoPE from llama.cpp's converter = folder (same RoPE tables)": (
        "test_phi3_from_llama_cpp_converter[True]"
    ),
    "Gemma 2 from llama.cpp's converter = folder, Gemma tokenizer = transformers' ids": (
        "test_gemma2_from_llama_cpp_converter"
    ),
    "JSON schema through Gemma 2's SentencePiece vocabulary": (
        "test_json_schema_through_gemma2s_vocabulary"
    ),
    "sliding window = transformers (whole prefill)": (
        "test_sliding_window_attention_equals_transformers[whole]"
    ),
    "sliding window = transformers (chunked prefill)": (
        "test_sliding_window_attention_equals_transformers[chunked]"
    ),
    "sliding window = transformers (prefix cache)": (
        "test_sliding_window_attention_equals_transformers[prefix-cache]"
    ),
    "JSON schema on Qwen3": "test_json_schema_request_gives_a_valid_object[qwen3]",
    "JSON schema on Qwen3-MoE": "test_json_schema_request_gives_a_valid_object[qwen3_moe]",
    "JSON schema on Gemma 2": "test_json_schema_request_gives_a_valid_object[gemma2]",
    "JSON schema on Gemma 3": "test_json_schema_request_gives_a_valid_object[gemma3]",
    "JSON schema on gpt-oss": "test_json_schema_request_gives_a_valid_object[gpt_oss]",
    "Gemma 2 logits in bfloat16 within 2x transformers' own bfloat16 error": (
        "test_logits_within_tolerance_bfloat16[gemma2]"
    ),
    "Gemma 3 logits in bfloat16 within 2x transformers' own bfloat16 error": (
        "test_logits_within_tolerance_bfloat16[gemma3]"
    ),
    "gpt-oss MXFP4 experts (official layout) = transformers' decode": (
        "test_mxfp4_experts_load_as_transformers_decodes_them"
    ),
    "gpt-oss MXFP4 GGUF from llama.cpp's converter = folder": (
        "test_mxfp4_through_llama_cpp_converter"
    ),
    "gpt-oss harmony special tokens (folder, llama.cpp's GGUF) = transformers' ids": (
        "test_harmony_special_tokens_from_folder_and_llama_cpp_gguf"
    ),
}


def run_tests(report: Path) -> int:
    """Runs the architecture tests with a JUnit report at ``report``; pytest's exit code."""
    # -P: the repository root must not shadow installed packages named like its folders
    # (transformers imports the "kernels" package; baton has a kernels/ folder).
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    cmd += ["--junitxml", str(report)]
    return subprocess.run(cmd, cwd=ROOT, check=False).returncode


def outcomes(report: Path) -> dict[str, str]:
    """Each test id (``name[params]``) -> "ok", "FAILED" or "not tested: <reason>"."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped")
        if failed:
            out[name] = "FAILED"
        elif skipped is not None:
            out[name] = f"not tested: {skipped.get('message', '').removeprefix('Skipped: ')}"
        else:
            out[name] = "ok"
    return out


def render(results: dict[str, str], commit: str, cpu: str) -> str:
    """The Markdown page: the verified cells per variant, then the features per architecture."""
    variants = sorted(
        {
            m.group(1)
            for name in results
            if (m := re.match(rf"(?:{'|'.join(COLUMNS)})\[(.+)\]$", name))
        }
    )
    lines = [
        "# Supported models",
        "",
        "Generated by `python -m baton.bench.readme.models_table` from the tests' outcomes at "
        f"commit {commit[:7]} on {cpu}; tiny random-weight models in float32, greedy tokens "
        "checked against transformers' argmax after every prefix.",
        "",
    ]
    cells = [
        [variant, *(results.get(f"{test}[{variant}]", "not tested") for test in COLUMNS)]
        for variant in variants
    ]
    lines.append(markdown_table(["variant", *COLUMNS.values()], cells, COMPACT))
    also = [[what, results.get(test, "not tested")] for what, test in ALSO.items()]
    lines += ["", markdown_table(["also checked", "outcome"], also, COMPACT)]
    lines += ["", "## Features by architecture", "", markdown_table(FEATURES, features(), COMPACT)]
    lines += [
        "",
        "RoPE scaling: linear, Llama 3, YaRN and LongRoPE (from folders and GGUF; its short "
        "factors: sequences stay within the original context, a longer `max_model_len` is "
        "refused); any other scheme, "
        "a partial rotary factor or an unknown architecture is refused by name before any "
        "weight is read.",
        "",
    ]
    return "\n".join(lines)


FEATURES = (
    "architecture",
    "Hugging Face classes",
    "GGUF name",
    "tensor parallel",
    "CUDA graphs",
    '`quantization="gguf"` kernels',
    '`quantization="int8"`',
)


def features() -> list[list[str]]:
    """One row per architecture: what baton does with it beyond the verified forward pass."""
    rows = []
    for a in ARCHITECTURES.values():
        experts = a.experts
        tp = "refused (experts)" if experts else "refused (Gemma)" if a.gemma else "yes"
        graphs = (
            "off (experts)"
            if experts
            else "off (sliding window, soft-caps)"
            if a.gemma
            else "yes (off with a sliding window)"
        )
        expert_count = " (with an expert count)" if experts and a.gguf_name == "llama" else ""
        rows.append(
            [
                str(a.name),
                ", ".join(a.hf_classes),
                f"{a.gguf_name}{expert_count}",
                tp,
                graphs,
                "every linear and routed expert" if experts else "every linear",
                "refused (experts)" if experts else "yes",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Runs the tests and writes the page; exit status 1 when a test failed."""
    p = argparse.ArgumentParser(
        prog="python -m baton.bench.readme.models_table", description=__doc__
    )
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        code = run_tests(report)
        results = outcomes(report)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(render(results, git_commit(), cpu_description()))
    print(f"wrote {a.out}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
