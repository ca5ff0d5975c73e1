"""Tests of baton.sampler: penalties against a reference, logprobs and ranks."""

from __future__ import annotations

import pytest
import torch
from sampler_testing import SAMPLERS, _meta

from baton.sampler import LogprobsTensors, Sampler

# ---------------------------------------------------------------- penalties


def _reference_penalties(
    logits: torch.Tensor,
    prompt: list[list[int]],
    output: list[list[int]],
    rep: list[float],
    pres: list[float],
    freq: list[float],
) -> torch.Tensor:
    out = logits.clone()
    for row in range(out.shape[0]):
        for tok in range(out.shape[1]):
            value = float(out[row, tok])
            count = output[row].count(tok)
            if tok in prompt[row] or count > 0:
                value = value / rep[row] if value > 0 else value * rep[row]
            value -= freq[row] * count
            if count > 0:
                value -= pres[row]
            out[row, tok] = value
    return out


@pytest.mark.parametrize("which", ["repetition", "presence", "frequency", "all"])
def test_penalties_match_reference(which: str) -> None:
    gen = torch.Generator().manual_seed(7)
    n, vocab = 5, 40
    logits = torch.randn(n, vocab, generator=gen) * 3
    prompt = [torch.randint(0, vocab, (6,), generator=gen).tolist() for _ in range(n)]
    output = [torch.randint(0, vocab, (row * 3,), generator=gen).tolist() for row in range(n)]
    rep = [1.0, 1.3, 0.8, 1.0, 2.0] if which in ("repetition", "all") else [1.0] * n
    pres = [0.0, 0.5, -0.4, 1.0, 0.0] if which in ("presence", "all") else [0.0] * n
    freq = [0.0, 0.3, 0.2, -0.5, 1.0] if which in ("frequency", "all") else [0.0] * n
    expected = _reference_penalties(logits, prompt, output, rep, pres, freq)
    meta = _meta(
        n,
        temperature=[0.0] * n,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        prompt_token_ids=prompt,
        output_token_ids=output,
        vocab_size=vocab,
        max_num_logprobs=0,
    )
    original = logits.clone()
    for sampler in SAMPLERS[:2]:
        out = sampler(logits, meta)
        assert torch.equal(out.token_ids, expected.argmax(dim=-1))
        assert torch.equal(logits, original), "the sampler must not modify its input"
        assert out.logprobs is not None  # logprobs come from the raw logits
        raw = torch.log_softmax(original, dim=-1).gather(1, out.token_ids.unsqueeze(1))
        torch.testing.assert_close(out.logprobs.logprobs, raw)

    from baton.sampler.penalties import apply_penalties

    got = apply_penalties(
        logits,
        repetition_penalty=meta.repetition_penalty,
        presence_penalty=meta.presence_penalty,
        frequency_penalty=meta.frequency_penalty,
        prompt_mask=meta.prompt_mask,
        output_counts=meta.output_counts,
    )
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits)


def test_penalties_on_the_cpu_match_the_dense_computation() -> None:
    """On the CPU the penalties are computed only where they apply: the same values as the
    dense version (which CUDA runs), each row as alone, negative penalties included."""
    from baton.sampler.penalties import Penalties, _penalised, apply_penalties

    gen = torch.Generator().manual_seed(12)
    n, vocab = 11, 49152
    logits = torch.randn(n, vocab, generator=gen) * 3
    history = [torch.randint(0, vocab, (50,), generator=gen).tolist() for _ in range(n)]
    history[3] = history[3][:20]  # a row with no output yet
    meta = _meta(
        n,
        repetition_penalty=[1.0 + 0.1 * (i % 3) for i in range(n)],
        presence_penalty=[0.5 * (i % 2) - 0.2 for i in range(n)],
        frequency_penalty=[0.25 - 0.1 * (i % 4) for i in range(n)],
        prompt_token_ids=[h[:20] for h in history],
        output_token_ids=[h[20:] for h in history],
        vocab_size=vocab,
    )
    tensors = {
        "repetition_penalty": meta.repetition_penalty,
        "presence_penalty": meta.presence_penalty,
        "frequency_penalty": meta.frequency_penalty,
        "prompt_mask": meta.prompt_mask,
        "output_counts": meta.output_counts,
    }
    for drop in (None, "repetition_penalty", "frequency_penalty", "presence_penalty"):
        given = {k: (None if k == drop else t) for k, t in tensors.items()}
        got = apply_penalties(logits, **given)
        assert torch.equal(got, _penalised(logits, Penalties(**given))), drop
        assert not torch.equal(got, logits)
        for i in (0, 3, n - 1):
            alone = {k: None if t is None else t[i : i + 1] for k, t in given.items()}
            assert torch.equal(got[i : i + 1], apply_penalties(logits[i : i + 1], **alone))
    assert torch.equal(
        logits.bfloat16().float(),
        apply_penalties(
            logits.bfloat16(),
            **{
                **tensors,
                "repetition_penalty": None,
                "presence_penalty": None,
                "frequency_penalty": None,
            },
        ),
    )


# ---------------------------------------------------------------- logprobs


def test_logprobs_of_many_rows_match_each_row_alone() -> None:
    """On the CPU many rows go a chunk at a time: each row's values are what it gets alone."""
    from baton.sampler.logprobs import compute_logprobs

    gen = torch.Generator().manual_seed(13)
    n, vocab = 37, 49152
    logits = torch.randn(n, vocab, generator=gen) * 3
    sampled = torch.randint(0, vocab, (n,), generator=gen)
    got = compute_logprobs(logits, sampled, 5)
    assert got.token_ids.shape == (n, 6) and got.ranks.shape == (n,)
    for i in range(n):
        alone = compute_logprobs(logits[i : i + 1], sampled[i : i + 1], 5)
        assert torch.equal(got.token_ids[i], alone.token_ids[0]), i
        assert torch.equal(got.logprobs[i], alone.logprobs[0]), i
        assert torch.equal(got.ranks[i], alone.ranks[0]), i


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_are_raw_log_softmax_with_ranks(k: int) -> None:
    gen = torch.Generator().manual_seed(8)
    n, vocab = 6, 50
    logits = torch.randn(n, vocab, generator=gen) * 2
    meta = _meta(
        n,
        temperature=[0.0, 1.0, 2.0, 0.7, 1.0, 0.0],
        top_k=[0, 0, 3, 0, 0, 0],
        repetition_penalty=[1.0, 1.0, 1.0, 1.0, 3.0, 1.0],
        prompt_token_ids=[[1]] * n,
        output_token_ids=[[2]] * n,
        vocab_size=vocab,
        max_num_logprobs=k,
    )
    out = Sampler()(logits, meta)
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    assert lp.token_ids.shape == (n, k + 1) and lp.logprobs.shape == (n, k + 1)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(lp.token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(
        lp.logprobs, reference.gather(1, lp.token_ids).float(), rtol=1e-5, atol=1e-5
    )
    for row in range(n):
        ranked = reference[row].argsort(descending=True).tolist()
        assert int(lp.ranks[row]) == ranked.index(int(out.token_ids[row])) + 1
        assert lp.token_ids[row, 1:].tolist() == ranked[:k]
