"""The engine's side of structured outputs: per-request grammars and step bitmasks.

``grammar/`` knows nothing of requests; this manager ties its compile service
and matchers to requests, checks specs at submission, and fills the bitmask
rows of the requests that sample in a step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from baton.engine.core.fill_thread import FillThread, PendingFills, run_fills
from baton.engine.core.request import Request, StructuredState
from baton.engine.scheduler_output import GrammarOutput
from baton.grammar.backend import (
    BackendRecipe,
    GrammarMatcher,
    NativeFill,
    allocate_bitmask,
    filled_now,
)
from baton.grammar.compile_service import CompilePoolConfig, CompileResult, CompileService
from baton.grammar.reasoning import ReasoningMatcher, ReasoningTokens, fill_thinking_row
from baton.grammar.spec import StructuredOutputsParams, allowed_backends
from baton.grammar.validation import DEFAULT_MAX_DEPTH, check_enforceable, validate_spec

logger = logging.getLogger(__name__)

_VALIDATED_CACHE_SIZE = 1024
# The fill group of the requests that are thinking (``grammar/reasoning.py``): no backend's.
_THINKING = "(thinking)"


@dataclasses.dataclass(frozen=True)
class GrammarVerdict:
    """What a request's grammar made of its sampled token: accepted (``terminated``: the
    grammar ended with it), or rejected / broken (``error`` says why; the request fails)."""

    terminated: bool = False
    error: str | None = None


_ACCEPTED = GrammarVerdict()
_TERMINATED = GrammarVerdict(terminated=True)


@dataclasses.dataclass(frozen=True)
class _FillGroup:
    """One backend's share of a fill; ``error`` when planning its batched fill raised."""

    backend: str
    requests: list[Request]
    matchers: list[GrammarMatcher]
    rows: list[int]
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class _FillInProgress:
    groups: list[_FillGroup]  # in the order of ``pending``'s calls
    pending: PendingFills


@dataclasses.dataclass(frozen=True)
class BitmaskInProgress:
    """A step's bitmask fill that ``StructuredOutputManager.start_bitmask`` began: the
    requests with a row (in row order), the rows, and the fill (None: no structured row)."""

    requests: tuple[Request, ...]
    bitmask: torch.Tensor | None
    fill: _FillInProgress | None


