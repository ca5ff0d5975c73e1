"""Tests of baton.sampler's draws: random numbers, greedy, determinism, distribution, truncation."""

from __future__ import annotations

import math

import pytest
import torch
from sampler_testing import MASK64, SAMPLER_IDS, SAMPLERS, _meta

from baton.sampler import Sampler, SamplingMetadata
from baton.sampler.random import mix64, row_uniforms
from baton.sampler.topk_topp import Candidates, apply_min_p_, top_k_top_p_candidates


def _row_params(gen: torch.Generator, vocab: int) -> dict[str, object]:
    """Random per-row sampling parameters, mixing every feature on and off."""
    r = torch.rand(6, generator=gen).tolist()
    return {
        "temperature": 0.0 if r[0] < 0.15 else 0.3 + 1.5 * r[1],
        "top_k": 0 if r[2] < 0.5 else int(1 + r[3] * 40),
        "top_p": 1.0 if r[4] < 0.4 else 0.2 + 0.75 * r[5],
        "min_p": 0.0 if r[1] < 0.6 else 0.05 * r[3],
        "seed": int(torch.randint(-(2**62), 2**62, (1,), generator=gen)),
        "position": int(torch.randint(0, 10_000, (1,), generator=gen)),
    }


def _build(rows: list[dict[str, object]], **extra: object) -> SamplingMetadata:
    return SamplingMetadata.build(
        temperature=[r["temperature"] for r in rows],  # type: ignore[misc]
        top_k=[r["top_k"] for r in rows],  # type: ignore[misc]
        top_p=[r["top_p"] for r in rows],  # type: ignore[misc]
        min_p=[r["min_p"] for r in rows],  # type: ignore[misc]
        seeds=[r["seed"] for r in rows],  # type: ignore[misc]
        positions=[r["position"] for r in rows],  # type: ignore[misc]
        **extra,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- random numbers


def _splitmix64_reference(x: int) -> int:
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def test_mix64_matches_uint64_reference() -> None:
    values = [0, 1, -1, 2**63 - 1, -(2**63), 0x123456789ABCDEF, -0x7EDCBA9876543210, 42]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & MASK64 for g in got] == [_splitmix64_reference(v) for v in values]


def test_row_uniforms_pure_in_range_and_spread() -> None:
    seeds = torch.tensor([7] * 1000 + [-(2**63), 2**63 - 1], dtype=torch.int64)
    positions = torch.tensor(list(range(1000)) + [0, 5], dtype=torch.int64)
    u = row_uniforms(seeds, positions)
    assert u.dtype == torch.float64
    assert bool(((u > 0) & (u <= 1)).all())
    assert torch.equal(u, row_uniforms(seeds.flip(0), positions.flip(0)).flip(0))
    assert abs(float(u[:1000].mean()) - 0.5) < 0.03
    assert len(set(u.tolist())) == u.numel()
    # (seed, position) and (position, seed) must not share a stream
    a = row_uniforms(torch.tensor([3], dtype=torch.int64), torch.tensor([9], dtype=torch.int64))
    b = row_uniforms(torch.tensor([9], dtype=torch.int64), torch.tensor([3], dtype=torch.int64))
    assert float(a) != float(b)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("sampler", SAMPLERS, ids=SAMPLER_IDS)
def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0))
    logits[3, 10] = logits[3, 20] = 100.0  # tie: the first index wins
    out = sampler(logits, _meta(8, temperature=[0.0] * 8))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert int(out.token_ids[3]) == 10
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None


@pytest.mark.parametrize("sampler", SAMPLERS, ids=SAMPLER_IDS)
def test_mixed_batch_greedy_rows_take_argmax(sampler: Sampler) -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 0.5]
    out = sampler(logits, _meta(6, temperature=temps, top_k=[0, 5, 3, 0, 0, 0]))
    for row, t in enumerate(temps):
        if t == 0.0:
            assert int(out.token_ids[row]) == int(logits[row].argmax())


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("sampler", SAMPLERS, ids=SAMPLER_IDS)
def test_same_seed_position_logits_same_token_whatever_the_batch(sampler: Sampler) -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 3000
    # Peaked rows (as a model gives) and flat ones (which overflow a narrow top-p window).
    scales = [1.0, 4.0, 8.0]
    target_rows = [_row_params(gen, vocab) for _ in range(12)]
    for row in target_rows:
        row["temperature"] = max(float(row["temperature"]), 0.5)
    target_logits = torch.randn(12, vocab, generator=gen)
    target_logits *= torch.tensor([scales[i % 3] for i in range(12)]).unsqueeze(1)
    alone = [
        sampler(target_logits[i : i + 1], _build([target_rows[i]])).token_ids for i in range(12)
    ]

    for trial in range(3):
        others = [_row_params(gen, vocab) for _ in range(4)]
        other_logits = torch.randn(4, vocab, generator=gen) * 5
        rows = target_rows + others
        logits = torch.cat([target_logits, other_logits])
        order = torch.randperm(16, generator=gen)
        torch.manual_seed(1000 + trial)  # the global RNG state must not matter
        out = sampler(logits[order], _build([rows[i] for i in order.tolist()])).token_ids
        for new_pos, old in enumerate(order.tolist()):
            if old < 12:
                assert int(out[new_pos]) == int(alone[old]), (trial, old)


