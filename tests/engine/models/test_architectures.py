"""Each architecture end to end against transformers: a tiny random-weight model saved as a
Hugging Face folder and converted to GGUF (by the tests' writer and by llama.cpp's own
converter), served by the engine in float32, its greedy tokens checked against transformers'
argmax; and a JSON-schema request validated on a dense and on a mixture-of-experts model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT
from engine_testing import (
    assert_equal_weights,
    assert_same_checkpoint,
    json_object,
    llama_cpp_convert_many,
)
from gguf_files import gguf_from_hf_dir, mini_tokenizer_metadata
from model_files import build_tiny_model_dir

from baton.bench.llama_server.llama_cpp_build import converter
from baton.engine import LLM, SamplingParams
from baton.engine.loader import ModelLoadError, load_checkpoint
from baton.engine.tokenizer import Tokenizer

# YaRN stretching 512 original positions to the tiny models' 2048 (factor 4): with head_dim 16
# the ramp falls inside the dimensions, so interpolated, extrapolated and blended frequencies
# all take part.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}

# LongRoPE with an original context of 512 of the tiny models' 2048 (the engine then keeps
# sequences within 512, where transformers applies the short factors too).
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
}

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "qwen3": {"arch": "qwen3"},
    "llama-yarn": {"arch": "llama", "rope_scaling": YARN},
    "qwen3-yarn": {"arch": "qwen3", "rope_scaling": YARN},
    "mixtral": {"arch": "mixtral"},
    "qwen3_moe": {"arch": "qwen3_moe"},
    "qwen2_moe": {"arch": "qwen2_moe"},
    "phi3": {"arch": "phi3"},
    "phi3-longrope": {"arch": "phi3", "rope_scaling": LONGROPE},
    "gemma2": {"arch": "gemma2"},
    # Linear scaling on the full layers only; the windowed ones keep plain RoPE of their base.
    "gemma3": {"arch": "gemma3", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # gpt-oss's YaRN: no truncation of the ramp (its configs say truncate: false).
    "gpt_oss": {"arch": "gpt_oss", "rope_scaling": {**YARN, "truncate": False}},
}
# llama.cpp's converter writes Phi-3 and Gemma 2 only with a SentencePiece tokenizer.model (the
# folders here carry SmolLM2's tokenizer.json).
NO_CONVERTER = {"phi3", "phi3-longrope", "gemma2"}
PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively, starting from",
]
GREEDY = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def variant_folders(tmp_path_factory, tokenizer: Tokenizer) -> dict[str, Path]:
    """Every variant's HF folder, built once for this module (all at once, so that llama.cpp's
    converter can take them in one process: ``llama_cpp_ggufs``)."""
    return {
        name: build_tiny_model_dir(tmp_path_factory.mktemp(name), tokenizer, **VARIANTS[name])
        for name in sorted(VARIANTS)
    }


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, variant_folders: dict[str, Path]):
    """(name, HF folder) of one variant."""
    return request.param, variant_folders[request.param]


def _hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _engine_tokens(model: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=256, max_num_seqs=4)
    try:
        requests = [{"prompt_token_ids": ids} for ids in prompts]
        outs = llm.generate(requests, GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_greedy_tokens_equal_transformers_from_folder_and_gguf(
    variant, tmp_path, tokenizer, default_gguf_metadata
):
    name, folder = variant
    hf = _hf_model(folder)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    tokens = _engine_tokens(str(folder), prompts)
    for prompt, out in zip(prompts, tokens, strict=True):
        assert len(out) == GREEDY.max_tokens
        # Teacher-forced: transformers' argmax after every prefix is the next engine token.
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out, (name, prompt)
    # The same model through llama.cpp's layout (float32 tensors): the same tokens.
    gguf = gguf_from_hf_dir(folder, tmp_path / f"{name}.gguf", default_gguf_metadata)
    assert _engine_tokens(str(gguf), prompts) == tokens


def test_gguf_config_equals_folder_config(variant, tmp_path):
    name, folder = variant
    gguf = gguf_from_hf_dir(folder, tmp_path / f"{name}.gguf", mini_tokenizer_metadata())
    a, b = load_checkpoint(folder), load_checkpoint(gguf)
    for field in ("architecture", "head_dim", "rope_theta", "tie_word_embeddings"):
        assert getattr(a.config, field) == getattr(b.config, field), field
    kind = lambda c: (c.rope_scaling or {}).get("rope_type")  # noqa: E731
    assert (
        kind(a.config) == kind(b.config) == VARIANTS[name].get("rope_scaling", {}).get("rope_type")
    )
    assert_equal_weights(a, b)


@pytest.fixture(scope="module")
def llama_cpp_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist (downloaded once into
    ~/.cache/baton, only the converter's files unpacked)."""
    try:
        return converter()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the llama-cpp-python sdist could not be downloaded: {exc}")


