"""The engine's side of structured outputs: per-request grammars and step bitmasks.

``grammar/`` knows nothing of requests; this manager ties its compile service
and matchers to requests, checks specs at submission, advances each request's
grammar by its sampled tokens and holds the bitmask buffer that a step's fill
(``bitmask_fill.py``) writes when the device has none of its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

from baton.engine.core.request import Request, StructuredState
from baton.grammar.backend import BackendRecipe, allocate_bitmask
from baton.grammar.compile.service import CompilePoolConfig, CompileResult, CompileService
from baton.grammar.reasoning import ReasoningMatcher, ReasoningTokens
from baton.grammar.spec import StructuredOutputsParams, allowed_backends
from baton.grammar.validation import DEFAULT_MAX_DEPTH, check_enforceable, validate_spec

logger = logging.getLogger(__name__)

_VALIDATED_CACHE_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class GrammarVerdict:
    """What a request's grammar made of its sampled token: accepted (``terminated``: the
    grammar ended with it), or rejected / broken (``error`` says why; the request fails)."""

    terminated: bool = False
    error: str | None = None


_ACCEPTED = GrammarVerdict()
_TERMINATED = GrammarVerdict(terminated=True)


# Buffers whose row views bitmask_rows keeps (its own and the executor's slots: a few).
_MAX_VIEWED_BUFFERS = 8


class StructuredOutputManager:
    """Validates specs, compiles them off-thread and advances grammars for the engine.

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
                "baton.grammar.xgrammar.backend:XGrammarBackend",
                (("max_threads", fill_threads), ("dynamic_compilation", dynamic_compilation)),
                # One thread per compile: its CPU time is then its running time (what the
                # limit bounds), and the workers compile side by side.
                worker_options=(("max_threads", 1),),
            ),
            "outlines": BackendRecipe("outlines", "baton.grammar.outlines.backend:OutlinesBackend"),
            "guidance": BackendRecipe(
                "guidance",
                "baton.grammar.guidance.backend:GuidanceBackend",
                (("fill_threads", fill_threads),),
                worker_options=(("fill_threads", 1),),
            ),
        }
        self.service = CompileService(
            recipes, tokenizer, vocab_size, compile_timeout_s, cache_size, compile_pool, cache_bytes
        )
        self._bitmask = allocate_bitmask(max_rows, vocab_size)
        # Row views by row count, per buffer asked for (the own one, or each of the executor's
        # slots), keyed by id with the buffer held so that an id is never reused.
        self._views: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
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
        thinking off), at most ``max_reasoning_tokens`` thinking tokens; a spec that
        ``writes_reasoning`` holds from the first token (its own budget bounds the thoughts).

        Raises:
            CompileQueueFull: as ``check_room``.
        """
        reasoning = None
        if self.reasoning is not None and not spec.writes_reasoning:
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
    def bitmask_rows(self, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``n`` rows of ``out`` (int32 ``[rows, words]``, e.g. the device's shared
        buffer), or of the manager's own buffer, which grows to ``n`` rows when the one
        chosen is smaller (a step's fill is ``bitmask_fill.BitmaskFill``)."""
        buffer = self._bitmask if out is None else out
        held = self._views.get(id(buffer))
        if held is None or held[0] is not buffer:
            if len(self._views) >= _MAX_VIEWED_BUFFERS:  # a caller that passes new buffers
                self._views.clear()
            held = self._views[id(buffer)] = (buffer, {})
        view = held[1].get(n)
        if view is None:
            if buffer.shape[0] < n:  # the own buffer grows, and serves a too small ``out`` too
                self._views.pop(id(self._bitmask), None)
                self._bitmask = allocate_bitmask(n, self.vocab_size)
                return self.bitmask_rows(n)
            # Kept: a step slices the same buffer to one of few sizes, and slicing a tensor is
            # a torch call (tens of µs on a busy engine thread); the backends also check a
            # view once, not once a step (they know it by identity).
            view = held[1][n] = buffer[:n]
        return view

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
