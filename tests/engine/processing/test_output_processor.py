"""OutputProcessor: final-only outputs (offline generate) equal the last of the per-step ones."""

from __future__ import annotations

import pytest

from baton.engine.processing.output_processor import OutputProcessor
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import EngineCoreOutput

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "机器学习是人工智能的一个分支。🎉🎊 emoji 👨\u200d👩\u200d👧\u200d👦 family",
    '{"name":"Ada","tags":["x","y"],"age":36}',
    "   leading spaces,\n\n\nnew lines\r\n and\ttabs   ",
]


def _feed(processor: OutputProcessor, rid: str, tokens: list[int], finish: str, chunk: int):
    """Delivers ``tokens`` ``chunk`` at a time; returns every output the processor gave."""
    outs = []
    for i in range(0, len(tokens), chunk):
        last = i + chunk >= len(tokens)
        core = EngineCoreOutput(
            rid,
            tokens[i : i + chunk],
            finish_reason=finish if last else None,
        )
        results, _ = processor.process([core])
        outs += results
    return outs


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("min_tokens", [0, 3])
@pytest.mark.parametrize("chunk", [1, 3])
def test_final_only_gives_the_same_last_output(tokenizer, skip_special, min_tokens, chunk):
    eos = tokenizer.eos_token_id
    for n, text in enumerate(TEXTS):
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for finish, ids in (("stop", [*tokens, eos]), ("length", tokens)):
            sp = SamplingParams(
                max_tokens=len(ids), min_tokens=min_tokens, skip_special_tokens=skip_special
            )
            streamed, final = OutputProcessor(tokenizer), OutputProcessor(tokenizer)
            streamed.add_request(f"r{n}", None, [1, 2], sp)
            final.add_request(f"r{n}", None, [1, 2], sp, final_only=True)
            per_step = _feed(streamed, f"r{n}", ids, finish, chunk)
            once = _feed(final, f"r{n}", ids, finish, chunk)
            assert len(per_step) == -(-len(ids) // chunk)  # one output per delivery
            assert len(once) == 1 and once[0].finished
            a, b = per_step[-1].outputs[0], once[0].outputs[0]
            assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
            assert a.text  # not vacuous: there is text to compare


def test_final_only_still_watches_stop_strings(tokenizer):
    tokens = tokenizer.encode("one two three four five six", add_special_tokens=False)
    sp = SamplingParams(max_tokens=len(tokens), stop=[" four"])
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], sp, final_only=True)
    aborted, outs, delivered = [], [], 0
    for tok in tokens:
        results, to_abort = processor.process([EngineCoreOutput("r", [tok])])
        delivered += 1
        outs += results
        aborted += to_abort
        if to_abort:
            break
    assert aborted == ["r"] and delivered < len(tokens)  # found while generating
    assert len(outs) == 1 and outs[0].outputs[0].text == "one two three"
    assert outs[0].outputs[0].finish_reason == "stop"


def test_parallel_completions_end_when_the_last_one_does(tokenizer):
    """With n > 1 the prompt's metrics carry its last completion's end (for the e2e latency
    histogram on /metrics), and none while one still runs."""
    processor = OutputProcessor(tokenizer)
    first, second = processor.add_request("p", None, [1, 2], SamplingParams(n=2, max_tokens=4))
    (out,), _ = processor.process([EngineCoreOutput(first, [5], finish_reason="length")])
    assert not out.finished and out.metrics.finished_time is None
    (out,), _ = processor.process([EngineCoreOutput(second, [6, 7], finish_reason="stop")])
    assert out.finished and out.metrics.finished_time is not None
    assert out.metrics.finished_time >= out.metrics.last_token_time >= out.metrics.arrival_time
