"""A lone request never waits for KV blocks forever (engine/kv_capacity.py, issues 53 and 56).

Checked: the per-group rule (full groups hold every block, a windowed group its window and a
step's tokens) against the blocks the scheduler really holds, sync and async, with and
without prefix caching; the engine's ``max_model_len`` lowered to what a lone request can
hold for windowed and grouped models as for full ones; a lone request that finds no room
finished with an error naming the numbers instead of waiting forever (scheduler, and a tiny
Gemma 2 engine); a windowed request whose prefix hits alone overflow the cache admitted
without them."""

from __future__ import annotations

import logging
import random
from collections import deque

import pytest
from conftest import build_tiny_model_dir
from test_scheduler import fake_output, make_request

from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.core.async_scheduler import AsyncScheduler
from baton.engine.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler
from baton.engine.kv_capacity import StepShape, blocks_of_span, lone_request_limit
from baton.engine.kv_layout import kv_cache_layout
from baton.engine.processing.model_setup import _fit_kv_cache
from baton.engine.scheduler_output import ModelRunnerOutput
from baton.engine.speculative_config import SpeculativeConfig

BS = 4
WINDOW = 8
# A lone request past any reasonable end: the guard that turns a hang into a failure.
MAX_STEPS = 400


def _config(budget: int = 8, blocks: int = 12, prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        block_size=BS,
        num_kv_blocks=blocks,
        enable_prefix_caching=prefix_caching,
        async_scheduling=False,
    )


def _run(sched: Scheduler, lag: int = 0, rng: random.Random | None = None) -> dict[str, object]:
    """Steps until every request finished (``lag`` steps in flight: 1 under async
    scheduling; ``rng``: how many of a step's drafts are accepted, else none); each request's
    finishing output. Fails after MAX_STEPS steps."""
    finished: dict[str, object] = {}
    in_flight: deque = deque()
    for _ in range(MAX_STEPS):
        if not sched.has_unfinished_requests() and not in_flight:
            return finished
        if sched.has_unfinished_requests():
            before = {rid: r.num_output_placeholders for rid, r in sched.requests.items()}
            so = sched.schedule()
            sched.kv.check_invariants()
            ids = list(so.num_scheduled_tokens)
            if lag:  # async: the requests whose placeholders grew sample in this step
                grew = [sched.requests[r].num_output_placeholders > before.get(r, 0) for r in ids]
                out = ModelRunnerOutput(ids, [[7] if g else [] for g in grew])
            else:
                out = fake_output(sched, so)
            for i, rid in enumerate(ids):  # accepted drafts come before the sampled token
                drafts = so.scheduled_spec_decode_tokens.get(rid, ())
                if drafts and out.sampled_token_ids[i] and rng is not None:
                    kept = list(drafts[: rng.randint(0, len(drafts))])
                    out.sampled_token_ids[i] = kept + out.sampled_token_ids[i]
            in_flight.append((so, out))
        if len(in_flight) > lag or not sched.has_unfinished_requests():
            so, out = in_flight.popleft()
            for o in sched.update_from_output(so, out):
                if o.finished:
                    finished[o.request_id] = o
    raise AssertionError(f"still unfinished after {MAX_STEPS} steps: a request waits forever")


# --- the rule ------------------------------------------------------------------------------


def test_the_limit_by_kind_of_group():
    sync = StepShape(max_num_batched_tokens=8)
    # Full attention: (blocks - 1) x block_size, as before.
    assert lone_request_limit((None,), 12, BS, sync) == 44
    # Windowed only: window 8 and a chunk of 8 span 15 positions, 5 blocks: any length fits
    # in 12 blocks; in 4 (3 usable) only 12 tokens do.
    assert blocks_of_span(sync.window_span(WINDOW), BS) == 5
    assert lone_request_limit((WINDOW,), 12, BS, sync) is None
    assert lone_request_limit((WINDOW,), 4, BS, sync) == 12
    # Gemma 2-like: the full group's 22 blocks and the window's 5 fill 27 usable blocks.
    assert lone_request_limit((None, WINDOW), 28, BS, sync) == 88
    # Shorter than the window's 5 blocks the two groups hold alike: 11 usable -> 6 blocks.
    assert lone_request_limit((None, WINDOW), 12, BS, sync) == 24
    # Async with drafts: the tokens in flight and, with prefix caching, a chunk not yet
    # registered stay held too.
    ahead = StepShape(16, num_speculative_tokens=3, async_scheduling=True, prefix_caching=True)
    assert ahead.window_span(WINDOW) == 32
    assert lone_request_limit((None, WINDOW), 40, BS, ahead) == 120


