"""Truncation of the sampling distribution: min-p, top-k and top-p.

All functions work on *weights*: unnormalised probabilities whose row maximum is
exactly 1, as `exp((x - max x) / T)` produces. Top-k and top-p keep a prefix of
the tokens in a canonical order (weight descending, token id ascending), so the
kept set is a pure function of the row, whatever the batch, the window used to
find it, or the tie order a sort routine happens to produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.sampler.row_chunks import cat_row_chunks


def apply_min_p_(weights: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero, in place, the weights below min_p times the row maximum (which is 1).

    A row with min_p 0 is left unchanged; the most likely token is always kept
    since min_p <= 1.

    Raises:
        ValueError: if the shapes disagree.
    """
    if weights.dim() != 2 or tuple(min_p.shape) != (weights.shape[0],):
        raise ValueError(
            f"weights must be [N, V] and min_p [N], got {tuple(weights.shape)} and "
            f"{tuple(min_p.shape)}"
        )
    weights.masked_fill_(weights < min_p.to(weights.dtype).unsqueeze(1), 0.0)


@dataclass(frozen=True)
class Candidates:
    """The kept tokens of each row: a prefix of a canonically ordered window.

    Fields:
        token_ids: int64 [N, W]; tokens by weight descending, then id ascending.
        cumulative: float64 [N, W]; inclusive running sum of their weights.
        count: int64 [N]; length of the kept prefix (>= 1).
        complete: bool [N]; False where the window was too narrow to be sure of the
            kept prefix (its ids or its length); such rows must be recomputed with
            the full vocabulary. Always True when W == V.
    """

    token_ids: torch.Tensor
    cumulative: torch.Tensor
    count: torch.Tensor
    complete: torch.Tensor


def _canonical_window(weights: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the `width` largest weights of each row and their ids, canonically ordered."""
    if width >= weights.shape[1]:
        # A stable descending sort keeps tied weights in ascending id order.
        return weights.sort(dim=-1, descending=True, stable=True)
    values, ids = weights.topk(width, dim=-1, sorted=False)
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(1, by_id)
    values, by_weight = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_weight)


def _row_totals(weights: torch.Tensor) -> torch.Tensor:
    """Return each row's weight sum as float64, independent of the batch around it."""
    totals = cat_row_chunks(lambda part: weights[part].cumsum(dim=-1)[:, -1], weights, 4)
    return totals.to(torch.float64)


def top_k_top_p_candidates(
    weights: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    width: int | None = None,
) -> Candidates:
    """Find each row's kept set under top-k then top-p (vLLM's order and semantics).

    Top-k keeps the k heaviest tokens (k <= 0 or k >= V: off). Top-p then keeps the
    shortest prefix whose weight reaches p times the total weight left by top-k
    (rows with p >= 1: off); a token is kept when the weight strictly before it is
    below that limit, so at least one token always stays. Min-p, if any, must
    already be applied to `weights`.

    `width` limits the work to the `width` heaviest tokens of each row (a top-k
    call instead of a full sort); rows whose kept set it cannot settle come back
    with complete=False. None means the full vocabulary, with no data-dependent
    branching (no host/device synchronisation).

    Raises:
        ValueError: if shapes disagree or width < 1.
    """
    if weights.dim() != 2:
        raise ValueError(f"weights must be 2-D [N, V], got shape {tuple(weights.shape)}")
    n, vocab = weights.shape
    for name, tensor in (("top_k", top_k), ("top_p", top_p)):
        if tensor is not None and tuple(tensor.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(tensor.shape)}")
    if width is not None and width < 1:
        raise ValueError(f"width must be >= 1 or None, got {width}")
    width = vocab if width is None else min(width, vocab)

    values, ids = _canonical_window(weights, width)
    cumulative = values.cumsum(dim=-1, dtype=torch.float64)
    count = torch.full((n,), width, dtype=torch.int64, device=weights.device)
    k_on = None
    if top_k is not None:
        k = top_k.to(torch.int64)
        k_on = (k > 0) & (k < vocab)
        count = torch.where(k_on, torch.minimum(k, count), count)
    if top_p is not None:
        # The total left by top-k: inside the window when top-k is on, else the whole
        # row, summed in index order by a (sequential, hence batch-independent)
        # cumsum rather than by a reduction whose order depends on the batch shape.
        # float32 output is plenty for a threshold (the CPU accumulates in double).
        if k_on is None:
            total = _row_totals(weights)
        else:
            total = cumulative.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
            # With the full width there is no branch on data (no synchronisation);
            # with a window the host may skip the row sums when every row has top-k.
            if width == vocab or not bool(k_on.all()):
                total = torch.where(k_on, total, _row_totals(weights))
        limit = (top_p.to(torch.float64) * total).unsqueeze(1)
        count_p = 1 + (cumulative[:, :-1] < limit).sum(dim=-1)
        count = torch.where(top_p < 1, torch.minimum(count, count_p), count)

    if width == vocab:
        complete = torch.ones((n,), dtype=torch.bool, device=weights.device)
    else:
        # Ids are canonical up to the first weight equal to the window's smallest:
        # ties of that weight may continue outside the window. Zero weights are
        # never drawn, so a zero boundary is harmless.
        smallest = values[:, -1:]
        strictly_heavier = (values > smallest).sum(dim=-1)
        complete = (count <= strictly_heavier) | (smallest.squeeze(1) == 0)
    return Candidates(token_ids=ids, cumulative=cumulative, count=count, complete=complete)
