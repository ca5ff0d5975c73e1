"""``quantization="gguf"``: a GGUF file's block-quantised linears kept in their blocks and
multiplied by ``kernels/quant_linear.py`` (``loader/gguf_quant.py``, ``models/gguf_linear.py``).

The tiny Llama of ``conftest`` (hidden 64, MLP 128: whole 32-weight blocks) is written with
its linears in Q8_0, Q4_0 or Q4_1 and its embedding (the tied LM head) in Q8_0, then loaded
both ways: kept quantised, and dequantised to float32 (``quantization=None``). The kernel's
weights are bit-identical to gguf's dequantisation (``tests/kernels/test_kernels_quant_linear.py``),
so the two models differ only in the float32 summation order of each dot product.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import gguf.quants
import pytest
import torch
from gguf_files import gguf_from_hf_dir, mini_tokenizer_metadata
from model_files import build_tiny_model_dir
from model_testing import decode_after_prompts

from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.loader import ModelLoadError, ShardSpec, load_checkpoint
from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.causal_lm import causal_lm_class
from baton.engine.models.gguf_linear import PROJECTIONS
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.worker.build import add_cpu_kernels
from baton.kernels.quant_formats import QuantWeight, dequantize
from baton.kernels.quant_linear import dequantize_rows_native

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the kernel is built for x86-64 only"
)

KINDS = ("Q8_0", "Q4_0", "Q4_1")
BLOCK = 4
LAYERS = 2  # conftest.TINY_SHAPE
# Token ids of the mini tokenizer (262 tokens), so no text has to be encoded.
PROMPTS = [[40, 72, 101, 108, 108, 111], [84, 104, 101, 32, 99, 97, 116], [49, 50, 51]]


def _linear_type(kind: str) -> object:
    def tensor_type(name: str) -> str:
        if name.endswith("norm.weight"):
            return "F32"
        return "Q8_0" if name == "token_embd.weight" else kind

    return tensor_type


@pytest.fixture(scope="module", params=KINDS)
def quant_gguf(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama with every linear in ``request.param`` and its embedding in Q8_0."""
    path = tmp_path_factory.mktemp("gguf_quant") / f"tiny-{request.param}.gguf"
    return gguf_from_hf_dir(
        tiny_model_dir, path, mini_tokenizer_metadata(), _linear_type(request.param)
    )


def _model(path: Path, dtype: torch.dtype, keep: bool) -> LlamaForCausalLM:
    ckpt = load_checkpoint(path, dtype, keep_quantized=keep)
    model = causal_lm_class(ckpt.config)(ckpt.config, quantized=ckpt.quantized).to(dtype)
    model.load_weights(ckpt.weights)
    add_cpu_kernels(model, "gguf" if keep else None)
    return model.eval()


def test_kept_blocks_dequantise_to_the_dense_loaders_weights(quant_gguf: Path) -> None:
    """Raw rows unpermuted (q/k) and concatenated (q|k|v, gate|up) give the very weights the
    dequantising loader gives, bit for bit; the dense checkpoint holds none of them."""
    dense = load_checkpoint(quant_gguf, torch.float32)
    kept = load_checkpoint(quant_gguf, torch.float32, keep_quantized=True)
    expected = {f"model.layers.{i}.{fused}" for i in range(LAYERS) for fused, _ in PROJECTIONS}
    assert set(kept.quantized) == expected | {"lm_head.weight"}
    assert set(kept.weights) == {  # the tied embedding is looked up in the head's blocks
        "model.norm.weight",
        *(
            f"model.layers.{i}.{n}_layernorm.weight"
            for i in range(2)
            for n in ("input", "post_attention")
        ),
    }
    for i in range(LAYERS):
        for fused, parts in PROJECTIONS:
            weight = kept.quantized[f"model.layers.{i}.{fused}"]
            want = torch.cat([dense.weights[f"model.layers.{i}.{p}"] for p in parts])
            assert torch.equal(dequantize(weight), want), fused
    head = kept.quantized["lm_head.weight"]
    assert head.format == "Q8_0"
    assert torch.equal(dequantize(head), dense.weights["model.embed_tokens.weight"])
    ids = torch.tensor([0, 5, 5, 261, 17])  # repeats, any order, the last row
    looked_up = dequantize_rows_native(head, ids) + 0.0  # -0.0 -> 0.0 (see dequantize_native)
    assert torch.equal(looked_up, dense.weights["model.embed_tokens.weight"][ids] + 0.0)