class _FixedDrafter:
    """Proposes the same tokens for every request (``Drafter``'s interface)."""

    config = SpeculativeConfig("ngram", 3)

    def can_draft(self, req: Request) -> bool:
        return True

    def propose(self, req: Request, max_drafts: int) -> tuple[int, ...]:
        return (5, 6, 5, 6, 5, 6)[:max_drafts]


def _peak_windowed_blocks(sched: Scheduler, lag: int, rng: random.Random) -> int:
    """Runs the scheduler's requests to the end; the most blocks any windowed group of one
    request held after a step was planned (checking the full groups hold every block)."""
    kv = sched.kv
    peak = 0
    original = sched.schedule

    def schedule():
        so = original()
        nonlocal peak
        for rid in so.num_scheduled_tokens:
            computed = sched.requests[rid].num_computed_tokens
            for window, ids in zip(kv.group_windows, kv.get_group_block_ids(rid), strict=True):
                held = sum(b != NULL_BLOCK_ID for b in ids)
                if window is None:
                    assert held == -(-computed // BS)
                else:
                    peak = max(peak, held)
        return so

    sched.schedule = schedule  # type: ignore[method-assign]
    finished = _run(sched, lag, rng)
    assert all(o.finish_reason == "length" for o in finished.values())
    return peak


@pytest.mark.parametrize("drafts", [0, 3], ids=["no-drafts", "drafts"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_a_windowed_group_holds_at_most_the_rule(async_scheduling, prefix_caching, drafts):
    """Random windows, chunks and lengths in a cache with room to spare, with or without 3
    drafts a step (some accepted): a windowed group never holds more blocks than the rule
    says, and reaches it in some case (the rule is not loose by a block)."""
    rng = random.Random(53)
    reached = drafted = 0
    for case in range(30):
        window, budget = rng.choice([1, 3, 4, 8, 13]), rng.choice([1, 4, 5, 8, 16])
        windows = rng.choice([(window,), (None, window)])
        cfg = _config(budget, 400, prefix_caching)
        kv = KVCacheManager(400, BS, prefix_caching, group_windows=windows)
        cls = AsyncScheduler if async_scheduling else Scheduler
        sched = cls(cfg, kv, 1024, drafter=_FixedDrafter() if drafts else None)
        for i in range(rng.randint(1, 3)):
            prompt = rng.randint(1, 60)
            sched.add_request(
                make_request(
                    f"{case}-{i}",
                    prompt,
                    first=100 + 100 * i,  # no shared prefix (see the module docstring there)
                    max_tokens=rng.randint(1, 30),
                    ignore_eos=True,
                )
            )
        step = StepShape(budget, drafts, async_scheduling, prefix_caching)
        bound = blocks_of_span(step.window_span(window), BS)
        peak = _peak_windowed_blocks(sched, 1 if async_scheduling else 0, rng)
        assert peak <= bound, (case, window, budget, windows)
        reached += peak == bound
        drafted += sched.num_accepted_tokens
        assert kv.num_used_blocks == 0
    assert reached and (drafted > 0) == bool(drafts)


# --- the engine's max_model_len ---------------------------------------------------------------


def test_fit_lowers_max_model_len_for_windowed_and_grouped_models(caplog):
    """What ``_fit_kv_cache`` makes of a cache per layout (sync, chunks of 8, blocks of 4):
    full attention as before; a windowed model keeps any length when its window's blocks fit,
    else is lowered; a Gemma 2-like model is lowered to its full group's share."""
    cfg = _config(budget=8)
    full, windowed = kv_cache_layout([None, None]), kv_cache_layout([WINDOW, WINDOW])
    grouped = kv_cache_layout([WINDOW, None])
    with caplog.at_level(logging.WARNING, logger="baton.engine.processing.model_setup"):
        assert _fit_kv_cache(cfg, 256, 12, full) == 44
        assert _fit_kv_cache(cfg, 256, 12, windowed) == 256
        assert _fit_kv_cache(cfg, 256, 28, grouped) == 88
        assert "max_model_len 256 lowered to 88" in caplog.text
        assert _fit_kv_cache(cfg, 256, 4, windowed) == 12
        assert "max_model_len 256 lowered to 12" in caplog.text
    assert _fit_kv_cache(cfg, 64, 28, grouped) == 64  # fits: unchanged
    with pytest.raises(ValueError, match="2 blocks of 1 tokens over 2 KV cache groups"):
        _fit_kv_cache(
            EngineConfig(max_num_batched_tokens=8, block_size=1, num_kv_blocks=2), 64, 2, grouped
        )


# --- a lone request that cannot fit -----------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_lone_request_that_outgrows_the_cache_fails_instead_of_waiting(async_scheduling):
    """A scheduler given more max_model_len than its cache holds (the engine lowers it; a
    grouped cache of 11 usable blocks holds 24 tokens): the 20 + 100-token request is
    finished with an error naming the numbers once it alone finds no room, every block goes
    back, and the request behind it is served."""
    kv = KVCacheManager(12, BS, True, group_windows=(None, WINDOW))
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(_config(), kv, 128)
    sched.add_request(make_request("long", 20, max_tokens=100, ignore_eos=True))
    sched.add_request(make_request("short", 8, first=300, max_tokens=4, ignore_eos=True))
    finished = _run(sched, 1 if async_scheduling else 0)
    long = finished["long"]
    assert long.finish_reason == "error"
    assert "cannot hold request 'long' even alone" in long.error
    assert "11 usable blocks of 4 tokens" in long.error and "max_model_len 128" in long.error
    assert finished["short"].finish_reason == "length"
    assert kv.num_used_blocks == 0


def test_a_request_whose_first_chunk_cannot_fit_is_refused_at_admission():
    """Two usable blocks, a grouped cache, chunks of 16: the first chunk needs 4 blocks a
    group; with nothing running the request is refused, not left waiting."""
    kv = KVCacheManager(3, BS, False, group_windows=(None, WINDOW))
    sched = Scheduler(_config(budget=16, blocks=3, prefix_caching=False), kv, 64)
    sched.add_request(make_request("r", 16, max_tokens=4))
    finished = _run(sched)
    assert finished["r"].finish_reason == "error"
    assert "its 16 tokens need more than the 2 usable blocks" in finished["r"].error


def test_a_windowed_request_is_admitted_without_hits_that_overflow_the_cache():
    """Every layer windowed (window 4, 7 usable blocks, chunks of 8): a 24-token prompt
    leaves its 6 blocks cached; a 32-token prompt that starts with it would take those 6 hit
    blocks and 2 new ones at once (8 > 7) and wait forever; alone, it is admitted without
    them (the window's blocks suffice) and completes."""
    kv = KVCacheManager(8, BS, True, sliding_window=4)
    sched = Scheduler(_config(blocks=8), kv, 128)
    prompt = list(range(100, 124))
    sched.add_request(make_request("a", 24, max_tokens=1))
    assert _run(sched)["a"].finish_reason == "length"
    assert kv.get_computed_blocks("probe", [*prompt, 1, 2]) == 24  # the 6 blocks are cached
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    sched.add_request(Request.new("b", [*prompt, *range(500, 508)], params, (2,), 0))
    out = _run(sched)["b"]
    assert out.finish_reason == "length" and len(out.new_token_ids) >= 1
    assert kv.num_used_blocks == 0


# --- a tiny Gemma 2 through the engine ----------------------------------------------------


@pytest.mark.timeout(300)  # without the fix the long request waits for blocks forever
def test_gemma2_engine_lowers_max_model_len_and_serves_within_it(tokenizer, tmp_path):
    """A tiny Gemma 2 (one windowed, one full layer; window 8) in 12 blocks of 4, chunks of
    8: max_model_len 128 is lowered to 24 (the full group's 6 blocks and the window's 5);
    a longer prompt is refused with the usual error, and a request asking 50 tokens stops at
    max_model_len instead of waiting for blocks forever."""
    folder = build_tiny_model_dir(tmp_path / "g", tokenizer, "gemma2")
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        block_size=BS,
        num_kv_blocks=12,
        max_num_batched_tokens=8,
        executor="uni",
        async_scheduling=False,
    )
    try:
        assert llm.engine.max_model_len == 24
        prompt = (tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 4)[:16]
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        with pytest.raises(ValueError, match="max_model_len is 24"):
            llm.generate([{"prompt_token_ids": prompt * 2}], params, use_tqdm=False)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 24 - 16
        assert llm.engine.core.scheduler.kv.num_used_blocks == 0
    finally:
        llm.shutdown()
