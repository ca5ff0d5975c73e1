"""gpt-oss against transformers: logits of a prompt longer than the window, decode steps past
it, each of its features shown to matter (attention sinks, the clamped SwiGLU, the window),
the official checkpoints' MXFP4 expert layout read to the values transformers' own MXFP4
decoder gives (and through llama.cpp's converter), and harmony's special tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testing import prefill_logits, random_prompt
from model_files import build_tiny_model_dir

from baton.engine.loader import ModelLoadError, load_checkpoint
from baton.engine.loader.gpt_oss import dequantize_mxfp4
from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.causal_lm import causal_lm_class
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.tokenizer import Tokenizer

BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer: Tokenizer) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("gpt_oss"), tokenizer, "gpt_oss")


def _hf(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _model(folder: Path, **changes: Any) -> LlamaForCausalLM:
    checkpoint = load_checkpoint(folder)
    config = dataclasses.replace(checkpoint.config, **changes)
    model = causal_lm_class(config)(config)
    weights = dict(checkpoint.weights)
    if not config.attention_bias:  # the variant without biases: drop them
        weights = {k: v for k, v in weights.items() if "self_attn" not in k or "bias" not in k}
    model.load_weights(weights)
    return model


def test_config_reads_gpt_oss_fields(folder):
    config = load_checkpoint(folder).config
    assert config.architecture == "gpt_oss" and config.is_moe
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        4,
        2,
        32,
    )
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    assert (config.sliding_window, config.full_attention_layers) == (8, (1,))
    assert config.o_bias and config.rope_scaling["rope_type"] == "yarn"
    assert config.rope_scaling["truncate"] is False


def test_logits_equal_transformers(folder):
    model = _model(folder)
    ids = random_prompt(model.config.vocab_size)
    with torch.no_grad():
        ref = _hf(folder)(ids[None]).logits[0]
    assert (prefill_logits(model, ids) - ref).abs().max().item() <= 1e-4


FEATURES: dict[str, dict[str, Any]] = {
    "window": {"sliding_window": None},
    "clamp": {"swiglu_limit": 1000.0},
    "alpha": {"swiglu_alpha": 1.0},
}


@pytest.mark.parametrize("feature", [*FEATURES, "sinks"])
def test_each_feature_changes_the_logits(folder, feature):
    model = _model(folder)
    ids = random_prompt(model.config.vocab_size)
    base = prefill_logits(model, ids)
    if feature == "sinks":
        other = _model(folder)
        for layer in other.layers:
            assert layer.sinks is not None
            layer.sinks.fill_(float("-inf"))  # a sink of weight 0
    else:
        other = _model(folder, **FEATURES[feature])
    assert (prefill_logits(other, ids) - base).abs().max().item() > 1e-2, feature


def test_decode_past_the_window_equals_full_recompute(folder):
    model = _model(folder)
    hf = _hf(folder)
    seq = random_prompt(model.config.vocab_size, 5).tolist()
    blocks = torch.tensor([[9, 2, 14, 5, 11, 3, 8, 1, 12, 6]])
    kv = allocate_kv_cache(model.config, 16, BLOCK, torch.float32)
    for step in range(16):
        n = len(seq)
        new = n if step == 0 else 1
        meta = AttentionMetadata.build(
            torch.tensor([new]), torch.tensor([n]), blocks, BLOCK, sliding_window=8
        )
        with torch.no_grad():
            logits = model.compute_logits(
                model(torch.tensor(seq[-new:]), torch.arange(n - new, n), kv, meta)
            )[-1]
            full = hf(torch.tensor([seq])).logits[0, -1]
        assert (logits - full).abs().max().item() <= 1e-4, step
        seq.append(int(logits.argmax()))


def test_packed_experts_compute_the_unpacked_logits(folder):
    from baton.engine.models.packed import packing_available

    if not packing_available(torch.float32):
        pytest.skip("oneDNN packing is not available on this CPU")
    model = _model(folder)
    ids = random_prompt(model.config.vocab_size)
    ref = prefill_logits(model, ids)
    model.pack_weights()
    assert (prefill_logits(model, ids) - ref).abs().max().item() <= 1e-4


def _mxfp4(weight: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales for a weight of ``weight``'s shape ``[E, out, in]``."""
    e, rows, cols = weight.shape
    blocks = torch.randint(
        0, 256, (e, rows, cols // 32, 16), generator=generator, dtype=torch.uint8
    )
    scales = torch.randint(120, 126, (e, rows, cols // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_folder(folder: Path, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny gpt-oss in the official layout: each projection's experts as random MXFP4
    blocks + scales (rows = output features, gate and up alternating) and config.json's
    quantization_config saying so; with transformers' decode of each projection's bytes
    (``convert_moe_packed_tensors``: ``[E, in, out]``)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(5)
    tensors = load_file(str(folder / "model.safetensors"))
    packed = tmp_path_factory.mktemp("mxfp4")
    for file in folder.iterdir():
        if file.name != "model.safetensors":
            (packed / file.name).write_bytes(file.read_bytes())
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        dense = tensors.pop(name).transpose(1, 2)  # [E, out, in]
        blocks, scales = _mxfp4(dense, generator)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(packed / "model.safetensors"))
    return packed, expected


def test_mxfp4_experts_load_as_transformers_decodes_them(mxfp4_folder, tmp_path):
    packed, expected = mxfp4_folder
    weights = load_checkpoint(packed).weights
    for name, values in expected.items():  # [E, in, out]
        prefix = name.rsplit(".", 1)[0]
        for e in range(values.shape[0]):
            if name.endswith("gate_up_proj"):
                gate = weights[f"{prefix}.{e}.gate_proj.weight"]
                up = weights[f"{prefix}.{e}.up_proj.weight"]
                assert torch.equal(gate, values[e, :, ::2].T)
                assert torch.equal(up, values[e, :, 1::2].T)
            else:
                assert torch.equal(weights[f"{prefix}.{e}.down_proj.weight"], values[e].T)
    # Half a projection is a clear error naming it.
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for file in packed.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(packed / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.down_proj is missing"):
        load_checkpoint(broken)


def test_dequantize_mxfp4_values():
    """Byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0); scale 128 doubles them; a
    nibble with the sign bit (0x9: -0.5)."""
    blocks = torch.tensor([[0x21] + [0x00] * 14 + [0x90]], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))
    assert values[:2].tolist() == [1.0, 2.0] and values[-1].item() == -1.0
    assert values.shape == (32,)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks[:, :8], torch.tensor([128], dtype=torch.uint8))


@pytest.mark.timeout(600)
def test_mxfp4_through_llama_cpp_converter(mxfp4_folder, tmp_path):
    """llama.cpp's converter keeps the experts in MXFP4 (GGML type MXFP4, its own nibble
    order): baton reads that GGUF to the folder's config and weights exactly."""
    import subprocess

    from engine_testing import (
        assert_same_checkpoint,
        llama_cpp_convert,
    )

    from baton.bench.llama_server.llama_cpp_build import converter
    from baton.engine.loader.gguf import read_gguf

    try:
        converter()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the llama-cpp-python sdist could not be downloaded: {exc}")
    packed, _ = mxfp4_folder
    gguf = llama_cpp_convert(packed, tmp_path / "mxfp4.gguf")
    kinds = {t.name: t.tensor_type.name for t in read_gguf(gguf).tensors}
    assert kinds["blk.0.ffn_down_exps.weight"] == "MXFP4"
    assert_same_checkpoint(load_checkpoint(packed), load_checkpoint(gguf))


HARMONY = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]


