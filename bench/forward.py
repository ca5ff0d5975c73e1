"""Forward-pass benchmark: baton's model vs transformers' on the same weights.

Decode step time at several batch sizes and the prefill of 128 tokens, the two
implementations interleaved trial by trial in one run. Prints a table with
the ratio baton / transformers (lower is better; the goal is <= 1.0) and
writes JSON and a PNG next to the README's results.

    python -m baton.bench.forward [--model PATH] [--batches 1,8,32,64] [--trials 5]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from baton.bench.plotting import pyplot, save_results
from baton.engine.loader import load_checkpoint
from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LlamaForCausalLM, allocate_kv_cache

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


def build_transformers(config: ModelConfig, weights: dict[str, torch.Tensor]):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    model = HFLlama(hf_config).eval()
    model.load_state_dict(weights, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


class BatonCase:
    """Prefill ``batch`` sequences of ``context`` tokens, then time decode steps."""

    def __init__(self, model: LlamaForCausalLM, batch: int, context: int, steps: int) -> None:
        self.model, self.batch, self.context, self.steps = model, batch, context, steps
        per_seq = -(-(context + steps + 1) // BLOCK)
        self.tables = torch.arange(1, 1 + batch * per_seq).view(batch, per_seq)
        dtype = model.embed_tokens.weight.dtype
        self.kv = allocate_kv_cache(model.config, 1 + batch * per_seq, BLOCK, dtype)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        b, n = ids.shape
        meta = AttentionMetadata.build(torch.full((b,), n), torch.full((b,), n), self.tables, BLOCK)
        pos = torch.arange(n).repeat(b)
        hidden = self.model(ids.reshape(-1), pos, self.kv, meta)
        return self.model.compute_logits(hidden.view(b, n, -1)[:, -1])

    def decode_time(self, ids: torch.Tensor) -> float:
        logits = self.prefill(ids)
        times = []
        for step in range(self.steps):
            n = self.context + step + 1
            tok = logits.argmax(-1)
            t0 = time.perf_counter()
            meta = AttentionMetadata.build(
                torch.ones(self.batch, dtype=torch.int64),
                torch.full((self.batch,), n),
                self.tables,
                BLOCK,
            )
            hidden = self.model(tok, torch.full((self.batch,), n - 1), self.kv, meta)
            logits = self.model.compute_logits(hidden)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def hf_decode_time(model, ids: torch.Tensor, steps: int) -> float:
    out = model(ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    times = []
    for _ in range(steps):
        tok = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        out = model(tok, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def run(
    model_path: str | None,
    batches: list[int],
    trials: int,
    context: int,
    steps: int,
    dtype: torch.dtype = torch.float32,
) -> dict:
    ckpt = load_checkpoint(model_path)
    baton = LlamaForCausalLM(ckpt.config)
    baton.load_weights(ckpt.weights)
    baton.to(dtype)
    hf = build_transformers(ckpt.config, ckpt.weights).to(dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        ids = torch.randint(0, ckpt.config.vocab_size, (batch, context), generator=gen)
        b_times, h_times = [], []
        for _ in range(trials):  # interleaved, so drift hits both alike
            b_times.append(BatonCase(baton, batch, context, steps).decode_time(ids))
            h_times.append(hf_decode_time(hf, ids, steps))
        rows.append(_row(f"decode b={batch}", b_times, h_times))
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 128), generator=gen)
    b_times, h_times = [], []
    for _ in range(trials):
        case = BatonCase(baton, 1, 128, 0)
        b_times.append(timed(lambda case=case: case.prefill(ids)))
        h_times.append(timed(lambda: hf(ids, use_cache=True)))
    rows.append(_row("prefill 128", b_times, h_times))
    return {
        "model": str(ckpt.path),
        "context_tokens": context,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }


def _row(name: str, baton_s: list[float], hf_s: list[float]) -> dict:
    b, h = statistics.median(baton_s), statistics.median(hf_s)
    return {"case": name, "baton_ms": b * 1e3, "transformers_ms": h * 1e3, "ratio": b / h}


def print_table(result: dict) -> None:
    print(f"{'case':<14} {'baton ms':>10} {'transformers ms':>16} {'baton/hf':>9}")
    for r in result["rows"]:
        print(
            f"{r['case']:<14} {r['baton_ms']:>10.2f} {r['transformers_ms']:>16.2f} "
            f"{r['ratio']:>9.2f}"
        )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [r["case"] for r in result["rows"]]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([i - 0.2 for i in x], [r["baton_ms"] for r in result["rows"]], 0.4, label="baton")
    ax.bar(
        [i + 0.2 for i in x],
        [r["transformers_ms"] for r in result["rows"]],
        0.4,
        label="transformers",
    )
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("ms per step")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"Forward pass ({result['dtype']}), same weights, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--context", type=int, default=64, help="tokens cached before decoding")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per trial")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=None, help="default: results/forward[_DTYPE].json")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    suffix = "" if a.dtype == "float32" else f"_{a.dtype}"
    out = a.out or RESULTS / f"forward{suffix}.json"
    batches = [int(b) for b in a.batches.split(",")]
    result = run(a.model, batches, a.trials, a.context, a.steps, dtype)
    print_table(result)
    save_results(result, out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
