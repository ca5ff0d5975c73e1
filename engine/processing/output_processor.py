"""Turns engine-core outputs into RequestOutputs: detokenisation, stop strings, n > 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from baton.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from baton.engine.processing.detokenizer import IncrementalDetokenizer
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import EngineCoreOutput, Logprobs
from baton.engine.tokenizer import Tokenizer


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    completion: CompletionOutput


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child] = field(default_factory=dict)
    arrival_time: float = 0.0
    structured_backend: str | None = None
    structured_fallback_reason: str | None = None
    structured_unenforced: str | None = None
    # With prompt_logprobs: set from the first output that carries them (each of the ``n``
    # completions computes the same ones).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Only the finished output is wanted (offline generate): no output per step, and text is
    # decoded once at the end unless stop strings must be watched token by token.
    final_only: bool = False


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """Engine-core id of completion ``index`` of a prompt (the parent id itself when n == 1)."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    """Keeps per-request detokenisers and assembles ``RequestOutput`` objects.

    ``process`` returns the outputs of this step and the ids of engine-core
    requests that a stop string finished or that failed here (the caller
    aborts them in the core).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        final_only: bool = False,
    ) -> list[str]:
        """Registers a prompt; returns the engine-core ids of its ``n`` completions.

        With ``final_only`` ``process`` returns the prompt's output once, finished, and a
        completion without stop strings is detokenised once when it finishes instead of at
        every step (the text is the same: the detokeniser is incremental over the same
        tokens).
        """
        now = time.monotonic()
        parent = _Parent(
            request_id, prompt, prompt_token_ids, params, arrival_time=now, final_only=final_only
        )
        ids = []
        for i in range(params.n):
            cid = child_request_id(request_id, i, params.n)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            completion = CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                cumulative_logprob=None if params.logprobs is None else 0.0,
                logprobs=None if params.logprobs is None else [],
            )
            parent.children[cid] = _Child(i, detok, RequestMetrics(now), completion)
            self._child_to_parent[cid] = request_id
            ids.append(cid)
        self._parents[request_id] = parent
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def remove(self, request_id: str) -> None:
        """Forgets a prompt (all its completions)."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for cid in parent.children:
                self._child_to_parent.pop(cid, None)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [] if parent is None else list(parent.children)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        # Prompts one of whose completions finished in this step: only they can be finished
        # (a prompt whose completions had all finished before was removed then).
        ended: set[str] = set()
        to_abort: list[str] = []
        child_to_parent, parents = self._child_to_parent, self._parents
        for out in outputs:
            pid = child_to_parent.get(out.request_id)
            if pid is None:
                continue
            parent = parents[pid]
            child = parent.children[out.request_id]
            if child.completion.finished:
                continue
            if out.structured_backend is not None:
                parent.structured_backend = out.structured_backend
                parent.structured_fallback_reason = out.structured_fallback_reason
                parent.structured_unenforced = out.structured_unenforced
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None, *self._entries(out.prompt_logprobs)]
            try:
                if self._apply(child, out, now, parent.final_only and not parent.params.stop):
                    to_abort.append(out.request_id)
                    ended.add(pid)
            except Exception as exc:  # noqa: BLE001 - fail this completion, not the engine
                child.completion.finish_reason = "error"
                child.completion.error = f"{type(exc).__name__}: {exc}"
                to_abort.append(out.request_id)
                ended.add(pid)
            if out.finish_reason is not None:
                ended.add(pid)
            touched[pid] = parent
        results = []
        for pid, parent in touched.items():
            finished = pid in ended and all(c.completion.finished for c in parent.children.values())
            if parent.final_only and not finished:
                continue
            results.append(self._make_output(parent, finished))
            if finished:
                self.remove(pid)
        return results, to_abort

    def _apply(self, child: _Child, out: EngineCoreOutput, now: float, lazy_text: bool) -> bool:
        """Adds a core output to a completion; True when a stop string finished it. With
        ``lazy_text`` (no stop strings, final output only) its tokens are detokenised when the
        completion finishes."""
        comp, m = child.completion, child.metrics
        tokens = out.new_token_ids
        if tokens:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += len(tokens)
        m.num_cached_tokens = out.num_cached_tokens
        # A final EOS / stop token is counted but its text is never shown.
        stop_terminated = out.finish_reason == "stop" and (
            out.stop_reason is None or isinstance(out.stop_reason, int)
        )
        stop_str = None
        if not lazy_text:
            stop_str = child.detok.update(tokens, stop_terminated=bool(tokens) and stop_terminated)
        elif out.finish_reason is not None:
            pending = [*comp.token_ids, *tokens]
            child.detok.update(pending, stop_terminated=bool(pending) and stop_terminated)
        comp.token_ids.extend(tokens)
        if out.logprobs is not None and comp.logprobs is not None:
            comp.logprobs.extend(self._entries(out.logprobs))
            for vals in out.logprobs.logprobs:
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + vals[0]
        comp.text = child.detok.output_text
        if stop_str is not None:
            comp.finish_reason = "stop"
            comp.stop_reason = stop_str
            m.finished_time = now
            return True
        if out.finish_reason is not None:
            comp.finish_reason = out.finish_reason
            comp.stop_reason = out.stop_reason
            comp.error = out.error
            comp.error_kind = out.error_kind
            m.finished_time = now
        return False

    def _entries(self, logprobs: Logprobs) -> list[dict[int, Logprob]]:
        """One ``{token id: Logprob}`` per position: its token (with its rank), then the
        top-k (rank j for the j-th) where not the token itself."""
        texts: dict[int, str] = {}  # a prompt's rows share many ids
        entries = []
        for ids, vals, rank in zip(
            logprobs.token_ids, logprobs.logprobs, logprobs.ranks, strict=True
        ):
            entry = {}
            for j, (tid, val) in enumerate(zip(ids, vals, strict=True)):
                if tid in entry:
                    continue
                text = texts.get(tid)
                if text is None:
                    text = texts[tid] = self.tokenizer.decode([tid], False)
                entry[tid] = Logprob(val, rank if j == 0 else j, text)
            entries.append(entry)
        return entries

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        children = sorted(parent.children.values(), key=lambda c: c.index)
        first = children[0].metrics
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=c.completion.index,
                    text=c.completion.text,
                    token_ids=list(c.completion.token_ids),
                    cumulative_logprob=c.completion.cumulative_logprob,
                    logprobs=None if c.completion.logprobs is None else list(c.completion.logprobs),
                    finish_reason=c.completion.finish_reason,
                    stop_reason=c.completion.stop_reason,
                    error=c.completion.error,
                    error_kind=c.completion.error_kind,
                )
                for c in children
            ],
            finished=finished,
            metrics=first if len(children) == 1 else _merge_metrics([c.metrics for c in children]),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
            structured_output_backend=parent.structured_backend,
            structured_output_fallback_reason=parent.structured_fallback_reason,
            structured_output_unenforced=parent.structured_unenforced,
        )


def _merge_metrics(ms: list[RequestMetrics]) -> RequestMetrics:
    firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
    lasts = [m.last_token_time for m in ms if m.last_token_time is not None]
    ends = [m.finished_time for m in ms]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms),
        first_token_time=min(firsts) if firsts else None,
        last_token_time=max(lasts) if lasts else None,
        # The request ends with its last completion (e2e latency).
        finished_time=None if None in ends else max(e for e in ends if e is not None),
        num_generation_tokens=max(m.num_generation_tokens for m in ms),
        num_cached_tokens=ms[0].num_cached_tokens,
    )