@pytest.fixture(scope="module")
def harmony_folder(folder: Path, tmp_path_factory) -> Path:
    """The tiny gpt-oss with harmony's special tokens added to its tokenizer (as the last ids)
    and its embedding and LM head grown to cover them, <|return|> its end of sequence."""
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    out = tmp_path_factory.mktemp("harmony")
    for file in folder.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    backend = Backend.from_file(str(out / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY])
    backend.save(str(out / "tokenizer.json"))
    vocab = backend.get_vocab_size()
    tensors = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = 0.1 * torch.randn(vocab - tensors[name].shape[0], 64, generator=generator)
        tensors[name] = torch.cat([tensors[name], extra])
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    eos = backend.token_to_id("<|return|>")
    (out / "config.json").write_text(
        json.dumps({**config, "vocab_size": vocab, "eos_token_id": eos})
    )
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


@pytest.mark.timeout(600)
def test_harmony_special_tokens_from_folder_and_llama_cpp_gguf(harmony_folder, tmp_path):
    """Harmony's turn markers are one id each, as transformers' tokenizer has them, from the
    folder and from llama.cpp's converter's GGUF; <|return|> ends a sequence; the model
    generates after a harmony prompt, transformers' greedy tokens."""
    import subprocess

    from engine_testing import llama_cpp_convert
    from transformers import AutoTokenizer

    from baton.bench.llama_server.llama_cpp_build import converter
    from baton.engine import LLM, SamplingParams
    from baton.engine.loader import load_tokenizer

    prompt = "<|start|>user<|message|>Name a colour.<|end|><|start|>assistant<|channel|>final"
    reference = AutoTokenizer.from_pretrained(harmony_folder)
    ids = reference.encode(prompt, add_special_tokens=False)
    ours = load_tokenizer(harmony_folder)
    assert ours.encode(prompt, add_special_tokens=False) == ids
    for token in HARMONY:
        assert len(ours.encode(token, add_special_tokens=False)) == 1, token
    eos = reference.convert_tokens_to_ids("<|return|>")
    assert eos in load_checkpoint(harmony_folder).config.eos_token_ids
    try:
        converter()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the llama-cpp-python sdist could not be downloaded: {exc}")
    gguf = llama_cpp_convert(harmony_folder, tmp_path / "harmony.gguf")
    assert load_tokenizer(gguf).encode(prompt, add_special_tokens=False) == ids
    llm = LLM(str(harmony_folder), dtype="float32", max_model_len=256, max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = list(out.outputs[0].token_ids)
    with torch.no_grad():
        logits = _hf(harmony_folder)(torch.tensor([ids + tokens])).logits[0]
    assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == tokens
