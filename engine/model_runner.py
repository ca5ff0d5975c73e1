"""Runs the model: builds each step's input batch, the forward pass, sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.llama import KVCache, LlamaForCausalLM
from baton.engine.request_states import RequestStates
from baton.engine.scheduler_output import (
    GrammarOutput,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.sampler import Sampler, SamplingMetadata, apply_token_bitmask_


@dataclass(frozen=True)
class ForwardOutput:
    """What ``execute_model`` hands to ``sample_tokens``: a value, not runner state.

    Attributes:
        request_ids: every scheduled request, in batch order.
        sample_request_ids: those that sample this step (reached their last known token).
        sample_rows: their state rows, int64 ``[N]``.
        hidden: final hidden states of their last tokens ``[N, hidden]``.
    """

    step_id: int
    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    sample_rows: torch.Tensor
    hidden: torch.Tensor


@dataclass(frozen=True)
class SampledTokens:
    """One step's sampled tokens, still a device tensor ``[N]`` in ``sample_request_ids`` order."""

    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    token_ids: torch.Tensor
    logprobs: dict[str, Logprobs]


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


class ModelRunner:
    """Owns the model, its KV cache and the persistent request rows."""

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
        self.eos_token_ids = tuple(eos_token_ids)
        # Ids past the tokenizer (padding rows of the embedding) can never be decoded.
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = model.config.vocab_size
        max_blocks = -(-max_model_len // block_size)
        self.states = RequestStates(max_num_reqs, max_model_len, max_blocks, self.vocab_size)
        self.sampler = Sampler()

    # ------------------------------------------------------------- forward
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ForwardOutput:
        """Applies the scheduler's changes to the rows and runs the forward pass."""
        st = self.states
        for rid in so.finished_request_ids:
            st.remove(rid)
        for new in so.new_requests:
            st.add(new)
        for cached in so.cached_requests:
            row = st.row_of[cached.request_id]
            st.append_blocks(row, cached.new_block_ids)
            st.num_computed[row] = cached.num_computed_tokens

        req_ids = tuple(so.num_scheduled_tokens)
        if not req_ids:
            empty = torch.zeros(0, dtype=torch.int64)
            return ForwardOutput(so.step_id, (), (), empty, torch.zeros(0))
        rows = torch.tensor([st.row_of[r] for r in req_ids], dtype=torch.int64)
        query_lens = torch.tensor(list(so.num_scheduled_tokens.values()), dtype=torch.int64)
        computed = st.num_computed[rows]
        seq_lens = computed + query_lens

        # Input ids come from the rows, where sampled tokens were written:
        # the CPU scheduler never has to know them.
        token_rows = torch.repeat_interleave(rows, query_lens)
        starts = torch.cumsum(query_lens, 0) - query_lens
        offsets = torch.arange(int(query_lens.sum())) - torch.repeat_interleave(starts, query_lens)
        positions = torch.repeat_interleave(computed, query_lens) + offsets
        input_ids = st.input_ids(token_rows, positions)

        meta = AttentionMetadata.build(query_lens, seq_lens, st.block_table[rows], self.block_size)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        st.num_computed[rows] = seq_lens

        samples = seq_lens >= st.num_tokens[rows]
        last_index = starts + query_lens - 1
        sample_idx = samples.nonzero().squeeze(1)
        return ForwardOutput(
            step_id=so.step_id,
            request_ids=req_ids,
            sample_request_ids=tuple(req_ids[i] for i in sample_idx.tolist()),
            sample_rows=rows[sample_idx],
            hidden=hidden[last_index[sample_idx]],
        )

    # ------------------------------------------------------------ sampling
    @torch.inference_mode()
    def sample(self, fwd: ForwardOutput, grammar: GrammarOutput | None = None) -> SampledTokens:
        """Samples one token per sampling row and writes it into the rows (device state)."""
        logprobs: dict[str, Logprobs] = {}
        if not fwd.sample_request_ids:
            empty = torch.zeros(0, dtype=torch.int64)
            return SampledTokens(fwd.request_ids, (), empty, logprobs)
        logits = self.model.compute_logits(fwd.hidden)
        self._ban_tokens(logits, fwd)
        if grammar is not None and grammar.request_ids:
            self._apply_grammar(logits, fwd, grammar)
        meta = self._sampling_metadata(fwd.sample_rows)
        out = self.sampler(logits, meta)
        self.states.append_sampled(fwd.sample_rows, out.token_ids)
        if out.logprobs is not None:
            logprobs = self._logprobs(fwd, out.logprobs)
        return SampledTokens(fwd.request_ids, fwd.sample_request_ids, out.token_ids, logprobs)

    def sample_tokens(
        self, fwd: ForwardOutput, grammar: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """``sample`` with its tokens read back to the host, as the scheduler takes them."""
        s = self.sample(fwd, grammar)
        return runner_output(s.request_ids, s.sample_request_ids, s.token_ids.tolist(), s.logprobs)

    def _ban_tokens(self, logits: torch.Tensor, fwd: ForwardOutput) -> None:
        """Tokens a row may not sample: undecodable ids, and stop tokens before min_tokens."""
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size < logits.shape[1]:
            logits[:, self.tokenizer_vocab_size :] = float("-inf")
        st = self.states
        for i, row in enumerate(fwd.sample_rows.tolist()):
            sp = st.params[row]
            if (
                sp.min_tokens
                and int(st.num_tokens[row] - st.num_prompt_tokens[row]) < sp.min_tokens
            ):
                banned = list(sp.stop_token_ids) + (
                    [] if sp.ignore_eos else list(self.eos_token_ids)
                )
                if banned:
                    logits[i, banned] = float("-inf")

    def _apply_grammar(
        self, logits: torch.Tensor, fwd: ForwardOutput, grammar: GrammarOutput
    ) -> None:
        index = {r: i for i, r in enumerate(fwd.sample_request_ids)}
        pairs = [(index[r], i) for i, r in enumerate(grammar.request_ids) if r in index]
        if not pairs:
            return
        logit_rows = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        mask_rows = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        apply_token_bitmask_(logits, grammar.bitmask[mask_rows], logit_rows)

    def _sampling_metadata(self, rows: torch.Tensor) -> SamplingMetadata:
        st = self.states
        row_list = rows.tolist()
        params = [st.params[r] for r in row_list]
        temperature = st.temperature[rows]
        all_greedy = all(p.greedy for p in params)
        all_random = not any(p.greedy for p in params)
        use_top_k = any(p.effective_top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        penalised = any(st.uses_penalties[r] for r in row_list)
        max_lp = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        pen: dict[str, torch.Tensor | None] = dict.fromkeys(
            (
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "prompt_mask",
                "output_counts",
            )
        )
        if penalised:
            pen = {
                "repetition_penalty": st.repetition_penalty[rows],
                "presence_penalty": st.presence_penalty[rows],
                "frequency_penalty": st.frequency_penalty[rows],
                "prompt_mask": st.prompt_mask[rows],
                "output_counts": st.output_counts[rows],
            }
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=st.top_k[rows] if use_top_k else None,
            top_p=st.top_p[rows] if use_top_p else None,
            min_p=st.min_p[rows] if use_min_p else None,
            seeds=st.seeds[rows],
            positions=st.num_tokens[rows] - st.num_prompt_tokens[rows],
            max_num_logprobs=max_lp,
            **pen,
        )

    def _logprobs(self, fwd: ForwardOutput, lp: object) -> dict[str, Logprobs]:
        st = self.states
        result: dict[str, Logprobs] = {}
        ids = lp.token_ids.tolist()
        vals = lp.logprobs.tolist()
        ranks = lp.ranks.tolist()
        for i, (rid, row) in enumerate(
            zip(fwd.sample_request_ids, fwd.sample_rows.tolist(), strict=True)
        ):
            k = st.params[row].logprobs
            if k is None:
                continue
            result[rid] = Logprobs([ids[i][: k + 1]], [vals[i][: k + 1]], [ranks[i]])
        return result
