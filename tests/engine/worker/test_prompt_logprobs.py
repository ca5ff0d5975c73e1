"""``SamplingParams.prompt_logprobs`` (issue 55) on the default model: every prompt token's
logprob, rank and top-k equal a float32 log_softmax of transformers' logits over the whole
prompt, with chunked prefill (in a worker process), after a prefix-cache hit on the same prompt,
through preemptions mid-prompt, and beside requests that do not ask (whose outputs do not
change). The HTTP shapes are in test_server_prompt_logprobs.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from baton.engine import LLM, SamplingParams
from baton.engine.outputs import Logprob
from baton.engine.scheduler_output import Logprobs

pytestmark = pytest.mark.slow

# 19 and 10 tokens: over the chunked engine's 7-token budget, and A past one 16-token block.
PROMPT_A = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest"
PROMPT_B = "Once upon a time, in a land far away,"
TOL = 1e-3


def _reference(model: Any, ids: list[int]) -> torch.Tensor:
    """float32 log_softmax of transformers' logits over the whole prompt, ``[len(ids), V]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _assert_matches(
    plp: list[dict[int, Logprob] | None] | None, ids: list[int], ref: torch.Tensor, k: int
) -> None:
    """Each prompt token's entry holds it (logprob and rank as the reference's row before it)
    and the top ``k`` (ranks 1..k, the reference's top values)."""
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry, row, tok = plp[pos], ref[pos - 1], ids[pos]
        assert entry is not None and tok in entry, pos
        lp = entry[tok]
        assert abs(lp.logprob - row[tok].item()) < TOL, pos
        # Its rank, up to ties within the tolerance.
        lo = int((row > lp.logprob + TOL).sum()) + 1
        hi = int((row >= lp.logprob - TOL).sum())
        assert lo <= lp.rank <= hi, (pos, lp.rank, lo, hi)
        # The top k: ranks 1..k (the prompt token among them where it is one).
        top = sorted((v for v in entry.values() if v.rank <= k), key=lambda v: v.rank)
        assert [v.rank for v in top] == list(range(1, k + 1)), pos
        want = torch.topk(row, k).values.tolist() if k else []
        assert [v.logprob for v in top] == pytest.approx(want, abs=TOL), pos
        for tid, v in entry.items():
            assert abs(v.logprob - row[tid].item()) < TOL, (pos, tid)
            assert v.decoded_token is not None


# ------------------------------------------------------------------ pure checks


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3"])
def test_a_bad_prompt_logprobs_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_a_chunk_delivered_again_keeps_the_first_rows() -> None:
    from baton.engine.core.request import PromptLogprobsSoFar
    from baton.engine.scheduler_output import PromptLogprobs

    # A preempted prompt is computed again from its start: its chunks arrive a second time.
    def part(start: int, n: int) -> PromptLogprobs:
        rows = range(start, start + n)
        return PromptLogprobs(
            start, Logprobs([[r] for r in rows], [[-r] for r in rows], list(rows))
        )

    held = PromptLogprobsSoFar()
    held.add(part(1, 3))
    held.add(part(1, 2))  # again, from the start
    held.add(part(3, 4))  # overlaps by one
    assert held.take() == Logprobs(
        [[r] for r in range(1, 7)], [[-r] for r in range(1, 7)], [1, 2, 3, 4, 5, 6]
    )
    assert held.take() is None  # sent once
    with pytest.raises(RuntimeError, match="position 9"):
        PromptLogprobsSoFar().add(part(9, 1))


def test_queued_prompt_logprobs_cut_each_request_to_its_top_k() -> None:
    """The runner's part alone: two requests' rows through a toy LM head in slices, each
    request's rows cut to its own k, the embedding's padding ids (past the tokenizer) never
    ranked."""
    import numpy as np

    from baton.engine.worker import prompt_logprobs as plp
    from baton.engine.worker.device_buffers import DeviceIO

    torch.manual_seed(0)
    hidden = torch.randn(5, 4)
    weight = torch.randn(7, 4)
    weight[6] = 100 * hidden.mean(0)  # a padding id the raw logits would rank first
    tokens = torch.tensor([[0, 3, 1, 4, 2, 5]])  # one state row of token ids
    rows = plp.PromptRows(
        request_ids=("a", "b"),
        starts=(1, 4),
        counts=(2, 3),
        top_k=(0, 2),
        hidden_index=np.arange(5, dtype=np.int64),
        token_rows=np.zeros(5, dtype=np.int64),
        target_positions=np.array([1, 2, 3, 4, 5], dtype=np.int64),
    )
    old = plp._HEAD_ROWS
    plp._HEAD_ROWS = 2  # three slices
    try:
        copy = plp.queue_prompt_logprobs(
            rows,
            hidden,
            lambda h: h @ weight.T,
            lambda r, p: tokens[r, p],
            DeviceIO(torch.device("cpu")),
            vocab_size=6,
        )
    finally:
        plp._HEAD_ROWS = old
    got = copy.result()
    ref = torch.log_softmax((hidden @ weight.T)[:, :6], -1)
    a, b = got["a"], got["b"]
    assert (a.start, b.start) == (1, 4)
    assert a.rows.token_ids == [[3], [1]] and len(b.rows.token_ids[0]) == 3
    for i, (ids, vals, rank) in enumerate(
        zip(
            a.rows.token_ids + b.rows.token_ids,
            a.rows.logprobs + b.rows.logprobs,
            a.rows.ranks + b.rows.ranks,
            strict=True,
        )
    ):
        assert 6 not in ids
        assert vals == pytest.approx(ref[i, ids].tolist(), abs=1e-6)
        assert rank == int((ref[i] >= ref[i, ids[0]]).sum())
        if i >= 2:
            assert ids[1:] == torch.topk(ref[i], 2).indices.tolist()


