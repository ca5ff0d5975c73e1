"""The synchronous engine end to end on the default model: greedy equals
transformers, chunked prefill and preemption change nothing, seeds are stable."""

from __future__ import annotations

import pytest
import torch

from baton.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, my friend.",
    "import numpy as np\nx = np.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def llm(default_checkpoint):
    llm = LLM.from_checkpoint(default_checkpoint, dtype="float32", max_model_len=512)
    yield llm
    llm.shutdown()


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def greedy_outputs(llm):
    """The engine's greedy continuation of every prompt, batched (checked against transformers
    by test_greedy_equals_transformers)."""
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_greedy_equals_transformers(llm, greedy_outputs, default_checkpoint, hf_default_model):
    # Teacher-forced: transformers' argmax after every prefix of prompt + output is the next
    # output token, and EOS where the output stopped. That is its greedy continuation, token
    # for token, from one forward pass per prompt instead of 32 decode steps (each of which
    # reads all 540 MB of float32 weights: 15 s for the 8 prompts).
    tokens = _tokens(greedy_outputs)
    for text, out in zip(PROMPTS, tokens, strict=True):
        prompt = default_checkpoint.tokenizer.encode(text)
        with torch.no_grad():
            logits = hf_default_model(torch.tensor([prompt + out])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out, text
        assert out[-1] == 2 or len(out) == GREEDY.max_tokens
    assert any(out[-1] == 2 for out in tokens) and any(len(t) == 32 for t in tokens)
    for o in greedy_outputs:
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length")
        assert c.text == llm.get_tokenizer().decode(c.token_ids)
        assert o.metrics.time_to_first_token is not None


# The chunked and preempted runs stop at 16 tokens: a greedy run's first 16 tokens are those of
# the 32-token run, and each step of this model reads all its weights (~0.1 s).
SHORT = SamplingParams(max_tokens=16, temperature=0.0)


def _short(outs):
    return [t[: SHORT.max_tokens] for t in _tokens(outs)]


def test_greedy_with_tiny_budget_chunks_prefill(default_checkpoint, greedy_outputs):
    llm = LLM.from_checkpoint(
        default_checkpoint, dtype="float32", max_model_len=512, max_num_batched_tokens=7
    )
    try:
        # Prompts of up to 16 tokens, 7 tokens a step: the longer ones are prefilled in chunks.
        assert max(len(o.prompt_token_ids) for o in greedy_outputs) > 7
        assert _tokens(llm.generate(PROMPTS, SHORT, use_tqdm=False)) == _short(greedy_outputs)
    finally:
        llm.shutdown()


def test_greedy_with_preemption(default_checkpoint, greedy_outputs):
    # 29 usable blocks of 4 tokens cannot hold the 8 growing sequences at once (about 57 at
    # their longest). Not much fewer: with 12, the requests ran nearly one at a time, each step
    # reading all the weights for one or two rows (twice as long for the same check).
    llm = LLM.from_checkpoint(
        default_checkpoint, dtype="float32", max_model_len=512, block_size=4, num_kv_blocks=30
    )
    try:
        assert _tokens(llm.generate(PROMPTS, SHORT, use_tqdm=False)) == _short(greedy_outputs)
        sched = llm.engine.core.scheduler
        assert sched.num_preemptions > 0
        assert not sched.has_unfinished_requests()
        assert sched.kv.num_used_blocks == 0
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_a_request_longer_than_the_kv_cache_ends_at_its_length(default_checkpoint):
    # 8 blocks of 4 tokens: 7 usable, 28 tokens (the last token's keys are never written).
    # Asked for 512, the engine lowers max_model_len to what one request can hold alone;
    # before, a request that grew past the cache waited for blocks forever.
    llm = LLM.from_checkpoint(
        default_checkpoint, dtype="float32", max_model_len=512, block_size=4, num_kv_blocks=8
    )
    try:
        limit = 28
        assert llm.engine.max_model_len == limit
        params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate(["Tell me a long story about a fox."], params, use_tqdm=False)
        done = out.outputs[0]
        assert done.finish_reason == "length"
        assert len(out.prompt_token_ids) + len(done.token_ids) == limit
        with pytest.raises(ValueError, match=f"max_model_len is {limit}"):
            llm.generate(["word " * 40], params, use_tqdm=False)
        assert llm.engine.core.scheduler.kv.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_same_seed_same_tokens_alone_or_in_batch(llm):
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(["Tell me a story about a dragon."], sp, use_tqdm=False)
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(15)]
    batch = llm.generate(
        [f"Prompt number {i}:" for i in range(8)]
        + ["Tell me a story about a dragon."]
        + [f"Another prompt {i}" for i in range(7)],
        others[:8] + [sp] + others[8:],
        use_tqdm=False,
    )
    assert batch[8].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_n_completions_differ_and_are_reproducible(llm):
    sp = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7)
    a = llm.generate("Write a word:", sp, use_tqdm=False)[0]
    b = llm.generate("Write a word:", sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_logprobs_equal_log_softmax_of_reference(llm, default_checkpoint, hf_default_model):
    prompt = "The quick brown fox"
    out = llm.generate(
        prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    ids = default_checkpoint.tokenizer.encode(prompt) + out.token_ids
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    n_prompt = len(ids) - len(out.token_ids)
    assert len(out.logprobs) == 4
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        assert tok in entry and entry[tok].rank == 1
        top = torch.topk(row, 3)
        assert set(top.indices.tolist()) <= set(entry)
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < 1e-3
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_stop_string_is_cut_and_min_tokens_hold(llm):
    # One batch, as short as the checks allow: a decode step reads all the weights whether it
    # has one row or five.
    count = "1, 2, 3, 4, 5,"
    say_ok = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"
    base, cut, kept, natural, forced = (
        o.outputs[0]
        for o in llm.generate(
            [count, count, count, say_ok, say_ok],
            [
                SamplingParams(max_tokens=12, temperature=0.0),
                SamplingParams(max_tokens=12, temperature=0.0, stop=[" 7"]),
                SamplingParams(
                    max_tokens=12, temperature=0.0, stop=[" 7"], include_stop_str_in_output=True
                ),
                SamplingParams(max_tokens=20, temperature=0.0),
                SamplingParams(max_tokens=20, temperature=0.0, min_tokens=16),
            ],
            use_tqdm=False,
        )
    )
    assert " 7" in base.text
    assert cut.finish_reason == "stop" and cut.stop_reason == " 7"
    assert cut.text == base.text[: base.text.index(" 7")]
    assert kept.text == base.text[: base.text.index(" 7") + 2]
    # Left alone the answer ends (EOS) before 16 tokens; min_tokens keeps it going.
    assert natural.finish_reason == "stop" and len(natural.token_ids) < 16
    assert len(forced.token_ids) >= 16


def test_chat_batch_and_single(llm):
    conv = [{"role": "user", "content": "What is 2+2?"}]
    single = llm.chat(conv, GREEDY, use_tqdm=False)
    batch = llm.chat([conv, [{"role": "user", "content": "Hi"}]], [GREEDY, GREEDY], use_tqdm=False)
    assert single[0].outputs[0].token_ids == batch[0].outputs[0].token_ids
    assert len(batch) == 2


def test_chat_continues_the_final_message(llm):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    ids = tokenizer.encode(text[: text.rindex("is") + 2], add_special_tokens=False)
    (plain,) = llm.generate([ids], GREEDY, use_tqdm=False)
    (cont,) = llm.chat(
        messages, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert cont.prompt_token_ids == ids
    assert cont.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="cannot both be set"):
        llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)


def test_dict_prompts_as_vllm_writes_them(llm):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, are the same prompts."""
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=True)
    plain = llm.generate([text, ids], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    for a, b in zip(plain, dicts, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert dicts[0].prompt == text
    (one,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert one.outputs[0].token_ids == plain[1].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ("x " * 600, SamplingParams(), "max_model_len"),
        ([1, 2, 99999999], SamplingParams(), "token ids"),
        ({"prompt": "hi", "multi_modal_data": {}}, SamplingParams(), "multi_modal_data"),
        ({}, SamplingParams(), "exactly one"),
        ({"prompt": "a", "prompt_token_ids": [1]}, SamplingParams(), "exactly one"),
        ({"prompt_token_ids": "abc"}, SamplingParams(), "list of ints"),
        ([{"prompt": "ok"}, {"prompt": 5}], SamplingParams(), "must be a string"),
    ],
)
def test_bad_input_raises_before_scheduling(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_failure_in_one_request_spares_the_others(llm, monkeypatch):
    from baton.engine.processing.detokenizer import IncrementalDetokenizer

    original = IncrementalDetokenizer.update

    def flaky(self, new_token_ids, stop_terminated=False):
        # Counted with the tokens of this call: LLM.generate decodes once, at the end.
        seen = self.num_output_tokens + len(new_token_ids)
        if seen >= 3 and "poison" in getattr(self, "_tag", ""):
            raise RuntimeError("detokenizer exploded")
        return original(self, new_token_ids, stop_terminated)

    original_init = IncrementalDetokenizer.__init__

    def tagging_init(self, tokenizer, prompt_token_ids, **kw):
        original_init(self, tokenizer, prompt_token_ids, **kw)
        text = llm.get_tokenizer().decode(list(prompt_token_ids or []))
        self._tag = "poison" if "poison" in text else ""

    monkeypatch.setattr(IncrementalDetokenizer, "update", flaky)
    monkeypatch.setattr(IncrementalDetokenizer, "__init__", tagging_init)
    outs = llm.generate(
        ["A healthy prompt", "A poison prompt", "Another healthy one"],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "error", "length"]
    assert "exploded" in outs[1].outputs[0].error
    assert len(outs[0].outputs[0].token_ids) == 8
    sched = llm.engine.core.scheduler
    assert not sched.has_unfinished_requests() and sched.kv.num_used_blocks == 0


def test_prefix_cache_reuses_part_of_a_block_without_changing_tokens(llm, default_checkpoint):
    """A prompt that shares 20 tokens with a finished one (one 16-token block and 4 tokens
    of the next) starts from those 20, the 4 copied from the cached block, and gets the
    tokens an engine without prefix caching gives. Without the copy its KV rows 16-19 are
    another block's (zeros or stale) and the greedy tokens change (checked)."""
    rng = torch.Generator().manual_seed(7)
    shared = torch.randint(1000, 20000, (20,), generator=rng).tolist()
    first = shared + torch.randint(1000, 20000, (15,), generator=rng).tolist()
    second = shared + torch.randint(1000, 20000, (9,), generator=rng).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    plain = LLM.from_checkpoint(
        default_checkpoint, dtype="float32", max_model_len=512, enable_prefix_caching=False
    )
    try:
        alone = plain.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    finally:
        plain.shutdown()
    llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 20
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert out.outputs[0].logprobs == alone.outputs[0].logprobs  # the same KV, bit for bit
    # the same prompt again: its own blocks hold all but its last prompt token
    again = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == len(second) - 1
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    assert again.outputs[0].logprobs == alone.outputs[0].logprobs