def test_a_batch_sampled_in_row_chunks_draws_what_each_row_draws_alone() -> None:
    """With the model's vocabulary the CPU samples a few rows at a time; every feature mixed
    in, each row's token is the one it gets alone, on both paths."""
    gen = torch.Generator().manual_seed(14)
    n, vocab = 70, 49152
    rows = [_row_params(gen, vocab) for _ in range(n)]
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.5, 8, n).unsqueeze(1)
    meta = _build(rows)
    batch = Sampler()(logits, meta).token_ids
    assert torch.equal(batch, Sampler(allow_host_sync=False)(logits, meta).token_ids)
    for i in range(n):
        alone = Sampler()(logits[i : i + 1], _build([rows[i]])).token_ids
        assert int(batch[i]) == int(alone[0]), i


def test_host_and_device_paths_agree() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = [_row_params(gen, 2000) for _ in range(40)]
    logits = torch.randn(40, 2000, generator=gen) * torch.linspace(0.5, 6, 40).unsqueeze(1)
    meta = _build(rows)
    expected = Sampler(allow_host_sync=False)(logits, meta).token_ids
    assert torch.equal(Sampler()(logits, meta).token_ids, expected)
    assert torch.equal(Sampler(top_p_window=2)(logits, meta).token_ids, expected)


def test_different_positions_and_seeds_give_different_draws() -> None:
    logits = torch.zeros(200, 1000)  # uniform distribution
    by_position = Sampler()(logits, _meta(200, seeds=[5] * 200, positions=list(range(200))))
    by_seed = Sampler()(logits, _meta(200, seeds=list(range(200)), positions=[3] * 200))
    assert len(set(by_position.token_ids.tolist())) > 150
    assert len(set(by_seed.token_ids.tolist())) > 150
    again = Sampler()(logits, _meta(200, seeds=[5] * 200, positions=list(range(200))))
    assert torch.equal(again.token_ids, by_position.token_ids)


def test_bfloat16_logits_are_accepted() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(4))
    meta = _meta(4, top_p=[0.9] * 4)
    out = Sampler()(logits.bfloat16(), meta)
    assert torch.equal(out.token_ids, Sampler()(logits.bfloat16().float(), meta).token_ids)


