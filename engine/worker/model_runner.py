"""Runs the model: builds each step's input batch, the forward pass, sampling.

The batch's structure (rows, positions, which rows sample, attention and sampling metadata)
is computed on the host from the request states' CPU mirrors and reaches the device through
``DeviceIO``'s staging copies; token values stay on the device. Nothing here reads a device
value on the host, so on CUDA both calls only queue work; results come back through
``SampledTokens.host``, which is waited for when the output is collected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.llama import KVCache, LlamaForCausalLM
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import (
    GrammarOutput,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.engine.worker.device_buffers import DeviceIO, HostCopy
from baton.engine.worker.request_states import RequestStates
from baton.sampler import Sampler, SamplingMetadata, apply_token_bitmask_
from baton.sampler.outputs import LogprobsTensors

_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


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


@dataclass(frozen=True)
class ForwardOutput:
    """What ``execute_model`` hands to ``sample_tokens``: a value, not runner state.

    Attributes:
        request_ids: every scheduled request, in batch order.
        sample_request_ids: those that sample this step (reached their last known token).
        sample_rows: their state rows, int64 ``[N]`` on the host.
        sample_rows_device: the same rows on the device.
        hidden: final hidden states of their last tokens ``[N, hidden]`` (device).
    """

    step_id: int
    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    sample_rows: np.ndarray
    sample_rows_device: torch.Tensor
    hidden: torch.Tensor


@dataclass(frozen=True)
class SampledTokens:
    """One step's sampled tokens: device tensors, and their copy to the host under way.

    Attributes:
        token_ids: int64 ``[N]`` device tensor, in ``sample_request_ids`` order.
        logprob_tensors: the sampler's logprobs (device), when some row asked for them.
        num_logprobs: per sampling row, the top-k it asked for (None: no logprobs).
        host: host copies of ``token_ids`` then the logprob tensors; waiting on it is the
            one wait for the step's results.
    """

    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    token_ids: torch.Tensor
    logprob_tensors: LogprobsTensors | None
    num_logprobs: tuple[int | None, ...]
    host: HostCopy

    @property
    def logprobs(self) -> dict[str, Logprobs]:
        """Logprobs of the rows that asked for them (waits for the host copy)."""
        return _logprobs(self.sample_request_ids, self.num_logprobs, self.host.wait()[1:])

    def to_runner_output(self) -> ModelRunnerOutput:
        """The scheduler's view of the step (waits for the host copy)."""
        host = self.host.wait()
        logprobs = _logprobs(self.sample_request_ids, self.num_logprobs, host[1:])
        return runner_output(self.request_ids, self.sample_request_ids, host[0].tolist(), logprobs)


def runner_output(
    request_ids: tuple[str, ...],
    sample_request_ids: tuple[str, ...],
    tokens: list[int],
    logprobs: dict[str, Logprobs],
) -> ModelRunnerOutput:
    """The scheduler's view of a step: per scheduled request, its sampled tokens (0 or 1)."""
    sampled = dict(zip(sample_request_ids, tokens, strict=True))
    return ModelRunnerOutput(
        request_ids=list(request_ids),
        sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in request_ids],
        logprobs=logprobs,
    )


def _logprobs(
    request_ids: tuple[str, ...], ks: tuple[int | None, ...], host: Sequence[torch.Tensor]
) -> dict[str, Logprobs]:
    """Per request that asked, its sampled token's logprob and its top-k, from host tensors."""
    if not host:
        return {}
    ids, vals, ranks = (t.tolist() for t in host)
    return {
        rid: Logprobs([ids[i][: k + 1]], [vals[i][: k + 1]], [ranks[i]])
        for i, (rid, k) in enumerate(zip(request_ids, ks, strict=True))
        if k is not None
    }


