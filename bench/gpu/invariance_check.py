"""The GPU check's batch-invariance cell (issue 52): on CUDA, whether a sequence's logits keep
their bits when it shares its steps, with the dense linears on cuBLAS (``F.linear``) and on the
batch-invariant Triton kernel (``kernels/invariant_matmul.py``), and what the kernel costs.

On a random-weight model of the default model's shape (SmolLM2-135M: 30 layers, hidden 576,
bfloat16; random weights make greedy picks close calls, so a changed bit soon shows as a
changed token), 16 prompts of 24 tokens, per linear mode:

- ``decode``: each prompt prefilled alone, then 8 greedy tokens decoded alone (the reference)
  and decoded with all 16 in one step each: how many sequences got identical logits at every
  step and identical tokens. Only the linears and the per-sequence Triton decode attention see
  the batch here.
- ``prefill``: all 16 prompts prefilled in one step against each alone: how many last-token
  logits are identical. Prefill attention on CUDA (torch's SDPA over a padded batch) is not
  made invariant, so this counts what remains.
- ``gemm``: GPU time of every linear of a decode step (30 layers' qkv, o, gate_up, down and the
  LM head) at 1, 8 and 32 rows, each shape 50 calls replayed in a CUDA graph, kernel vs cuBLAS.
- ``step``: a whole decode step (forward + logits) at batch 1, 8, 32, replayed as a CUDA graph
  (eager where capture fails, recorded), kernel vs cuBLAS.

About 20-30 s on an H100/H200, most of it Triton compiling the kernel's tiles. Without CUDA it
writes ``{"skipped": ...}`` and exits 0.

    python -m baton.bench.gpu.invariance_check --out invariance.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from baton.bench.common import write_results

PROMPTS, PROMPT_LEN, DECODE_STEPS, BLOCK = 16, 24, 8, 16
STEP_BATCHES = (1, 8, 32)
GRAPH_CALLS = 50


def smollm2_shape_model(device: str, dtype: torch.dtype) -> Any:
    """A ``LlamaForCausalLM`` of SmolLM2-135M's shape with seeded random weights on ``device``."""
    from baton.engine.models.config import ModelConfig
    from baton.engine.models.llama import LlamaForCausalLM

    config = ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _step(model: Any, kv: Any, ids: list[int], lens: list[int], seqs: list[int]) -> torch.Tensor:
    """One forward of sequences ``seqs`` (``lens``: their lengths after the step, ``ids``:
    their new tokens, flat); float32 logits of each sequence's last token."""
    from baton.engine.models.attention import AttentionMetadata

    device = model.embed_tokens.weight.device
    per_seq = -(-(PROMPT_LEN + DECODE_STEPS) // BLOCK)
    tables = torch.tensor([[1 + s * per_seq + j for j in range(per_seq)] for s in seqs])
    new = len(ids) // len(seqs)
    meta = AttentionMetadata.build(
        torch.full((len(seqs),), new), torch.tensor(lens), tables, BLOCK, device=device
    )
    positions = torch.cat([torch.arange(n - new, n) for n in lens]).to(device)
    hidden = model(torch.tensor(ids, device=device), positions, kv, meta)
    last = torch.arange(1, len(seqs) + 1, device=device) * new - 1
    return model.compute_logits(hidden[last])


def invariance(model: Any, prompts: torch.Tensor) -> dict[str, int]:
    """The ``decode`` and ``prefill`` counts of the module docstring for the model as it is
    set (``set_invariant_gemm``); allocates its own KV caches."""
    from baton.engine.models.kv_cache import allocate_kv_cache

    dtype = model.norm.weight.dtype
    device = model.norm.weight.device
    blocks = 1 + PROMPTS * -(-(PROMPT_LEN + DECODE_STEPS) // BLOCK)
    seqs = list(range(PROMPTS))
    rows = prompts.tolist()
    with torch.no_grad():
        kv_alone = allocate_kv_cache(model.config, blocks, BLOCK, dtype, device)
        kv_batch = allocate_kv_cache(model.config, blocks, BLOCK, dtype, device)
        first = [_step(model, kv_alone, rows[s], [PROMPT_LEN], [s]) for s in seqs]
        for s in seqs:
            _step(model, kv_batch, rows[s], [PROMPT_LEN], [s])
        together = _step(model, allocate_kv_cache(model.config, blocks, BLOCK, dtype, device),
                         sum(rows, []), [PROMPT_LEN] * PROMPTS, seqs)  # fmt: skip
        prefill_same = sum(torch.equal(first[s][0], together[s]) for s in seqs)
        alone_tok = [[int(first[s].argmax())] for s in seqs]
        batch_tok = [list(t) for t in alone_tok]
        logits_same = [True] * PROMPTS
        for i in range(DECODE_STEPS):
            n = PROMPT_LEN + i + 1
            alone = [_step(model, kv_alone, [alone_tok[s][-1]], [n], [s]) for s in seqs]
            batch = _step(model, kv_batch, [t[-1] for t in batch_tok], [n] * PROMPTS, seqs)
            for s in seqs:
                logits_same[s] &= torch.equal(alone[s][0], batch[s])
                alone_tok[s].append(int(alone[s].argmax()))
                batch_tok[s].append(int(batch[s].argmax()))
    return {
        "sequences": PROMPTS,
        "decode_logits_identical": sum(logits_same),
        "decode_tokens_identical": sum(a == b for a, b in zip(alone_tok, batch_tok, strict=True)),
        "prefill_logits_identical": prefill_same,
    }


def _graph_ms(fn: Any, calls: int) -> float:
    """GPU ms per call of ``fn``: warmed up, then ``calls`` calls captured in one CUDA graph
    and replayed (no host launch cost in the time)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / (5 * calls)


def gemm_cost(model: Any) -> list[dict[str, Any]]:
    """Per row count: GPU ms of one decode step's linears (``gemm`` in the module docstring)."""
    import torch.nn.functional as F

    from baton.kernels.invariant_matmul import invariant_matmul

    layer = model.layers[0]
    weights = [layer.qkv_proj.weight, layer.o_proj.weight]
    weights += [layer.gate_up_proj.weight, layer.down_proj.weight]
    out = []
    for m in STEP_BATCHES:
        total = {"kernel": 0.0, "cublas": 0.0}
        for i, w in enumerate([*weights, model.embed_tokens.weight]):
            x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)
            times = len(model.layers) if i < len(weights) else 1
            kernel, cublas = (
                (lambda x=x, w=w: invariant_matmul(x, w)),
                (lambda x=x, w=w: F.linear(x, w)),
            )
            total["kernel"] += times * _graph_ms(kernel, GRAPH_CALLS)
            total["cublas"] += times * _graph_ms(cublas, GRAPH_CALLS)
        out.append({"rows": m, "kernel_ms": total["kernel"], "cublas_ms": total["cublas"],
                    "kernel_over_cublas": total["kernel"] / total["cublas"]})  # fmt: skip
    return out


def step_cost(model: Any) -> list[dict[str, Any]]:
    """Per batch: ms of a decode step (forward + logits) in each linear mode (``step``)."""
    return [_step_ms(model, batch) for batch in STEP_BATCHES]


def _step_ms(model: Any, batch: int) -> dict[str, Any]:
    """A decode step of ``batch`` sequences of 100 tokens, timed with the kernel and with
    cuBLAS; leaves the model on cuBLAS."""
    from baton.engine.models.attention import AttentionMetadata
    from baton.engine.models.kv_cache import allocate_kv_cache

    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    kv = allocate_kv_cache(model.config, 1 + batch * 8, BLOCK, dtype, device)
    tables = torch.arange(1, 1 + batch * 8).view(batch, 8)
    meta = AttentionMetadata.build(
        torch.ones(batch, dtype=torch.long), torch.full((batch,), 100), tables, BLOCK,
        device=device,
    )  # fmt: skip
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    pos = torch.full((batch,), 99, device=device)

    def forward() -> None:
        model.compute_logits(model(ids, pos, kv, meta))

    row: dict[str, Any] = {"batch": batch}
    for mode in ("kernel", "cublas"):
        model.set_invariant_gemm(mode == "kernel")
        with torch.no_grad():
            try:
                row[f"{mode}_ms"], row["graphed"] = _graph_ms(forward, 5), True
            except Exception as e:  # a step that cannot be captured: eager, recorded
                row["graph_error"] = f"{type(e).__name__}: {e}"[:200]
                row[f"{mode}_ms"], row["graphed"] = _eager_ms(forward), False
    row["kernel_over_cublas"] = row["kernel_ms"] / row["cublas_ms"]
    return row


def _eager_ms(fn: Any) -> float:
    """Wall ms per call of ``fn`` run eagerly (10 calls after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 100.0


def run() -> dict[str, Any]:
    """Every measurement of the module docstring on CUDA (the caller checks it is there)."""
    t0 = time.monotonic()
    model = smollm2_shape_model("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(52)
    prompts = torch.randint(0, model.config.vocab_size, (PROMPTS, PROMPT_LEN), generator=gen)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16"}
    for mode in ("kernel", "cublas"):
        model.set_invariant_gemm(mode == "kernel")
        result[f"invariance_{mode}"] = invariance(model, prompts)
    with torch.no_grad():
        result["gemm"] = gemm_cost(model)
    result["step"] = step_cost(model)
    result["seconds"] = time.monotonic() - t0
    return result


def summarize(data: dict[str, Any]) -> list[str]:
    """The cell's lines for the check's summary."""
    if "skipped" in data:
        return [f"skipped: {data['skipped']}"]
    lines = ["linears  decode logits same  decode tokens same  prefill logits same (of 16)"]
    for mode in ("kernel", "cublas"):
        r = data[f"invariance_{mode}"]
        lines.append(
            f"{mode:>7} {r['decode_logits_identical']:>19} {r['decode_tokens_identical']:>18} "
            f"{r['prefill_logits_identical']:>20}"
        )
    lines.append("rows  step linears ms kernel  cublas  kernel/cublas")
    for r in data["gemm"]:
        lines.append(
            f"{r['rows']:>4} {r['kernel_ms']:>22.3f} {r['cublas_ms']:>7.3f} "
            f"{r['kernel_over_cublas']:>14.2f}"
        )
    lines.append("batch  decode step ms kernel  cublas  kernel/cublas  graphed")
    for r in data["step"]:
        lines.append(
            f"{r['batch']:>5} {r['kernel_ms']:>22.3f} {r['cublas_ms']:>7.3f} "
            f"{r['kernel_over_cublas']:>14.2f}  {r['graphed']}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Writes the cell's JSON to ``--out`` and prints its summary; exit status 0, also when
    skipped without CUDA."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    data = run() if torch.cuda.is_available() else {"skipped": "no CUDA device visible to torch"}
    write_results(data, a.out, None)
    print("\n".join(summarize(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
