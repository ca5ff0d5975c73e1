"""Decode CUDA graphs (worker/cuda_graphs.py): the padding arithmetic and the padded decode
path on the CPU (the same buffers, run eagerly), and on CUDA the captured graphs against the
eager forward and the engine with graphs against the engine without."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from baton.engine import SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import add_engine_args, config_from_args
from baton.engine.models.attention import AttentionMetadata
from baton.engine.processing.llm_engine import LLMEngine
from baton.engine.worker.cuda_graphs import (
    GRAPH_COPIES_ENV,
    MAX_CAPTURE_SIZE,
    NULL_SLOT,
    DecodeGraphs,
    DecodePadding,
    capture_sizes,
    graph_copies,
)

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK = 16


def test_capture_sizes_cover_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(64)[-1] == 64 and capture_sizes(64)[:4] == (1, 2, 4, 8)
    assert capture_sizes(65)[-1] == 80
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_padding_puts_real_rows_first_and_pads_into_the_null_block():
    tables = np.array([[3, 9, 0], [5, 6, 7], [2, 0, 0]], dtype=np.int64)
    rows = np.array([7, 2, 5])
    pad = DecodePadding.of((1, 2, 4, 8), np.array([5, 33, 1]), tables, BLOCK, rows)
    assert pad is not None and (pad.size, pad.num_seqs) == (4, 3)
    # The new token sits at position len - 1: block len-1 // 16 of the row's table.
    assert pad.positions.tolist() == [4, 32, 0, 0]
    assert pad.slots.tolist() == [3 * BLOCK + 4, 7 * BLOCK + 0, 2 * BLOCK + 0, NULL_SLOT]
    assert pad.seq_lens.tolist() == [5, 33, 1, 1]
    assert pad.rows.tolist() == [7, 2, 5, 0]
    # One array in the order the graph reads it, for one copy.
    assert pad.meta.tolist() == [
        *pad.positions.tolist(),
        *pad.slots.tolist(),
        *pad.seq_lens.tolist(),
        *pad.rows.tolist(),
    ]
    assert pad.tables.shape == (3, 3)  # up to the longest sequence's last block
    short = DecodePadding.of((1, 2), np.array([3]), tables[:1], BLOCK)
    assert short is not None and short.tables.shape == (1, 1) and short.size == 1
    assert short.rows.tolist() == [0]


def test_padding_refuses_bad_steps_and_declines_oversized_ones():
    tables = np.zeros((3, 2), dtype=np.int64)
    assert DecodePadding.of((1, 2), np.array([1, 2, 3]), tables, BLOCK) is None
    with pytest.raises(ValueError, match="at least one sequence"):
        DecodePadding.of((1, 2), np.zeros(0, np.int64), tables[:0], BLOCK)
    with pytest.raises(ValueError, match="at least one sequence"):
        DecodePadding.of((1, 4), np.array([1, 0, 3]), tables, BLOCK)
    with pytest.raises(ValueError, match="block_tables"):
        DecodePadding.of((1, 4), np.array([1, 40, 3]), tables, BLOCK)
    with pytest.raises(ValueError, match="rows"):
        DecodePadding.of((1, 4), np.array([1, 2, 3]), tables, BLOCK, np.array([0, 1]))


def test_block_table_decode_metadata_has_no_gathered_layout():
    slots, lens = torch.tensor([17, 0]), torch.tensor([2, 1])
    meta = AttentionMetadata.decode(slots, lens, torch.tensor([[1], [0]]))
    assert meta.kv_index is None and meta.mask is None and meta.query_index is None
    assert (meta.num_seqs, meta.max_query_len) == (2, 1)


def test_enforce_eager_is_a_checked_flag_with_a_cli_option():
    import argparse

    assert EngineConfig().enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig(enforce_eager=1)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert config_from_args(parser.parse_args([])).enforce_eager is False


# ------------------------------------------------------------------ the padded path on the CPU
def _engine(tiny_model_dir: Any, sizes: tuple[int, ...] = (), **kw: Any) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=256,
        executor="uni",
        async_scheduling=False,
        dtype=torch.float32,
        structured_drafts=False,
        **kw,
    )
    engine = LLMEngine(config)
    if sizes:
        runner = engine.core.executor.runner
        # The CUDA path's buffers and padding, run eagerly (nothing to capture on a CPU).
        runner.graphs = DecodeGraphs(
            runner.model,
            runner.kv_caches,
            runner.io,
            sizes,
            runner.states.block_table.shape[1],
            runner.block_size,
            runner.states.token_ids,
        )
    return engine


def _requests() -> list[tuple[str, SamplingParams]]:
    """Lengths that end at different steps, so the batch shrinks and pad rows reuse buffer
    rows real sequences held before."""
    prompts = ["The capital of France is", "def quicksort(arr):", "Once upon", "1, 2, 3, 4,", "Hi"]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 30, 11, 23)
    ] + [SamplingParams(max_tokens=19, temperature=1.0, seed=5, top_k=40, ignore_eos=True)]
    return list(zip(prompts, params, strict=True))


def _run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> dict[str, list[int]]:
    for i, (prompt, sp) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, sp)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                assert o.outputs[0].finish_reason == "length"
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


def test_padded_decode_gives_the_tokens_of_the_plain_forward(tiny_model_dir):
    plain = _engine(tiny_model_dir)
    try:
        expected = _run(plain, _requests())
    finally:
        plain.shutdown()
    padded = _engine(tiny_model_dir, sizes=(1, 2, 4, 8))
    try:
        got = _run(padded, _requests())
        runner = padded.core.executor.runner
        assert runner.decode_graph_steps > 20 and runner.graphs.replays == 0
    finally:
        padded.shutdown()
    assert got == expected


def test_pad_rows_write_only_the_null_block(tiny_model_dir):
    engine = _engine(tiny_model_dir, sizes=(4,))
    try:
        runner = engine.core.executor.runner
        graphs = runner.graphs
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        tables = np.array([[3, 4], [6, 0]], dtype=np.int64)
        pad = DecodePadding.of(graphs.sizes, np.array([20, 2]), tables, BLOCK)
        assert pad is not None
        hidden = graphs.forward(pad)
        assert hidden.shape == (2, runner.model.config.hidden_size)
        written = {4 * BLOCK + 3, 6 * BLOCK + 1}  # block 4 offset 3; block 6 offset 1
        for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
            for old, new in ((k0, k1), (v0, v1)):
                changed = (old != new).flatten(2).any(-1).flatten()
                slots = set(torch.nonzero(changed).flatten().tolist())
                assert slots - written <= set(range(BLOCK)), "a pad row wrote outside block 0"
                assert written <= slots
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@_needs_cuda
def test_graph_replay_matches_the_eager_forward(tiny_model_dir):
    """Each captured size, at several lengths, against the runner's eager forward of the
    same step (float32: equal to float rounding; cuBLAS may pick other kernels by rows)."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), device="cuda", dtype=torch.float32, max_num_seqs=8)
    )
    try:
        runner = engine.core.executor.runner
        graphs = runner.graphs
        assert graphs is not None and graphs.captured and graphs.sizes == (1, 2, 4, 8)
        gen = torch.Generator().manual_seed(0)
        for n, length in ((1, 5), (3, 40), (5, 17), (8, 200)):
            width = -(-length // BLOCK)
            tables = (torch.randperm(200, generator=gen)[: n * width] + 1).view(n, width).numpy()
            lens = np.array([length - i for i in range(n)], dtype=np.int64)
            ids = torch.randint(0, 1000, (n,), generator=gen).cuda()
            rows = np.arange(n)[::-1].copy()  # the graph gathers row b's token at lens[b] - 1
            pad = DecodePadding.of(graphs.sizes, lens, tables, BLOCK, rows)
            assert pad is not None
            with runner.io.on_stream(), torch.inference_mode():
                token_ids = runner.states.token_ids
                token_ids[torch.from_numpy(rows).cuda(), torch.from_numpy(lens - 1).cuda()] = ids
                before = graphs.replays
                got = graphs.forward(pad).clone()
                assert graphs.replays == before + 1
                positions, slots, seq_lens, table_d = runner.io.to_device(
                    [pad.positions[:n], pad.slots[:n], lens, tables]
                )
                meta = AttentionMetadata.decode(slots, seq_lens, table_d)
                want = runner.model(ids, positions, runner.kv_caches, meta)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    finally:
        engine.shutdown()


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("copies", [1, 2])
def test_cuda_engine_with_graphs_gives_the_eager_engine_tokens(tiny_model_dir, monkeypatch, copies):
    monkeypatch.setenv(GRAPH_COPIES_ENV, str(copies))
    kw = {"device": "cuda", "dtype": torch.float32, "max_num_seqs": 8}
    eager = LLMEngine(EngineConfig(model=str(tiny_model_dir), enforce_eager=True, **kw))
    try:
        assert eager.core.executor.runner.graphs is None
        expected = _run(eager, _requests())
    finally:
        eager.shutdown()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), **kw))
    try:
        got = _run(engine, _requests())
        assert engine.core.executor.runner.graphs.replays > 20
        assert engine.core.executor.runner.graphs.copies == copies
    finally:
        engine.shutdown()
    assert got == expected


