"""Loading one tensor-parallel rank's shard straight from the file (``load_checkpoint(...,
shard=ShardSpec(rank, size))``): the same weights, bit for bit, as loading the whole model and
cutting it with ``shard_weights``, for every rank, on the default GGUF, on safetensors folders and
on a GGUF of every block type with uneven vocabulary and block-unaligned column slices; and
without ever decoding (or holding) the whole model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_files import encode_tensor, mini_tokenizer_metadata, write_gguf

from baton.engine.loader import ModelLoadError, ShardSpec, expected_weight_shapes, load_checkpoint
from baton.engine.loader.checkpoint import Checkpoint
from baton.engine.models.sharding import shard_weights


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaNs included), not merely close."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(torch.uint8).numpy()
    )


def _assert_rank_equals_load_then_shard(full: Checkpoint, part: Checkpoint, shard: ShardSpec):
    expected = shard_weights(full.weights, full.config, shard.rank, shard.size)
    assert set(part.weights) == set(expected)
    for name, weight in expected.items():
        got = part.weights[name]
        assert got.is_contiguous(), name
        assert _same_bits(got, weight), f"rank {shard.rank} of {shard.size}: {name} differs"
    assert part.config == full.config  # the whole model's: the model cuts its own shape
    assert part.shard == shard


class _DecodeCounter:
    """Wraps ``gguf.quants.dequantize`` and the loader's C++ decode (``dequantize_native``,
    for the kernel's block types) to count the elements the GGUF loader decodes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from gguf import quants

        from baton.engine.loader import gguf as gguf_loader

        self.elements = 0
        original = quants.dequantize
        native = gguf_loader.dequantize_native

        def counted(data: np.ndarray, qtype: Any) -> np.ndarray:
            out = original(data, qtype)
            self.elements += out.size
            return out

        def counted_native(data: np.ndarray, kind: str) -> Any:
            out = native(data, kind)
            self.elements += out.numel()
            return out

        monkeypatch.setattr(quants, "dequantize", counted)
        monkeypatch.setattr(gguf_loader, "dequantize_native", counted_native)


# ---------------------------------------------------------------- the default model (Q4_1 GGUF)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_default_gguf_rank_equals_load_then_shard(
    default_checkpoint: Checkpoint, default_model_path: Path, rank: int
) -> None:
    # 9 query heads and 3 key/value heads: 3 is the only size above 1 that fits.
    shard = ShardSpec(rank, 3)
    _assert_rank_equals_load_then_shard(
        default_checkpoint, load_checkpoint(default_model_path, shard=shard), shard
    )


