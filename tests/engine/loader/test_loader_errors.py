"""Model loaders' error cases: missing, corrupt and truncated files, unsupported types and
architectures, missing tensors, weights and hyperparameters, bad arguments; and a handwritten
GGUF that loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_files import encode_tensor, write_gguf
from loader_testing import MINI_VOCAB, _tiny_metadata, _tiny_tensors
from safetensors.torch import load_file

from baton.engine.loader import ModelLoadError, load_checkpoint, load_tokenizer

# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf.*no such file"):
        load_checkpoint(missing)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json") as info:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_random_bytes_gguf(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 100, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="random.gguf.*not a readable GGUF"):
        load_checkpoint(path)


def test_empty_gguf(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf"):
        load_checkpoint(path)


def test_tiny_handwritten_gguf_loads(tmp_path: Path) -> None:
    # The baseline for the error cases below: the same file without the defect loads.
    path = write_gguf(
        tmp_path / "ok.gguf", "llama", _tiny_metadata("llama"), _tiny_tensors(MINI_VOCAB)
    )
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.head_dim == 16 and checkpoint.config.num_kv_heads == 1
    assert checkpoint.config.max_position_embeddings == 64


@pytest.mark.parametrize("cut", ["metadata", "half"])
def test_truncated_gguf(cut: str, tmp_path: Path) -> None:
    whole = write_gguf(
        tmp_path / "whole.gguf", "llama", _tiny_metadata("llama"), _tiny_tensors(MINI_VOCAB)
    )
    data = whole.read_bytes()
    # 2000 bytes ends inside the metadata (the token list); half ends inside the tensor data.
    size = 2000 if cut == "metadata" else len(data) // 2
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:size])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(truncated|not a readable GGUF)"):
        load_checkpoint(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType

    tensors = _tiny_tensors(MINI_VOCAB)
    # IQ4_NL: 18-byte blocks of 32 values; the bytes only need the right size.
    tensors["blk.0.ffn_up.weight"] = (
        np.zeros((64, 18), dtype=np.uint8),
        GGMLQuantizationType.IQ4_NL,
    )
    path = write_gguf(tmp_path / "iq.gguf", "llama", _tiny_metadata("llama"), tensors)
    with pytest.raises(
        ModelLoadError, match=r"iq\.gguf.*blk\.0\.ffn_up\.weight.*IQ4_NL.*not supported"
    ):
        load_checkpoint(path)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "falcon.gguf", "falcon", _tiny_metadata("falcon"), _tiny_tensors(MINI_VOCAB)
    )
    with pytest.raises(ModelLoadError, match=r"falcon\.gguf.*'falcon'.*llama, mistral, qwen2"):
        load_checkpoint(path)


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "hole.gguf",
        "llama",
        _tiny_metadata("llama"),
        _tiny_tensors(MINI_VOCAB, drop="blk.0.ffn_gate.weight"),
    )
    with pytest.raises(
        ModelLoadError, match=r"hole\.gguf.*missing weights model\.layers\.0\.mlp\.gate_proj"
    ):
        load_checkpoint(path)


def test_gguf_unsupported_tokenizer(tmp_path: Path) -> None:
    metadata = _tiny_metadata("llama")
    metadata["tokenizer.ggml.model"] = "t5"
    path = write_gguf(tmp_path / "t5.gguf", "llama", metadata, _tiny_tensors(MINI_VOCAB))
    with pytest.raises(ModelLoadError, match=r"t5\.gguf.*tokenizer\.ggml\.model 't5'"):
        load_checkpoint(path)


def test_gguf_missing_hyperparameter(tmp_path: Path) -> None:
    metadata = _tiny_metadata("llama")
    del metadata["llama.feed_forward_length"]
    path = write_gguf(tmp_path / "noffn.gguf", "llama", metadata, _tiny_tensors(MINI_VOCAB))
    with pytest.raises(ModelLoadError, match=r"noffn\.gguf.*llama\.feed_forward_length.*missing"):
        load_checkpoint(path)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    from baton.engine.loader.gguf_config import _llama3_rope_factors

    tensors = _tiny_tensors(MINI_VOCAB)
    factors = _llama3_rope_factors(10000.0, 16, 8.0, 1.0, 4.0, 8192)
    tensors["rope_freqs.weight"] = encode_tensor(factors, "F32")
    path = write_gguf(tmp_path / "l31.gguf", "llama", _tiny_metadata("llama"), tensors)
    scaling = load_checkpoint(path).config.rope_scaling
    assert scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _edit_config(source: Path, target: Path, **changes: Any) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_unsupported_hf_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = _edit_config(
        tiny_model_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    with pytest.raises(ModelLoadError, match=r"config\.json.*GPT2LMHeadModel.*LlamaForCausalLM"):
        load_checkpoint(directory)


def test_hf_missing_weight(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    directory = tmp_path / "hole"
    shutil.copytree(tiny_model_dir, directory)
    saved = load_file(str(directory / "model.safetensors"))
    del saved["model.layers.1.self_attn.v_proj.weight"]
    save_file(saved, str(directory / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"hole.*missing weights model\.layers\.1\.self_attn\.v_proj"
    ):
        load_checkpoint(directory)


def test_hf_wrong_shape(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = _edit_config(tiny_model_dir, tmp_path / "wide", intermediate_size=256)
    with pytest.raises(
        ModelLoadError, match=r"wide.*gate_proj\.weight has shape \(128, 64\), expected \(256, 64\)"
    ):
        load_checkpoint(directory)


def test_hf_corrupt_safetensors(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*not a readable safetensors"):
        load_checkpoint(directory)


def test_hf_missing_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "notok"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"notok.*tokenizer\.json"):
        load_checkpoint(directory)


def test_hf_no_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "noweights"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"noweights.*no \*\.safetensors"):
        load_checkpoint(directory)


def test_bad_arguments(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="floating torch.dtype"):
        load_checkpoint(tiny_model_dir, dtype=torch.int8)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"weights\.bin.*expected a \.gguf file"):
        load_checkpoint(other)
    assert load_tokenizer(tiny_model_dir).vocab_size == 49152
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        load_tokenizer(tmp_path / "missing.gguf")


def test_model_load_error_is_value_error() -> None:
    assert issubclass(ModelLoadError, ValueError)
