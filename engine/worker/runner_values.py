"""The values the model runner hands on: its forward's output for sampling, and the sampled
tokens on their way to the host (``runner_output`` turns them into the scheduler's
``ModelRunnerOutput``). Frozen, so that steps in flight travel as values, not runner state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.scheduler_output import Logprobs, ModelRunnerOutput, PromptLogprobs
from baton.engine.worker.device_buffers import HostCopy
from baton.engine.worker.prompt_logprobs import PromptLogprobsCopy
from baton.engine.worker.spec_decode import DraftLayout, accepted_tokens
from baton.sampler.outputs import LogprobsTensors


@dataclass(frozen=True)
class ForwardOutput:
    """What ``execute_model`` hands to ``sample_tokens``: a value, not runner state.

    Attributes:
        request_ids: every scheduled request, in batch order.
        sample_request_ids: those that sample this step (reached their last known token).
        sample_rows: their state rows, int64 ``[N]`` on the host.
        sample_rows_device: the same rows on the device.
        logits: the logits of their last tokens ``[N, vocab]`` (device); with ``drafts``, of
            their last token and each draft token ``[M, vocab]``. Queued with the forward, so
            that a step whose sampling waits for its grammar bitmask waits with the LM head
            already done.
        drafts: where the logits rows of requests with draft tokens lie; None: one row each.
        prompt_logprobs: the step's prompt logprobs on their way to the host, when a request
            that asked for them ran a prompt chunk.
    """

    step_id: int
    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    sample_rows: np.ndarray
    sample_rows_device: torch.Tensor
    logits: torch.Tensor
    drafts: DraftLayout | None = None
    prompt_logprobs: PromptLogprobsCopy | None = None


@dataclass(frozen=True)
class SampledTokens:
    """One step's sampled tokens: device tensors, and their copy to the host under way.

    Attributes:
        token_ids: int64 ``[N]`` device tensor, in ``sample_request_ids`` order.
        logprob_tensors: the sampler's logprobs (device), when some row asked for them.
        num_logprobs: per sampling row, the top-k it asked for (None: no logprobs).
        host: host copies of ``token_ids`` then the logprob tensors; waiting on it is the
            one wait for the step's results.
        drafts: where each request's rows lie when some carry drafts (``token_ids`` then holds
            one token per logits row); None: one row each.
        prompt_logprobs: the forward's prompt logprobs, passed on (see ``ForwardOutput``).
    """

    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    token_ids: torch.Tensor
    logprob_tensors: LogprobsTensors | None
    num_logprobs: tuple[int | None, ...]
    host: HostCopy
    drafts: DraftLayout | None = None
    prompt_logprobs: PromptLogprobsCopy | None = None

    @property
    def prompt_logprob_parts(self) -> dict[str, PromptLogprobs]:
        """Prompt logprobs of the requests whose prompt chunk delivered some (waits for
        their host copy)."""
        return {} if self.prompt_logprobs is None else self.prompt_logprobs.result()

    @property
    def logprobs(self) -> dict[str, Logprobs]:
        """Logprobs of the rows that asked for them (waits for the host copy)."""
        host = self.host.wait()
        if len(host) == 1:  # no row asked: no token list to build
            return {}
        kept = kept_tokens(host[0].tolist(), self.drafts)
        return _logprobs(self.sample_request_ids, self.num_logprobs, host[1:], self.drafts, kept)

    def to_runner_output(self) -> ModelRunnerOutput:
        """The scheduler's view of the step (waits for the host copy)."""
        host = self.host.wait()
        kept = kept_tokens(host[0].tolist(), self.drafts)
        logprobs = _logprobs(
            self.sample_request_ids, self.num_logprobs, host[1:], self.drafts, kept
        )
        return _runner_output(
            self.request_ids, self.sample_request_ids, kept, logprobs, self.prompt_logprob_parts
        )


def runner_output(
    request_ids: tuple[str, ...],
    sample_request_ids: tuple[str, ...],
    tokens: list[int],
    logprobs: dict[str, Logprobs],
    drafts: DraftLayout | None = None,
    prompt_logprobs: dict[str, PromptLogprobs] | None = None,
) -> ModelRunnerOutput:
    """The scheduler's view of a step: per scheduled request, its new tokens (none, one, or
    with drafts its accepted drafts and one more), with the logprobs of its sampled tokens and
    of its prompt chunk where it asked."""
    kept = kept_tokens(tokens, drafts)
    return _runner_output(request_ids, sample_request_ids, kept, logprobs, prompt_logprobs)


def _runner_output(
    request_ids: tuple[str, ...],
    sample_request_ids: tuple[str, ...],
    kept: list[list[int]],
    logprobs: dict[str, Logprobs],
    prompt_logprobs: dict[str, PromptLogprobs] | None = None,
) -> ModelRunnerOutput:
    sampled = dict(zip(sample_request_ids, kept, strict=True))
    return ModelRunnerOutput(
        request_ids=list(request_ids),
        sampled_token_ids=[sampled.get(r, []) for r in request_ids],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs or {},
    )


def kept_tokens(tokens: list[int], drafts: DraftLayout | None) -> list[list[int]]:
    """Per sampling request, the tokens it keeps from its rows: its one token, or with drafts
    its accepted drafts and the token after them."""
    if drafts is None:
        return [[t] for t in tokens]
    return [
        accepted_tokens(tokens[start : start + count], d)
        for start, count, d in zip(
            drafts.starts.tolist(), drafts.counts.tolist(), drafts.drafts, strict=True
        )
    ]


def _logprobs(
    request_ids: tuple[str, ...],
    ks: tuple[int | None, ...],
    host: Sequence[torch.Tensor],
    drafts: DraftLayout | None,
    kept: list[list[int]],
) -> dict[str, Logprobs]:
    """Per request that asked, each kept token's logprob and its top-k, from host tensors:
    with drafts, the rows of its accepted drafts and the one after them (each row's
    distribution is the one a step without drafts has at that position)."""
    if not host:
        return {}
    ids, vals, ranks = (t.tolist() for t in host)
    first = range(len(request_ids)) if drafts is None else drafts.starts.tolist()
    out = {}
    for i, rid, k, tokens in zip(first, request_ids, ks, kept, strict=True):
        if k is None:
            continue
        rows = range(i, i + len(tokens))
        out[rid] = Logprobs(
            [ids[r][: k + 1] for r in rows],
            [vals[r][: k + 1] for r in rows],
            [ranks[r] for r in rows],
        )
    return out
