"""Speculative decoding's pieces: config checks, the drafters (n-gram lookup, forced text),
verification (accepted tokens, recorded and rewound tokens, KV truncation, the rejection rule)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from baton.engine import SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.core.drafter import Drafter, extendable_tokens, ngram_lookup
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.entrypoints.args import add_engine_args, config_from_args
from baton.engine.scheduler_output import NewRequestData
from baton.engine.speculative_config import SpeculativeConfig
from baton.engine.worker.request_states import RequestStates
from baton.engine.worker.spec_decode import accepted_tokens, record_verified_
from baton.sampler import Sampler, SamplingMetadata

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------- config


def test_config_validates_each_field():
    assert SpeculativeConfig.of(None) is None
    cfg = SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg == SpeculativeConfig("ngram", 3)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=True)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"unknown keys \['k'\]"):
        SpeculativeConfig.of({"k": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.of("{method: ngram}")


def test_engine_config_refuses_what_is_not_built_yet():
    spec = {"method": "auto"}
    cfg = EngineConfig(speculative_config=spec)
    assert cfg.speculative_config == SpeculativeConfig("auto")
    assert cfg.async_scheduling is False and cfg.executor == "uni"
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)
    # In a worker process, with either scheduling.
    mp = EngineConfig(speculative_config=spec, async_scheduling=True)
    assert mp.executor == "mp" and mp.speculative_config == SpeculativeConfig("auto")
    # The simulated device verifies drafts under either scheduling; its default is async.
    sim = EngineConfig(device="sim:h200", speculative_config=spec)
    assert sim.executor == "sim" and sim.async_scheduling is True
    sim_sync = EngineConfig(device="sim:h200", speculative_config=spec, async_scheduling=False)
    assert sim_sync.async_scheduling is False
    # Structured drafts by default on the simulator, sync or async (measured faster there).
    default = SpeculativeConfig("auto", 5, structured_only=True)
    sim_async = EngineConfig(device="sim:h200")
    assert sim_async.async_scheduling is True and sim_async.speculative_config == default
    sim_sync = EngineConfig(device="sim:h200", async_scheduling=False)
    assert sim_sync.speculative_config == default
    assert EngineConfig(device="sim:h200", structured_drafts=False).speculative_config is None
    with pytest.raises(ValueError, match="speculative_config.method"):
        EngineConfig(speculative_config={"method": "medusa"})


def test_structured_drafts_are_on_by_default_where_they_can_run():
    cfg = EngineConfig()  # this machine: sync in-process wherever the CPU has < 3 cores
    if cfg.async_scheduling or cfg.executor != "uni":
        pytest.skip("the default engine here schedules asynchronously")
    assert cfg.speculative_config == SpeculativeConfig("auto", 5, structured_only=True)
    assert EngineConfig(structured_drafts=False).speculative_config is None
    # Not measured faster in a worker process: off by default there, on when asked for.
    assert EngineConfig(executor="mp").speculative_config is None
    assert EngineConfig(async_scheduling=True, executor="mp").speculative_config is None
    asked = EngineConfig(structured_drafts=True, executor="mp", async_scheduling=True)
    assert asked.speculative_config == SpeculativeConfig("auto", 5, structured_only=True)
    with pytest.raises(ValueError, match="structured_drafts=True is not supported with"):
        EngineConfig(structured_drafts=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="structured_drafts must be None, True or False"):
        EngineConfig(structured_drafts="yes")
    # An explicit config wins over the default.
    explicit = EngineConfig(speculative_config={"method": "ngram"}, structured_drafts=False)
    assert explicit.speculative_config == SpeculativeConfig("ngram")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--no-structured-drafts"])
    assert config_from_args(args).speculative_config is None
    with pytest.raises(ValueError, match="structured_only must be a bool"):
        SpeculativeConfig(structured_only=1)


def test_cli_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method":"grammar"}'])
    assert config_from_args(args).speculative_config == SpeculativeConfig("grammar")
    args = parser.parse_args(["--speculative-config", '{"method":"x"}'])
    with pytest.raises(ValueError, match="method"):
        config_from_args(args)


# ------------------------------------------------------------------ pieces


def test_ngram_lookup_takes_the_longest_latest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last occurred before the end at index 5..6, followed by 7 8 5.
    assert ngram_lookup(seq, 1, 3, 3) == [7, 8, 5]
    assert ngram_lookup(seq, 1, 3, 10) == [7, 8, 5, 2, 3]
    assert ngram_lookup([1, 2, 3], 1, 3, 4) == []
    assert ngram_lookup([4, 4], 1, 1, 2) == [4]
    assert ngram_lookup([], 1, 3, 2) == []


def test_extendable_tokens_are_proper_prefixes():
    assert extendable_tokens(["ab", "a", "abc", "b", "x", "xy"]) == {0, 1, 4}


class _Codec:
    """A tokenizer over a fixed vocabulary that encodes by longest match."""

    VOCAB = ("{", '"', "a", '":', '":"', "x", "}", '"a')

    def token_strings(self) -> list[str]:
        return list(self.VOCAB)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.VOCAB[i] for i in ids)

    def encode(self, text, add_special_tokens=True) -> list[int]:
        out = []
        while text:
            best = max((t for t in self.VOCAB if text.startswith(t)), key=len)
            out.append(self.VOCAB.index(best))
            text = text[len(best) :]
        return out


class _Matcher:
    """Forces '"a":"' after '{' and the rest of it inside it; nothing elsewhere."""

    def __init__(self, req) -> None:
        self.req = req

    def jump_forward_string(self) -> str:
        text = _Codec().decode(self.req.output_token_ids)
        forced = '{"a":"'
        return forced[len(text) :] if forced.startswith(text) else ""

    def validate_tokens(self, tokens) -> int:
        return len(tokens)


def _fake_request(rid: str, output: list[int]):
    from types import SimpleNamespace

    req = SimpleNamespace(
        request_id=rid,
        output_token_ids=output,
        eos_token_ids=(),
        sampling_params=SamplingParams(),
    )
    req.structured = SimpleNamespace(matcher=_Matcher(req))
    req.all_token_ids = output
    return req


def test_a_forced_text_is_drafted_as_the_model_wrote_it_last():
    """The canonical tokens of '"a":"' are '"a' '":"'; a model that writes '"' 'a' '":' '"'
    instead gets those as drafts once the drafter has seen it, from the start of the forced
    text or from inside it, even where the last one could start a longer token."""
    codec = _Codec()
    tok = {t: i for i, t in enumerate(codec.VOCAB)}
    model_wrote = [tok['"'], tok["a"], tok['":'], tok['"']]
    drafter = Drafter(SpeculativeConfig("grammar", 3), codec)
    first = _fake_request("r1", [tok["{"]])
    assert drafter.propose(first, 3) == (tok['"a'], tok['":"'])  # nothing learned yet
    first.output_token_ids += [*model_wrote, tok["x"]]  # the drafts were rejected
    assert drafter.propose(first, 3) == ()  # inside the string: nothing forced
    second = _fake_request("r2", [tok["{"]])
    assert drafter.propose(second, 3) == tuple(model_wrote[:3])
    second.output_token_ids += model_wrote[:3]
    assert drafter.propose(second, 3) == (tok['"'],)  # the rest, though '"a' extends it
    # A text the model ran past mid-token teaches nothing and keeps what was learned.
    third = _fake_request("r3", [tok["{"]])
    drafter.propose(third, 3)
    third.output_token_ids += [tok['"a'], tok['":'], tok["x"]]  # '"a":x' leaves the text
    drafter.propose(third, 3)
    assert drafter.propose(_fake_request("r4", [tok["{"]]), 3) == tuple(model_wrote[:3])
    # A request id used again does not follow the old request's watch: its own forced text
    # is drafted (canonically here: nothing was learned for '{"a":"').
    again = _fake_request("r4", [])
    assert drafter.propose(again, 3) == (tok["{"], tok['"a'], tok['":"'])


def test_accepted_tokens_is_the_matching_prefix_and_one_more():
    assert accepted_tokens([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert accepted_tokens([5, 9, 7], [5, 6]) == [5, 9]
    assert accepted_tokens([4, 6, 7], [5, 6]) == [4]
    assert accepted_tokens([3], []) == [3]


def test_record_verified_writes_only_kept_tokens():
    token_ids = torch.zeros(3, 10, dtype=torch.int64)
    num_tokens = torch.tensor([2, 3, 4])
    last = torch.zeros(3, dtype=torch.int64)
    counts = torch.zeros(3, 6, dtype=torch.int32)
    rows = torch.tensor([2, 0])
    lengths = torch.tensor([4, 2])
    sampled = torch.tensor([[1, 2, 3], [4, 5, 4]])
    drafts = torch.tensor([[1, 5], [-1, -1]])
    record_verified_(token_ids, num_tokens, last, counts, rows, lengths, sampled, drafts)
    assert num_tokens.tolist() == [3, 3, 6]
    assert last.tolist() == [4, 0, 2]
    assert token_ids[2, 4:6].tolist() == [1, 2] and token_ids[0, 2].item() == 4
    assert counts[2].tolist() == [0, 1, 1, 0, 0, 0]
    assert counts[0].tolist() == [0, 0, 0, 0, 1, 0]


def test_rewind_forgets_the_tokens_recorded_past_the_real_length():
    states = RequestStates(max_num_reqs=3, max_model_len=16, max_blocks_per_req=4, vocab_size=8)
    params = SamplingParams(max_tokens=8, repetition_penalty=1.1)
    for i, rid in enumerate(("a", "b", "c")):
        states.add(NewRequestData(rid, (1, 2), (3, 4 + i), params, 0, (), 0))
    states.flush()
    rows = np.array([0, 1, 2], dtype=np.int64)
    # Row 0 sampled two tokens past its real length, row 1 none; row 2 is left alone.
    states.append_sampled(rows[:1], torch.tensor([0]), torch.tensor([6]))
    states.append_sampled(rows[:1], torch.tensor([0]), torch.tensor([6]))
    counts_before = states.output_counts.clone()
    states.rewind(rows[:2], np.array([4, 4], dtype=np.int64), 3)
    assert states.num_tokens[:3].tolist() == [4, 4, 4]
    assert states.num_tokens_device[:3].tolist() == [4, 4, 4]
    assert states.last_sampled[:3].tolist() == [4, 5, 6]
    expected = counts_before.clone()
    expected[0, 6] -= 2
    assert torch.equal(states.output_counts, expected)
    assert (states.output_counts >= 0).all()


def test_kv_truncate_frees_the_tail():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots("r", 13)
    assert len(kv.get_block_ids("r")) == 4
    assert kv.truncate("r", 9) == 3
    assert kv.num_free_blocks == 6
    assert kv.truncate("r", 12) == 3
    kv.cache_blocks("r", list(range(12)), 8)
    with pytest.raises(ValueError, match="prefix cache"):
        kv.truncate("r", 4)
    kv.check_invariants()


def test_rejection_rule_is_exact_on_a_small_vocabulary():
    """The verification rule (keep the draft iff the row's sampled token is the draft, else
    that token) accepts a draft with its target probability p(d) and otherwise gives a token of
    the residual distribution: chi-square over fixed seeds, no flakes."""
    probs = torch.tensor([0.30, 0.05, 0.20, 0.10, 0.15, 0.02, 0.08, 0.10])
    draft = 2
    n = 20000
    logits = torch.log(probs).expand(n, -1).contiguous()
    meta = SamplingMetadata.build(
        temperature=[1.0] * n, seeds=list(range(n)), positions=[3] * n, top_k=None
    )
    tokens = Sampler()(logits, meta).token_ids.tolist()
    kept = [accepted_tokens([t, 0], [draft])[0] for t in tokens]
    accepted = sum(1 for t in kept if t == draft)
    # Acceptance: binomial(n, p(d)); 4 standard deviations.
    p = float(probs[draft])
    assert abs(accepted - n * p) < 4 * (n * p * (1 - p)) ** 0.5
    residual = probs.clone()
    residual[draft] = 0
    residual /= residual.sum()
    rejected = np.bincount([t for t in kept if t != draft], minlength=8)
    expected = residual.numpy() * rejected.sum()
    cells = expected > 0
    chi2 = float((((rejected - expected) ** 2)[cells] / expected[cells]).sum())
    assert rejected[draft] == 0
    assert chi2 < 24.32  # chi-square, 6 degrees of freedom, p = 0.0005
