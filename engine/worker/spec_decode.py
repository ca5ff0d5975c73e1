"""The runner's side of speculative decoding: logits rows per draft position, verification.

A request with k draft tokens feeds its last token and the drafts (k + 1 input tokens) and
gets k + 1 logits rows. The sampler draws a token at every row exactly as it would without
drafts (same (seed, position) uniform, same masks), and the request keeps the sampled tokens up
to and including the first one that differs from its draft. For greedy rows that is the
longest prefix equal to the masked argmax plus one token. For random rows it is speculative
rejection sampling with a deterministic draft d: the row's token equals d with probability
p(d) (accept), and otherwise is a draw from p restricted to the other tokens, renormalised
(the residual distribution). So the output is token for token what the engine gives without
drafts, alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DraftLayout:
    """Where each sampling request's logits rows lie when some of them carry drafts.

    Attributes:
        drafts: per sampling request, its draft tokens (empty: none).
        counts: logits rows per sampling request (1 + its drafts) ``[N]``.
        starts: the first of them ``[N]``.
        row_index: for every logits row, its sampling request ``[M]``.
        offsets: for every logits row, its draft position (0 = after the last known token).
    """

    drafts: tuple[tuple[int, ...], ...]
    counts: np.ndarray
    starts: np.ndarray
    row_index: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, drafts: Sequence[tuple[int, ...]]) -> DraftLayout:
        counts = np.fromiter((1 + len(d) for d in drafts), np.int64, len(drafts))
        starts = np.cumsum(counts) - counts
        row_index = np.repeat(np.arange(len(drafts), dtype=np.int64), counts)
        offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
        return cls(tuple(drafts), counts, starts, row_index, offsets)

    @property
    def num_rows(self) -> int:
        """Logits rows in all."""
        return int(self.row_index.size)


def accepted_tokens(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request keeps: ``sampled`` (one per draft position, plus one) up to and
    including the first that differs from its draft."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return list(sampled[: n + 1])


def record_verified_(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    last_sampled: torch.Tensor,
    output_counts: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    sampled: torch.Tensor,
    drafts: torch.Tensor,
) -> None:
    """Records each request's kept tokens in the runner's device rows, with no host read.

    Args:
        token_ids, num_tokens, last_sampled, output_counts: the rows' device state.
        rows: int64 ``[N]`` state rows of the sampling requests.
        lengths: int64 ``[N]`` their token counts before this step.
        sampled: int64 ``[N, K + 1]`` the tokens drawn at each draft position and one more
            (padded past a request's own drafts with any valid token id).
        drafts: int64 ``[N, K]`` the drafts, padded with -1 (never a token).
    """
    width = sampled.shape[1]
    matches = (sampled[:, : width - 1] == drafts).to(torch.int64)
    accepted = matches.cumprod(dim=1).sum(dim=1)  # [N]
    cols = torch.arange(width, device=rows.device)
    keep = cols.unsqueeze(0) <= accepted.unsqueeze(1)  # [N, K + 1]
    pos = lengths.unsqueeze(1) + cols.unsqueeze(0)
    pos = torch.minimum(pos, torch.full_like(pos, token_ids.shape[1] - 1))
    row_grid = rows.unsqueeze(1).expand_as(pos)
    # Tokens past the kept ones land beyond the row's length, where nothing reads them.
    token_ids[row_grid, pos] = sampled
    num_tokens[rows] = lengths + accepted + 1
    last_sampled[rows] = sampled.gather(1, accepted.unsqueeze(1)).squeeze(1)
    output_counts.index_put_(
        (row_grid.flatten(), sampled.flatten()),
        keep.flatten().to(output_counts.dtype),
        accumulate=True,
    )