class StructuredOutputManager:
    """Validates specs, compiles them off-thread and fills bitmasks for the engine.

    Args:
        tokenizer: the model's tokenizer (baton ``Tokenizer``).
        vocab_size: the model's vocabulary size (bitmask width ceil(vocab_size / 32)).
        max_rows: most structured rows in one step (max_num_seqs).
        compile_timeout_s: time limit of one compile's own running time.
        dynamic_compilation: xgrammar compiles JSON schemas lazily.
        fill_threads: threads of xgrammar's batched mask fills (and compiles);
            1 when the model's worker process needs every core.
        compile_pool: compile worker processes, queue bound and memory cap.
        cache_bytes: size budget of the compiled-grammar cache (see ``CompileService``).
        reasoning: the tokens that open and close the model's thoughts (the engine's
            reasoning parser), or None: a grammar holds from a request's first token.
        eos_token_ids: the model's ends of sequence (not allowed while a request thinks).
    """

    def __init__(
        self,
        tokenizer: object,
        vocab_size: int,
        max_rows: int,
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
        dynamic_compilation: bool = False,
        fill_threads: int = 2,
        compile_pool: CompilePoolConfig | None = None,
        cache_bytes: int = 1 << 30,
        reasoning: ReasoningTokens | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.vocab_size = vocab_size
        # The model's markers of thoughts (token ids; EngineConfig.reasoning_parser), and
        # the ends of sequence a thinking request may not stop on.
        self.reasoning = reasoning
        self.eos_token_ids = eos_token_ids
        recipes = {
            "xgrammar": BackendRecipe(
                "xgrammar",
                "baton.grammar.xgrammar_backend:XGrammarBackend",
                (("max_threads", fill_threads), ("dynamic_compilation", dynamic_compilation)),
                # One thread per compile: its CPU time is then its running time (what the
                # limit bounds), and the workers compile side by side.
                worker_options=(("max_threads", 1),),
            ),
            "outlines": BackendRecipe("outlines", "baton.grammar.outlines_backend:OutlinesBackend"),
            "guidance": BackendRecipe(
                "guidance",
                "baton.grammar.guidance_backend:GuidanceBackend",
                (("fill_threads", fill_threads),),
                worker_options=(("fill_threads", 1),),
            ),
        }
        self.service = CompileService(
            recipes, tokenizer, vocab_size, compile_timeout_s, cache_size, compile_pool, cache_bytes
        )
        self._bitmask = allocate_bitmask(max_rows, vocab_size)
        self._validated: OrderedDict[tuple[object, ...], None] = OrderedDict()

    # ------------------------------------------------------------ submission
    def validate(self, spec: StructuredOutputsParams) -> None:
        """Checks a spec before anything is scheduled.

        Raises:
            ValueError: naming what is wrong (syntax, meta-invalid schema,
                keywords no allowed backend enforces, limits).
        """
        try:
            key = (spec.kind, spec.spec_text, spec.options_key, spec.backend, spec.allow_unenforced)
        except RecursionError:
            # json.dumps / json.loads of a hostile schema, before validate_spec could look.
            raise ValueError(
                f"json schema nests deeper than the limit of {DEFAULT_MAX_DEPTH} levels"
            ) from None
        except (TypeError, ValueError):
            # A value JSON cannot hold (a set, say): validate_spec names it as a ValueError.
            validate_spec(spec)
            raise
        if key in self._validated:
            self._validated.move_to_end(key)
            return
        validate_spec(spec)
        _, reasons = self.service.candidates(spec)
        check_enforceable(spec, {n: reasons.get(n) for n in allowed_backends(spec.backend)})
        # Many requests share a schema: meta-validating it took ~10 ms each time.
        self._validated[key] = None
        if len(self._validated) > _VALIDATED_CACHE_SIZE:
            self._validated.popitem(last=False)

    def has_room(self, spec: StructuredOutputsParams) -> bool:
        """False when ``start(spec)`` would queue a new compile and the compile queue is
        full (a cached spec or one in flight always has room); changes nothing."""
        return self.service.has_room(spec)

    def check_room(self, spec: StructuredOutputsParams) -> None:
        """Refuses (and counts) a request that ``has_room`` says would overfill the queue.

        Raises:
            CompileQueueFull: with the seconds after which to retry.
        """
        if not self.service.has_room(spec):
            raise self.service.refuse()

    def start(
        self,
        spec: StructuredOutputsParams,
        prompt_token_ids: Sequence[int] = (),
        max_reasoning_tokens: int | None = None,
    ) -> StructuredState:
        """Starts compiling; the request waits for the result. With a reasoning parser the
        request's matcher lets it think first (``grammar/reasoning.py``): from its first
        token unless ``prompt_token_ids`` closed the thoughts already (a chat template with
        thinking off), at most ``max_reasoning_tokens`` thinking tokens.

        Raises:
            CompileQueueFull: as ``check_room``.
        """
        reasoning = None
        if self.reasoning is not None:
            reasoning = self.reasoning.spec(
                self.reasoning.thinks_first(prompt_token_ids),
                max_reasoning_tokens,
                self.eos_token_ids,
            )
        return StructuredState(spec=spec, handle=self.service.submit(spec), reasoning=reasoning)

    def poll(self, state: StructuredState) -> CompileResult | None:
        """None while compiling; the result once done (a matcher is then ready on success)."""
        if state.matcher is not None:
            return CompileResult(None, state.backend or "")
        assert state.handle is not None
        result = state.handle.result()
        if result is None:
            return None
        state.handle = None
        state.backend = result.backend
        state.fallback_reason = result.fallback_reason
        state.compile_seconds = result.seconds
        if result.grammar is not None:
            try:
                matcher = result.grammar.new_matcher()
                if state.reasoning is not None:
                    matcher = ReasoningMatcher(matcher, state.reasoning, self.vocab_size)
                state.matcher = matcher
                if state.spec.allow_unenforced:
                    strict = dataclasses.replace(state.spec, allow_unenforced=False)
                    reason = self.service.backend(result.backend).unsupported_reason(strict)
                    # The reason without its hint to the caller (who set it already).
                    state.unenforced = reason and reason.split(" (set allow_unenforced")[0]
            except Exception as exc:  # noqa: BLE001 - a backend bug fails this request only
                logger.exception("creating a %s matcher failed", result.backend)
                return dataclasses.replace(
                    result,
                    grammar=None,
                    error=f"matcher creation failed: {type(exc).__name__}: {exc}",
                )
        return result

    # ------------------------------------------------------------------ steps
    def grammar_bitmask(
        self,
        requests: Sequence[Request],
        out: torch.Tensor | None = None,
        drafts: Mapping[str, Sequence[int]] | None = None,
    ) -> tuple[GrammarOutput | None, list[tuple[Request, str]]]:
        """Bitmask rows for the structured requests that sample this step, and the requests
        whose grammar failed to fill its row, each with why.

        With ``drafts`` (speculative decoding), a request with k draft tokens gets 1 + k
        consecutive rows: the mask after its known tokens, then after each draft in turn (its
        matcher is advanced over the drafts between batched fills and rolled back at the end).

        Rows are filled per backend in one batched call each, into ``out``
        (int32 ``[rows, words]``, e.g. the device's shared buffer) when given,
        else into the manager's own buffer. When a batched fill raises, that backend's rows
        are filled one by one instead; a request whose own fill raises gets an all-allowed row
        and is returned as failed (the caller fails it, so its token is dropped).
        """
        if drafts:
            reqs = self._with_matchers(requests)
            return self._draft_bitmask(reqs, out, drafts) if reqs else (None, [])
        return self.finish_bitmask(self.start_bitmask(requests, out))

    def start_bitmask(
        self,
        requests: Sequence[Request],
        out: torch.Tensor | None = None,
        filler: FillThread | None = None,
    ) -> BitmaskInProgress:
        """Starts filling the bitmask rows of the structured requests that sample this step
        (one row each, no drafts); ``finish_bitmask`` completes it.

        With ``filler``, each backend's Python side of the fill runs now and its native
        batched fill runs on the filler's thread, so the caller can do Python work meanwhile
        (the rows are not ready, and the matchers must not change, until
        ``finish_bitmask``). Without it the whole fill happens here.
        """
        reqs = self._with_matchers(requests)
        if not reqs:
            return BitmaskInProgress((), None, None)
        bitmask = (self._bitmask if out is None else out)[: len(reqs)]
        fill = self._start_fill(reqs, range(len(reqs)), bitmask, filler)
        return BitmaskInProgress(tuple(reqs), bitmask, fill)

    def finish_bitmask(
        self, started: BitmaskInProgress
    ) -> tuple[GrammarOutput | None, list[tuple[Request, str]]]:
        """Waits for a fill ``start_bitmask`` began: the step's bitmask rows, and the
        requests whose grammar failed to fill its row, each with why."""
        if started.fill is None or started.bitmask is None:
            return None, []
        failed = self._finish_fill(started.fill, started.bitmask)
        # A view of a preallocated buffer: valid until it is filled again.
        grammar = GrammarOutput(tuple([r.request_id for r in started.requests]), started.bitmask)
        return grammar, failed

    @staticmethod
    def _with_matchers(requests: Sequence[Request]) -> list[Request]:
        return [r for r in requests if r.structured is not None and r.structured.matcher]

    def _start_fill(
        self,
        reqs: Sequence[Request],
        rows: Sequence[int],
        bitmask: torch.Tensor,
        filler: FillThread | None = None,
    ) -> _FillInProgress:
        """Plans the fill of ``bitmask[rows[i]]`` for ``reqs[i]``'s matcher, one batched
        call per backend, and starts the native calls (on ``filler``'s thread, or here)."""
        groups: list[_FillGroup] = []
        calls: list[NativeFill] = []
        for name, group_reqs, matchers, group_rows in _by_backend(reqs, rows):
            error: BaseException | None = None
            try:
                if name == _THINKING:  # every token but the ends, or the end of thoughts
                    for matcher, row in zip(matchers, group_rows, strict=True):
                        assert isinstance(matcher, ReasoningMatcher)
                        fill_thinking_row(matcher, bitmask, row)
                    call = filled_now
                else:
                    call = self.service.backend(name).plan_fill(
                        matchers, bitmask, group_rows, off_thread=filler is not None
                    )
            except Exception as exc:  # noqa: BLE001 - filled row by row in _finish_fill
                error, call = exc, filled_now
            calls.append(call)
            groups.append(_FillGroup(name, group_reqs, matchers, group_rows, error))
        if filler is not None:
            return _FillInProgress(groups, filler.start(calls))
        return _FillInProgress(groups, run_fills(calls))

    def _finish_fill(
        self, fill: _FillInProgress, bitmask: torch.Tensor
    ) -> list[tuple[Request, str]]:
        """Waits for the fill's native calls; a backend whose batched fill raised is filled
        row by row, and a request whose own row fails gets an all-allowed row and is
        returned as failed (the caller fails it, so its token is dropped)."""
        errors = fill.pending.wait()
        failed: list[tuple[Request, str]] = []
        for i, group in enumerate(fill.groups):
            error = group.error or errors.get(i)
            if error is None:
                continue
            logger.error(
                "batched %s bitmask fill failed; filling row by row",
                group.backend,
                exc_info=error,
            )
            for req, matcher, row in zip(group.requests, group.matchers, group.rows, strict=True):
                try:
                    matcher.fill_bitmask(bitmask, row)
                except Exception as exc:  # noqa: BLE001 - the caller fails this request
                    # Not all-zero: a row that allows nothing would break sampling for the batch.
                    bitmask[row].fill_(-1)
                    failed.append(
                        (req, f"grammar bitmask fill failed: {type(exc).__name__}: {exc}")
                    )
        return failed

    def _fill(
        self,
        reqs: Sequence[Request],
        rows: Sequence[int],
        bitmask: torch.Tensor,
    ) -> list[tuple[Request, str]]:
        """Fills ``bitmask[rows[i]]`` for ``reqs[i]``'s matcher, one batched call per backend."""
        return self._finish_fill(self._start_fill(reqs, rows, bitmask), bitmask)

    def _draft_bitmask(
        self,
        reqs: Sequence[Request],
        out: torch.Tensor | None,
        drafts: Mapping[str, Sequence[int]],
    ) -> tuple[GrammarOutput, list[tuple[Request, str]]]:
        counts = [1 + len(drafts.get(r.request_id, ())) for r in reqs]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        total = sum(counts)
        buffer = self._bitmask if out is None else out
        if buffer.shape[0] < total:
            buffer = self._bitmask = allocate_bitmask(total, self.vocab_size)
        bitmask = buffer[:total]
        failed = self._fill(reqs, starts, bitmask)
        advanced = [0] * len(reqs)
        try:
            for j in range(1, max(counts)):
                live, rows = [], []
                for i, req in enumerate(reqs):
                    if counts[i] <= j:
                        continue
                    row = starts[i] + j
                    if advanced[i] == j - 1 and _accepts(
                        req.structured.matcher, drafts[req.request_id][j - 1]
                    ):
                        advanced[i] = j
                        live.append(req)
                        rows.append(row)
                    else:
                        # The draft before is masked out at its own row, so it is never
                        # accepted and nothing from here on is either.
                        bitmask[row].fill_(-1)
                if live:
                    failed += self._fill(live, rows, bitmask)
        finally:
            for req, n in zip(reqs, advanced, strict=True):
                if n:
                    req.structured.matcher.rollback(n)
        broken = {id(r) for r, _ in failed}
        unique = []
        for req, message in failed:
            if id(req) in broken:
                broken.discard(id(req))
                unique.append((req, message))
        grammar = GrammarOutput(tuple(r.request_id for r in reqs), bitmask, tuple(counts))
        return grammar, unique

    @staticmethod
    def advance(reqs: Sequence[Request], tokens: Sequence[int]) -> list[GrammarVerdict]:
        """Advances ``reqs[i]``'s grammar by ``tokens[i]``: a verdict per request. A rejected
        token or a raising matcher is logged and fails only its own request (a rejected
        token leaves the matcher unchanged)."""
        verdicts: list[GrammarVerdict] = []
        for req, token in zip(reqs, tokens, strict=True):
            assert req.structured is not None and req.structured.matcher is not None
            matcher = req.structured.matcher
            try:
                if matcher.accept_tokens((token,)):
                    verdicts.append(_TERMINATED if matcher.is_terminated() else _ACCEPTED)
                    continue
                error = f"grammar rejected sampled token {token}"
                logger.error("request %s: %s", req.request_id, error)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                logger.exception("request %s: advancing its grammar failed", req.request_id)
                error = f"{type(exc).__name__}: {exc}"
            verdicts.append(GrammarVerdict(error=error))
        return verdicts

    def shutdown(self) -> None:
        self.service.shutdown()


def _by_backend(
    reqs: Sequence[Request], rows: Sequence[int]
) -> list[tuple[str, list[Request], list[GrammarMatcher], list[int]]]:
    """``reqs`` (with their rows) grouped by backend: (name, requests, matchers, rows), the
    biggest group first. On the fill thread only the first call is sure to run beside the
    caller's Python (each later one needs the GIL to start)."""
    if len(rows) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(rows)} rows")
    if not reqs:
        return []
    states = [req.structured for req in reqs]
    names = [state.backend for state in states]
    first = names[0]
    if names.count(first) == len(names) and all(state.reasoning is None for state in states):
        # Every request on one backend, the usual case: no per-request grouping (a step
        # fills every structured row, so this runs once per step on the engine thread).
        return [(first, list(reqs), [state.matcher for state in states], list(rows))]
    by_backend: dict[str, tuple[list[Request], list[GrammarMatcher], list[int]]] = {}
    for req, state, row in zip(reqs, states, rows, strict=True):
        name, matcher = state.backend, state.matcher
        if isinstance(matcher, ReasoningMatcher):  # thinking: filled here; else its grammar's
            name, matcher = (_THINKING, matcher) if matcher.thinking else (name, matcher.inner)
        group = by_backend.setdefault(name, ([], [], []))
        group[0].append(req)
        group[1].append(matcher)
        group[2].append(row)
    ordered = sorted(by_backend.items(), key=lambda item: -len(item[1][0]))
    return [(name, *group) for name, group in ordered]


def _accepts(matcher: GrammarMatcher, token: int) -> bool:
    """Advances ``matcher`` by a draft token; False when the grammar rejects it or the matcher
    fails (the draft is then masked out at its own row, so it is never kept)."""
    try:
        return matcher.accept_tokens([token])
    except Exception:  # noqa: BLE001 - a broken matcher costs its request the draft only
        logger.exception("advancing a matcher over a draft token failed")
        return False
