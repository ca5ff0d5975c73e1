"""SentencePiece GGUF vocabularies (Llama 2, Mistral up to v0.3, Gemma): a tiny SentencePiece BPE
model trained here, a Llama folder using it, converted to GGUF by llama.cpp's own converter;
baton's tokenizer from that GGUF gives transformers' ids for the folder on a fixed text set, and
a JSON-schema request through it gives a valid object. The same for a Gemma 2 folder with a
Gemma-style vocabulary (no dummy prefix, <pad> <eos> <bos> <unk> <mask> first)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from engine_testing import assert_same_checkpoint, json_object, llama_cpp_convert

from baton.bench.llama_server.llama_cpp_build import converter
from baton.engine.loader import load_tokenizer

spm = pytest.importorskip("sentencepiece")

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Über café naïve, 東京 です.\n"
    '    def f(x): return x + 1\n{"name": "Ana", "age": 34, "tags": ["a", "b"]}\n'
    "Numbers 1234567 and 3.14, a-b_c/d; emoji 🙂 and tabs\tend.\n"
)
TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces and\ttab",
    "Über café naïve — 東京 です 🙂",
    '{"name": "Ana", "age": 34}',
    "line one\nline two\n\n",
    "a <tool> call",
    "<s> literal bos text",
    "",
    "Zebra Quartz xylophone 🦓",  # pieces absent from the corpus: byte fallback
]


@pytest.fixture(scope="module")
def spm_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(Hugging Face folder, its GGUF by llama.cpp's converter) of a tiny random Llama whose
    tokenizer is a 400-piece SentencePiece BPE with byte fallback."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("spm")
    sp_model = _train(
        root, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, user_defined_symbols=["<tool>"]
    )
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2)
    folder = _with_tokenizer(LlamaForCausalLM(config), root / "model", sp_model)
    try:
        converter()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the llama-cpp-python sdist could not be downloaded: {exc}")
    return folder, llama_cpp_convert(folder, root / "spm.gguf")


SHAPE = {
    "vocab_size": 400,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _with_tokenizer(model: torch.nn.Module, folder: Path, sp_model: Path) -> Path:
    """``model`` saved in ``folder`` with the SentencePiece tokenizer ``sp_model``, its
    tokenizer.json written by transformers and the tokenizer_config.json a Hugging Face repo
    has (its added_tokens_decoder is where llama.cpp's converter reads the token types)."""
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(sp_model.read_bytes())
    config = json.dumps(
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "added_tokens_decoder": {
                str(i): {"content": text, "special": special, "normalized": False}
                for i, text, special in (
                    (0, "<unk>", True),
                    (1, "<s>", True),
                    (2, "</s>", True),
                    (3, "<tool>", False),
                )
            },
        }
    )
    (folder / "tokenizer_config.json").write_text(config)
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(config)  # save_pretrained rewrote it
    return folder


@pytest.mark.timeout(600)  # a first run downloads the llama-cpp-python sdist (76 MB)
def test_gguf_sentencepiece_ids_equal_transformers(spm_llama: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    folder, gguf = spm_llama
    reference = AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(gguf)
    assert ours.vocab_size == 400 and ours.bos_token_id == 1 and ours.eos_token_id == 2
    assert ours.add_bos_token
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        # Byte fallback and the "▁" spaces come back as the text, leading space included.
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert any(t.startswith("<0x") for t in ours.convert_ids_to_tokens(ours.encode("🦓")))


def test_json_schema_through_a_sentencepiece_vocabulary(spm_llama: tuple[Path, Path]) -> None:
    _, gguf = spm_llama
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["city", "ok", "n"],
        "additionalProperties": False,
    }
    json_object(str(gguf), "A city as JSON:", schema, max_tokens=96)


