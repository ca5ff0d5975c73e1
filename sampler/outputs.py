"""What the sampler returns: sampled token ids and, on request, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogprobsTensors:
    """Log-probabilities of the sampled token and of the top-k tokens, per row.

    Fields:
        token_ids: int64 [N, k+1]; column 0 is the sampled token, then the top-k ids
            in decreasing probability.
        logprobs: float32 [N, k+1]; log_softmax of the raw logits at those ids.
        ranks: int64 [N]; rank of the sampled token (1 = most likely; tokens tied
            with it count as ranked above it).

    Raises:
        ValueError: if the shapes do not agree.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def __post_init__(self) -> None:
        if self.token_ids.dim() != 2 or self.token_ids.shape != self.logprobs.shape:
            raise ValueError(
                f"token_ids and logprobs must both be [N, k+1], got {tuple(self.token_ids.shape)} "
                f"and {tuple(self.logprobs.shape)}"
            )
        if self.ranks.shape != (self.token_ids.shape[0],):
            raise ValueError(
                f"ranks must be [{self.token_ids.shape[0]}], got {tuple(self.ranks.shape)}"
            )


@dataclass(frozen=True)
class SamplerOutput:
    """One step's sampling result.

    Fields:
        token_ids: int64 [N]; the sampled token of each row.
        logprobs: None unless the metadata asked for logprobs.
    """

    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None