@pytest.fixture(scope="module")
def llama_cpp_ggufs(
    variant_folders: dict[str, Path], tmp_path_factory, llama_cpp_converter: Path
) -> dict[str, tuple[Path, str | None]]:
    """Each convertible variant as llama.cpp's converter writes it (float32 tensors): its GGUF
    path and the converter's output where it failed. One converter process for them all (a
    process each took 4-5 s of CPU, mostly importing torch and transformers)."""
    out = tmp_path_factory.mktemp("llama_cpp")
    jobs = {
        name: (folder, out / f"{name}.gguf")
        for name, folder in variant_folders.items()
        if name not in NO_CONVERTER
    }
    errors = llama_cpp_convert_many(jobs)
    return {name: (jobs[name][1], errors[name]) for name in jobs}


@pytest.mark.timeout(600)  # a first run downloads the sdist (76 MB)
def test_llama_cpp_converter_output_loads_as_its_folder(variant, llama_cpp_ggufs):
    """The GGUF llama.cpp's own converter writes (names, q/k layout, rope keys, tokenizer)
    loads to the folder's config, weights and tokens exactly."""
    name, folder = variant
    if name in NO_CONVERTER:
        pytest.skip(
            "llama.cpp's converter writes Phi-3 and Gemma 2 only with a SentencePiece tokenizer "
            "(test_tokenizer_sentencepiece.py converts them so)"
        )
    gguf, error = llama_cpp_ggufs[name]
    assert error is None, f"convert_hf_to_gguf.py failed on {name}:\n{error}"
    a, b = load_checkpoint(folder), load_checkpoint(gguf)
    assert_same_checkpoint(a, b)
    for text in PROMPTS:
        assert a.tokenizer.encode(text) == b.tokenizer.encode(text)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt_oss"])
def test_json_schema_request_gives_a_valid_object(tokenizer, tmp_path, arch):
    folder = build_tiny_model_dir(tmp_path / arch, tokenizer, arch)
    schema = {
        "type": "object",
        # Bounded, so that a random-weight model's object ends within max_tokens.
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "colour": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "colour"],
        "additionalProperties": False,
    }
    json_object(str(folder), "A person as JSON:", schema, max_tokens=64)


@pytest.mark.parametrize(
    "scaling,message",
    [
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0],
                "original_max_position_embeddings": 512,
            },
            "longrope' has 1 short_factor entries, expected 8",
        ),
        ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
        ({**YARN, "unknown_knob": 1.0}, "unknown_knob"),
    ],
)
def test_unsupported_rope_scaling_refused_before_weights_are_read(
    tokenizer, tmp_path, scaling, message, monkeypatch
):
    folder = build_tiny_model_dir(tmp_path / "m", tokenizer, "llama")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = scaling
    (folder / "config.json").write_text(json.dumps(config))
    import baton.engine.loader.hf as hf_loader

    def no_weights(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were read before the config was checked")

    monkeypatch.setattr(hf_loader, "_read_safetensors", no_weights)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_checkpoint(folder)
    assert str(folder) in str(info.value)


def test_unsupported_gguf_rope_scaling_refused(tokenizer, tmp_path):
    folder = build_tiny_model_dir(tmp_path / "m", tokenizer, "qwen3", rope_scaling=YARN)
    path = gguf_from_hf_dir(folder, tmp_path / "m.gguf", mini_tokenizer_metadata())
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    field = reader.fields["qwen3.rope.scaling.type"]
    # Same length as "yarn", so the file stays well formed: an unknown scheme.
    field.parts[field.data[0]][:] = memoryview(b"ntkx").cast("B")
    del reader
    with pytest.raises(ModelLoadError, match="ntkx") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_moe_runs_on_the_default_bfloat16_kernels_and_refuses_int8(tokenizer, tmp_path):
    folder = build_tiny_model_dir(tmp_path / "moe", tokenizer, "qwen3_moe")
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, max_num_seqs=4)
    try:
        (out,) = llm.generate(["The three primary colours are"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="does not cover a mixture-of-experts model's experts"):
        LLM(str(folder), quantization="int8", max_model_len=256)


def test_moe_cannot_be_cut_for_tensor_parallelism(tokenizer, tmp_path):
    folder = build_tiny_model_dir(tmp_path / "moe", tokenizer, "mixtral")
    with pytest.raises(ValueError, match="mixture-of-experts model .4 experts. cannot be cut"):
        LLM(str(folder), tensor_parallel_size=2, max_model_len=256)


def _with_window(tokenizer, tmp_path: Path, window: int) -> Path:
    """The tiny Llama as a Mistral v0.1-style model: attention through a sliding window."""
    folder = build_tiny_model_dir(tmp_path / "m", tokenizer, "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 7}, {"enable_prefix_caching": True}],
    ids=["whole", "chunked", "prefix-cache"],
)
def test_sliding_window_attention_equals_transformers(
    tokenizer, tmp_path, engine_args, default_gguf_metadata
):
    """A window of 8 tokens on prompts of ~20 and 28 greedy tokens: every step past the window
    masks keys out, in prefill (whole or in chunks of 7) and decode; transformers' argmax
    after every prefix is the engine's next token. The GGUF gives the same tokens."""
    folder = _with_window(tokenizer, tmp_path, 8)
    assert load_checkpoint(folder).config.sliding_window == 8
    hf = _hf_model(folder)
    assert hf.config.sliding_window == 8
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_seqs=4, **engine_args)
    try:
        requests = [{"prompt_token_ids": ids} for ids in prompts]
        runs = 2 if engine_args.get("enable_prefix_caching") else 1  # the second from cache
        for _ in range(runs):
            outs = llm.generate(requests, GREEDY, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            for prompt, out in zip(prompts, tokens, strict=True):
                with torch.no_grad():
                    logits = hf(torch.tensor([prompt + out])).logits[0]
                assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out, prompt
    finally:
        llm.shutdown()
    if not engine_args:  # llama.cpp's layout with attention.sliding_window: the same tokens
        gguf = gguf_from_hf_dir(folder, tmp_path / "m.gguf", default_gguf_metadata)
        assert load_checkpoint(gguf).config.sliding_window == 8
        assert _engine_tokens(str(gguf), prompts) == tokens
    # Without the window the same model would answer otherwise (the test can fail).
    full = dict(json.loads((folder / "config.json").read_text()), sliding_window=None)
    (folder / "config.json").write_text(json.dumps(full))
    assert _engine_tokens(str(folder), prompts) != tokens


@pytest.mark.timeout(180)  # without the release the request could never be scheduled
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_windowed_model_runs_a_long_sequence_in_a_window_of_blocks(
    tokenizer, tmp_path, prefix_caching
):
    """Every layer windowed (8 tokens): blocks wholly before the window go back to the pool,
    so a 100-token prompt plus 60 generated tokens (40 blocks of 4) run in a cache of 12
    blocks, in chunks of 8, with transformers' greedy tokens."""
    folder = _with_window(tokenizer, tmp_path, 8)
    prompt = (tokenizer.encode(" ".join(PROMPTS)) * 6)[:100]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=1,
        block_size=4,
        num_kv_blocks=12,
        max_num_batched_tokens=8,
        enable_prefix_caching=prefix_caching,
    )
    try:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == 60
    with torch.no_grad():
        logits = _hf_model(folder)(torch.tensor([prompt + tokens])).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens


