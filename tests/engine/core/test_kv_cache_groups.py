"""KV cache groups (engine/kv_layout.py): a model that mixes sliding-window layers with
full-attention ones (Gemma 2, gpt-oss) keeps a group of blocks per kind, and the windowed
group gives back its blocks wholly before the window. Checked: the layout, the manager's
bookkeeping (bounded windowed group, prefix hits by vLLM's window rule), the scheduler's
release under chunked prefill, and a tiny Gemma 2 / gpt-oss with transformers' greedy tokens
in a cache that one shared block table could not hold."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from model_files import build_tiny_model_dir
from test_scheduler import fake_output

from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager, hash_block_tokens
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler
from baton.engine.kv_layout import KVCacheLayout, kv_cache_layout
from baton.engine.loader import load_checkpoint
from baton.engine.processing import model_setup
from baton.engine.tokenizer import Tokenizer
from baton.engine.worker import build, model_runner

BS = 4
WINDOW = 8


def test_layout_groups_layers_by_kind():
    one = kv_cache_layout([None, None, None])
    assert (one.group_windows, one.layer_slots, one.num_slots) == ((None,), (0, 1, 2), 3)
    assert kv_cache_layout([8, 8]).group_windows == (8,)
    # Gemma 2: alternating. Full attention is group 0; slot j of each group shares a tensor.
    gemma2 = kv_cache_layout([8, None, 8, None])
    assert gemma2.group_windows == (None, 8) and gemma2.num_slots == 2
    assert gemma2.layer_groups == (1, 0, 1, 0) and gemma2.layer_slots == (0, 0, 1, 1)
    # Gemma 3: five windowed to one full: groups of one layer.
    gemma3 = kv_cache_layout([8] * 5 + [None])
    assert gemma3.group_windows == (None,) + (8,) * 5 and gemma3.num_slots == 1
    with pytest.raises(ValueError, match="more than one window"):
        kv_cache_layout([8, 16, None])


def _windowed_blocks(kv: KVCacheManager, rid: str) -> int:
    full, sliding = kv.get_group_block_ids(rid)
    assert NULL_BLOCK_ID not in full
    return sum(b != NULL_BLOCK_ID for b in sliding)


def test_scheduler_keeps_the_windowed_group_to_window_and_chunk():
    """A 100-token prompt in chunks of 8 then 19 decode steps: the full group grows to every
    block, the windowed group stays within ceil((window + chunk) / block) + 1 blocks. Without
    groups (one table) every block stays held."""
    chunk = 8
    cfg = EngineConfig(
        max_num_seqs=1, max_num_batched_tokens=chunk, block_size=BS, num_kv_blocks=64
    )
    kv = KVCacheManager(64, BS, True, group_windows=(None, WINDOW))
    sched = Scheduler(cfg, kv, 256)
    prompt = list(range(100, 200))
    sched.add_request(Request.new("r", prompt, SamplingParams(max_tokens=30), (2,), 0))
    bound = math.ceil((WINDOW + chunk) / BS) + 1
    most = 0
    for _ in range(13 + 19):
        so = sched.schedule()
        most = max(most, _windowed_blocks(kv, "r"))
        full = kv.get_group_block_ids("r")[0]
        assert len(full) == math.ceil(sched.requests["r"].num_computed_tokens / BS)
        sched.update_from_output(so, fake_output(sched, so))
        kv.check_invariants()
    assert sched.requests["r"].num_computed_tokens == 119
    assert len(kv.get_group_block_ids("r")[0]) == 30 and most <= bound
    # Blocks held: the full group's 30 and the window's few, not 2 x 30.
    assert kv.num_used_blocks <= 30 + bound


def test_windowed_prefix_hit_needs_only_the_window():
    """A cached prompt of 8 blocks: a new request takes every full-attention block, and in the
    windowed group only the blocks its window reaches (the others' slots are null). Evicting
    a windowed block inside that window makes the lookup take the shorter hit that has its
    window cached."""
    kv = KVCacheManager(40, BS, True, group_windows=(None, WINDOW))
    tokens = list(range(500, 534))  # 8 full blocks and 2 tokens
    assert kv.allocate_slots("a", len(tokens)) is not None
    kv.cache_blocks("a", tokens, len(tokens))
    kv.free("a")
    assert kv.get_computed_blocks("b", tokens) == 32
    assert kv.allocate_slots("b", len(tokens) + 1, 32) is not None
    full, sliding = kv.get_group_block_ids("b")
    # A query at 32 sees 25..32: blocks 6 and 7 of the prompt, then the new block 8.
    assert NULL_BLOCK_ID not in full and sliding[:6] == [NULL_BLOCK_ID] * 6
    assert NULL_BLOCK_ID not in sliding[6:]
    kv.check_invariants()
    kv.free("b")
    # Evict the windowed group's block 7 (tokens 28..31) alone: no public call evicts one
    # block, and LRU order would evict the full group's blocks too.
    parent = None
    for i in range(8):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS])
    block_7 = kv._cached(parent, 1)  # noqa: SLF001
    assert block_7 is not None and block_7.ref_cnt == 0
    pool = kv._pool  # noqa: SLF001
    del pool._evictable[block_7.block_id]  # noqa: SLF001
    pool._forget(block_7)  # noqa: SLF001
    pool._free.append(block_7)  # noqa: SLF001
    # Hit of 7 blocks (28 tokens): its window (21..28) is blocks 5 and 6, both still cached.
    assert kv.get_computed_blocks("c", tokens) == 28
    assert kv.allocate_slots("c", len(tokens) + 1, 28) is not None
    kv.check_invariants()


def test_groups_release_and_truncate_in_step():
    """Drafts: a truncate keeps every group's slots in step; a release never goes past the
    committed position, so truncating to it is allowed; free gives every block back."""
    kv = KVCacheManager(40, BS, False, group_windows=(None, WINDOW))
    assert kv.allocate_slots("r", 40) is not None
    assert kv.release_outside_window("r", 30) == 5  # positions 23.. seen: blocks 0-4 go
    assert len(kv.get_block_ids("r")) == 20  # 10 slots x 2 groups, interleaved
    assert kv.truncate("r", 30) == 16
    assert [len(g) for g in kv.get_group_block_ids("r")] == [8, 8]
    with pytest.raises(ValueError, match="released past its window"):
        kv.truncate("r", 16)
    kv.check_invariants()
    kv.free("r")
    assert kv.num_used_blocks == 0


# --- a tiny Gemma 2 and gpt-oss through the engine ---------------------------------------


@pytest.fixture(scope="module", params=["gemma2", "gpt_oss"])
def mixed_folder(request: pytest.FixtureRequest, tmp_path_factory, tokenizer: Tokenizer) -> Path:
    folder = build_tiny_model_dir(tmp_path_factory.mktemp(request.param), tokenizer, request.param)
    config = load_checkpoint(folder).config
    assert config.sliding_window == WINDOW and config.full_attention_layers
    assert (
        len({config.layer_window(i) for i in range(config.num_layers)}) == 2
    )  # windowed and full layers mixed
    return folder


def _hf_greedy_ok(folder: Path, runs: list[tuple[list[int], list[int]]]) -> bool:
    """Whether each (prompt, tokens) is transformers' greedy continuation (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, tokens in runs:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0]
        if logits[len(prompt) - 1 : -1].argmax(-1).tolist() != tokens:
            return False
    return True


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.timeout(300)  # without groups the long request never fits: it waits forever
def test_mixed_model_runs_a_long_request_in_a_cache_one_table_cannot_hold(mixed_folder, tokenizer):
    """Window 8, blocks of 4, chunks of 8. A 36-token prompt (4 tokens generated) is cached;
    then a 64-token prompt that starts with it takes its 9 blocks from the prefix cache (the
    full group's and the window's) and generates 24 tokens (88 tokens, 22 blocks a table).
    With groups a block is one slot's keys and values, and the budget of 22 + 5 + 2
    slot-blocks holds the full group's 22 and the windowed group's few; one table of every
    layer would need 22 blocks of every layer. Both requests get transformers' greedy
    tokens."""
    c = load_checkpoint(mixed_folder).config
    layout = kv_cache_layout([c.layer_window(i) for i in range(c.num_layers)])
    assert layout.num_groups >= 2
    slot_block = 2 * BS * c.num_kv_heads * c.head_dim * 4  # float32 keys and values
    budget = (22 + math.ceil((WINDOW + 8) / BS) + 2) * slot_block * layout.num_slots
    assert budget < 22 * slot_block * c.num_layers  # one table of every layer: too small
    prompt = (tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 8)[:64]
    llm = LLM(
        str(mixed_folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=1,
        block_size=BS,
        kv_cache_memory_bytes=budget,
        max_num_batched_tokens=8,
    )
    try:
        (short,) = _generate(llm, [prompt[:36]], 4)
        (long,) = _generate(llm, [prompt], 24)
    finally:
        llm.shutdown()
    assert short.num_cached_tokens == 0 and long.num_cached_tokens == 36
    runs = [(prompt[:36], short), (prompt, long)]
    tokens = [list(out.outputs[0].token_ids) for _, out in runs]
    assert [len(t) for t in tokens] == [4, 24]
    pairs = [(ids, t) for (ids, _), t in zip(runs, tokens, strict=True)]
    assert _hf_greedy_ok(mixed_folder, pairs)


@pytest.mark.timeout(300)
def test_mixed_model_with_drafts_and_preemption_keeps_greedy_tokens(mixed_folder, tokenizer):
    """Four requests in a cache too small for them together (preemptions), with prompt-lookup
    drafts (rejected drafts truncate every group) and chunks of 16: each gets transformers'
    greedy tokens, and every block is back in the pool at the end. gpt-oss runs one step
    ahead (async scheduling: steps planned past drafts are rewound), Gemma 2 in step (one
    model worker process's start-up is enough for the file's time)."""
    async_scheduling = load_checkpoint(mixed_folder).config.architecture != "gemma2"
    text = "one two three four five six seven eight nine ten. "
    prompts = [(tokenizer.encode(f"{i} {text}") * 4)[: 30 + 3 * i] for i in range(4)]
    llm = LLM(
        str(mixed_folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        block_size=BS,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        async_scheduling=async_scheduling,
    )
    try:
        outs = _generate(llm, prompts, 16)
        sched = llm.engine.core.scheduler
        assert sched.num_preemptions > 0
        assert sched.num_accepted_tokens < sched.num_draft_tokens  # some were rejected
        assert sched.kv.num_used_blocks == 0
        sched.kv.check_invariants()
    finally:
        llm.shutdown()
    tokens = [list(out.outputs[0].token_ids) for out in outs]
    assert all(len(t) == 16 for t in tokens)
    assert _hf_greedy_ok(mixed_folder, list(zip(prompts, tokens, strict=True)))


def _one_table(windows: Sequence[int | None]) -> KVCacheLayout:
    """The layout before groups: one block table for every layer (windows still applied)."""
    n = len(windows)
    return KVCacheLayout((None,), (0,) * n, tuple(range(n)), n)


@pytest.mark.timeout(300)
def test_groups_give_the_tokens_of_one_shared_table(mixed_folder, tokenizer, monkeypatch):
    """The same requests (a 64-token prompt in chunks of 8, then one that hits its cached
    prefix) with groups and with one block table for every layer: the same greedy tokens."""
    prompt = (tokenizer.encode("A bird in the hand is worth two in the bush. ") * 8)[:64]
    prompts = [prompt[:40], prompt]

    def run(num_groups: int) -> list[list[int]]:
        llm = LLM(
            str(mixed_folder),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=1,
            block_size=BS,
            num_kv_blocks=64,
            max_num_batched_tokens=8,
            executor="uni",  # the patched layout must reach the runner: one process
            async_scheduling=False,
        )
        try:
            assert llm.engine.core.scheduler.kv.num_groups == num_groups
            outs = [_generate(llm, [p], 16)[0] for p in prompts]
        finally:
            llm.shutdown()
        assert outs[1].num_cached_tokens == 40
        return [list(o.outputs[0].token_ids) for o in outs]

    grouped = run(2)
    for module in (model_setup, build, model_runner):
        monkeypatch.setattr(module, "kv_cache_layout", _one_table)
    assert run(1) == grouped
