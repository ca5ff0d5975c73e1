"""A step's batch structure as the model runner plans it on the host (``StepPlan``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    """A step's batch structure, computed on the host from the CPU mirrors (int64 arrays).

    Attributes:
        rows: state row of each scheduled request ``[B]``.
        query_lens, seq_lens: new tokens this step, and tokens after it ``[B]``.
        token_rows, positions: row and position of every flat token ``[T]``.
        sample_idx: batch indices of the requests that sample ``[N]``.
        hidden_index: flat index of their last token ``[N]``.
    """

    rows: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    token_rows: np.ndarray
    positions: np.ndarray
    sample_idx: np.ndarray
    hidden_index: np.ndarray

    @property
    def sample_rows(self) -> np.ndarray:
        """State rows of the requests that sample ``[N]``."""
        return self.rows[self.sample_idx]
