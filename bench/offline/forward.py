"""Forward-pass benchmark: baton's model vs transformers' on the same weights.

Decode step time at several batch sizes and the prefill of 128 tokens, the
implementations interleaved trial by trial in one run. Both compute logits for the last
position only in prefill (transformers with ``logits_to_keep=1``) and for every row in
decode. Prints a table with the ratio baton / transformers in the same dtype (lower is
better; the goal is <= 1.0) and writes JSON and a PNG next to the README's results.

``baton`` is the model with plain ``F.linear`` layers, kernel for kernel what transformers
runs. Two more columns: baton as the engine builds it by default (its linears packed for
oneDNN where the CPU has it, ``engine/models/packed.py``; no quantisation) and transformers
in float32, the reference of the issue's batch-1 goal (engine step <= 0.6x transformers'
float32 step).

    baton bench forward [--model PATH] [--batches 1,8,32,64] [--trials 5]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from baton.bench.common import RESULTS_DIR, add_common_args, write_results
from baton.bench.plotting import pyplot
from baton.bench.readme.readme_tables import engine_label
from baton.engine.loader import load_checkpoint
from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.config import ModelConfig
from baton.engine.models.kv_cache import allocate_kv_cache
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.worker.build import add_cpu_kernels

RESULTS = RESULTS_DIR
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


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hf_prefill(model, ids: torch.Tensor) -> object:
    """transformers' prefill with logits for the last position only, as baton computes."""
    return model(ids, use_cache=True, logits_to_keep=1)


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
    hfs = {"transformers": build_transformers(ckpt.config, ckpt.weights).to(dtype)}
    # What the engine builds by default (quantization=None): packed weights where it can.
    engine = copy.deepcopy(baton)
    add_cpu_kernels(engine, quantization=None)
    if dtype == torch.bfloat16:
        hfs["transformers_float32"] = build_transformers(ckpt.config, ckpt.weights).float()
    batons = {"baton": baton, "baton_engine": engine}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        ids = torch.randint(0, ckpt.config.vocab_size, (batch, context), generator=gen)
        times: dict[str, list[float]] = {k: [] for k in (*batons, *hfs)}
        for _ in range(trials):  # interleaved, so drift hits every model alike
            for name, model in batons.items():
                times[name].append(BatonCase(model, batch, context, steps).decode_time(ids))
            for name, model in hfs.items():
                times[name].append(hf_decode_time(model, ids, steps))
        rows.append(_row(f"decode b={batch}", times))
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 128), generator=gen)
    times = {k: [] for k in (*batons, *hfs)}
    for _ in range(trials):
        for name, model in batons.items():
            case = BatonCase(model, 1, 128, 0)
            times[name].append(timed(lambda case=case: case.prefill(ids)))
        for name, model in hfs.items():
            times[name].append(timed(lambda model=model: hf_prefill(model, ids)))
    rows.append(_row("prefill 128", times))
    return {
        "model": str(ckpt.path),
        "context_tokens": context,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": None,
        "packed": engine.lm_head_packed is not None,
        "prefill_logits": "last position only, both",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }


def _row(name: str, times: dict[str, list[float]]) -> dict:
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    row = {
        "case": name,
        "baton_ms": ms["baton"],
        "transformers_ms": ms["transformers"],
        "ratio": ms["baton"] / ms["transformers"],
    }
    # In float32 the transformers column is already the float32 reference.
    hf32 = ms.get("transformers_float32", ms["transformers"])
    row["baton_engine_ms"] = ms["baton_engine"]
    row["transformers_float32_ms"] = hf32
    row["engine_vs_transformers_float32"] = ms["baton_engine"] / hf32
    return row


def print_table(result: dict) -> None:
    extra = "baton_engine_ms" in result["rows"][0]
    head = f"{'case':<14} {'baton ms':>10} {'transformers ms':>16} {'baton/hf':>9}"
    if extra:
        head += f" {'engine ms':>10} {'hf fp32 ms':>11} {'engine/hf fp32':>15}"
    print(head)
    for r in result["rows"]:
        line = (
            f"{r['case']:<14} {r['baton_ms']:>10.2f} {r['transformers_ms']:>16.2f} "
            f"{r['ratio']:>9.2f}"
        )
        if extra:
            line += (
                f" {r['baton_engine_ms']:>10.2f} {r['transformers_float32_ms']:>11.2f} "
                f"{r['engine_vs_transformers_float32']:>15.2f}"
            )
        print(line)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [r["case"] for r in result["rows"]]
    dtype = result["dtype"]
    series = [("baton_ms", f"baton {dtype}"), ("transformers_ms", f"transformers {dtype}")]
    if "baton_engine_ms" in result["rows"][0]:
        label = f"baton as the engine builds it ({engine_label(result)})"
        series.append(("baton_engine_ms", label))
        if dtype != "float32":
            series.append(("transformers_float32_ms", "transformers float32"))
    x = range(len(names))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, (key, label) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([j + offset for j in x], [r[key] for r in result["rows"]], width, label=label)
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("ms per step")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"Forward pass ({result['dtype']}), same weights, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "forward")
    p.set_defaults(out=None)  # default: results/forward[_DTYPE].json
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--context", type=int, default=64, help="tokens cached before decoding")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per trial")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    suffix = "" if a.dtype == "float32" else f"_{a.dtype}"
    out = a.out or RESULTS / f"forward{suffix}.json"
    batches = [int(b) for b in a.batches.split(",")]
    result = run(a.model, batches, a.trials, a.context, a.steps, dtype)
    print_table(result)
    write_results(result, out, plot, dtype=a.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
