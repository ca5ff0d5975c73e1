"""``SimExecutor``: a simulated accelerator (``device="sim:<gpu>"``) that spends no host CPU on
its "device" work.

The device is a timeline on the host's ``perf_counter`` clock that runs queued work in order,
like a CUDA stream: each forward and each sampling pass starts when it is queued or when the
previous one ends, whichever is later, and takes the time the cost model gives for that
step's real work (tokens, context lengths, rows sampled) on the named GPU and model shape.
``get_output()`` is a real wait until the step's simulated end. Tokens come from traces of
real token sequences (``sim_traces.py``); a structured request's token is checked against
the bitmask row the engine sent for it, and a token the mask forbids fails the step loudly,
so a run also proves the masks are right and on time. Everything around it is the real
engine.

Speculative decoding (either scheduling): a request's draft tokens are fed with its last
token and verified against its trace as greedy verification would against a model whose
argmax is the trace: the drafts equal to the trace's next tokens are kept, then one more token
(the trace's next). Every kept token is checked against the bitmask row of its draft position.
The forward is timed with all the fed tokens and one logits row per draft position and one
more, as a real verification step computes. Under async scheduling a step planned past
drafts that were then rejected sampled past the real length: the next step's ``rewound``
moves the trace back.

The model runner's own costs (``sim_runner.py``): with a ``RunnerModel`` the executor spends the
runner's host time on the engine thread, in ``execute_model`` (inputs, the forward's launch:
one graph replay for a pure decode step, one launch per kernel otherwise) and in
``sample_tokens`` (bitmask apply, sampling, the copy back), as the in-process runner does on a
GPU; and no kernel of a forward or a sampling pass is faster than the calibrated floor. A
forward run op by op starts on the device as its launching starts and cannot end before the
launching does. The runner's host time is charged as this host would take it (the calibrated
time times the runner model's host scale). ``time_scale`` stretches the device's times by a
factor: set to the host scale (how much slower this host is than the GPU machine's), a run
plays that machine, host and GPU, in slow motion.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.executor.sim_cost import CostModel, ForwardWork
from baton.engine.executor.sim_runner import RunnerModel, RunnerStep
from baton.engine.executor.sim_traces import TraceBook
from baton.engine.models.config import ModelConfig
from baton.engine.scheduler_output import (
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    bitmask_rows,
)
from baton.engine.sim_specs import GpuSpec, ModelShape
from baton.engine.sync_check import SyncChecker
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import allocate_bitmask

logger = logging.getLogger(__name__)

_RECENT_OPS = 65536
# Waits shorter than this spin (yielding the GIL) instead of sleeping: a sleep overshoots by
# tens of microseconds, which would show up as device idle time the engine did not cause.
_SPIN_S = 150e-6


class DeviceOp(NamedTuple):
    """One piece of simulated device work, on the host's ``perf_counter`` clock."""

    kind: str  # "forward" or "sample"
    step_id: int
    start: float
    end: float
    num_requests: int
    num_tokens: int
    num_sampled: int


@dataclass(eq=False)
class _Row:
    """What the device holds of one request."""

    trace: tuple[int, ...] | None
    position: int  # output tokens produced so far (the next one is trace[position])
    num_tokens: int  # prompt + outputs, counting tokens sampled on the device
    num_computed: int


@dataclass(frozen=True)
class _Forward:
    step_id: int
    request_ids: tuple[str, ...]
    sample_ids: tuple[str, ...]
    seconds: float  # the forward's device time
    drafts: dict[str, tuple[int, ...]]  # per sampling request with drafts, its drafts
    num_logits_rows: int  # one per sampling request and one more per draft
    runner_step: RunnerStep | None  # the runner model's view (None: no runner costs)


def sim_model_config(shape: ModelShape, tokenizer: Tokenizer) -> ModelConfig:
    """The model config the engine sees on a simulated device: ``shape``'s dimensions over the
    tokenizer's vocabulary (the bitmask width; the cost model keeps the shape's own)."""
    return ModelConfig(
        architecture="llama",
        vocab_size=tokenizer.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
    )


