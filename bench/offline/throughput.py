"""Offline throughput: baton ``LLM.generate`` vs transformers batched ``generate``.

Same model weights, same prompts, greedy, every request generating exactly
``--output-len`` tokens (EOS ignored on both sides), measured in one run.
Each dtype runs both engines in that dtype (transformers casts its whole model,
baton keeps norms and softmax in float32; baton runs as its engine does by default, without
weight quantisation). Both are warmed
up the same way, on prompts that are not measured, and baton runs with prefix caching off
(transformers has none), so every measured prompt is prefilled in full by both. Prints
tokens/s, the same-dtype ratio, and each baton run against transformers in float32 (stock
``from_pretrained``); writes JSON and a PNG.

    baton bench throughput [--num-prompts 64] [--output-len 128] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from baton.bench.common import add_common_args, write_results
from baton.bench.offline.forward import build_transformers
from baton.bench.plotting import pyplot
from baton.engine import LLM, SamplingParams
from baton.engine.loader import load_checkpoint

TOPICS = [
    "the history of the printing press",
    "how photosynthesis works",
    "why the sky is blue",
    "the rules of chess",
    "a recipe for pancakes",
    "the water cycle",
    "how a bicycle stays upright",
    "the life of honey bees",
]


def make_prompts(n: int) -> list[list[dict[str, str]]]:
    """Chat conversations of varied length, deterministic."""
    return [
        [
            {
                "role": "user",
                "content": f"Request {i}: explain {TOPICS[i % len(TOPICS)]}."
                + " Be detailed." * (i % 4),
            }
        ]
        for i in range(n)
    ]


def run_baton(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


@torch.inference_mode()
def run_transformers(
    model, prompts: list[list[int]], output_len: int, batch: int
) -> tuple[float, int]:
    pad = 2
    total = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad,
        )
        total += (out.shape[1] - width) * len(chunk)
    return time.perf_counter() - t0, total


WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "throughput", dtype=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=64, help="transformers batch size")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    a = p.parse_args(argv)

    ckpt = load_checkpoint(a.model)
    tok = ckpt.tokenizer
    # The warm-up prompts come after the measured ones and are never measured.
    convs = make_prompts(a.num_prompts + WARMUP_PROMPTS)
    all_prompts = [tok.apply_chat_template(c, tokenize=True) for c in convs]
    prompts, warmup = all_prompts[: a.num_prompts], all_prompts[a.num_prompts :]
    rows = []
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        llm = LLM.from_checkpoint(
            ckpt,
            max_model_len=1024,
            max_num_seqs=a.max_num_seqs,
            dtype=dtype,
            enable_prefix_caching=False,
        )
        quantization = str(llm.stats()["quantization"])
        run_baton(llm, warmup, WARMUP_TOKENS)
        b_time, b_tokens = run_baton(llm, prompts, a.output_len)
        llm.shutdown()
        del llm
        hf = build_transformers(ckpt.config, ckpt.weights).to(dtype)
        run_transformers(hf, warmup, WARMUP_TOKENS, a.hf_batch)
        h_time, h_tokens = run_transformers(hf, prompts, a.output_len, a.hf_batch)
        del hf
        rows.append(
            {
                "dtype": name,
                "baton_quantization": quantization,
                "baton": {"seconds": b_time, "tokens": b_tokens, "tok_per_s": b_tokens / b_time},
                "transformers": {
                    "seconds": h_time,
                    "tokens": h_tokens,
                    "tok_per_s": h_tokens / h_time,
                },
            }
        )
    hf32 = next((r for r in rows if r["dtype"] == "float32"), None)
    for r in rows:
        r["ratio"] = r["baton"]["tok_per_s"] / r["transformers"]["tok_per_s"]
        if hf32 is not None:
            r["ratio_vs_transformers_float32"] = (
                r["baton"]["tok_per_s"] / hf32["transformers"]["tok_per_s"]
            )
    result = {
        "model": str(ckpt.path),
        "num_prompts": a.num_prompts,
        "output_len": a.output_len,
        "hf_batch": a.hf_batch,
        "warmup": f"{WARMUP_PROMPTS} unmeasured prompts x {WARMUP_TOKENS} tokens, both engines",
        "prefix_caching": False,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    print(f"{'dtype':<9} {'baton tok/s':>12} {'hf tok/s':>9} {'baton/hf':>9} {'baton/hf fp32':>14}")
    for r in rows:
        vs32 = r.get("ratio_vs_transformers_float32", float("nan"))
        print(
            f"{r['dtype']:<9} {r['baton']['tok_per_s']:>12.1f} "
            f"{r['transformers']['tok_per_s']:>9.1f} {r['ratio']:>9.2f} {vs32:>14.2f}"
        )
    write_results(result, a.out, _plot, dtype=a.dtypes)
    return 0


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    rows = result["rows"]
    x = range(len(rows))
    for offset, engine, color in ((-0.2, "baton", "tab:blue"), (0.2, "transformers", "tab:gray")):
        values = [r[engine]["tok_per_s"] for r in rows]
        ax.bar([i + offset for i in x], values, 0.4, label=engine, color=color)
    ax.set_xticks(list(x), [r["dtype"] for r in rows])
    ax.legend()
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['num_prompts']} prompts x {result['output_len']} tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