@pytest.mark.parametrize("longrope", [False, True])
def test_phi3_from_llama_cpp_converter(spm_llama, tmp_path, longrope) -> None:
    """Phi-3 as llama.cpp writes it (q|k|v in attn_qkv, gate|up in ffn_up; LongRoPE's factors
    as rope_factors_* tensors): the folder's config and weights exactly (the factors as the
    float32 values both RoPE tables are computed from), and the same RoPE tables."""

    from transformers import Phi3Config, Phi3ForCausalLM

    from baton.engine.loader import load_checkpoint
    from baton.engine.models.layers import RotaryEmbedding

    folder, _ = spm_llama
    factors = [1.0, 1.1, 1.3, 1.6, 2.0, 3.0, 4.0, 6.0]
    scaling = {"rope_type": "longrope", "short_factor": factors, "long_factor": factors}
    config = Phi3Config(
        **SHAPE,
        rope_scaling=scaling if longrope else None,
        original_max_position_embeddings=128 if longrope else 512,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    phi = _with_tokenizer(Phi3ForCausalLM(config), tmp_path / "phi3", folder / "tokenizer.model")
    gguf = llama_cpp_convert(phi, tmp_path / "phi3.gguf")
    a, b = load_checkpoint(phi), load_checkpoint(gguf)
    if longrope:
        ours, theirs = dict(a.config.rope_scaling), dict(b.config.rope_scaling)
        for key in ("short_factor", "long_factor"):
            assert theirs.pop(key) == torch.tensor(ours.pop(key), dtype=torch.float32).tolist()
        assert ours == theirs
        ropes = [
            RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
            for c in (a.config, b.config)
        ]
        assert torch.equal(ropes[0].cos, ropes[1].cos) and torch.equal(ropes[0].sin, ropes[1].sin)
        b = dataclasses.replace(b, config=dataclasses.replace(b.config, rope_scaling=None))
        a = dataclasses.replace(a, config=dataclasses.replace(a.config, rope_scaling=None))
    assert_same_checkpoint(a, b)


def _train(root: Path, **options: object) -> Path:
    """A 400-piece SentencePiece BPE with byte fallback trained on ``CORPUS``; its model file."""
    (root / "corpus.txt").write_text(CORPUS * 40)
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"),
        model_prefix=str(root / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        minloglevel=2,
        **options,
    )
    return root / "tokenizer.model"


@pytest.fixture(scope="module")
def spm_gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(Hugging Face folder, its GGUF by llama.cpp's converter, which writes Gemma 2 only with
    a tokenizer.model) of a tiny random Gemma 2 with a Gemma-style SentencePiece vocabulary."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    root = tmp_path_factory.mktemp("spm_gemma")
    sp_model = _train(
        root,
        add_dummy_prefix=False,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        bos_piece="<bos>",
        eos_piece="<eos>",
        user_defined_symbols=["<mask>", "<tool>"],
    )
    torch.manual_seed(0)
    config = Gemma2Config(
        **SHAPE,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    folder = root / "gemma2"
    Gemma2ForCausalLM(config).save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(sp_model.read_bytes())
    specials = ((0, "<pad>", True), (1, "<eos>", True), (2, "<bos>", True), (3, "<unk>", True))
    tokens = (*specials, (4, "<mask>", True), (5, "<tool>", False))
    tokenizer_config = json.dumps(
        {
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": {
                str(i): {"content": text, "special": special, "normalized": False}
                for i, text, special in tokens
            },
        }
    )
    (folder / "tokenizer_config.json").write_text(tokenizer_config)
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(tokenizer_config)
    try:
        converter()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"the llama-cpp-python sdist could not be downloaded: {exc}")
    return folder, llama_cpp_convert(folder, root / "gemma2.gguf")


@pytest.mark.timeout(600)
def test_gemma2_from_llama_cpp_converter(spm_gemma2: tuple[Path, Path]) -> None:
    """Gemma 2 as llama.cpp writes it (norms stored as 1 + w, its four norm names, the caps,
    its SentencePiece vocabulary without a dummy prefix): the folder's config and weights
    exactly, and transformers' GemmaTokenizer ids on the text set."""
    from transformers import AutoTokenizer

    from baton.engine.loader import load_checkpoint

    folder, gguf = spm_gemma2
    assert_same_checkpoint(load_checkpoint(folder), load_checkpoint(gguf))
    reference = AutoTokenizer.from_pretrained(folder)
    assert type(reference).__name__ == "GemmaTokenizer"
    ours = load_tokenizer(gguf)
    assert ours.vocab_size == 400 and ours.bos_token_id == 2 and ours.eos_token_id == 1
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_json_schema_through_gemma2s_vocabulary(spm_gemma2: tuple[Path, Path]) -> None:
    _, gguf = spm_gemma2
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    }
    json_object(str(gguf), "A city as JSON:", schema, max_tokens=96)
