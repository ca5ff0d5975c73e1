"""Same request, same tokens (``EngineConfig.batch_invariant``, the default): each request run
alone on a fresh engine is the reference, and the same requests then run under other loads
and settings must give identical token ids, greedy and seeded, in float32 and bfloat16
(forced where the machine's default is float32):

- in one batch among strangers of other lengths, on a fresh engine and again on the same
  engine (prompts from the prefix cache);
- prefill in chunks of 16 tokens, with n-gram drafts, on one torch thread;
- in the model worker process (``executor="mp"``) with async scheduling, on two threads, and
  with drafts and chunks on one.

The model is a tiny random Llama whose down projection reads 1280 features: on the AMD EPYC
this was written on, oneDNN reduces a lone row of that width in another order than a row among
others (``models/row_invariance.py``), and random weights make greedy picks close calls, so a
changed bit shows as a changed token (checked: with ``batch_invariant=False`` this test fails
in bfloat16). Tiny Gemma 2 and gpt-oss models do the same for sliding windows, soft caps and
attention sinks (both fail with ``batch_invariant=False``, checked).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from model_files import build_tiny_model_dir, built_once_per_run

from baton.engine import LLM, SamplingParams
from baton.engine.tokenizer import Tokenizer

MAX_TOKENS = 20
ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 256,
    "block_size": 4,
    "num_kv_blocks": 256,
    "max_num_seqs": 32,
    "adapt_cpu_threads": False,
}


@pytest.fixture(scope="module")
def wide_mlp_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    folder, _ = built_once_per_run(
        tmp_path_factory,
        "tiny_llama_wide_mlp",
        lambda folder: build_tiny_model_dir(
            folder, tokenizer, "llama", shape={"intermediate_size": 1280}
        ),
    )
    return folder


def _probes() -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight prompts of 7-40 random tokens; the first four greedy, the rest seeded."""
    gen = torch.Generator().manual_seed(52)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (7, 40, 13, 29) * 2]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=70 + i, ignore_eos=True)
        for i in range(4)
    ]
    return prompts, params


def _strangers() -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(53)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (3, 55, 21, 64)]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS + 5 * i, temperature=0.7, seed=i) for i in range(4)
    ]
    return prompts, params


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _interleaved(probes: list[Any], strangers: list[Any]) -> list[Any]:
    """Probes with strangers between them: probe i at index 2i when there are enough."""
    mixed: list[Any] = []
    for i, probe in enumerate(probes):
        mixed.append(probe)
        if i < len(strangers):
            mixed.append(strangers[i])
    return mixed


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def _assert_alone_tokens(
    folder: Path, dtype: str, settings: tuple[tuple[str, dict[str, Any]], ...]
) -> None:
    """Each probe alone on a fresh engine, then all of them among strangers on an engine per
    setting, twice (the second time from the prefix cache): identical token ids."""
    prompts, params = _probes()
    strangers, stranger_params = _strangers()
    runs: dict[str, list[list[int]]] = {}

    def build(**args: Any) -> LLM:
        return LLM(str(folder), dtype=dtype, **{**ENGINE_ARGS, **args})

    alone = build(executor="uni", async_scheduling=False, worker_threads=2)
    try:
        reference = [_tokens(alone, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    finally:
        alone.shutdown()

    mixed_prompts = _interleaved(prompts, strangers)
    mixed_params = _interleaved(params, stranger_params)
    probe_at = [mixed_prompts.index(p) for p in prompts]

    def probe_tokens(llm: LLM) -> list[list[int]]:
        tokens = _tokens(llm, mixed_prompts, mixed_params)
        return [tokens[i] for i in probe_at]

    for name, args in settings:
        llm = build(**args)
        try:
            runs[f"{name}: among strangers"] = probe_tokens(llm)
            runs[f"{name}: warm prefix cache"] = probe_tokens(llm)
        finally:
            llm.shutdown()

    assert all(len(t) == MAX_TOKENS for t in reference)
    for name, tokens in runs.items():
        differing = [
            (i, next(j for j, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b))
            for i, (ref, got) in enumerate(zip(reference, tokens, strict=True))
            if ref != got
        ]
        assert not differing, f"{dtype}, {name}: (request, first differing token) {differing}"


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
CHUNKED_DRAFTS_1_THREAD = {
    "executor": "uni", "async_scheduling": False, "worker_threads": 1,
    "max_num_batched_tokens": 16, "speculative_config": NGRAM,
}  # fmt: skip


def test_a_request_gets_its_alone_tokens_under_every_load_and_setting(
    wide_mlp_dir: Path, dtype: str
) -> None:
    settings = (
        ("chunked, drafts, 1 thread", CHUNKED_DRAFTS_1_THREAD),
        ("mp executor, async, 2 threads", {
            "executor": "mp", "async_scheduling": True, "worker_threads": 2,
        }),
        ("mp executor, async, drafts, chunked, 1 thread", {
            "executor": "mp", "async_scheduling": True, "worker_threads": 1,
            "max_num_batched_tokens": 16, "speculative_config": NGRAM,
        }),
    )  # fmt: skip
    _assert_alone_tokens(wide_mlp_dir, dtype, settings)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_windows_soft_caps_and_sinks_keep_a_request_alone_tokens(
    arch: str, tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer
) -> None:
    """Gemma 2 (a window of 8 on every other layer, soft-capped scores and logits) and gpt-oss
    (windows, attention sinks, experts) in bfloat16: prompts far past the window, chunked,
    with drafts, among strangers, on one thread."""
    folder, _ = built_once_per_run(
        tmp_path_factory, f"tiny_{arch}", lambda f: build_tiny_model_dir(f, tokenizer, arch)
    )
    _assert_alone_tokens(
        folder, "bfloat16", (("chunked, drafts, 1 thread", CHUNKED_DRAFTS_1_THREAD),)
    )
