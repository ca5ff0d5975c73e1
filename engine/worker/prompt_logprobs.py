"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the logits of every prompt position of
the requests that ask, beside the sampling rows.

The hidden state at prompt position ``i`` gives the logprob of prompt token ``i + 1``, so a
prompt chunk covering positions ``[c, c + q)`` delivers the logprobs of prompt tokens
``c + 1 ..`` up to the prompt's last one; the last prompt position is the sampling row, as for
any request. Chunks follow each other, so every prompt token is delivered once (a chunk
computed again after a preemption delivers its positions again; the scheduler keeps the first).
Only the runner's rows that asked are looked at, and only while one of them is in its prompt:
a step without such a row does no work here at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.scheduler_output import Logprobs, PromptLogprobs
from baton.engine.worker.device_buffers import DeviceIO, HostCopy
from baton.engine.worker.step_plan import StepPlan
from baton.sampler.logprobs import compute_logprobs

# Hidden rows sent through the LM head at once: a long prompt chunk's float32 logits
# ([rows, vocab]) are bounded to this many rows (512 x 49152 tokens: 100 MB).
_HEAD_ROWS = 512


@dataclass(frozen=True)
class PromptRows:
    """Where one step's prompt-logprob rows lie.

    Attributes:
        request_ids: the requests with rows this step, in batch order.
        starts: each one's first prompt position delivered (>= 1).
        counts: how many rows each has (consecutive).
        top_k: the top-k each asked for.
        hidden_index: flat token index of each row's hidden state ``[M]``.
        token_rows, target_positions: state row and position of each row's prompt token
            ``[M]`` (the position after its hidden state's).
    """

    request_ids: tuple[str, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    top_k: tuple[int, ...]
    hidden_index: np.ndarray
    token_rows: np.ndarray
    target_positions: np.ndarray

    @classmethod
    def of(
        cls,
        request_ids: tuple[str, ...],
        plan: StepPlan,
        asking: dict[int, int],
        num_prompt_tokens: np.ndarray,
    ) -> PromptRows | None:
        """The step's rows of the requests in ``asking`` (state row -> top-k) whose chunk
        covers prompt positions before their last; None when there are none."""
        ids: list[str] = []
        starts: list[int] = []
        counts: list[int] = []
        ks: list[int] = []
        hidden: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        flat_starts = np.cumsum(plan.query_lens) - plan.query_lens
        for b in np.flatnonzero(np.isin(plan.rows, list(asking))).tolist():
            row, end = int(plan.rows[b]), int(plan.seq_lens[b])
            first = end - int(plan.query_lens[b])  # the chunk's first position
            last = min(end, int(num_prompt_tokens[row]) - 1)  # positions [first, last) deliver
            if last <= first:
                continue
            n = last - first
            ids.append(request_ids[b])
            starts.append(first + 1)
            counts.append(n)
            ks.append(asking[row])
            flat = int(flat_starts[b])
            hidden.append(np.arange(flat, flat + n, dtype=np.int64))
            rows.append(np.full(n, row, dtype=np.int64))
            targets.append(np.arange(first + 1, last + 1, dtype=np.int64))
        if not ids:
            return None
        return cls(
            tuple(ids),
            tuple(starts),
            tuple(counts),
            tuple(ks),
            np.concatenate(hidden),
            np.concatenate(rows),
            np.concatenate(targets),
        )


@dataclass(frozen=True)
class PromptLogprobsCopy:
    """A step's prompt logprobs on their way to the host (ids and values ``[M, 1 + k]``, ranks
    ``[M]``: each row's prompt token first, then the step's largest top-k)."""

    rows: PromptRows
    host: HostCopy

    def result(self) -> dict[str, PromptLogprobs]:
        """Per request, its rows cut to its own top-k (waits for the host copy)."""
        ids, vals, ranks = (t.tolist() for t in self.host.wait())
        out: dict[str, PromptLogprobs] = {}
        r = self.rows
        first = 0
        for rid, start, n, k in zip(r.request_ids, r.starts, r.counts, r.top_k, strict=True):
            span = range(first, first + n)
            out[rid] = PromptLogprobs(
                start,
                Logprobs(
                    [ids[i][: k + 1] for i in span],
                    [vals[i][: k + 1] for i in span],
                    [ranks[i] for i in span],
                ),
            )
            first += n
        return out


def queue_prompt_logprobs(
    rows: PromptRows,
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    io: DeviceIO,
    driver: bool = True,
    vocab_size: int | None = None,
) -> PromptLogprobsCopy | None:
    """Queues the LM head over the rows' hidden states (``_HEAD_ROWS`` at a time), their
    log_softmax in float32 (the raw model output, as vLLM's prompt logprobs), each prompt
    token's logprob and rank and the top-k, and their copy to the host. ``targets(token_rows,
    positions)`` reads the prompt tokens on the device. Off the tensor-parallel driver
    (``driver`` False) only the head runs (its gather is a collective) and None is returned.
    Ids from ``vocab_size`` on (the embedding's padding rows, past the tokenizer) get no
    probability, as in sampling.
    """
    index, token_rows, positions = io.to_device(
        [rows.hidden_index, rows.token_rows, rows.target_positions]
    )
    tokens = targets(token_rows, positions)
    k = max(rows.top_k)
    parts = []
    for i in range(0, rows.hidden_index.size, _HEAD_ROWS):
        logits = head(hidden[index[i : i + _HEAD_ROWS]])
        if vocab_size is not None and vocab_size < logits.shape[1]:
            logits[:, vocab_size:] = float("-inf")
        if driver:
            parts.append(compute_logprobs(logits, tokens[i : i + _HEAD_ROWS], k))
    if not driver:
        return None
    ids = torch.cat([p.token_ids for p in parts])
    values = torch.cat([p.logprobs for p in parts])
    ranks = torch.cat([p.ranks for p in parts])
    return PromptLogprobsCopy(rows, io.to_host([ids, values, ranks]))


def prune_done(asking: dict[int, int], plan: StepPlan, num_prompt_tokens: np.ndarray) -> None:
    """Forgets the rows of ``asking`` whose step reached their prompt's last position: every
    prompt token of theirs has been delivered."""
    rows = plan.rows
    done = np.isin(rows, list(asking)) & (plan.seq_lens >= num_prompt_tokens[rows] - 1)
    for row in rows[done].tolist():
        del asking[row]