def test_only_norms_are_dequantised(quant_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No linear weight nor the embedding is ever decoded to floats at load, and the model
    holds no dense projection, LM head or embedding table (lookups decode the tied head's
    rows): only the norms."""
    decoded: list[tuple[int, ...]] = []
    real = gguf.quants.dequantize

    def spy(data, kind):  # noqa: ANN001, ANN202 - gguf's signature
        out = real(data, kind)
        decoded.append(tuple(out.shape))
        return out

    def spy_native(data, kind):  # noqa: ANN001, ANN202 - the loader's C++ decode
        out = real_native(data, kind)
        decoded.append(tuple(out.shape))
        return out

    from baton.engine.loader import gguf as gguf_loader

    real_native = gguf_loader.dequantize_native
    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    monkeypatch.setattr(gguf_loader, "dequantize_native", spy_native)
    model = _model(quant_gguf, torch.float32, keep=True)
    vocab = model.config.vocab_size
    assert sorted(decoded) == [(64,)] * (2 * LAYERS + 1)  # the norms: nothing else
    for layer in model.layers:
        assert layer.quant is not None and all(q is not None for q in layer.quant)
        assert all(lin.weight.numel() == 0 for lin in layer._linears)
    assert isinstance(model.lm_head_quant, QuantWeight) and model.lm_head is None
    assert model.embed_quant is model.lm_head_quant
    big = {n: tuple(p.shape) for n, p in model.named_parameters() if p.numel() > 0 and p.dim() > 1}
    assert big == {}
    assert model.lm_head_quant.n == vocab


def _decode_logits(model: LlamaForCausalLM, prompt: list[int], steps: int) -> torch.Tensor:
    """Prefill then ``steps`` greedy one-token decodes; every step's logits."""
    n = len(prompt)
    blocks = torch.tensor([list(range(1, 9))])
    dtype = model.embed_tokens.weight.dtype
    kv = allocate_kv_cache(model.config, 9, BLOCK, dtype)
    window = model.config.sliding_window
    meta = AttentionMetadata.build(
        torch.tensor([n]), torch.tensor([n]), blocks, BLOCK, sliding_window=window
    )
    with torch.no_grad():
        rows = [model.compute_logits(model(torch.tensor(prompt), torch.arange(n), kv, meta))[-1]]
        for i in range(steps):
            tok = rows[-1].argmax().view(1)
            meta = AttentionMetadata.build(
                torch.tensor([1]), torch.tensor([n + i + 1]), blocks, BLOCK, sliding_window=window
            )
            rows.append(model.compute_logits(model(tok, torch.tensor([n + i]), kv, meta))[0])
    return torch.stack(rows)


def test_quantised_logits_equal_the_dequantised_models_up_to_summation_order(
    quant_gguf: Path,
) -> None:
    """float32: the same weights, another summation order per dot product (the kernel's 16
    lanes against oneDNN's), so the logits agree to a few float32 ulps of the sums involved:
    measured at most 5.4e-7 of the logits' range (2026-12-06), bounded here by 1e-4 of it;
    the greedy tokens are the same."""
    ref = _decode_logits(_model(quant_gguf, torch.float32, keep=False), PROMPTS[0], 6)
    out = _decode_logits(_model(quant_gguf, torch.float32, keep=True), PROMPTS[0], 6)
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-4 * scale
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def _generate(path: Path, **engine_args: object) -> list[list[int]]:
    llm = LLM(str(path), dtype=torch.float32, num_kv_blocks=64, **engine_args)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    if engine_args.get("quantization") == "gguf":
        kind = path.stem.removeprefix("tiny-")  # 8 projections in it, the LM head in Q8_0
        want = {"Q8_0": 9} if kind == "Q8_0" else {kind: 8, "Q8_0": 1}
        assert stats["quantization"] == "gguf"
        assert stats["quantized_weights"] == ",".join(f"{k}={v}" for k, v in sorted(want.items()))
    else:
        assert stats["quantization"] == "none" and "quantized_weights" not in stats
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_greedy_tokens_equal_dequantised_and_worker_process(quant_gguf: Path) -> None:
    """The same greedy tokens with the linears kept quantised, in this process and in the
    worker process (the quantised weights shared with it), as with them dequantised."""
    dense = _generate(quant_gguf, executor="uni")
    assert _generate(quant_gguf, executor="uni", quantization="gguf") == dense
    assert _generate(quant_gguf, executor="mp", quantization="gguf") == dense


def test_weights_move_to_new_pages_in_idle_time_and_give_the_same_tokens(quant_gguf: Path) -> None:
    """An engine starts on the weights as repacked and moves them (onto huge-page memory,
    ``worker/weight_pages.py``) a slice at a time in ``idle_work``, never while a request is
    unfinished; the tokens are the same before and after. ``LLM`` finishes the moves before it
    returns; a caller's checkpoint (which may back another engine) is never moved."""
    from baton.engine.processing.llm_engine import LLMEngine

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = _generate(quant_gguf, executor="uni", quantization="gguf")
    config = EngineConfig(
        model=str(quant_gguf),
        dtype=torch.float32,
        num_kv_blocks=64,
        executor="uni",
        quantization="gguf",
    )

    def run(engine: LLMEngine, request_id: str) -> list[list[int]]:
        engine.add_request(request_id, PROMPTS[0], params)
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens.append(list(out.outputs[0].token_ids))
        return tokens

    engine = LLMEngine(config)
    try:
        head = engine.core.executor.runner.model.lm_head_quant.data  # type: ignore[attr-defined]
        before = head.data_ptr()
        engine.add_request("a", PROMPTS[0], params)
        assert not engine.idle_work()  # a request is unfinished: nothing moves
        assert head.data_ptr() == before
        engine.abort_request("a")
        assert run(engine, "b") == expected[:1]
        slices = 0
        while engine.idle_work():
            slices += 1
        assert slices >= 1 and head.data_ptr() != before
        assert run(engine, "c") == expected[:1]
    finally:
        engine.shutdown()
    ckpt = load_checkpoint(quant_gguf, keep_quantized=True, huge_pages=False)
    pointers = [q.data.data_ptr() for q in ckpt.quantized.values()]
    engine = LLMEngine(config, ckpt)
    try:
        assert not engine.idle_work()
        assert run(engine, "d") == expected[:1]
        assert [q.data.data_ptr() for q in ckpt.quantized.values()] == pointers
    finally:
        engine.shutdown()
    llm = LLM(str(quant_gguf), dtype=torch.float32, num_kv_blocks=64, quantization="gguf")
    try:
        assert not llm.engine.idle_work()  # moved before LLM() returned
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(
    quant_gguf: Path, dtype: torch.dtype
) -> None:
    """The quantised projections and LM head compute a row the same whatever the other rows
    (each linear alone), and so does a whole decode step of sequences of equal length (one new
    token each): a row of the batch equals that sequence decoded alone, bit for bit."""
    model = _model(quant_gguf, dtype, keep=True)
    gen = torch.Generator().manual_seed(8)
    layer = model.layers[0]
    with torch.no_grad():
        for rows in (2, 5, 16, 33):
            for i, width in enumerate((64, 64, 64, 128)):  # in_features of qkv, o, gate_up, down
                x = torch.randn(rows, width, generator=gen).to(dtype)
                batch = layer._project(i, x)
                for r in (0, rows // 2, rows - 1):
                    assert torch.equal(layer._project(i, x[r : r + 1].clone())[0], batch[r])
            hidden = torch.randn(rows, 64, generator=gen).to(dtype)
            batch = model.compute_logits(hidden)
            for r in (0, rows - 1):
                assert torch.equal(model.compute_logits(hidden[r : r + 1].clone())[0], batch[r])
    n, seqs = 6, 4
    prompts = torch.randint(0, 262, (seqs, n + 1), generator=gen)

    def decode(which: list[int]) -> torch.Tensor:
        return decode_after_prompts(model, prompts, which, dtype, BLOCK)

    batch = decode(list(range(seqs)))
    for s in range(seqs):
        assert torch.equal(decode([s])[0], batch[s]), s


def test_a_projection_of_another_quantised_type_is_dequantised_with_a_warning(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Q5_0 has no kernel: that projection (gate|up of layer 1, one part Q5_0) is loaded dense
    and named in a warning with its memory; the rest stays quantised and the model runs."""

    def tensor_type(name: str) -> str:
        if name == "blk.1.ffn_up.weight":
            return "Q5_0"
        return _linear_type("Q4_0")(name)  # type: ignore[operator]

    path = gguf_from_hf_dir(
        tiny_model_dir, tmp_path / "mixed.gguf", mini_tokenizer_metadata(), tensor_type
    )
    with caplog.at_level(logging.WARNING, logger="baton.engine.loader.gguf_quant"):
        kept = load_checkpoint(path, torch.float32, keep_quantized=True)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "model.layers.1.mlp.gate_up_proj.weight has type Q4_0, Q5_0" in warning
    assert "dequantised to float32 instead: 0.1 MiB" in warning  # 2 x 128 x 64 x 4 bytes
    assert "model.layers.1.mlp.gate_up_proj.weight" not in kept.quantized
    assert "model.layers.1.mlp.up_proj.weight" in kept.weights
    assert len(kept.quantized) == 4 * LAYERS  # 7 projections and the LM head
    model = _model(path, torch.float32, keep=True)
    assert model.layers[1].quant[2] is None and model.layers[1].gate_up_proj.weight.shape == (
        256,
        64,
    )
    ref = _decode_logits(_model(path, torch.float32, keep=False), PROMPTS[1], 3)
    out = _decode_logits(model, PROMPTS[1], 3)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_bad_inputs_are_clear_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    meta = mini_tokenizer_metadata()
    quant_gguf = gguf_from_hf_dir(tiny_model_dir, tmp_path / "q8.gguf", meta, _linear_type("Q8_0"))
    with pytest.raises(ModelLoadError, match="quantization='gguf'.*not a .gguf file"):
        load_checkpoint(tiny_model_dir, keep_quantized=True)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        LLM(str(tiny_model_dir), quantization="gguf", dtype=torch.float32)
    f32 = gguf_from_hf_dir(tiny_model_dir, tmp_path / "f32.gguf", mini_tokenizer_metadata())
    with pytest.raises(
        ModelLoadError, match="this file's linear weights are F32; use quantization=None"
    ):
        load_checkpoint(f32, keep_quantized=True)
    with pytest.raises(ModelLoadError, match="cannot be cut into 2 shards"):
        load_checkpoint(quant_gguf, shard=ShardSpec(0, 2), keep_quantized=True)
    # A device other than the CPU that exists here: the simulated GPU.
    with pytest.raises(ValueError, match="quantization='gguf' needs device='cpu'.*'sim:h200'"):
        EngineConfig(model=str(quant_gguf), device="sim:h200", quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf' runs on one rank.*size=2"):
        LLM(str(quant_gguf), quantization="gguf", tensor_parallel_size=2)
    dense = load_checkpoint(quant_gguf, torch.float32)
    model = LlamaForCausalLM(dense.config)
    model.load_weights(dense.weights)
    with pytest.raises(ValueError, match="needs the checkpoint's quantised weights"):
        add_cpu_kernels(model, "gguf")
    quant = _model(quant_gguf, torch.float32, keep=True)
    with pytest.raises(ValueError, match="GGUF-quantised; int8 needs dense ones"):
        quant.quantize_int8()
    with pytest.raises(ValueError, match="GGUF-quantised; packing needs dense ones"):
        quant.pack_weights()


def test_bench_gguf_decode_runs_a_config_in_a_fresh_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from baton.bench.compute.gguf_decode import run_config

    path = gguf_from_hf_dir(
        tiny_model_dir, tmp_path / "q4.gguf", mini_tokenizer_metadata(), _linear_type("Q4_0")
    )
    result = run_config(str(path), "float32", "gguf", 2)
    assert result["quantization"] == "gguf"
    assert result["b1_tok_s"] > 0 and result["b16_tok_s"] > 0
    assert result["peak_rss_mib"] >= result["rss_imports_mib"] > 0
    with pytest.raises(RuntimeError, match="(?s)float32/gguf failed:.*not a .gguf file"):
        run_config(str(tiny_model_dir), "float32", "gguf", 2)


def test_qwen2_bias_and_untied_head_through_the_kernel(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    """Qwen2: q/k/v biases added after the kernel, q/k not permuted, and an untied LM head
    (output.weight) and embedding kept quantised with no dense copy."""
    path = gguf_from_hf_dir(
        tiny_qwen_dir, tmp_path / "qwen2.gguf", mini_tokenizer_metadata(), _linear_type("Q8_0")
    )
    kept = load_checkpoint(path, torch.float32, keep_quantized=True)
    assert kept.config.attention_bias and not kept.config.tie_word_embeddings
    assert "lm_head.weight" in kept.quantized and "lm_head.weight" not in kept.weights
    # the untied embedding is kept in its own blocks, looked up there
    assert "model.embed_tokens.weight" in kept.quantized
    assert "model.embed_tokens.weight" not in kept.weights
    assert "model.layers.0.self_attn.q_proj.bias" in kept.weights
    model = _model(path, torch.float32, keep=True)
    assert model.lm_head is not None and model.lm_head.weight.numel() == 0
    assert model.layers[0].qkv_proj.bias.abs().sum() > 0
    ref = _decode_logits(_model(path, torch.float32, keep=False), PROMPTS[2], 4)
    out = _decode_logits(model, PROMPTS[2], 4)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_qwen3_qk_norms_through_the_kernel(tokenizer, tmp_path: Path) -> None:
    """Qwen3: the per-head q/k norms applied between the kernel's q/k and RoPE, on the layers'
    own forward (the fused C++ layer has no q/k norm, so the model never takes it)."""
    folder = build_tiny_model_dir(tmp_path / "qwen3", tokenizer, "qwen3")
    path = gguf_from_hf_dir(
        folder, tmp_path / "qwen3.gguf", mini_tokenizer_metadata(), _linear_type("Q8_0")
    )
    model = _model(path, torch.float32, keep=True)
    assert model.layers[0].quant is not None and model.layers[0].q_norm is not None
    ref = _decode_logits(_model(path, torch.float32, keep=False), PROMPTS[2], 4)
    out = _decode_logits(model, PROMPTS[2], 4)
    assert model._fused is None and not model._fusable
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_through_the_kernel(tokenizer, tmp_path: Path, arch: str) -> None:
    """Gemma: every projection from its Q8_0 blocks under Gemma's block (sandwich norms,
    GeGLU, soft-caps, windowed and full layers), decoding past the window of 8; the norms stay
    F32 as llama.cpp keeps them."""
    folder = build_tiny_model_dir(tmp_path / arch, tokenizer, arch)
    path = gguf_from_hf_dir(
        folder, tmp_path / f"{arch}.gguf", mini_tokenizer_metadata(), _linear_type("Q8_0")
    )
    model = _model(path, torch.float32, keep=True)
    assert all(q is not None for q in model.layers[0].quant or ())
    ref = _decode_logits(_model(path, torch.float32, keep=False), PROMPTS[0], 8)
    out = _decode_logits(model, PROMPTS[0], 8)
    assert not model._fusable
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_moe_experts_through_the_kernel(
    tokenizer, tmp_path: Path, arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An MoE model's q/k/v/o and each routed expert stay in their Q8_0 blocks (llama.cpp's
    stacked expert tensors cut per expert, gate | up fused); the logits equal the dequantised
    model's to float32 summation order. Qwen2-MoE's shared expert (F32 here: 48 wide, no whole
    Q8_0 blocks) stays dense, and gpt-oss's expert biases are added after the kernel."""
    folder = build_tiny_model_dir(tmp_path / arch, tokenizer, arch)
    path = gguf_from_hf_dir(folder, tmp_path / "m.gguf", mini_tokenizer_metadata(), _moe_type)
    with caplog.at_level(logging.WARNING, logger="baton.engine.loader.gguf_quant"):
        kept = load_checkpoint(path, torch.float32, keep_quantized=True)
    assert "model.layers.0.self_attn.qkv_proj.weight" in kept.quantized
    assert "model.layers.1.mlp.experts.3.gate_up_proj.weight" in kept.quantized
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in kept.quantized
    assert not any(".mlp.experts." in name and "proj.weight" in name for name in kept.weights)
    assert "dequantised" not in caplog.text
    model = _model(path, torch.float32, keep=True)
    ref = _decode_logits(_model(path, torch.float32, keep=False), PROMPTS[0], 6)
    out = _decode_logits(model, PROMPTS[0], 6)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def _moe_type(name: str) -> str:
    """Q8_0 for every 2-D and 3-D weight but the routers (F32, as llama.cpp keeps them),
    Qwen2-MoE's shared expert (48 wide: no whole Q8_0 blocks), biases and sinks."""
    keep = ("ffn_gate_inp", "shexp", "sinks")
    dense = name.endswith(("norm.weight", ".bias")) or any(k in name for k in keep)
    return "F32" if dense else "Q8_0"


def test_a_decode_step_reads_every_weight_and_the_embedding_only_when_tied(
    tiny_model_dir: Path, tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    from baton.bench.compute.memory_bandwidth import weight_bytes_per_token
    from baton.engine.loader.gguf import read_gguf

    for hf_dir, tied in ((tiny_model_dir, True), (tiny_qwen_dir, False)):
        path = gguf_from_hf_dir(
            hf_dir,
            tmp_path / f"{hf_dir.name}.gguf",
            mini_tokenizer_metadata(),
            _linear_type("Q4_0"),
        )
        tensors = {t.name: t.n_bytes for t in read_gguf(path).tensors}
        assert ("output.weight" not in tensors) == tied
        embedding = 0 if tied else tensors["token_embd.weight"]
        assert weight_bytes_per_token(path) == sum(tensors.values()) - embedding


def test_an_moe_decode_step_reads_its_share_of_the_experts(tokenizer, tmp_path: Path) -> None:
    """Mixtral (4 experts, top 2, untied): a batch-1 step reads half of each stacked expert
    tensor and everything else but the embedding."""
    from baton.bench.compute.memory_bandwidth import weight_bytes_per_token
    from baton.engine.loader.gguf import read_gguf

    folder = build_tiny_model_dir(tmp_path / "mixtral", tokenizer, "mixtral")
    path = gguf_from_hf_dir(folder, tmp_path / "m.gguf", mini_tokenizer_metadata(), _moe_type)
    tensors = {t.name: t.n_bytes for t in read_gguf(path).tensors}
    experts = sum(n for name, n in tensors.items() if "_exps." in name)
    assert experts > 0
    rest = sum(tensors.values()) - experts - tensors["token_embd.weight"]
    assert weight_bytes_per_token(path) == rest + experts // 2


def test_memory_bandwidth_measures_and_restores_the_threads() -> None:
    from baton.bench.compute.memory_bandwidth import memory_bandwidth

    threads = torch.get_num_threads()
    figures = memory_bandwidth(1, mib=8, trials=1)
    assert figures["copy_gb_s"] > 0 and figures["read_gb_s"] > 0
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="must be >= 1"):
        memory_bandwidth(0)