def test_graph_copies_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(GRAPH_COPIES_ENV, raising=False)
    assert graph_copies() == 1
    monkeypatch.setenv(GRAPH_COPIES_ENV, "2")
    assert graph_copies() == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(GRAPH_COPIES_ENV, bad)
        with pytest.raises(ValueError, match=GRAPH_COPIES_ENV):
            graph_copies()


class _CountingGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_copies_of_a_size_are_replayed_in_turn(tiny_model_dir):
    engine = _engine(tiny_model_dir, sizes=(4,))
    try:
        graphs = engine.core.executor.runner.graphs
        copies = [_CountingGraph(), _CountingGraph()]
        # Stand-ins for captured graphs (nothing can be captured on a CPU).
        graphs._graphs[4] = [(copies[0], torch.zeros(4, 8)), (copies[1], torch.ones(4, 8))]
        pad = DecodePadding.of(graphs.sizes, np.array([3, 5]), np.array([[1], [2]]), BLOCK)
        outs = [graphs.run(pad) for _ in range(5)]
        assert [c.replays for c in copies] == [3, 2]
        assert [float(o[0, 0]) for o in outs] == [0.0, 1.0, 0.0, 1.0, 0.0]
        assert outs[0].shape == (2, 8)
    finally:
        engine.shutdown()
