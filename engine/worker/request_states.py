"""The model runner's persistent per-request state, one fixed row per request.

Two halves. What the CPU can know (lengths, progress, block tables, sampling parameters) lives in
numpy mirrors on the host, so each step's batch structure is computed without reading the device.
What only the device knows (token ids, including sampled ones, the last sampled token, penalty
counts) lives in device tensors. Host-known changes to the device half (a new request's tokens,
its length, its last token) are staged on the CPU and applied by one kernel per step
(`flush`); sampled tokens are recorded on the device (`append_sampled`), and the mirrors follow
by counting: a sampling row grows by exactly one token, whatever its value.
"""

from __future__ import annotations

import numpy as np
import torch

from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import NewRequestData
from baton.engine.worker.device_buffers import DeviceIO
from baton.kernels.staged_write import staged_write_
from baton.kernels.step_state import gather_input_ids, post_sample_update_


class RequestStates:
    """Token ids, progress, block tables and sampling parameters by row.

    Host mirrors (numpy, indexed by row): ``num_tokens``, ``num_prompt_tokens``,
    ``num_computed``, ``block_table``/``num_blocks``, ``params`` and the per-row sampling values
    (``logit_bias`` as arrays of token ids and biases).
    Device state: ``token_ids`` ``[R, max_model_len + 1]``, ``num_tokens_device`` and
    ``last_sampled`` ``[R]`` (three views of one flat int64 ``storage``, the target of staged
    writes), ``output_counts`` and ``prompt_mask`` ``[R, V]``.

    Raises:
        RuntimeError: when more requests arrive than ``max_num_reqs`` rows.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        io: DeviceIO | None = None,
    ) -> None:
        self.io = io or DeviceIO(torch.device("cpu"))
        device = self.io.device
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        r = max_num_reqs
        # One spare column: the token sampled at max_model_len is stored before the
        # scheduler finishes the request.
        self.row_len = max_model_len + 1
        self.storage = torch.zeros(r * self.row_len + 2 * r, dtype=torch.int64, device=device)
        self._num_tokens_at = r * self.row_len
        self._last_sampled_at = self._num_tokens_at + r
        self.token_ids = self.storage[: self._num_tokens_at].view(r, self.row_len)
        self.num_tokens_device = self.storage[self._num_tokens_at : self._last_sampled_at]
        self.last_sampled = self.storage[self._last_sampled_at :]
        self.output_counts = torch.zeros(r, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(r, vocab_size, dtype=torch.bool, device=device)
        self._staged: list[np.ndarray] = []
        self._new_rows: list[int] = []
        # Rows whose last step verified drafts: their host length is known again only from the
        # scheduler's count of computed tokens (``settle``).
        self.unverified: set[int] = set()

        self.num_tokens = np.zeros(r, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(r, dtype=np.int64)
        self.num_computed = np.zeros(r, dtype=np.int64)
        self.block_table = np.zeros((r, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(r, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * r
        self.uses_penalties = [False] * r
        self.temperature = np.zeros(r, dtype=np.float32)
        self.top_k = np.zeros(r, dtype=np.int64)
        self.top_p = np.ones(r, dtype=np.float32)
        self.min_p = np.zeros(r, dtype=np.float32)
        self.seeds = np.zeros(r, dtype=np.int64)
        self.repetition_penalty = np.ones(r, dtype=np.float32)
        self.presence_penalty = np.zeros(r, dtype=np.float32)
        self.frequency_penalty = np.zeros(r, dtype=np.float32)
        # A row's logit_bias as (token ids, biases) arrays, None without one; the rows with one.
        self.logit_bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * r
        self.biased_rows: set[int] = set()
        # Rows owed prompt logprobs (row -> top-k) while their prompt is being computed.
        self.prompt_logprob_rows: dict[int, int] = {}

    def add(self, data: NewRequestData) -> int:
        """Takes a free row for a new (or resumed) request: fills the mirrors now and stages its
        device rows (token ids, length, last token) for the next `flush`."""
        if data.request_id in self.row_of:
            self.remove(data.request_id)
        if not self._free_rows:
            raise RuntimeError(f"no free row: more than {self.max_num_reqs} requests in the runner")
        row = self._free_rows.pop()
        self.row_of[data.request_id] = row
        self.unverified.discard(row)
        tokens = np.asarray(data.prompt_token_ids + data.output_token_ids, dtype=np.int64)
        n = tokens.size
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(data.prompt_token_ids)
        self.num_computed[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, data.block_ids)
        sp = data.sampling_params
        self.params[row] = sp
        self.uses_penalties[row] = sp.uses_penalties
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.effective_top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.seeds[row] = data.seed
        self.repetition_penalty[row] = sp.repetition_penalty
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.logit_bias[row] = None
        self.biased_rows.discard(row)
        if sp.logit_bias:
            self.logit_bias[row] = (
                np.array([t for t, _ in sp.logit_bias], dtype=np.int64),
                np.array([b for _, b in sp.logit_bias], dtype=np.float32),
            )
            self.biased_rows.add(row)
        self.prompt_logprob_rows.pop(row, None)
        # A request resumed with outputs has had its prompt logprobs (with its first token).
        if sp.prompt_logprobs is not None and not data.output_token_ids:
            self.prompt_logprob_rows[row] = sp.prompt_logprobs
        index = np.concatenate(
            (
                np.arange(row * self.row_len, row * self.row_len + n),
                [self._num_tokens_at + row, self._last_sampled_at + row],
            )
        )
        self._staged.append(np.stack((index, np.concatenate((tokens, [n, tokens[-1]])))))
        self._new_rows.append(row)
        return row

    def flush(self) -> None:
        """Applies the staged device writes with one host-to-device copy and one kernel, then
        resets the new rows' penalty tables from their (now written) token ids."""
        if not self._staged:
            return
        (staged,) = self.io.to_device([np.concatenate(self._staged, axis=1)])
        staged_write_(self.storage, staged)
        for row in self._new_rows:
            if self.params[row] is not None:  # not freed again since it was staged
                self._reset_penalty_rows(row)
        self._staged.clear()
        self._new_rows.clear()

    def _reset_penalty_rows(self, row: int) -> None:
        prompt_len = int(self.num_prompt_tokens[row])
        counts = self.output_counts[row]
        counts.zero_()
        out = self.token_ids[row, prompt_len : int(self.num_tokens[row])]
        counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if self.uses_penalties[row]:
            mask = self.prompt_mask[row]
            mask.zero_()
            # index_fill_, not ``mask[ids] = True``: that copies the host scalar to the device
            # synchronously (torch's sync debug mode stops it on CUDA).
            mask.index_fill_(0, self.token_ids[row, :prompt_len], True)

    def append_blocks(self, row: int, block_ids: tuple[int, ...]) -> None:
        """Appends block ids to the row's block table (host only: attention metadata is built
        from it on the CPU).

        Raises:
            RuntimeError: if the table would outgrow max_model_len.
        """
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError("block table overflow: request longer than max_model_len")
        if block_ids:
            self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def remove(self, request_id: str) -> None:
        """Frees the request's row; unknown ids are ignored."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self.params[row] = None
        self.uses_penalties[row] = False
        self.logit_bias[row] = None
        self.biased_rows.discard(row)
        self.prompt_logprob_rows.pop(row, None)
        self.unverified.discard(row)
        self._free_rows.append(row)

    def stage_tokens(self, row: int, start: int, tokens: tuple[int, ...]) -> None:
        """Stages host-known token ids (a step's draft tokens) at ``start`` of the row, for the
        next `flush`; the row's length does not change."""
        if start + len(tokens) > self.row_len:
            raise RuntimeError("draft tokens past the row's end: longer than max_model_len")
        base = row * self.row_len + start
        index = np.arange(base, base + len(tokens), dtype=np.int64)
        self._staged.append(np.stack((index, np.asarray(tokens, dtype=np.int64))))

    def settle(self, row: int, num_computed: int) -> None:
        """Sets the host length of a row whose drafts were verified on the device: all its
        tokens but the last are computed, as the scheduler counts them."""
        if row in self.unverified:
            self.num_tokens[row] = num_computed + 1
            self.unverified.discard(row)

    def rewind(self, rows: np.ndarray, num_tokens: np.ndarray, width: int) -> None:
        """Gives rows their real lengths after steps planned as if every draft of the step
        before were kept recorded tokens past a rejected one (async scheduling): the tokens at
        most ``width`` recorded past ``num_tokens`` are forgotten on the device (length, last
        sampled token, penalty counts) with no host read, and the host mirrors take the given
        lengths."""
        if not rows.size:
            return
        rows_d, n_d = self.io.to_device([rows, num_tokens])
        cols = n_d.unsqueeze(1) + torch.arange(max(width, 1), device=n_d.device)
        past = self.token_ids[rows_d.unsqueeze(1), cols.clamp(max=self.row_len - 1)]
        recorded = cols < self.num_tokens_device[rows_d].unsqueeze(1)
        self.output_counts.index_put_(
            (rows_d.unsqueeze(1).expand_as(past).flatten(), past.flatten()),
            -recorded.flatten().to(self.output_counts.dtype),
            accumulate=True,
        )
        self.num_tokens_device[rows_d] = n_d
        self.last_sampled[rows_d] = self.token_ids[rows_d, n_d - 1]
        self.num_tokens[rows] = num_tokens
        self.unverified.difference_update(rows.tolist())

    def append_sampled(
        self, rows: np.ndarray, rows_device: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Records one sampled token at the end of each given (distinct) row: on the device its
        value (token ids, length, last sampled token, penalty counts), on the host the length.

        ``rows`` and ``rows_device`` are the same rows, on the host and on the device."""
        post_sample_update_(
            self.token_ids,
            self.num_tokens_device,
            self.last_sampled,
            self.output_counts,
            rows_device,
            tokens,
        )
        self.num_tokens[rows] += 1

    def input_ids(
        self, token_rows: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step's input ids, read from the device rows (never through the CPU scheduler);
        written into ``out`` when given."""
        return gather_input_ids(self.token_ids, token_rows, positions, out)
