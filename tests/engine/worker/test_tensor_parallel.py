"""Tensor parallelism: the shards, the config checks, and TP=2 over gloo (one thread per rank)
giving TP=1's greedy tokens in float32, sync and async, with structured requests."""

from __future__ import annotations

import argparse
import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.entrypoints.args import add_engine_args, config_from_args, engine_config
from baton.engine.loader import load_checkpoint
from baton.engine.models.config import ModelConfig
from baton.engine.models.sharding import (
    check_tensor_parallel,
    shard_config,
    shard_weights,
    vocab_shard_rows,
)
from baton.engine.worker.step_broadcast import StepBroadcaster, StepReader

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "A JSON answer:",
    "Pick a colour:",
]


def _params() -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=14, temperature=1.0, seed=7, repetition_penalty=1.3),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=so(json=SCHEMA)),
        SamplingParams(
            max_tokens=8, temperature=0.0, structured_outputs=so(choice=["red", "green", "blue"])
        ),
    ]


def _config(**changes: object) -> ModelConfig:
    base = {
        "architecture": "llama",
        "vocab_size": 101,
        "hidden_size": 8,
        "intermediate_size": 12,
        "num_layers": 1,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 2,
    }
    return ModelConfig(**{**base, **changes})  # type: ignore[arg-type]


def test_sizes_that_do_not_divide_the_model_are_named():
    # The default model's shape: 9 query heads, 3 key/value heads.
    config = _config(num_heads=9, num_kv_heads=3, intermediate_size=1536)
    with pytest.raises(ValueError, match=r"attention heads \(9\) and key/value heads \(3\)"):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match=r"fit this model: \[1, 3\]"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="positive int"):
        check_tensor_parallel(config, 0)


def test_shards_put_back_together_are_the_whole_model(tiny_qwen_dir: Path):
    ckpt = load_checkpoint(tiny_qwen_dir)  # untied LM head, q/k/v biases
    config, full = ckpt.config, ckpt.weights
    shards = [shard_weights(full, config, rank, 2) for rank in range(2)]
    local = shard_config(config, 2)
    assert (local.num_heads, local.num_kv_heads) == (
        config.num_heads // 2,
        config.num_kv_heads // 2,
    )
    for name, weight in full.items():
        parts = [s[name] for s in shards]
        if name.endswith("norm.weight"):
            assert all(p is weight for p in parts)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), weight)
        else:
            assert torch.equal(torch.cat(parts, dim=0)[: weight.shape[0]], weight)
    # Column and vocabulary shards are views of the loaded weights: nothing copied per rank.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert shards[1][q].untyped_storage().data_ptr() == full[q].untyped_storage().data_ptr()


def test_an_uneven_vocabulary_pads_the_last_rank():
    config = _config(vocab_size=101)
    rows = vocab_shard_rows(config, 2)
    embed = torch.arange(101 * 8, dtype=torch.float32).view(101, 8)
    last = shard_weights({"model.embed_tokens.weight": embed}, config, 1, 2)
    assert last["model.embed_tokens.weight"].shape == (rows, 8) == (51, 8)
    assert torch.equal(last["model.embed_tokens.weight"][:50], embed[51:])
    assert not last["model.embed_tokens.weight"][50].any()


def test_the_step_ring_delivers_once_to_every_reader_and_never_overwrites_unread():
    ring = StepBroadcaster(readers=2, slots=2, slot_bytes=256)
    # Each reader owns (and closes) its descriptor, as a worker owns its inherited copy.
    readers = [StepReader(replace(ring.layout, fd=os.dup(ring.layout.fd)), r) for r in range(2)]
    first, second = ring.publish(("execute", 1)), ring.publish(("execute", 2))
    assert (first, second) == (1, 2)
    assert ring.publish(("execute", 3)) is None  # both slots still unread: send it directly
    assert [r.read(1) for r in readers] == [("execute", 1)] * 2
    assert ring.publish(("execute", 3)) == 3
    assert ring.publish("x" * 1000) is None  # larger than a slot
    assert [r.read(s) for r in readers for s in (2, 3)] == [("execute", 2), ("execute", 3)] * 2


def test_config_checks_and_the_command_line_flag():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_config(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="needs executor='mp'"):
        engine_config(tensor_parallel_size=2, executor="uni")
    # Off by default on 2 cores, async scheduling still gets the worker processes it needs.
    assert engine_config(tensor_parallel_size=2, async_scheduling=False).executor == "mp"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--no-async-scheduling"])
    assert config_from_args(args).tensor_parallel_size == 2


def test_a_size_the_model_cannot_take_is_refused_before_any_worker_starts(tiny_model_dir: Path):
    # The tiny model has 2 key/value heads.
    with pytest.raises(ValueError, match=r"key/value heads \(2\).*fit this model: \[1, 2\]"):
        LLM(str(tiny_model_dir), tensor_parallel_size=4, max_model_len=64)


def _generate(llm: LLM) -> list[tuple[list[int], str | None, str]]:
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].text) for o in outs
    ]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[tuple[list[int], str | None, str]]:
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, executor="uni")
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_gives_the_tokens_of_tp1(
    tiny_model_dir: Path, reference, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
):
    if async_scheduling:  # and the engine thread never reads device values outside its wait
        monkeypatch.setenv("BATON_SYNC_CHECK", "error")
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=2,
        worker_threads=1,
        async_scheduling=async_scheduling,
    )
    try:
        got = _generate(llm)
        stats = llm.stats()
        assert stats["tensor_parallel_size"] == 2
        assert 0 < float(stats["tp_collective_s"]) < float(stats["device_s"])
        assert got == reference
        assert all(finish != "error" for _, finish, _ in got)
        text, finish = got[4][2], got[4][1]
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        assert got[5][2] in ("red", "green", "blue")
        if async_scheduling:
            _kill_rank_1_fails_requests(llm)
    finally:
        llm.shutdown()


def _kill_rank_1_fails_requests(llm: LLM) -> None:
    """A dead rank fails the requests in flight with a reason naming it, instead of hanging."""
    engine = llm.engine
    executor = engine.core.executor
    pids = executor.worker_pids  # type: ignore[attr-defined]
    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], sp)
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    final = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert final["a"].finish_reason == "error"
    assert "rank" in (engine.failure() or "")