# ---------------------------------------------------------------- distribution


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "a zero-probability token was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (1.5, 3, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.12),
    ],
)
def test_distribution_matches_expected(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    draws = 20_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    probs = torch.softmax(base.double() / temperature, dim=0)
    order = probs.argsort(descending=True)
    keep = probs >= min_p * probs.max()
    if top_k:
        keep[order[top_k:]] = False
    kept = torch.where(keep, probs, 0.0)
    if top_p < 1.0:
        sorted_probs = kept[order] / kept.sum()
        before = torch.cumsum(sorted_probs, 0) - sorted_probs
        keep[order[before >= top_p]] = False
    expected = torch.where(keep, probs, 0.0)
    expected /= expected.sum()
    meta = _meta(
        draws,
        temperature=[temperature] * draws,
        top_k=[top_k] * draws,
        top_p=[top_p] * draws,
        min_p=[min_p] * draws,
        seeds=[i // 7 for i in range(draws)],
        positions=[i % 7 for i in range(draws)],
    )
    tokens = Sampler()(base.expand(draws, -1), meta).token_ids
    # 5 degrees of freedom at most; P(chi2 > 25) < 2e-4 for a correct sampler.
    assert _chi_square(tokens, expected) < 25.0


def test_tiny_probabilities_keep_their_weight() -> None:
    # Token 1 has probability ~2e-4: 100k draws see it ~20 times.
    draws = 100_000
    logits = torch.tensor([[0.0, -math.log(5e3)]]).expand(draws, -1)
    meta = _meta(draws, seeds=list(range(draws)))
    hits = int(Sampler()(logits, meta).token_ids.sum())
    assert 5 <= hits <= 45


# ---------------------------------------------------------------- truncation


def _reference_kept(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    probs = torch.softmax(logits.double() / temperature, dim=0).tolist()
    pmax = max(probs)
    ranked = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    ranked = [i for i in ranked if probs[i] >= min_p * pmax]
    if 0 < top_k < len(probs):
        ranked = ranked[:top_k]
    if top_p < 1.0:
        total = sum(probs[i] for i in ranked)
        kept, before = [], 0.0
        for i in ranked:
            if before >= top_p * total:
                break
            kept.append(i)
            before += probs[i]
        ranked = kept
    return set(ranked)


def _drawable(candidates: Candidates, weights: torch.Tensor, row: int) -> list[int]:
    ids = candidates.token_ids[row, : int(candidates.count[row])].tolist()
    return [t for t in ids if float(weights[row, t]) > 0]


def test_truncation_matches_per_row_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab, n = 400, 60
    rows = [_row_params(gen, vocab) for _ in range(n)]
    for row in rows:
        row["temperature"] = max(float(row["temperature"]), 0.4)
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.5, 5, n).unsqueeze(1)
    meta = _build(rows)
    temperature = meta.temperature.unsqueeze(1)
    weights = ((logits - logits.amax(dim=-1, keepdim=True)) / temperature).exp()
    if meta.min_p is not None:
        apply_min_p_(weights, meta.min_p)
    full = top_k_top_p_candidates(weights, meta.top_k, meta.top_p, None)
    narrow = top_k_top_p_candidates(weights, meta.top_k, meta.top_p, 50)
    assert bool(full.complete.all())
    assert not bool(narrow.complete.all()), "the narrow window should overflow on flat rows"
    for i, row in enumerate(rows):
        expected = _reference_kept(
            logits[i], float(row["temperature"]), int(row["top_k"]), float(row["top_p"]),
            float(row["min_p"]),
        )  # fmt: skip
        got = set(full.token_ids[i, : int(full.count[i])].tolist())
        got = {t for t in got if float(weights[i, t]) > 0}
        assert got == expected, i
        if bool(narrow.complete[i]):
            # Same drawable tokens in the same order (ids of zero weights do not matter).
            assert _drawable(narrow, weights, i) == _drawable(full, weights, i), i


@pytest.mark.parametrize("sampler", SAMPLERS, ids=SAMPLER_IDS)
def test_top_p_boundary_and_tie_order(sampler: Sampler) -> None:
    # Four equal tokens, p = 0.5: the two before which exactly 0 and 1/4 of the mass
    # lie are kept; the third starts at exactly 1/2 and is cut (vLLM's rule). Ties
    # are broken by token id, so the kept two are tokens 0 and 1.
    n = 300
    meta = _meta(n, top_p=[0.5] * n, seeds=list(range(n)))
    drawn = sampler(torch.zeros(n, 4), meta).token_ids.tolist()
    assert set(drawn) == {0, 1}


def test_extreme_uniforms_never_pick_zero_weight_tokens() -> None:
    from baton.sampler.sampler import _sample_candidates, _sample_full

    weights = torch.tensor([[0.0, 1.0, 0.5, 0.0, 0.0]] * 3)
    uniforms = torch.tensor([2.0**-53, 2.0 / 3.0, 1.0], dtype=torch.float64)
    assert _sample_full(weights, uniforms).tolist() == [1, 1, 2]
    candidates = top_k_top_p_candidates(weights, torch.tensor([4, 4, 4]), None, None)
    assert _sample_candidates(candidates, uniforms).tolist() == [1, 1, 2]


def test_full_sampling_in_row_chunks_draws_what_one_pass_draws() -> None:
    """The CPU scans the CDF a few rows at a time: the same tokens as one pass over them all,
    masked tokens and an all-masked row included."""
    from baton.sampler.sampler import _sample_cdf, _sample_full

    gen = torch.Generator().manual_seed(11)
    rows, vocab = 23, 49152
    weights = torch.rand(rows, vocab, generator=gen) ** 8
    weights[weights < 0.5] = 0.0
    weights[5] = 0.0
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64).clamp_(min=2.0**-53)
    assert _sample_full(weights[:1], uniforms[:1]).shape == (1,)
    tokens = _sample_full(weights, uniforms)
    assert torch.equal(tokens, _sample_cdf(weights, uniforms))
    assert bool((weights.gather(1, tokens.unsqueeze(1)).squeeze(1) > 0).sum() == rows - 1)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=SAMPLER_IDS)
def test_filtered_and_masked_tokens_are_never_drawn(sampler: Sampler) -> None:
    gen = torch.Generator().manual_seed(6)
    vocab, n = 200, 400
    logits = torch.randn(1, vocab, generator=gen).expand(n, -1).clone() * 3
    masked = torch.rand(vocab, generator=gen) < 0.5
    logits[:, masked] = float("-inf")
    for top_k, top_p, min_p in [(5, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.2), (0, 1.0, 0.0)]:
        meta = _meta(
            n,
            temperature=[1.3] * n,
            top_k=[top_k] * n,
            top_p=[top_p] * n,
            min_p=[min_p] * n,
            seeds=list(range(n)),
        )
        allowed = _reference_kept(logits[0], 1.3, top_k, top_p, min_p) - set(
            torch.nonzero(masked).squeeze(1).tolist()
        )
        drawn = set(sampler(logits, meta).token_ids.tolist())
        assert drawn <= allowed
        assert len(drawn) >= min(len(allowed), 3)
