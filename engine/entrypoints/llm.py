"""``LLM``: the offline Python API (vLLM-compatible for the common subset)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import engine_config
from baton.engine.errors import EngineBusyError
from baton.engine.loader import Checkpoint
from baton.engine.outputs import RequestOutput
from baton.engine.processing.llm_engine import LLMEngine, prompt_from_dict
from baton.engine.sampling_params import SamplingParams, as_params_list
from baton.engine.tokenizer import Tokenizer

Prompt = str | Sequence[int] | Mapping[str, Any]
Message = dict[str, Any]

_BUSY_WAIT_S = 0.01


class LLM:
    """Generates completions for batches of prompts with one engine.

    Args:
        model: a GGUF file or Hugging Face folder; None = the default model.
        dtype: "auto" (default: bfloat16 where the CPU has AMX or AVX512-BF16 or on CUDA,
            float32 elsewhere), "float32" (matches transformers), "float16", "bfloat16"
            or a torch dtype. ``stats()`` says which one was picked and why.
        **engine_args: any other ``EngineConfig`` field (max_num_seqs,
            max_num_batched_tokens, max_model_len, num_kv_blocks,
            async_scheduling, executor, quantization, ...).

    Raises:
        ModelLoadError: the model cannot be read. ValueError: a bad engine argument (a
            removed one, such as ``int8_small_batches``, names its replacement).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        checkpoint: Checkpoint | None = None,
        **engine_args: Any,
    ) -> None:
        self._start(engine_config(model, dtype=dtype, **engine_args), checkpoint)

    def _start(self, config: EngineConfig, checkpoint: Checkpoint | None) -> None:
        self.config = config
        self.engine = LLMEngine(config, checkpoint)
        # Offline use has no idle time to defer to: the GGUF weights move onto huge pages now
        # (worker/weight_pages.py; a server moves them while idle, after it is ready).
        while self.engine.idle_work():
            pass
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, checkpoint: Checkpoint | None = None) -> LLM:
        """An LLM over an engine built from ``config`` (see ``entrypoints.args``)."""
        llm = cls.__new__(cls)
        llm._start(config, checkpoint)
        return llm

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, **engine_args: Any) -> LLM:
        """An LLM over an already loaded checkpoint (loads nothing from disk)."""
        return cls(str(checkpoint.path), checkpoint=checkpoint, **engine_args)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of ``generate(..., sampling_params=None)``: baton's defaults
        with the model's own (its ``generation_config.json``, or a GGUF's
        ``general.sampling.*`` keys) on top."""
        return self.engine.default_sampling_params()

    def stats(self) -> dict[str, float | int | str]:
        """Engine statistics since start: ``steps``, ``deferred_steps``,
        ``device_busy_fraction``, and seconds spent in ``schedule_s``,
        ``bitmask_s``, ``device_wait_s``, ``update_s`` (plus ``engine_s``,
        ``device_s``); how the model computes: ``dtype``, ``dtype_reason``,
        ``quantization`` (see ``LLMEngine.stats``); and the grammar compiles: queue
        length, running compiles, worker processes, compiles, errors, time-outs, worker
        kills, cache hits and the compile-time histogram (``grammar_*`` keys;
        ``CompileService.stats`` lists them)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stops the model worker process and the grammar compile workers (also done at exit)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completes every prompt; returns one finished RequestOutput per prompt, in order.

        Prompts are strings, lists of token ids, or vLLM's dicts (``{"prompt": text}``,
        ``{"prompt_token_ids": ids}``). ``sampling_params=None`` means
        ``get_default_sampling_params()`` (the model's generation config). All prompts are
        validated before any is queued, so a bad one raises ``ValueError`` and nothing runs.
        When the grammar compile queue is full, the next prompts wait (the engine runs
        meanwhile) until compiles have made room, instead of failing.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = as_params_list(sampling_params, len(prompt_list))
        for p, sp in zip(prompt_list, params, strict=True):  # validate all before queuing any
            self.engine.tokenize_prompt(p)
            self.engine.validate_params(sp)
        work = [
            (f"llm-{next(self._ids)}", prompt, sp)
            for prompt, sp in zip(prompt_list, params, strict=True)
        ]
        return self._run(work, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Renders one conversation (a list of messages) or a batch of them with the
        model's chat template, then generates. With ``continue_final_message`` (and
        ``add_generation_prompt=False``, as in vLLM) the output continues the last message,
        such as an assistant answer already begun.

        Raises:
            ValueError: no messages, both ``continue_final_message`` and
                ``add_generation_prompt``, or a template that cannot render the chat.
        """
        if not messages:
            raise ValueError("messages must not be empty")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            ids = self.engine.tokenizer.apply_chat_template(
                list(conv),
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            prompts.append(list(ids))
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self, work: list[tuple[str, Prompt, SamplingParams]], use_tqdm: bool
    ) -> list[RequestOutput]:
        ids = [rid for rid, _, _ in work]
        pending = deque(work)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending or self.engine.has_unfinished_requests():
                self._add_while_room(pending)
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            final[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
                elif pending:
                    # The queue is full of compiles whose requests are gone: they end by
                    # themselves, at their time limit at the latest.
                    time.sleep(_BUSY_WAIT_S)
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[r] for r in ids]

    def _add_while_room(self, pending: deque[tuple[str, Prompt, SamplingParams]]) -> None:
        """Queues prompts in order until one would overfill the grammar compile queue."""
        while pending:
            rid, prompt, sp = pending[0]
            if not self.engine.has_compile_room(sp):
                return
            try:
                self.engine.add_request(rid, prompt, sp, final_only=True)
            except EngineBusyError:
                return
            pending.popleft()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    """Text or token ids per prompt; dict prompts become what they hold."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single token-id prompt
    for p in prompts:
        if not isinstance(p, (str, list, tuple, Mapping)):
            raise ValueError(
                "each prompt must be a string, a list of token ids or a dict with 'prompt' or "
                f"'prompt_token_ids', got {type(p).__name__}"
            )
    return [prompt_from_dict(p) if isinstance(p, Mapping) else p for p in prompts]
