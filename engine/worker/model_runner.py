"""Runs the model: builds each step's input batch, the forward pass, sampling.

The batch's structure (rows, positions, which rows sample, attention and sampling metadata)
is computed on the host from the request states' CPU mirrors and reaches the device through
``DeviceIO``'s staging copies; token values stay on the device. Nothing here reads a device
value on the host, so on CUDA both calls only queue work; results come back through
``SampledTokens.host``, which is waited for when the output is collected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.kv_layout import kv_cache_layout
from baton.engine.models.attention import AttentionMetadata
from baton.engine.models.kv_cache import KVCache, copy_kv_blocks
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import (
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.engine.worker.cuda_graphs import DecodeGraphs, DecodePadding
from baton.engine.worker.device_buffers import DeviceIO, HostCopy
from baton.engine.worker.host_times import HostTimes
from baton.engine.worker.prompt_logprobs import (
    PromptLogprobsCopy,
    PromptRows,
    prune_done,
    queue_prompt_logprobs,
)
from baton.engine.worker.request_states import RequestStates
from baton.engine.worker.runner_values import ForwardOutput, SampledTokens
from baton.engine.worker.spec_decode import DraftLayout, record_verified_
from baton.engine.worker.step_plan import StepPlan
from baton.sampler import Sampler, SamplingMetadata, apply_token_bitmask_
from baton.sampler.outputs import LogprobsTensors

_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


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
        decode_graph_sizes: tuple[int, ...] = (),
    ) -> None:
        """``decode_graph_sizes``: batch sizes whose pure-decode steps run through
        `DecodeGraphs` (padded to the next size; captured as CUDA graphs by
        `capture_cuda_graphs`); empty: every step runs the model as it is."""
        self.model = model
        self.io = DeviceIO.for_device(model.embed_tokens.weight.device)
        self.eos_token_ids = tuple(eos_token_ids)
        # Ids past the tokenizer (padding rows of the embedding) can never be decoded.
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = model.config.vocab_size
        # KV cache groups (engine/kv_layout.py): a row's block table holds every group's block
        # ids interleaved, as the scheduler sends them; group g's table is its g-th column of
        # every num_groups.
        self.kv_layout = kv_cache_layout(model.config.layer_windows())
        max_blocks = -(-max_model_len // block_size)
        with self.io.on_stream():  # zero-filled on the stream that will read them
            self.states = RequestStates(
                max_num_reqs,
                max_model_len,
                max_blocks * self.kv_layout.num_groups,
                self.vocab_size,
                self.io,
            )
        self.sampler = Sampler()
        self.graphs = (
            DecodeGraphs(
                model,
                kv_caches,
                self.io,
                decode_graph_sizes,
                max_blocks,
                block_size,
                self.states.token_ids,
            )
            if decode_graph_sizes
            else None
        )
        self.decode_graph_steps = 0
        self.host_times = HostTimes()  # per-part host laps, on with BATON_RUNNER_TIMES=1

    def capture_cuda_graphs(self) -> float:
        """Captures the decode graphs (see `DecodeGraphs.capture`); returns the seconds taken.

        Raises:
            RuntimeError: the runner has no graph sizes, or is not on a CUDA device.
        """
        if self.graphs is None:
            raise RuntimeError("this runner was built without decode_graph_sizes")
        return self.graphs.capture()

    # ------------------------------------------------------------- forward
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ForwardOutput:
        """Applies the scheduler's changes to the rows and queues the forward pass."""
        with self.io.on_stream():
            laps = self.host_times
            laps.start()
            self._apply_changes(so)
            laps.lap("apply_changes")
            req_ids = tuple(so.num_scheduled_tokens)
            if not req_ids:
                rows = np.zeros(0, dtype=np.int64)
                return ForwardOutput(
                    so.step_id, (), (), rows, torch.from_numpy(rows), torch.zeros(0)
                )
            plan = self._plan(so)
            st = self.states
            prompt_rows = None
            if st.prompt_logprob_rows:  # the usual step: no host work at all
                prompt_rows = PromptRows.of(
                    req_ids, plan, st.prompt_logprob_rows, st.num_prompt_tokens
                )
            # Prompt rows need every hidden state: the decode graphs keep the last ones only.
            pad = None if prompt_rows is not None else self._decode_padding(plan)
            hidden_index: torch.Tensor | None = None
            graph_logits: torch.Tensor | None = None
            if pad is not None:
                # A decode graph gathers its own input ids; its plan is all host arrays.
                sample_rows, tables, index = self.io.to_device(
                    [plan.sample_rows, pad.tables, plan.hidden_index]
                )
                # A decode step usually samples every row, in order: no gather then.
                hidden_index = None if plan.sample_idx.size == pad.num_seqs else index
                laps.lap("plan_and_copy")
                self.graphs.load(pad, tables)
                laps.lap("graph_inputs")
                hidden = self.graphs.run(pad)
                graph_logits = self.graphs.logits(pad)
                self.decode_graph_steps += 1
            else:
                hidden, hidden_index, sample_rows = self._eager_forward(plan)
            laps.lap("forward")
            self.states.num_computed[plan.rows] = plan.seq_lens
            sample_ids = tuple(req_ids[i] for i in plan.sample_idx.tolist())
            drafts = None
            if so.scheduled_spec_decode_tokens:
                spec = so.scheduled_spec_decode_tokens
                drafts = DraftLayout.of([spec.get(r, ()) for r in sample_ids])
            # No sampling row, no LM head: every tensor-parallel rank skips its gather alike.
            head = self.model.compute_logits
            if not sample_ids:
                logits = torch.zeros(0)
            elif graph_logits is not None:  # the LM head ran in the graph
                logits = graph_logits if hidden_index is None else graph_logits[hidden_index]
            elif hidden_index is None:
                logits = head(hidden)
            else:
                logits = head(hidden[hidden_index])
            prompt_lp = (
                self._prompt_logprobs(plan, prompt_rows, hidden) if st.prompt_logprob_rows else None
            )
            laps.lap("logits")
            return ForwardOutput(
                step_id=so.step_id,
                request_ids=req_ids,
                sample_request_ids=sample_ids,
                sample_rows=plan.sample_rows,
                sample_rows_device=sample_rows,
                logits=logits,
                drafts=drafts,
                prompt_logprobs=prompt_lp,
            )

    def _eager_forward(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step's forward outside the decode graphs: (hidden states, the index of the
        sampling rows' states or None, the sampling rows on the device)."""
        token_rows, positions, hidden_index, sample_rows = self.io.to_device(
            [plan.token_rows, plan.positions, plan.hidden_index, plan.sample_rows]
        )
        # Input ids come from the rows, where sampled tokens were written:
        # the CPU scheduler never has to know them.
        input_ids = self.states.input_ids(token_rows, positions)
        self.host_times.lap("plan_and_copy")
        tables = self.states.block_table[plan.rows]
        layout = self.kv_layout
        # Each group's own table and window; each layer gets its group's. One group holds
        # every layer: the whole table, and the model's window for its windowed layers.
        one = layout.num_groups == 1
        groups = [
            AttentionMetadata.build(
                plan.query_lens,
                plan.seq_lens,
                tables if one else tables[:, g :: layout.num_groups],
                self.block_size,
                self.io.device,
                stage=self.io.to_device,
                sliding_window=self.model.config.sliding_window if one else window,
            )
            for g, window in enumerate(layout.group_windows)
        ]
        meta = groups[0] if len(groups) == 1 else tuple(groups[g] for g in layout.layer_groups)
        return self.model(input_ids, positions, self.kv_caches, meta), hidden_index, sample_rows

    def _prompt_logprobs(
        self, plan: StepPlan, rows: PromptRows | None, hidden: torch.Tensor
    ) -> PromptLogprobsCopy | None:
        """Queues the prompt logprobs of ``rows`` (see ``prompt_logprobs.py``), then forgets
        the rows whose prompt this step finished."""
        out = None
        if rows is not None:
            out = queue_prompt_logprobs(
                rows,
                hidden,
                self.model.compute_logits,
                self.states.input_ids,
                self.io,
                driver=self.model.tp is None or self.model.tp.is_driver,
                vocab_size=self.tokenizer_vocab_size,
            )
        prune_done(self.states.prompt_logprob_rows, plan, self.states.num_prompt_tokens)
        return out

    def _decode_padding(self, plan: StepPlan) -> DecodePadding | None:
        """The step's layout for the decode graphs, or None when it runs the model as it is:
        no graphs, a prompt chunk or drafts in the step (more than one new token somewhere),
        or more sequences than the largest graph."""
        if self.graphs is None or (plan.query_lens != 1).any():
            return None
        return DecodePadding.of(
            self.graphs.sizes,
            plan.seq_lens,
            self.states.block_table[plan.rows],
            self.block_size,
            plan.rows,
        )

    def _apply_changes(self, so: SchedulerOutput) -> None:
        if so.kv_block_copies:
            copy_kv_blocks(self.kv_caches, so.kv_block_copies)
        st = self.states
        for rid in so.finished_request_ids:
            st.remove(rid)
        for new in so.new_requests:
            st.add(new)
        for rid, kept in so.num_kept_blocks.items():
            if (row := st.row_of.get(rid)) is not None:
                st.num_blocks[row] = kept
        if so.rewound:
            live = [(st.row_of[r], n, w) for r, (n, w) in so.rewound.items() if r in st.row_of]
            st.rewind(
                np.array([r for r, _, _ in live], dtype=np.int64),
                np.array([n for _, n, _ in live], dtype=np.int64),
                max((w for _, _, w in live), default=1),
            )
        for cached in so.cached_requests:
            row = st.row_of[cached.request_id]
            st.settle(row, cached.num_computed_tokens)
            st.append_blocks(row, cached.new_block_ids)
            st.num_computed[row] = cached.num_computed_tokens
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            row = st.row_of[rid]
            st.stage_tokens(row, int(st.num_tokens[row]), drafts)
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
        hidden_index = (starts + query_lens - 1)[sample_idx]
        spec = so.scheduled_spec_decode_tokens
        if spec:
            # A request with k drafts samples at its last known token and at each draft.
            ids = list(so.num_scheduled_tokens)
            counts = np.fromiter(
                (1 + len(spec.get(ids[i], ())) for i in sample_idx.tolist()),
                np.int64,
                sample_idx.size,
            )
            ends = np.repeat(hidden_index + 1 - counts, counts)
            hidden_index = (
                ends + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            )
        return StepPlan(
            rows=rows,
            query_lens=query_lens,
            seq_lens=seq_lens,
            token_rows=np.repeat(rows, query_lens),
            positions=np.repeat(computed - starts, query_lens) + np.arange(num_tokens),
            sample_idx=sample_idx,
            hidden_index=hidden_index,
        )

    # ------------------------------------------------------------ sampling
    @torch.inference_mode()
    def sample(self, fwd: ForwardOutput, grammar: GrammarOutput | None = None) -> SampledTokens:
        """Queues sampling of one token per sampling row (with drafts: per draft position and
        one more, then the verification), its write into the rows, and the copy of the tokens
        (and logprobs) to the host."""
        with self.io.on_stream():
            if not fwd.sample_request_ids:
                empty = torch.zeros(0, dtype=torch.int64)
                return SampledTokens(
                    fwd.request_ids,
                    (),
                    empty,
                    None,
                    (),
                    HostCopy((empty,)),
                    prompt_logprobs=fwd.prompt_logprobs,
                )
            laps = self.host_times
            laps.start()
            # Each sampling request's parameters, looked up once for the whole step.
            params = [self.states.params[r] for r in fwd.sample_rows.tolist()]
            rows = _LogitsRows.of(fwd, self.io)
            row_params = params if fwd.drafts is None else [params[i] for i in rows.request]
            logits = fwd.logits
            if grammar is not None and grammar.request_ids:
                self._apply_grammar(logits, fwd, grammar)
            laps.lap("grammar")
            self._add_logit_bias(logits, rows)
            self._ban_tokens(logits, rows, row_params)
            meta = self._sampling_metadata(rows, row_params, fwd.drafts)
            laps.lap("bans_and_metadata")
            out = self.sampler(logits, meta)
            laps.lap("sampler")
            if fwd.drafts is None:
                self.states.append_sampled(fwd.sample_rows, fwd.sample_rows_device, out.token_ids)
            else:
                self._record_verified(fwd, fwd.drafts, out.token_ids)
            laps.lap("record")
            lp = out.logprobs
            to_copy = [out.token_ids] if lp is None else [out.token_ids, *_lp_tensors(lp)]
            num_logprobs = tuple(p.logprobs for p in params)
            copy = self.io.to_host(to_copy)
            laps.lap("to_host")
            return SampledTokens(
                fwd.request_ids,
                fwd.sample_request_ids,
                out.token_ids,
                lp,
                num_logprobs,
                copy,
                fwd.drafts,
                fwd.prompt_logprobs,
            )

    def _record_verified(
        self, fwd: ForwardOutput, layout: DraftLayout, tokens: torch.Tensor
    ) -> None:
        """Keeps each request's accepted drafts and the token after them in its device rows;
        the host lengths of rows with drafts are settled by the next step's scheduler data."""
        st = self.states
        width = int(layout.counts.max())
        cols = np.arange(width, dtype=np.int64)
        # Past a request's own rows, its last token again (a valid id, never kept).
        gather = layout.starts[:, None] + np.minimum(cols[None, :], layout.counts[:, None] - 1)
        drafts = np.full((len(layout.drafts), width - 1), -1, dtype=np.int64)
        for i, d in enumerate(layout.drafts):
            drafts[i, : len(d)] = d
        gather_d, drafts_d = self.io.to_device([gather, drafts])
        record_verified_(
            st.token_ids,
            st.num_tokens_device,
            st.last_sampled,
            st.output_counts,
            fwd.sample_rows_device,
            # The device's lengths: a row planned past drafts still in flight (async) has an
            # optimistic host length until it is rewound.
            st.num_tokens_device[fwd.sample_rows_device],
            tokens[gather_d],
            drafts_d,
        )
        plain = layout.counts == 1
        st.num_tokens[fwd.sample_rows[plain]] += 1
        st.unverified.update(fwd.sample_rows[~plain].tolist())

    def sample_tokens(
        self, fwd: ForwardOutput, grammar: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """``sample`` with its tokens read back to the host, as the scheduler takes them."""
        return self.sample(fwd, grammar).to_runner_output()

    def _add_logit_bias(self, logits: torch.Tensor, rows: _LogitsRows) -> None:
        """Adds each row's logit_bias to its logits, in place, with one copy to the device.

        Runs after the grammar mask: a finite bias leaves a forbidden (-inf) token forbidden.
        Each row's sum is its own, so a request's tokens do not depend on its batch.
        """
        if not self.states.biased_rows:  # the usual step: no host work at all
            return
        biases = self.states.logit_bias
        parts = [
            (i, b) for i, row in enumerate(rows.state.tolist()) if (b := biases[row]) is not None
        ]
        if not parts:
            return
        index = np.concatenate([np.full(ids.size, i, dtype=np.int64) for i, (ids, _) in parts])
        cols = np.concatenate([ids for _, (ids, _) in parts])
        values = np.concatenate([v for _, (_, v) in parts])
        rows_d, cols_d, values_d = self.io.to_device([index, cols, values])
        logits.index_put_((rows_d, cols_d), values_d.to(logits.dtype), accumulate=True)

    def _ban_tokens(
        self, logits: torch.Tensor, rows: _LogitsRows, params: list[SamplingParams]
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
        for i, (row, offset, sp) in enumerate(
            zip(rows.state.tolist(), rows.offsets.tolist(), params, strict=True)
        ):
            # The host mirror knows the length: this row's tokens before this sample.
            produced = st.num_tokens[row] - st.num_prompt_tokens[row] + offset
            if sp.min_tokens and produced < sp.min_tokens:
                banned = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    banned.update(self.eos_token_ids)
                ban_rows += [i] * len(banned)
                ban_cols += sorted(banned)
        if not ban_rows:
            return
        rows_d, cols = self.io.to_device(
            [np.array(ban_rows, dtype=np.int64), np.array(ban_cols, dtype=np.int64)]
        )
        kept = logits[rows_d, cols]
        logits[rows_d, cols] = float("-inf")
        # Decided on the device, so that no value is read back here.
        empty = (logits == float("-inf")).all(dim=1)
        logits[rows_d, cols] = torch.where(
            empty[rows_d], kept, torch.full_like(kept, float("-inf"))
        )

    def _apply_grammar(
        self, logits: torch.Tensor, fwd: ForwardOutput, grammar: GrammarOutput
    ) -> None:
        if (
            fwd.drafts is None
            and not grammar.row_counts
            and grammar.request_ids == fwd.sample_request_ids
        ):
            # Every sampling row is structured, in order (a JSON-only decode batch): mask row
            # i is logits row i, so no rows are gathered or sent.
            (bitmask,) = self.io.to_device([grammar.bitmask[: len(grammar.request_ids)]])
            apply_token_bitmask_(logits, bitmask)
            return
        index = {r: i for i, r in enumerate(fwd.sample_request_ids)}
        starts = None if fwd.drafts is None else fwd.drafts.starts.tolist()
        logit_list: list[int] = []
        mask_list: list[int] = []
        for rid, first, count in grammar.rows_of():
            i = index.get(rid)
            if i is None:
                continue
            base = i if starts is None else starts[i]
            logit_list += range(base, base + count)
            mask_list += range(first, first + count)
        if not logit_list:
            return
        logit_rows = np.array(logit_list, dtype=np.int64)
        # Gathered on the host (where the grammar filled it), then copied with the rows at once.
        rows = grammar.bitmask[torch.tensor(mask_list, dtype=torch.int64)]
        bitmask, logit_rows_device = self.io.to_device([rows, logit_rows])
        apply_token_bitmask_(logits, bitmask, logit_rows_device)

    def _sampling_metadata(
        self, sel: _LogitsRows, params: list[SamplingParams], drafts: DraftLayout | None = None
    ) -> SamplingMetadata:
        """The logits rows' parameters (``params``, in row order), gathered from the host
        mirrors and copied in one transfer; penalty tables are gathered on the
        device. A draft row samples the output position after its drafts, with those drafts
        counted as output tokens by the penalties."""
        st, rows = self.states, sel.state
        penalised = any(p.uses_penalties for p in params)
        ints = {
            "seeds": st.seeds[rows],
            "positions": st.num_tokens[rows] - st.num_prompt_tokens[rows] + sel.offsets,
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
        values = {**ints, **floats}
        tensors.update(zip(values, self.io.to_device(list(values.values())), strict=True))
        if penalised:
            tensors["prompt_mask"] = st.prompt_mask[sel.state_device]
            counts = st.output_counts[sel.state_device]  # a copy: one row per logits row
            if drafts is not None:
                self._count_drafts_(counts, sel, drafts)
            tensors["output_counts"] = counts
        return SamplingMetadata(
            all_greedy=all(p.greedy for p in params),
            all_random=not any(p.greedy for p in params),
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            **tensors,
        )

    def _count_drafts_(self, counts: torch.Tensor, sel: _LogitsRows, drafts: DraftLayout) -> None:
        """Adds to each draft row's output counts the drafts before its position (the
        tokens a step without drafts would have sampled and counted by then)."""
        rows: list[int] = []
        tokens: list[int] = []
        for r, (req, offset) in enumerate(zip(sel.request, sel.offsets.tolist(), strict=True)):
            prior = drafts.drafts[req][:offset]
            rows += [r] * len(prior)
            tokens += prior
        if not tokens:
            return
        rows_d, tokens_d = self.io.to_device(
            [np.asarray(rows, dtype=np.int64), np.asarray(tokens, dtype=np.int64)]
        )
        counts.index_put_(
            (rows_d, tokens_d), torch.ones_like(tokens_d, dtype=counts.dtype), accumulate=True
        )


@dataclass(frozen=True)
class _LogitsRows:
    """Per logits row of a step: its state row (host and device), its draft offset, and its
    sampling request's index."""

    state: np.ndarray
    state_device: torch.Tensor
    offsets: np.ndarray
    request: list[int]

    @classmethod
    def of(cls, fwd: ForwardOutput, io: DeviceIO) -> _LogitsRows:
        layout = fwd.drafts
        if layout is None:
            n = len(fwd.sample_request_ids)
            return cls(
                fwd.sample_rows, fwd.sample_rows_device, np.zeros(n, np.int64), list(range(n))
            )
        state = fwd.sample_rows[layout.row_index]
        (state_device,) = io.to_device([state])
        return cls(state, state_device, layout.offsets, layout.row_index.tolist())


def _lp_tensors(lp: LogprobsTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lp.token_ids, lp.logprobs, lp.ranks
