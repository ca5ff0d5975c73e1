"""AsyncLLM: streaming, validation in the caller, cancellation and abort (KV blocks freed),
concurrency, and failures that must not hang clients (engine thread crash, worker death)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton.engine.entrypoints.async_llm import AsyncLLM, EngineDeadError
from baton.engine.outputs import RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.grammar.spec import StructuredOutputsParams

NUM_KV_BLOCKS = 128


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM.from_engine_args(
        str(tiny_model_dir), num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8, max_model_len=1024
    )
    yield engine
    engine.shutdown()


async def _wait_idle(llm: AsyncLLM, timeout_s: float = 10.0) -> dict[str, float | int]:
    """Stats once nothing runs and every KV block is free again (or the last seen on time-out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.stats()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["kv_free_blocks"] == stats["kv_total_blocks"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


def _long(seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=900, ignore_eos=True, seed=seed)


@pytest.mark.timeout(60)
def test_stream_grows_then_finishes(llm: AsyncLLM) -> None:
    async def run() -> list[RequestOutput]:
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
        return [out async for out in llm.generate("The sky is", params, "grow")]

    outs = asyncio.run(run())
    assert len(outs) >= 2
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert counts == sorted(counts) and counts[-1] == 24
    texts = [o.outputs[0].text for o in outs]
    assert all(texts[-1].startswith(t) for t in texts)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert all(o.request_id == "grow" for o in outs)


@pytest.mark.timeout(60)
def test_validation_errors_raise_in_caller(llm: AsyncLLM) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="prompt must not be empty"):
            async for _ in llm.generate("", SamplingParams()):
                pass
        bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": 7}}})
        with pytest.raises(ValueError, match="json schema is invalid"):
            await llm.add_request("hi", SamplingParams(structured_outputs=bad))
        with pytest.raises(ValueError, match="multi_modal_data"):
            await llm.add_request({"prompt": "hi", "multi_modal_data": {}}, SamplingParams())
        # The engine goes on serving, vLLM's dict prompts too.
        outs = [o async for o in llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        ids = list(outs[-1].prompt_token_ids)
        gen = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, ignore_eos=True))
        outs = [o async for o in gen]
        assert outs[-1].prompt_token_ids == ids and len(outs[-1].outputs[0].token_ids) == 2

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_duplicate_request_id_is_rejected(llm: AsyncLLM) -> None:
    async def run() -> None:
        stream = await llm.add_request("hi", _long(), "dup")
        try:
            with pytest.raises(ValueError, match="already in use"):
                await llm.add_request("hi", _long(), "dup")
        finally:
            stream.close()
        stats = await _wait_idle(llm)
        assert stats["num_running"] == 0

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_cancelling_the_consumer_aborts_and_frees_kv(llm: AsyncLLM) -> None:
    async def consume(seen: asyncio.Event) -> None:
        async for out in llm.generate("Once upon a time", _long(), "cancel-me"):
            if len(out.outputs[0].token_ids) >= 4:
                seen.set()

    async def run() -> None:
        seen = asyncio.Event()
        task = asyncio.create_task(consume(seen))
        await asyncio.wait_for(seen.wait(), 30)
        busy = llm.stats()
        assert busy["num_running"] == 1
        assert busy["kv_free_blocks"] < busy["kv_total_blocks"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await _wait_idle(llm)
        # Aborted, not run to completion: only the steps already in flight ran after.
        assert stats["steps"] - busy["steps"] < 300
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
        assert stats["kv_usage"] == 0.0

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_breaking_out_of_the_iterator_aborts(llm: AsyncLLM) -> None:
    async def run() -> None:
        gen = llm.generate("Once upon a time", _long(1), "break-me")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        steps = llm.stats()["steps"]
        await gen.aclose()
        stats = await _wait_idle(llm)
        assert stats["steps"] - steps < 300
        assert stats["num_running"] == 0
        assert stats["kv_free_blocks"] == stats["kv_total_blocks"]

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_explicit_abort_ends_the_stream(llm: AsyncLLM) -> None:
    async def run() -> RequestOutput:
        stream = await llm.add_request("hello", _long(2), "abort-me")
        last = None
        async for out in stream:
            last = out
            if len(out.outputs[0].token_ids) >= 2 and not out.finished:
                await llm.abort("abort-me")
        assert last is not None
        return last

    last = asyncio.run(run())
    assert last.finished
    assert last.outputs[0].finish_reason == "abort"
    assert 2 <= len(last.outputs[0].token_ids) < 900


@pytest.mark.timeout(60)
def test_concurrent_generates(llm: AsyncLLM) -> None:
    greedy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)

    async def final(prompt: str, params: SamplingParams, rid: str) -> RequestOutput:
        last = None
        async for out in llm.generate(prompt, params, rid):
            last = out
        assert last is not None
        return last

    async def run() -> list[RequestOutput]:
        jobs = [final("Same prompt", greedy, f"same-{i}") for i in range(3)]
        jobs += [
            final(f"Prompt {i}", SamplingParams(max_tokens=8 + i), f"other-{i}") for i in range(3)
        ]
        return await asyncio.gather(*jobs)

    outs = asyncio.run(run())
    ids = [o.request_id for o in outs]
    assert ids == [f"same-{i}" for i in range(3)] + [f"other-{i}" for i in range(3)]
    same = [o.outputs[0].token_ids for o in outs[:3]]
    assert len(same[0]) == 16 and same[0] == same[1] == same[2]
    for i, o in enumerate(outs[3:]):
        assert o.finished
        assert 1 <= len(o.outputs[0].token_ids) <= 8 + i
    assert llm.is_healthy()


