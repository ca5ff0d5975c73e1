"""The model runner's persistent per-request state, one fixed row per request.

Rows are written by small updates when requests arrive, get blocks or
sample; each step's input batch is gathered from them with a few indexed
reads instead of being rebuilt from Python lists.
"""

from __future__ import annotations

import torch

from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import NewRequestData
from baton.kernels.step_state import gather_input_ids, post_sample_update_


class RequestStates:
    """Token ids, progress, block tables and sampling parameters by row.

    Raises:
        RuntimeError: when more requests arrive than ``max_num_reqs`` rows.
    """

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # One spare column: the token sampled at max_model_len is stored before the
        # scheduler finishes the request.
        self.token_ids = torch.zeros(max_num_reqs, max_model_len + 1, dtype=torch.int64)
        self.num_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.num_prompt_tokens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.num_computed = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int64)
        self.num_blocks = [0] * max_num_reqs
        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32)
        self.min_p = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.seeds = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.repetition_penalty = torch.ones(max_num_reqs, dtype=torch.float32)
        self.presence_penalty = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.frequency_penalty = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.last_sampled = torch.zeros(max_num_reqs, dtype=torch.int64)
        # Dense occurrence tables, so the post-sampling update is one kernel for
        # every row; only rows in ``uses_penalties`` read them.
        self.uses_penalties = [False] * max_num_reqs
        self.prompt_mask = torch.zeros(max_num_reqs, vocab_size, dtype=torch.bool)
        self.output_counts = torch.zeros(max_num_reqs, vocab_size, dtype=torch.int32)

    def add(self, data: NewRequestData) -> int:
        """Takes a free row for a new (or resumed) request and fills it."""
        if data.request_id in self.row_of:
            self.remove(data.request_id)
        if not self._free_rows:
            raise RuntimeError(f"no free row: more than {self.max_num_reqs} requests in the runner")
        row = self._free_rows.pop()
        self.row_of[data.request_id] = row
        tokens = torch.tensor(data.prompt_token_ids + data.output_token_ids, dtype=torch.int64)
        n = tokens.numel()
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(data.prompt_token_ids)
        self.num_computed[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, data.block_ids)
        sp = data.sampling_params
        self.params[row] = sp
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.effective_top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.seeds[row] = data.seed
        self.repetition_penalty[row] = sp.repetition_penalty
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.last_sampled[row] = tokens[-1]
        self.uses_penalties[row] = sp.uses_penalties
        counts = self.output_counts[row]
        counts.zero_()
        out = tokens[len(data.prompt_token_ids) :]
        counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if sp.uses_penalties:
            mask = self.prompt_mask[row]
            mask.zero_()
            mask[tokens[: len(data.prompt_token_ids)]] = True
        return row

    def append_blocks(self, row: int, block_ids: tuple[int, ...]) -> None:
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise RuntimeError("block table overflow: request longer than max_model_len")
        if block_ids:
            self.block_table[row, start:end] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = end

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self.params[row] = None
        self.uses_penalties[row] = False
        self._free_rows.append(row)

    def append_sampled(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Writes one sampled token at the end of each given (distinct) row, on the device:
        token ids, lengths, last sampled token and penalty counts."""
        post_sample_update_(
            self.token_ids, self.num_tokens, self.last_sampled, self.output_counts, rows, tokens
        )

    def input_ids(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step's input ids, read from the rows (never through the CPU scheduler)."""
        return gather_input_ids(self.token_ids, token_rows, positions)