def test_default_gguf_rank_decodes_only_its_shard(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _DecodeCounter(monkeypatch)
    part = load_checkpoint(default_model_path, shard=ShardSpec(1, 3))
    held = sum(w.numel() for w in part.weights.values())
    # Every column slice of the default model falls on Q4_1's 32-element blocks and the
    # vocabulary divides by 3: exactly the rank's own elements are decoded, nothing more
    # (a load-then-shard decodes all of them: _whole_elements).
    assert counter.elements == held
    assert held < 0.36 * _whole_elements(part)


def _whole_elements(part: Checkpoint) -> int:
    """Elements of the whole model that ``part`` is a shard of."""
    return sum(int(np.prod(shape)) for shape in expected_weight_shapes(part.config).values())


def test_a_size_that_does_not_fit_is_refused(default_model_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"cannot be cut into 2 shards.*attention heads"):
        load_checkpoint(default_model_path, shard=ShardSpec(0, 2))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        ShardSpec(3, 3)
    with pytest.raises(TypeError, match="ShardSpec"):
        load_checkpoint(default_model_path, shard=(0, 3))  # type: ignore[arg-type]


def test_one_rank_is_the_whole_model(
    default_checkpoint: Checkpoint, default_model_path: Path
) -> None:
    _assert_rank_equals_load_then_shard(
        default_checkpoint,
        load_checkpoint(default_model_path, shard=ShardSpec(0, 1)),
        ShardSpec(0, 1),
    )


_RSS_SCRIPT = """
import json, sys
from baton.engine.loader import ShardSpec, load_checkpoint
from baton.engine.models.sharding import shard_weights
if sys.argv[2] == "load-then-shard":
    ckpt = load_checkpoint(sys.argv[1])
    weights = shard_weights(ckpt.weights, ckpt.config, 0, 3)
else:
    weights = load_checkpoint(sys.argv[1], shard=ShardSpec(0, 3)).weights
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"hwm_kib": int(status["VmHWM"].split()[0])}))
"""


def test_a_rank_never_holds_the_whole_model(
    default_checkpoint: Checkpoint, default_model_path: Path
) -> None:
    # Peak resident memory of a fresh process that builds rank 0's weights (of 3):
    # load-then-shard holds the whole float32 model (540 MB) at its peak, the shard load a
    # third of it, so the peaks differ by well over half the model.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def peak(how: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, str(default_model_path), how],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=300,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])["hwm_kib"] * 1024

    whole = sum(w.numel() * w.element_size() for w in default_checkpoint.weights.values())
    full, shard = peak("load-then-shard"), peak("shard")
    assert full - shard > 0.5 * whole, (full, shard, whole)


# ---------------------------------------------------------------- safetensors folders


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen_dir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_ranks_equal_load_then_shard(
    fixture: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    # tiny Llama: tied embeddings; tiny Qwen2: q/k/v biases and an untied LM head.
    folder = request.getfixturevalue(fixture)
    full = load_checkpoint(folder, dtype=dtype)
    for rank in range(2):
        shard = ShardSpec(rank, 2)
        _assert_rank_equals_load_then_shard(
            full, load_checkpoint(folder, dtype=dtype, shard=shard), shard
        )


def test_safetensors_rank_reads_only_its_shard(
    tiny_qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors

    read = {"elements": 0}
    original = safetensors.safe_open

    class Counted:
        """A ``safe_open`` handle whose reads are counted (element by element)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._inner = original(*args, **kwargs)

        def __enter__(self) -> Counted:
            self._handle = self._inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self._inner.__exit__(*exc)

        def keys(self) -> Any:
            return self._handle.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            out = self._handle.get_tensor(name)
            read["elements"] += out.numel()
            return out

        def get_slice(self, name: str) -> Any:
            inner = self._handle.get_slice(name)

            class Slice:
                def get_shape(self) -> Any:
                    return inner.get_shape()

                def __getitem__(self, index: Any) -> torch.Tensor:
                    out = inner[index]
                    read["elements"] += out.numel()
                    return out

            return Slice()

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    part = load_checkpoint(tiny_qwen_dir, shard=ShardSpec(1, 2))
    assert read["elements"] == sum(w.numel() for w in part.weights.values())
    whole = _whole_elements(part)
    assert read["elements"] < 0.55 * whole


# ---------------------------------------------------------------- every GGUF block type

# A one-off Llama whose shapes exercise every cut: 4 heads of 64 (hidden 256) and 4 key/value
# heads, so sizes 2 and 4 fit; an MLP of 768, so down_proj's column slices (384 or 192) fall
# inside the 256-element K-quant blocks; 263 vocabulary rows, so the last rank is padded.
_SHAPE = {"hidden": 256, "heads": 4, "kv_heads": 4, "head_dim": 64, "mlp": 768, "vocab": 263}
# Layer 0 in the K-quants (256-element blocks; o_proj's 128-column slices too), layer 1 in the
# 32-element block types and the plain ones.
_TYPES = {
    0: {
        "attn_q": "Q4_K",
        "attn_k": "Q5_K",
        "attn_v": "Q3_K",
        "attn_output": "Q6_K",
        "ffn_gate": "Q2_K",
        "ffn_up": "BF16",
        "ffn_down": "Q4_K",
    },
    1: {
        "attn_q": "Q4_0",
        "attn_k": "Q4_1",
        "attn_v": "Q5_0",
        "attn_output": "Q5_1",
        "ffn_gate": "F16",
        "ffn_up": "Q8_0",
        "ffn_down": "Q4_1",
    },
}
# K-quant block bytes and where each block keeps its fp16 scale(s) (d, and dmin where there is
# one): random bytes there could be inf or NaN.
_K_BLOCKS = {"Q2_K": (84, 80, 2), "Q3_K": (110, 108, 1), "Q4_K": (144, 0, 2)}
_K_BLOCKS |= {"Q5_K": (176, 0, 2), "Q6_K": (210, 208, 1)}


def _encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    if kind not in _K_BLOCKS:
        return encode_tensor(values, kind)
    from gguf import GGMLQuantizationType

    # gguf-py cannot quantise to K-quants; random blocks with small finite scales will do.
    block_bytes, at, n = _K_BLOCKS[kind]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(blocks.shape[0], n)).astype(np.float16)
    blocks[:, at : at + 2 * n] = scales.view(np.uint8)
    return blocks.reshape(rows, -1), GGMLQuantizationType[kind]


@pytest.fixture(scope="module")
def all_types_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-off Llama above (untied: Q6_K embedding, Q8_0 LM head) as a GGUF file."""
    rng = np.random.default_rng(7)
    s = _SHAPE
    q_rows, kv_rows = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    tensors = {
        "token_embd.weight": _encode(rand(s["vocab"], s["hidden"]), "Q6_K", rng),
        "output.weight": _encode(rand(s["vocab"], s["hidden"]), "Q8_0", rng),
        "output_norm.weight": encode_tensor(1 + rand(s["hidden"]), "F32"),
    }
    shapes = {
        "attn_q": (q_rows, s["hidden"]),
        "attn_k": (kv_rows, s["hidden"]),
        "attn_v": (kv_rows, s["hidden"]),
        "attn_output": (s["hidden"], q_rows),
        "ffn_gate": (s["mlp"], s["hidden"]),
        "ffn_up": (s["mlp"], s["hidden"]),
        "ffn_down": (s["hidden"], s["mlp"]),
    }
    for layer, types in _TYPES.items():
        for leaf, shape in shapes.items():
            tensors[f"blk.{layer}.{leaf}.weight"] = _encode(rand(*shape), types[leaf], rng)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{norm}.weight"] = encode_tensor(1 + rand(s["hidden"]), "F32")
    metadata = {
        "llama.block_count": len(_TYPES),
        "llama.context_length": 512,
        "llama.embedding_length": s["hidden"],
        "llama.feed_forward_length": s["mlp"],
        "llama.attention.head_count": s["heads"],
        "llama.attention.head_count_kv": s["kv_heads"],
        "llama.rope.dimension_count": s["head_dim"],
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": s["vocab"],
        **mini_tokenizer_metadata(),
    }
    path = tmp_path_factory.mktemp("tp_gguf") / "all-types.gguf"
    return write_gguf(path, "llama", metadata, tensors)


@pytest.mark.parametrize("size", [2, 4])
def test_every_block_type_rank_equals_load_then_shard(
    all_types_gguf: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = load_checkpoint(all_types_gguf)
    whole = sum(w.numel() for w in full.weights.values())
    for rank in range(size):
        shard = ShardSpec(rank, size)
        counter = _DecodeCounter(monkeypatch)
        part = load_checkpoint(all_types_gguf, shard=shard)
        _assert_rank_equals_load_then_shard(full, part, shard)
        # Unaligned column slices decode the K-quant blocks that cover them, at most one
        # block per row more at each end; never the whole tensor.
        held = sum(w.numel() for w in part.weights.values())
        assert held <= counter.elements < held + 2 * 256 * 2 * _SHAPE["hidden"]
        assert counter.elements < whole / size + 2 * 256 * 2 * _SHAPE["hidden"]
    last = part.weights["model.embed_tokens.weight"]
    assert last.shape[0] == -(-_SHAPE["vocab"] // size)
    assert not last[-1].any()  # the padding row