@pytest.mark.timeout(60)
def test_engine_thread_failure_fails_streams(tiny_model_dir: Path) -> None:
    llm = AsyncLLM.from_engine_args(
        str(tiny_model_dir), executor="uni", async_scheduling=False, num_kv_blocks=32
    )
    try:
        assert llm.is_healthy()

        def boom() -> list[RequestOutput]:
            raise RuntimeError("boom")

        # The engine thread is idle (blocked on its queue): the next request steps into this.
        llm._engine.step = boom  # type: ignore[union-attr,method-assign]

        async def run() -> None:
            with pytest.raises(EngineDeadError, match="boom"):
                async for _ in llm.generate("hi", SamplingParams(max_tokens=4)):
                    pass
            with pytest.raises(EngineDeadError):
                await llm.add_request("hi", SamplingParams(max_tokens=4))

        asyncio.run(run())
        assert not llm.is_healthy()
    finally:
        llm.shutdown()


@pytest.mark.timeout(90)
def test_worker_death_is_unhealthy_and_fails_requests(tiny_model_dir: Path) -> None:
    llm = AsyncLLM.from_engine_args(str(tiny_model_dir), num_kv_blocks=32, executor="mp")
    try:
        assert llm.is_healthy()
        pid = llm._engine.core.executor.worker_pid  # type: ignore[union-attr,attr-defined]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.is_healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.is_healthy()

        async def run() -> RequestOutput | None:
            last = None
            try:
                async for out in llm.generate("hi", SamplingParams(max_tokens=4)):
                    last = out
            except EngineDeadError:
                return None
            return last

        last = asyncio.run(asyncio.wait_for(run(), 30))
        # Either refused outright or finished with an error: never a hang.
        assert last is None or last.outputs[0].finish_reason == "error"
    finally:
        llm.shutdown()


@pytest.mark.timeout(30)
def test_shutdown_fails_open_streams_and_new_requests(tiny_model_dir: Path) -> None:
    llm = AsyncLLM.from_engine_args(
        str(tiny_model_dir), executor="uni", async_scheduling=False, num_kv_blocks=64
    )

    async def run() -> None:
        stream = await llm.add_request("hi", _long())
        first = await stream.__anext__()
        assert not first.finished
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("hi", SamplingParams())

    try:
        asyncio.run(run())
        assert not llm.is_healthy()
    finally:
        llm.shutdown()