class ModelRunner:
    """Owns the model, its KV cache and the persistent request rows, on the model's device."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCache,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer_vocab_size: int | None = None,
    ) -> None:
        self.model = model
        self.io = DeviceIO.for_device(model.embed_tokens.weight.device)
        self.eos_token_ids = tuple(eos_token_ids)
        # Ids past the tokenizer (padding rows of the embedding) can never be decoded.
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = model.config.vocab_size
        max_blocks = -(-max_model_len // block_size)
        with self.io.on_stream():  # zero-filled on the stream that will read them
            self.states = RequestStates(
                max_num_reqs, max_model_len, max_blocks, self.vocab_size, self.io
            )
        self.sampler = Sampler()

    # ------------------------------------------------------------- forward
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ForwardOutput:
        """Applies the scheduler's changes to the rows and queues the forward pass."""
        with self.io.on_stream():
            self._apply_changes(so)
            req_ids = tuple(so.num_scheduled_tokens)
            if not req_ids:
                rows = np.zeros(0, dtype=np.int64)
                return ForwardOutput(
                    so.step_id, (), (), rows, torch.from_numpy(rows), torch.zeros(0)
                )
            plan = self._plan(so)
            token_rows, positions, hidden_index, sample_rows = self.io.to_device(
                [plan.token_rows, plan.positions, plan.hidden_index, plan.sample_rows]
            )
            meta = AttentionMetadata.build(
                plan.query_lens,
                plan.seq_lens,
                self.states.block_table[plan.rows],
                self.block_size,
                self.io.device,
            )
            # Input ids come from the rows, where sampled tokens were written:
            # the CPU scheduler never has to know them.
            input_ids = self.states.input_ids(token_rows, positions)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            self.states.num_computed[plan.rows] = plan.seq_lens
            return ForwardOutput(
                step_id=so.step_id,
                request_ids=req_ids,
                sample_request_ids=tuple(req_ids[i] for i in plan.sample_idx.tolist()),
                sample_rows=plan.sample_rows,
                sample_rows_device=sample_rows,
                hidden=hidden[hidden_index],
            )

    def _apply_changes(self, so: SchedulerOutput) -> None:
        st = self.states
        for rid in so.finished_request_ids:
            st.remove(rid)
        for new in so.new_requests:
            st.add(new)
        for cached in so.cached_requests:
            row = st.row_of[cached.request_id]
            st.append_blocks(row, cached.new_block_ids)
            st.num_computed[row] = cached.num_computed_tokens
        st.flush()

    def _plan(self, so: SchedulerOutput) -> StepPlan:
        """The step's batch structure, from the host mirrors only."""
        st = self.states
        n = len(so.num_scheduled_tokens)
        rows = np.fromiter((st.row_of[r] for r in so.num_scheduled_tokens), np.int64, n)
        query_lens = np.fromiter(so.num_scheduled_tokens.values(), np.int64, n)
        computed = st.num_computed[rows]
        seq_lens = computed + query_lens
        starts = np.cumsum(query_lens) - query_lens
        num_tokens = int(query_lens.sum())
        sample_idx = np.flatnonzero(seq_lens >= st.num_tokens[rows])
        return StepPlan(
            rows=rows,
            query_lens=query_lens,
            seq_lens=seq_lens,
            token_rows=np.repeat(rows, query_lens),
            positions=np.repeat(computed - starts, query_lens) + np.arange(num_tokens),
            sample_idx=sample_idx,
            hidden_index=(starts + query_lens - 1)[sample_idx],
        )

    # ------------------------------------------------------------ sampling
    @torch.inference_mode()
    def sample(self, fwd: ForwardOutput, grammar: GrammarOutput | None = None) -> SampledTokens:
        """Queues sampling of one token per sampling row, its write into the rows, and the
        copy of the tokens (and logprobs) to the host."""
        with self.io.on_stream():
            if not fwd.sample_request_ids:
                empty = torch.zeros(0, dtype=torch.int64)
                return SampledTokens(fwd.request_ids, (), empty, None, (), HostCopy((empty,)))
            # Each sampling row's parameters, looked up once for the whole step.
            params = [self.states.params[r] for r in fwd.sample_rows.tolist()]
            logits = self.model.compute_logits(fwd.hidden)
            if grammar is not None and grammar.request_ids:
                self._apply_grammar(logits, fwd, grammar)
            self._ban_tokens(logits, fwd, params)
            out = self.sampler(logits, self._sampling_metadata(fwd, params))
            self.states.append_sampled(fwd.sample_rows, fwd.sample_rows_device, out.token_ids)
            lp = out.logprobs
            to_copy = [out.token_ids] if lp is None else [out.token_ids, *_lp_tensors(lp)]
            num_logprobs = tuple(p.logprobs for p in params)
            return SampledTokens(
                fwd.request_ids,
                fwd.sample_request_ids,
                out.token_ids,
                lp,
                num_logprobs,
                self.io.to_host(to_copy),
            )

    def sample_tokens(
        self, fwd: ForwardOutput, grammar: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """``sample`` with its tokens read back to the host, as the scheduler takes them."""
        return self.sample(fwd, grammar).to_runner_output()

    def _ban_tokens(
        self, logits: torch.Tensor, fwd: ForwardOutput, params: list[SamplingParams]
    ) -> None:
        """Tokens a row may not sample: undecodable ids, and stop tokens before min_tokens.

        Runs after the grammar mask. A row whose grammar allows only stop tokens keeps them:
        the grammar's end wins over min_tokens, else the row would have nothing to sample.
        """
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size < logits.shape[1]:
            logits[:, self.tokenizer_vocab_size :] = float("-inf")
        st = self.states
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i, (row, sp) in enumerate(zip(fwd.sample_rows.tolist(), params, strict=True)):
            # The host mirror knows the length: this row's tokens before this sample.
            if sp.min_tokens and st.num_tokens[row] - st.num_prompt_tokens[row] < sp.min_tokens:
                banned = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    banned.update(self.eos_token_ids)
                ban_rows += [i] * len(banned)
                ban_cols += sorted(banned)
        if not ban_rows:
            return
        rows, cols = self.io.to_device(
            [np.array(ban_rows, dtype=np.int64), np.array(ban_cols, dtype=np.int64)]
        )
        kept = logits[rows, cols]
        logits[rows, cols] = float("-inf")
        # Decided on the device, so that no value is read back here.
        empty = (logits == float("-inf")).all(dim=1)
        logits[rows, cols] = torch.where(empty[rows], kept, torch.full_like(kept, float("-inf")))

    def _apply_grammar(
        self, logits: torch.Tensor, fwd: ForwardOutput, grammar: GrammarOutput
    ) -> None:
        index = {r: i for i, r in enumerate(fwd.sample_request_ids)}
        pairs = [(index[r], i) for i, r in enumerate(grammar.request_ids) if r in index]
        if not pairs:
            return
        logit_rows = np.array([p[0] for p in pairs], dtype=np.int64)
        mask_rows = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        # Gathered on the host (where the grammar filled it), then copied once.
        bitmask = self.io.tensor_to_device(grammar.bitmask[mask_rows])
        (logit_rows_device,) = self.io.to_device([logit_rows])
        apply_token_bitmask_(logits, bitmask, logit_rows_device)

    def _sampling_metadata(
        self, fwd: ForwardOutput, params: list[SamplingParams]
    ) -> SamplingMetadata:
        """The sampling rows' parameters (``params``, in row order), gathered from the host
        mirrors and copied in two transfers (int64, float32); penalty tables are gathered on the
        device."""
        st, rows = self.states, fwd.sample_rows
        penalised = any(p.uses_penalties for p in params)
        ints = {
            "seeds": st.seeds[rows],
            "positions": st.num_tokens[rows] - st.num_prompt_tokens[rows],
        }
        if any(p.effective_top_k > 0 for p in params):
            ints["top_k"] = st.top_k[rows]
        floats = {"temperature": st.temperature[rows]}
        for name, used in (
            ("top_p", any(p.top_p < 1.0 for p in params)),
            ("min_p", any(p.min_p > 0.0 for p in params)),
            *((name, penalised) for name in _PENALTIES),
        ):
            if used:
                floats[name] = getattr(st, name)[rows]
        tensors: dict[str, torch.Tensor | None] = dict.fromkeys(("top_k", "top_p", "min_p"))
        tensors.update(zip(ints, self.io.to_device(list(ints.values())), strict=True))
        tensors.update(zip(floats, self.io.to_device(list(floats.values())), strict=True))
        if penalised:
            tensors["prompt_mask"] = st.prompt_mask[fwd.sample_rows_device]
            tensors["output_counts"] = st.output_counts[fwd.sample_rows_device]
        return SamplingMetadata(
            all_greedy=all(p.greedy for p in params),
            all_random=not any(p.greedy for p in params),
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            **tensors,
        )


def _lp_tensors(lp: LogprobsTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lp.token_ids, lp.logprobs, lp.ranks