@pytest.mark.timeout(300)
def test_a_32k_context_in_the_blocks_of_a_4k_window(tokenizer, tmp_path):
    """The issue's goal at tiny scale: a window of 4096, a 32768-token prompt in chunks of 1024
    and 32 generated tokens, in a cache of 324 blocks of 16 (the window, one chunk and 4
    spare: 5184 slots, where full attention would need 2050 blocks)."""
    folder = _with_window(tokenizer, tmp_path, 4096)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40000}))
    prompt = (tokenizer.encode(" ".join(PROMPTS)) * 3000)[:32768]
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=34000,
        max_num_seqs=1,
        block_size=16,
        num_kv_blocks=(4096 + 1024) // 16 + 4,
        max_num_batched_tokens=1024,
    )
    try:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) == 32


def test_qwen_windows_only_the_layers_from_max_window_layers(tokenizer, tmp_path):
    """Qwen2 with use_sliding_window: layers below max_window_layers see every token, the
    others a window of 8 (transformers' rule; the config without layer_types, as
    transformers 4 wrote it), greedy tokens equal to transformers'."""
    folder = build_tiny_model_dir(tmp_path / "q", tokenizer, "qwen2")
    config = json.loads((folder / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_checkpoint(folder).config
    assert (loaded.sliding_window, loaded.full_attention_layers) == (8, (0,))
    hf = _hf_model(folder)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    for prompt, out in zip(prompts, _engine_tokens(str(folder), prompts), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out, prompt


def test_longrope_keeps_sequences_within_the_original_context(tokenizer, tmp_path, caplog):
    """baton applies LongRoPE's short factors: sequences stay within the original context
    (where transformers applies them too), said in a warning; a longer max_model_len is
    refused by name."""
    folder = build_tiny_model_dir(tmp_path / "phi", tokenizer, "phi3", rope_scaling=LONGROPE)
    with caplog.at_level("WARNING", logger="baton.engine.processing.model_setup"):
        llm = LLM(str(folder), dtype="float32", max_num_seqs=2)
    try:
        assert llm.engine.max_model_len == 512
        assert "LongRoPE scaling beyond its original 512 positions" in caplog.text
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="max_model_len=1024: .*at most 512"):
        LLM(str(folder), dtype="float32", max_model_len=1024)


def test_the_models_page_lists_every_architecture():
    """docs/models.md (python -m baton.bench.readme.models_table) is regenerated when the registry
    changes: every architecture has its row, and no test it reports failed."""
    from baton.engine.models.architectures import ARCHITECTURES

    page = (ROOT / "docs" / "models.md").read_text()
    for name, arch in ARCHITECTURES.items():
        assert f"| {name} | {', '.join(arch.hf_classes)} |" in page, name
    assert "FAILED" not in page