class SimExecutor(Executor):
    """Simulates ``shape`` on ``gpu`` for the engine core.

    Args:
        gpu, shape: what the cost model times.
        traces: the outputs to replay, by prompt.
        eos_token_id: sampled after a trace's last token.
        vocab_size: the engine's vocabulary (bitmask width).
        max_num_seqs: most rows in one step's bitmask.
        runner: the model runner's host costs and kernel floors (None: neither is charged).
        time_scale: the factor on every device time (see the module docstring).
        clock: the host clock the timeline runs on.
    """

    def __init__(
        self,
        gpu: GpuSpec,
        shape: ModelShape,
        traces: TraceBook,
        eos_token_id: int,
        vocab_size: int,
        max_num_seqs: int,
        checker: SyncChecker | None = None,
        runner: RunnerModel | None = None,
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.cost = CostModel(gpu, shape)
        self.runner = runner
        self.time_scale = time_scale
        # GEMMs of a forward (four per layer and the LM head): the kernels whose time the
        # roofline gives; the others take the floor.
        self._gemms = 4 * shape.num_layers + 1
        self._traces = traces
        self._eos = eos_token_id
        self._checker = checker or SyncChecker("off")
        self._clock = clock
        self._bitmask = allocate_bitmask(max_num_seqs, vocab_size)
        # The last mask checked, and its numpy view (sharing its memory).
        self._mask_of: torch.Tensor | None = None
        self._mask_np = np.empty((0, 0), dtype=np.int32)
        self._rows: dict[str, _Row] = {}
        self._pending: deque[_Forward] = deque()
        self._free_at = 0.0
        self._device_s = 0.0
        self._host_s = 0.0
        self._runner_s = 0.0
        self._wake_late_s = 0.0
        self._steps: deque[RunnerStep] = deque(maxlen=_RECENT_OPS)
        # Plain tuples, named on the way out: the collector untracks a plain tuple of numbers
        # (see ``stats.EngineStats``), so the recent ops cost the engine's collections nothing.
        self._ops: deque[tuple[str, int, float, float, int, int, int]] = deque(maxlen=_RECENT_OPS)

    # ----------------------------------------------------------------- steps
    def execute_model(self, so: SchedulerOutput) -> None:
        t0 = self._clock()
        rows = self._rows
        for rid in so.finished_request_ids:
            rows.pop(rid, None)
        for new in so.new_requests:
            rows[new.request_id] = _Row(
                trace=self._traces.output_for(new.prompt_token_ids),
                position=len(new.output_token_ids),
                num_tokens=len(new.prompt_token_ids) + len(new.output_token_ids),
                num_computed=new.num_computed_tokens,
            )
        for rid, (n, _) in so.rewound.items():
            # Tokens sampled past rejected drafts (async): the trace goes on from n.
            if (row := rows.get(rid)) is not None:
                row.position -= row.num_tokens - n
                row.num_tokens = n
        for cached in so.cached_requests:
            rows[cached.request_id].num_computed = cached.num_computed_tokens
        work = []
        sample_ids = []
        spec = so.scheduled_spec_decode_tokens
        drafts: dict[str, tuple[int, ...]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            row = rows[rid]
            work.append(ForwardWork(n, row.num_computed))
            row.num_computed += n
            if row.num_computed >= row.num_tokens:
                sample_ids.append(rid)
                if d := spec.get(rid):
                    drafts[rid] = tuple(d)
        logits_rows = len(sample_ids) + sum(len(d) for d in drafts.values())
        roofline = self.cost.forward(work, logits_rows).seconds
        tokens = so.total_num_scheduled_tokens
        step = None
        if self.runner is None:
            seconds = roofline * self.time_scale
            self._queue("forward", so.step_id, t0, seconds, len(work), tokens, logits_rows)
            self._host_s += self._clock() - t0
        else:
            step = self.runner.step(so.num_scheduled_tokens, spec, logits_rows)
            seconds = self._runner_forward(so.step_id, step, roofline, t0, len(work))
        ids = tuple(so.num_scheduled_tokens)
        self._pending.append(
            _Forward(so.step_id, ids, tuple(sample_ids), seconds, drafts, logits_rows, step)
        )

    def _runner_forward(
        self, step_id: int, step: RunnerStep, roofline: float, t0: float, reqs: int
    ) -> float:
        """Spends the runner's launch time on this thread and queues the forward; returns its
        device seconds."""
        runner = self.runner
        assert runner is not None
        floor = runner.calibration.kernel_floor_s
        gemm_floor = self._gemms * floor
        others = max(0.0, runner.forward_floor_s(step) - gemm_floor)
        seconds = (max(roofline, gemm_floor) + others) * self.time_scale
        launch0 = self._clock()
        self._host_s += launch0 - t0
        launch_end = self._spin(runner.launch_host_s(step))
        if step.graphed:
            self._queue(
                "forward", step_id, launch_end, seconds, reqs, step.tokens, step.logits_rows
            )
        else:
            # Op by op: the device runs each kernel as it is launched, so the forward starts
            # with the launching and ends no sooner than one kernel after it.
            start = max(launch0, self._free_at)
            seconds = max(seconds, launch_end + floor * self.time_scale - start)
            self._queue("forward", step_id, launch0, seconds, reqs, step.tokens, step.logits_rows)
        return seconds

    def _spin(self, seconds: float) -> float:
        """Keeps this thread busy for ``seconds`` (the runner's host work); returns the end."""
        t0 = self._clock()
        end = t0 + seconds
        now = t0
        while now < end:
            now = self._clock()
        self._runner_s += now - t0
        return now

    def sample_tokens(self, step_id: int, grammar: GrammarOutput | None) -> AsyncOutput:
        t0 = self._clock()
        if not self._pending or self._pending[0].step_id != step_id:
            nxt = self._pending[0].step_id if self._pending else None
            raise ExecutorError(f"sample_tokens for step {step_id}, but step {nxt} is next")
        fwd = self._pending.popleft()
        output = self._sample(fwd, grammar)
        seconds = self.cost.sample(fwd.num_logits_rows).seconds
        n = len(fwd.request_ids)
        start = self._clock()
        self._host_s += start - t0
        if self.runner is not None and fwd.runner_step is not None:
            mask_rows = 0
            if grammar is not None and grammar.request_ids:
                mask_rows = bitmask_rows(grammar.request_ids, grammar.row_counts)
            step = fwd.runner_step._replace(mask_rows=mask_rows)
            self._steps.append(step)
            seconds += self.runner.sample_floor_s(mask_rows)
            start = self._spin(self.runner.sample_host_s(step))
        seconds *= self.time_scale
        end = self._queue("sample", step_id, start, seconds, n, 0, fwd.num_logits_rows)
        return _SimOutput(self, output, end, fwd.seconds + seconds)

    def _queue(
        self,
        kind: str,
        step_id: int,
        now: float,
        seconds: float,
        reqs: int,
        toks: int,
        sampled: int,
    ) -> float:
        """Puts work on the timeline behind what is queued; returns when it ends."""
        start = max(now, self._free_at)
        self._free_at = start + seconds
        self._ops.append((kind, step_id, start, self._free_at, reqs, toks, sampled))
        return self._free_at

    def _sample(self, fwd: _Forward, grammar: GrammarOutput | None) -> ModelRunnerOutput:
        """The device's tokens for the step's sampling rows: each request's next trace token
        (with drafts: the drafts its trace continues with, then its next token), each checked
        against the bitmask row of its position."""
        kept: dict[str, list[int]] = {}
        errors: dict[str, str] = {}
        all_drafts = fwd.drafts
        rows = self._rows
        for rid in fwd.sample_ids:
            row = rows[rid]
            trace, pos = row.trace, row.position
            if trace is not None and pos < len(trace):  # _next_token's usual case, inlined
                row.position = pos + 1
                row.num_tokens += 1
                tok, error = trace[pos], None
            else:
                tok, error = self._next_token(row)
            tokens = kept[rid] = [tok]
            drafts = all_drafts.get(rid) if all_drafts else None
            if error is not None:
                errors[rid] = error
            elif drafts:
                # Verification: keep the drafts the trace continues with, then its next token.
                for draft in drafts:
                    if draft != tok:
                        break
                    tok, error = self._next_token(row)
                    tokens.append(tok)
                    if error is not None:
                        errors[rid] = error
                        break
        if grammar is not None and grammar.request_ids:
            bad = self._check_masks(kept, grammar)
            if bad is not None:
                logger.error("simulated device: %s", bad)
                return ModelRunnerOutput(
                    request_ids=list(fwd.request_ids),
                    sampled_token_ids=[[] for _ in fwd.request_ids],
                    errors=dict.fromkeys(fwd.request_ids, bad),
                )
        return ModelRunnerOutput(
            request_ids=list(fwd.request_ids),
            sampled_token_ids=[kept.get(r, []) for r in fwd.request_ids],
            errors=errors,
        )

    def _next_token(self, row: _Row) -> tuple[int, str | None]:
        """The row's next token from its trace (EOS at its end) and advances the row; with why
        the request fails, if it does."""
        trace, pos = row.trace, row.position
        row.position += 1
        row.num_tokens += 1
        if trace is None:
            return self._eos, "the simulated device has no trace for this request's prompt"
        if pos < len(trace):
            return trace[pos], None
        if pos == len(trace):
            return self._eos, None
        return self._eos, f"the request went on past its trace's end ({len(trace)} tokens + EOS)"

    def _check_masks(self, kept: dict[str, list[int]], grammar: GrammarOutput) -> str | None:
        """Why the step fails (a token its bitmask row forbids), or None."""
        mask_rows: list[int] = []
        toks: list[int] = []
        owners: list[str] = []
        if not grammar.row_counts:  # one row per request, its one token (no drafts)
            for row, rid in enumerate(grammar.request_ids):
                if (tokens := kept.get(rid)) is not None:
                    mask_rows.append(row)
                    toks.append(tokens[0])
                    owners.append(rid)
        else:
            for rid, start, count in grammar.rows_of():
                if (tokens := kept.get(rid)) is None:
                    continue
                n = min(count, len(tokens))
                mask_rows += range(start, start + n)
                toks += tokens[:n]
                owners += [rid] * n
        if not mask_rows:
            return None
        rows = np.asarray(mask_rows, dtype=np.int64)
        tok_arr = np.asarray(toks, dtype=np.int64)
        if grammar.bitmask is not self._mask_of:  # each step sends the same view: one numpy
            with self._checker.allow():  # the device reading the mask it was sent
                self._mask_of, self._mask_np = grammar.bitmask, grammar.bitmask.numpy()
        words = self._mask_np[rows, tok_arr >> 5]
        allowed = (words >> (tok_arr & 31)) & 1
        if allowed.all():
            return None
        first = int(np.flatnonzero(allowed == 0)[0])
        rid = owners[first]
        return (
            f"token {int(tok_arr[first])} sampled for request {rid} is forbidden by the bitmask "
            f"row the engine sent for it (the step fails)"
        )

    def bitmask_buffer(self) -> torch.Tensor:
        # The mask is checked inside sample_tokens, so one buffer serves every step.
        return self._bitmask

    def _collect(self, end: float, seconds: float) -> None:
        """The one wait: until the step's simulated end; then its device time counts."""
        waited = False
        while (left := end - self._clock()) > 0:
            waited = True
            time.sleep(left - _SPIN_S if left > 2 * _SPIN_S else 0)
        if waited:  # on a busy host the thread wakes up past the end: the OS's delay
            self._wake_late_s += -left
        self._device_s += seconds

    # ------------------------------------------------------------ accessors
    def supports_async_scheduling(self) -> bool:
        return True

    @property
    def device_seconds(self) -> float:
        return self._device_s

    @property
    def host_seconds(self) -> float:
        """Host time the simulator itself spent (bookkeeping, trace lookups, mask checks)."""
        return self._host_s

    @property
    def runner_seconds(self) -> float:
        """Host time spent as the model runner's (the runner model's charges)."""
        return self._runner_s

    def runner_steps(self) -> list[RunnerStep]:
        """The recent sampled steps as the runner model saw them, oldest first (empty without
        a runner model)."""
        return list(self._steps)

    @property
    def wake_late_seconds(self) -> float:
        """Time ``get_output()`` returned past the end of the step it waited for: the host OS
        waking the engine thread late (large on a loaded machine), not the engine's work."""
        return self._wake_late_s

    def device_ops(self) -> list[DeviceOp]:
        """The recent device work, oldest first (for timelines and idle fractions)."""
        return [DeviceOp._make(o) for o in self._ops]


class _SimOutput(AsyncOutput):
    def __init__(
        self, executor: SimExecutor, output: ModelRunnerOutput, end: float, seconds: float
    ) -> None:
        self._executor, self._output = executor, output
        self._end, self._seconds = end, seconds
        self._done = False

    def get_output(self) -> ModelRunnerOutput:
        if not self._done:
            self._executor._collect(self._end, self._seconds)
            self._done = True
        return self._output
