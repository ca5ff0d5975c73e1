"""Offline throughput: baton ``LLM.generate`` vs transformers batched ``generate``.

Same model weights, same prompts, greedy, every request generating exactly
``--output-len`` tokens (EOS ignored on both sides), measured in one run.
Prints tokens/s for each and the ratio; writes JSON and a PNG.

    python -m baton.bench.throughput [--num-prompts 64] [--output-len 128]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from baton.bench.forward import RESULTS, build_transformers
from baton.bench.plotting import pyplot, save_results
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=64, help="transformers batch size")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "throughput.json")
    a = p.parse_args(argv)

    ckpt = load_checkpoint(a.model)
    llm = LLM.from_checkpoint(ckpt, max_model_len=1024, max_num_seqs=a.max_num_seqs)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(c, tokenize=True) for c in make_prompts(a.num_prompts)]
    hf = build_transformers(ckpt.config, ckpt.weights)

    run_baton(llm, prompts[:2], 4)  # warm-up
    b_time, b_tokens = run_baton(llm, prompts, a.output_len)
    h_time, h_tokens = run_transformers(hf, prompts, a.output_len, a.hf_batch)
    result = {
        "model": str(ckpt.path),
        "num_prompts": a.num_prompts,
        "output_len": a.output_len,
        "threads": torch.get_num_threads(),
        "baton": {"seconds": b_time, "tokens": b_tokens, "tok_per_s": b_tokens / b_time},
        "transformers": {
            "seconds": h_time,
            "tokens": h_tokens,
            "tok_per_s": h_tokens / h_time,
            "batch": a.hf_batch,
        },
    }
    result["ratio"] = result["baton"]["tok_per_s"] / result["transformers"]["tok_per_s"]
    print(f"{'engine':<14} {'tokens':>8} {'seconds':>9} {'tok/s':>8}")
    for name in ("baton", "transformers"):
        r = result[name]
        print(f"{name:<14} {r['tokens']:>8} {r['seconds']:>9.1f} {r['tok_per_s']:>8.1f}")
    print(f"baton / transformers throughput: {result['ratio']:.2f}x")
    save_results(result, a.out, _plot)
    return 0


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    names = ["baton", "transformers"]
    ax.bar(names, [result[n]["tok_per_s"] for n in names], color=["tab:blue", "tab:gray"])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['num_prompts']} prompts x {result['output_len']} tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
