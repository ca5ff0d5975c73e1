"""Tests of baton.sampler: the token bitmask applied to logits, and bad input (shapes, metadata)
refused naming the field."""

from __future__ import annotations

import pytest
import torch
from sampler_testing import MASK64, _meta

from baton.sampler import Sampler, SamplingMetadata, apply_token_bitmask_, unpack_bitmask

# ---------------------------------------------------------------- bitmask


def _random_bitmask(gen: torch.Generator, rows: int, words: int) -> torch.Tensor:
    raw = torch.randint(0, 2**32, (rows, words), generator=gen, dtype=torch.int64)
    return torch.where(raw >= 2**31, raw - 2**32, raw).to(torch.int32)


def _reference_bitmask_apply(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]
) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    for b_row, l_row in enumerate(indices):
        for tok in range(out.shape[1]):
            word, bit = divmod(tok, 32)
            allowed = word < words and (int(bitmask[b_row, word]) & MASK64) >> bit & 1
            if not allowed:
                out[l_row, tok] = float("-inf")
    return out


@pytest.mark.parametrize(("vocab", "words"), [(100, 4), (96, 3), (100, 3), (70, 5)])
def test_bitmask_apply_matches_per_token_reference(vocab: int, words: int) -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = _random_bitmask(gen, 4, words)
    bitmask[0, 0] = -1  # all 32 bits, including the sign bit
    bitmask[1, 0] = -(2**31)  # only bit 31
    expected = _reference_bitmask_apply(logits, bitmask, [0, 1, 2, 3])
    got = logits.clone()
    apply_token_bitmask_(got, bitmask)
    assert torch.equal(got, expected)
    assert bool(torch.isinf(got[1, :31]).all()) and bool(torch.isfinite(got[1, 31]))
    assert unpack_bitmask(bitmask, vocab).shape == (4, vocab)


def test_bitmask_apply_with_indices() -> None:
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(6, 77, generator=gen)
    bitmask = _random_bitmask(gen, 3, 3)
    expected = _reference_bitmask_apply(logits, bitmask, [4, 0, 2])
    got = logits.clone()
    apply_token_bitmask_(got, bitmask, torch.tensor([4, 0, 2]))
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])


def test_bitmask_bad_input_raises() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_(logits, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="indices"):
        apply_token_bitmask_(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(ValueError, match="indices"):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="logits"):
        apply_token_bitmask_(torch.zeros(64), torch.zeros(1, 2, dtype=torch.int32))


# ---------------------------------------------------------------- validation


def test_bad_shapes_raise_value_error_naming_the_field() -> None:
    meta = _meta(2)
    sampler = Sampler()
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(10), meta)
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(2, 10, dtype=torch.int64), meta)
    with pytest.raises(ValueError, match="temperature"):
        sampler(torch.zeros(3, 10), meta)
    penalised = _meta(2, presence_penalty=[0.5, 0.0], output_token_ids=[[1], []], vocab_size=10)
    with pytest.raises(ValueError, match="output_counts"):
        sampler(torch.zeros(2, 12), penalised)
    with pytest.raises(ValueError, match="max_num_logprobs"):
        sampler(torch.zeros(2, 3), _meta(2, max_num_logprobs=4))


def test_metadata_validation() -> None:
    ok = _meta(2)
    with pytest.raises(ValueError, match="seeds"):
        SamplingMetadata.build(temperature=[1.0, 1.0], seeds=[1], positions=[0, 0])
    with pytest.raises(ValueError, match="top_p"):
        _meta(2, top_p=[0.0, 1.0])
    with pytest.raises(ValueError, match="temperature"):
        _meta(2, temperature=[-1.0, 1.0])
    with pytest.raises(ValueError, match="vocab_size"):
        _meta(2, frequency_penalty=[0.1, 0.0], output_token_ids=[[], []])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        _meta(2, repetition_penalty=[1.2, 1.0], output_token_ids=[[], []], vocab_size=5)
    with pytest.raises(ValueError, match="positions"):
        SamplingMetadata(
            temperature=ok.temperature,
            all_greedy=False,
            all_random=True,
            top_k=None,
            top_p=None,
            min_p=None,
            seeds=ok.seeds,
            positions=ok.positions.int(),
        )
    with pytest.raises(ValueError, match="top_k"):
        SamplingMetadata(
            temperature=ok.temperature,
            all_greedy=False,
            all_random=True,
            top_k=torch.tensor([1, 2, 3]),
            top_p=None,
            min_p=None,
            seeds=ok.seeds,
            positions=ok.positions,
        )
    with pytest.raises(ValueError, match="all_greedy"):
        SamplingMetadata(
            temperature=ok.temperature,
            all_greedy=True,
            all_random=False,
            top_k=None,
            top_p=None,
            min_p=None,
            seeds=ok.seeds,
            positions=ok.positions,
        )
    with pytest.raises(ValueError, match="needs"):
        SamplingMetadata(
            temperature=ok.temperature,
            all_greedy=False,
            all_random=True,
            top_k=None,
            top_p=None,
            min_p=None,
            seeds=ok.seeds,
            positions=ok.positions,
            presence_penalty=torch.tensor([0.5, 0.0]),
        )


def test_build_turns_unused_parameters_off_and_wraps_seeds() -> None:
    meta = _meta(
        3,
        temperature=[0.0, 0.0, 0.0],
        top_k=[0, 0, 0],
        top_p=[1.0, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0],
        repetition_penalty=[1.0, 1.0, 1.0],
        seeds=[2**64 - 1, -1, 2**70 + 5],
    )
    assert meta.all_greedy and not meta.all_random
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert not meta.has_penalties
    assert meta.seeds.tolist() == [-1, -1, 5]


def test_empty_batch() -> None:
    meta = _meta(0, max_num_logprobs=2)
    out = Sampler()(torch.zeros(0, 10), meta)
    assert out.token_ids.shape == (0,)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (0, 3)
