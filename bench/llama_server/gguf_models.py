"""Random-weight Llama GGUF files of real model shapes (Llama-3.2-1B, Llama-3.1-8B; two
scaled-down mixtures of experts in Mixtral's layout), for the
benchmarks whose speed is bound by reading the weights: quantised decode, baton against
llama.cpp. Nothing is downloaded: the tokenizer is the default model's (SmolLM2's 49,152 BPE
tokens), padded with never-produced control tokens to the shape's vocabulary (128,256), so that
the embedding and the LM head have the real sizes.

The weights are normal(0, 0.02) in float16 (norms 1), written tensor by tensor (an 8B file is
never whole in memory), then quantised by llama.cpp's ``llama-quantize`` (``Q4_K_M``,
``Q8_0``, ...). Files are cached under ``DEFAULT_DIR`` by shape and type; only the quantised
file is kept.

    python -m baton.bench.llama_server.gguf_models --shape llama-1b --type Q4_K_M
"""

from __future__ import annotations

import argparse
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from baton.bench.llama_server.llama_cpp_build import LlamaCppBuild
from baton.bench.llama_server.llama_cpp_build import build as build_llama_cpp
from baton.engine.loader import default_model_path

DEFAULT_DIR = Path.home() / ".cache" / "baton" / "gguf-models"
CONTROL = 3  # llama.cpp's token type for tokens that text never produces


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's shape, as the GGUF ``llama.*`` keys give it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0
    context: int = 8192
    # A mixture of experts (Mixtral's layout: llama.cpp's "llama" with an expert count): each
    # layer's MLP is ``experts`` SwiGLU experts of width ``intermediate``, ``experts_used`` a
    # token; 0 experts: a dense MLP.
    experts: int = 0
    experts_used: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's GGUF name and numpy shape (rows = output features)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", (h,)),
                (b + "attn_q.weight", (h, h)),
                (b + "attn_k.weight", (kv, h)),
                (b + "attn_v.weight", (kv, h)),
                (b + "attn_output.weight", (h, h)),
                (b + "ffn_norm.weight", (h,)),
            ]
            ff, e = self.intermediate, self.experts
            if e:
                out += [
                    (b + "ffn_gate_inp.weight", (e, h)),
                    (b + "ffn_gate_exps.weight", (e, ff, h)),
                    (b + "ffn_up_exps.weight", (e, ff, h)),
                    (b + "ffn_down_exps.weight", (e, h, ff)),
                ]
            else:
                out += [
                    (b + "ffn_gate.weight", (ff, h)),
                    (b + "ffn_up.weight", (ff, h)),
                    (b + "ffn_down.weight", (h, ff)),
                ]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, h)))
        return out

    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())


SHAPES: dict[str, LlamaShape] = {
    "llama-1b": LlamaShape(2048, 16, 32, 8, 8192, 128256, tied=True),
    "llama-8b": LlamaShape(4096, 32, 32, 8, 14336, 128256, tied=False),
    # bench/compute/moe_decode.py's scaled-down MoE shapes: Mixtral's 8 wide experts (top 2) and
    # Qwen3-MoE's many narrow ones (64 of width 256 here, top 8).
    "mixtral-mini": LlamaShape(1024, 8, 16, 4, 2816, 49152, tied=False, experts=8, experts_used=2),
    "qwen3moe-mini": LlamaShape(1024, 8, 16, 4, 256, 49152, tied=False, experts=64, experts_used=8),
}


def _copy_tokenizer(writer: GGUFWriter, source: Path, vocab: int) -> None:
    """The ``tokenizer.*`` keys of ``source``, its token list padded to ``vocab`` entries."""
    reader = GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            if len(value) > vocab:
                raise ValueError(f"{source} has {len(value)} tokens, more than {vocab}")
            value = value + [f"<|baton_pad_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [CONTROL] * (vocab - len(value))
        kind = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub)


def write_random_gguf(path: Path, shape: LlamaShape, seed: int = 0) -> Path:
    """Writes ``shape`` with random float16 weights as a GGUF file at ``path``; returns it."""
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"baton random llama {shape.hidden}x{shape.layers}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
    writer.add_file_type(1)  # mostly F16
    _copy_tokenizer(writer, default_model_path(), shape.vocab)
    tensors = shape.tensors()
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        raw = GGMLQuantizationType.F32 if dtype == np.float32 else GGMLQuantizationType.F16
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
            continue
        # Row blocks keep the float32 draw small (an 8B embedding is 2 GB in float32).
        data = np.empty(dims, np.float16)
        rows = data.reshape(-1, dims[-1])
        for r in range(0, len(rows), 4096):
            block = rng.standard_normal((min(4096, len(rows) - r), dims[-1]), np.float32)
            rows[r : r + len(block)] = block * np.float32(0.02)
        writer.write_tensor_data(data)
    writer.close()
    return path


def quantized_model(
    shape_name: str,
    qtype: str,
    directory: Path = DEFAULT_DIR,
    llama_cpp: LlamaCppBuild | None = None,
    threads: int = 2,
) -> Path:
    """The cached ``shape_name`` GGUF in ``qtype`` (e.g. ``Q4_K_M``), made when missing: the
    float16 file, then ``llama-quantize`` (llama.cpp is built first when needed), then the
    float16 file is deleted.

    Raises:
        KeyError: an unknown shape name.
        subprocess.CalledProcessError: llama-quantize failed (e.g. an unknown type).
    """
    shape = SHAPES[shape_name]
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{shape_name}-random.{qtype}.gguf"
    if out.is_file():
        return out
    build = llama_cpp or build_llama_cpp()
    f16 = directory / f"{shape_name}-random.F16.gguf.part"
    t0 = time.perf_counter()
    write_random_gguf(f16, shape)
    print(f"wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    part = out.with_suffix(".part")
    try:
        cmd = [str(build.quantize), str(f16), str(part), qtype, str(threads)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        part.rename(out)
    finally:
        f16.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--type", dest="qtype", default="Q4_K_M", help="llama-quantize's type name")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    a = p.parse_args(argv)
    path = quantized_model(a.shape, a.qtype, a.dir)
    print(f"{path} ({path.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