# --------------------------------------------------------------------- engine


@pytest.fixture
def llm(default_checkpoint):
    # One test's engine, gone before the next test starts its own, with a small KV cache (64
    # blocks: 1,024 tokens): a module-wide one with the default cache (1 GiB) beside those
    # engines took this file's worker to 3.8 of its 4 GiB (tests/memory_guard.py).
    llm = LLM.from_checkpoint(
        default_checkpoint, dtype="float32", max_model_len=256, num_kv_blocks=64
    )
    yield llm
    llm.shutdown()


def test_prompt_logprobs_skip_the_prefix_cache_and_equal_the_reference(
    llm, default_checkpoint, hf_default_model
):
    ids = default_checkpoint.tokenizer.encode(PROMPT_A)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    # The prompt's blocks go into the prefix cache...
    assert llm.generate(PROMPT_A, greedy, use_tqdm=False)[0].prompt_logprobs is None
    asked = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=3)
    out = llm.generate(PROMPT_A, asked, use_tqdm=False)[0]
    # ...which a request owed prompt logprobs does not take: it computes every position.
    assert out.num_cached_tokens == 0
    _assert_matches(out.prompt_logprobs, ids, _reference(hf_default_model, ids), 3)
    assert len(out.outputs[0].logprobs) == 2  # the sampled tokens' logprobs as well
    # Others still hit the cache.
    assert llm.generate(PROMPT_A, greedy, use_tqdm=False)[0].num_cached_tokens >= 16
    # A one-token prompt has only the first token's None.
    one = llm.generate(
        [{"prompt_token_ids": ids[:1]}],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    assert one.prompt_logprobs == [None]


def test_chunked_prompt_logprobs_beside_requests_that_do_not_ask(
    default_checkpoint, hf_default_model
):
    # 7 tokens a step: A's 19 prompt tokens come in chunks that share steps with B's; in a
    # worker process, so that the prompt logprobs cross its replies. No prefix cache, so that
    # the second batch computes exactly what the first did.
    llm = LLM.from_checkpoint(
        default_checkpoint,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
        executor="mp",
    )
    plain = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    asked = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2)
    try:
        before = llm.generate([PROMPT_A, PROMPT_B], [plain, plain], use_tqdm=False)
        after = llm.generate([PROMPT_A, PROMPT_B], [asked, plain], use_tqdm=False)
    finally:
        llm.shutdown()
    ids = default_checkpoint.tokenizer.encode(PROMPT_A)
    assert len(ids) > 2 * 7  # three chunks at least
    _assert_matches(after[0].prompt_logprobs, ids, _reference(hf_default_model, ids), 2)
    assert after[1].prompt_logprobs is None and before[0].prompt_logprobs is None
    for b, a in zip(before, after, strict=True):  # asking changed no one's tokens
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_prompt_logprobs_survive_preemption_mid_prompt(default_checkpoint, hf_default_model):
    # 8 usable blocks of 4 tokens, 4 tokens a step: B (admitted first) grows until A, midway
    # through its 19-token prompt, is preempted (the most recent), and again after each
    # restart until B ends. Each restart computes A's prompt from its start (no prefix cache
    # while its logprobs are owed) and delivers its first chunks again.
    llm = LLM.from_checkpoint(
        default_checkpoint,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=4,
        block_size=4,
        num_kv_blocks=9,
    )
    try:
        b, a = llm.generate(
            [PROMPT_B, PROMPT_A],
            [
                SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
            ],
            use_tqdm=False,
        )
        assert llm.engine.core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    assert len(b.outputs[0].token_ids) == 14 and a.outputs[0].finish_reason == "length"
    ids = default_checkpoint.tokenizer.encode(PROMPT_A)
    _assert_matches(a.prompt_logprobs, ids, _reference(hf_default_model, ids), 1)
