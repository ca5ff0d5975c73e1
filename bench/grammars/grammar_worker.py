"""The child-process side of ``baton bench grammar``: compile one schema, walk its tests.

A worker process builds its backends once, then serves tasks (one schema on one backend) sent
over a pipe, answering with one message per step so that the parent can time out each step
and survive a crash, hang or out-of-memory of a backend:

    parent -> child: ``Task`` or None (stop)
    child -> parent: ("ready",) once at start, or ("fatal", text) when the backends cannot be
                     built; per task ("compiled", CompileOutcome as dict), then per test
                     ("instance", InstanceOutcome as dict), then ("done",)

Nothing here imports the engine: the tokenizer arrives pickled.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import resource
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np
import torch

from baton.bench.common import require_positive_ints
from baton.bench.grammars.mask_families import in_schema_order
from baton.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError, allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.validation import validate_spec
from baton.grammar.vocab import VocabSource

BackendFactory = Callable[[VocabSource, int], GrammarBackend]
"""Builds a backend from (tokenizer, vocab_size); must be picklable (a module-level callable)."""

Whitespace = Literal["compact", "any"]
ErrorKind = Literal["invalid", "unsupported", "compile", "oom"]


def xgrammar_factory(tokenizer: VocabSource, vocab_size: int) -> GrammarBackend:
    """baton's xgrammar backend with the engine's defaults."""
    from baton.grammar.xgrammar.backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size)


def outlines_factory(tokenizer: VocabSource, vocab_size: int) -> GrammarBackend:
    """baton's outlines-core backend with the engine's defaults."""
    from baton.grammar.outlines.backend import OutlinesBackend

    return OutlinesBackend(tokenizer, vocab_size)


def guidance_factory(tokenizer: VocabSource, vocab_size: int) -> GrammarBackend:
    """baton's llguidance backend with the engine's defaults."""
    from baton.grammar.guidance.backend import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size)


@dataclass(frozen=True)
class TestInstance:
    """One instance of a schema's tests: is ``data`` valid under the schema?"""

    description: str
    valid: bool
    data: Any


@dataclass(frozen=True)
class SchemaCase:
    """A schema and its test instances (none for a bare schema file).

    Attributes:
        id: names the case in the results (the file's path relative to its data root).
        schema: the JSON schema (an object or a boolean).
        tests: the test instances.
    """

    id: str
    schema: Any
    tests: tuple[TestInstance, ...] = ()


@dataclass(frozen=True)
class Task:
    """One schema on one backend."""

    case: SchemaCase
    backend: str


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs; pickled into it at start.

    Attributes:
        tokenizer: the model's tokenizer (baton ``Tokenizer``).
        vocab_size: the model's vocabulary size (the bitmask width is ceil(vocab_size / 32)).
        factories: backend name -> factory; the worker builds every one before it is ready.
        whitespace: the spec's whitespace mode; instances are serialised to match it.
        max_memory_bytes: address-space limit of the worker (None: none), so that a runaway
            compile fails inside the worker instead of starving the machine.
        rows: matchers walked side by side; each state's bitmask is filled for all of them
            with the backend's batched ``fill_bitmasks`` (as the engine fills a batch) and
            timed per row.
        allow_unenforced: compile specs with ``allow_unenforced`` (a backend then takes a
            schema with keywords it ignores, as a request that opts in would have it).
        fill_repeats: fills timed per state, the fastest kept (a fill is idempotent): on a
            loaded host one fill in a hundred is preempted, which would read as a slow state.
    """

    tokenizer: VocabSource
    vocab_size: int
    factories: Mapping[str, BackendFactory]
    whitespace: Whitespace = "compact"
    max_memory_bytes: int | None = None
    rows: int = 1
    allow_unenforced: bool = False
    fill_repeats: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {self.vocab_size!r}")
        if not self.factories:
            raise ValueError("at least one backend factory is needed")
        if self.whitespace not in ("compact", "any"):
            raise ValueError(f"whitespace must be 'compact' or 'any', got {self.whitespace!r}")
        if self.max_memory_bytes is not None and self.max_memory_bytes <= 0:
            raise ValueError(f"max_memory_bytes must be positive, got {self.max_memory_bytes}")
        require_positive_ints(self, "rows", "fill_repeats")


@dataclass(frozen=True)
class CompileOutcome:
    """How compiling one schema went.

    Attributes:
        ok: compiled.
        error_kind: "invalid" (rejected at submission by ``validate_spec``), "unsupported"
            (the backend's ``unsupported_reason``), "compile" (the compile raised) or "oom"
            (MemoryError); None when ok.
        error: the message, None when ok.
        compile_s: seconds of ``unsupported_reason`` plus ``compile`` (None when the spec was
            rejected before).
    """

    ok: bool
    error_kind: ErrorKind | None = None
    error: str | None = None
    compile_s: float | None = None


@dataclass(frozen=True)
class InstanceOutcome:
    """How one test instance walked through the matcher.

    Attributes:
        description: the test's description.
        valid: what the test says.
        accepted: every token (and then EOS) was accepted and the matcher terminated.
        tokens: tokens walked, EOS included (fewer than the instance's when rejected early).
        mask_us: microseconds of each bitmask fill per row, one per token walked.
        mismatches: tokens where the bitmask and ``accept_tokens`` disagreed.
        rejected_at: index of the first rejected token (the EOS is the last), None if none.
        error: an exception the backend raised while walking (the instance then counts as not
            accepted), None if none.
    """

    description: str
    valid: bool
    accepted: bool
    tokens: int
    mask_us: tuple[float, ...]
    mismatches: int = 0
    rejected_at: int | None = None
    error: str | None = None


def serialize_instance(data: Any, whitespace: Whitespace) -> str:
    """The instance as the grammar expects it: compact JSON for "compact" whitespace (baton's
    default: no whitespace between tokens), ``json.dumps``' default spacing for "any"."""
    separators = (",", ":") if whitespace == "compact" else (", ", ": ")
    return json.dumps(data, separators=separators, ensure_ascii=False)


def integral_floats_as_ints(data: Any) -> Any:
    """``data`` with every float that holds an integer (``1.0``, ``-2.0``) as that int.

    JSON Schema compares numbers by value: ``1.0`` is the integer 1 for ``type``, ``const``,
    ``enum`` and ``multipleOf``, so the instance stays as valid or invalid as it was. The
    grammars write such a value as ``1`` (``const: 0`` is the text ``0``, an integer has no
    fraction), so the instance is fed as the grammar would write the same value, as its
    properties are fed in schema order. (Drafts 3 and 4 did not count ``1.0`` as an integer:
    ``fed_as_written`` leaves instances of such schemas alone.)
    """
    if isinstance(data, float) and data.is_integer():
        return int(data)
    if isinstance(data, dict):
        return {k: integral_floats_as_ints(v) for k, v in data.items()}
    if isinstance(data, list):
        return [integral_floats_as_ints(v) for v in data]
    return data


def fed_as_written(schema: Any, data: Any) -> Any:
    """The test instance ``data`` as a grammar of ``schema`` writes the same value: properties
    in schema order (``in_schema_order``), integral numbers without a fraction
    (``integral_floats_as_ints``, from draft 6 on)."""
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if not (isinstance(declared, str) and ("draft-03" in declared or "draft-04" in declared)):
        data = integral_floats_as_ints(data)
    return in_schema_order(schema, data)


def compile_case(
    backend: GrammarBackend, schema: Any, whitespace: Whitespace, allow_unenforced: bool = False
) -> tuple[CompiledGrammar | None, CompileOutcome]:
    """Checks and compiles ``schema`` as the engine would for a request pinned to ``backend``
    (with ``allow_unenforced`` as given).

    The spec goes through ``validate_spec`` (submission checks), then the backend's
    ``unsupported_reason`` and ``compile``; both of the latter are timed. Never raises for a
    schema the backend cannot take: that is an outcome.
    """
    try:
        spec = StructuredOutputsParams(
            json=schema, whitespace=whitespace, allow_unenforced=allow_unenforced
        )
        validate_spec(spec)
    except ValueError as exc:
        return None, CompileOutcome(False, "invalid", str(exc))
    t0 = time.perf_counter()
    try:
        reason = backend.unsupported_reason(spec)
        if reason is not None:
            return None, CompileOutcome(False, "unsupported", reason, time.perf_counter() - t0)
        compiled = backend.compile(spec)
    except MemoryError:
        return None, CompileOutcome(False, "oom", "out of memory", time.perf_counter() - t0)
    except GrammarError as exc:
        return None, CompileOutcome(False, "compile", str(exc), time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - a backend bug fails this schema only
        message = f"{type(exc).__name__}: {exc}"
        return None, CompileOutcome(False, "compile", message, time.perf_counter() - t0)
    return compiled, CompileOutcome(True, compile_s=time.perf_counter() - t0)


def walk_tokens(
    compiled: CompiledGrammar,
    tokens: Sequence[int],
    eos: int,
    bitmask: torch.Tensor,
    backend: GrammarBackend | None = None,
    rows: int = 1,
    repeats: int = 1,
) -> tuple[bool, list[float], int, int | None]:
    """Walks ``tokens`` and then ``eos`` through fresh matchers, filling the bitmask before
    each token (timed) and checking that row 0 agrees with ``accept_tokens``.

    With ``rows`` > 1, that many matchers advance together and ``backend.fill_bitmasks``
    fills rows ``0..rows-1`` at once; the time is divided by ``rows``. With one row, the
    matcher's own ``fill_bitmask`` fills row 0. Each state is filled ``repeats`` times and the
    fastest fill is kept.

    Returns (accepted, mask microseconds per row per token walked, mask/accept disagreements,
    index of the first rejected token or None). Exceptions of the backend propagate.

    Raises:
        ValueError: ``rows`` > 1 without a backend, or more rows than ``bitmask`` has.
    """
    if rows > 1 and backend is None:
        raise ValueError("filling several rows needs the backend")
    if rows > bitmask.shape[0]:
        raise ValueError(f"{rows} rows but the bitmask has {bitmask.shape[0]}")
    matchers = [compiled.new_matcher() for _ in range(rows)]
    row_ids = list(range(rows))
    words = bitmask[0].numpy().view(np.uint32)
    limit = 32 * words.size
    times: list[float] = []
    mismatches = 0
    clock = time.perf_counter_ns
    for index, token in enumerate([*tokens, eos]):
        best = None
        for _ in range(repeats):
            t0 = clock()
            if backend is None or rows == 1:
                matchers[0].fill_bitmask(bitmask, 0)
            else:
                backend.fill_bitmasks(matchers, bitmask, row_ids)
            elapsed = clock() - t0
            best = elapsed if best is None else min(best, elapsed)
        assert best is not None
        times.append(best / 1000.0 / rows)
        allowed = token < limit and bool((int(words[token >> 5]) >> (token & 31)) & 1)
        accepted = matchers[0].accept_tokens([token])
        for matcher in matchers[1:]:
            matcher.accept_tokens([token])
        mismatches += accepted != allowed
        if not accepted:
            return False, times, mismatches, index
    return matchers[0].is_terminated(), times, mismatches, None


def run_instance(
    compiled: CompiledGrammar,
    test: TestInstance,
    tokenizer: VocabSource,
    whitespace: Whitespace,
    bitmask: torch.Tensor,
    backend: GrammarBackend | None = None,
    rows: int = 1,
    repeats: int = 1,
) -> InstanceOutcome:
    """Serialises, tokenises and walks one test instance (``rows`` matchers side by side, each
    state's fill timed best of ``repeats``; see ``walk_tokens``); a backend exception is
    recorded."""
    text = serialize_instance(test.data, whitespace)
    tokens = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    eos = tokenizer.eos_token_ids[0]
    try:
        accepted, times, mismatches, rejected_at = walk_tokens(
            compiled, tokens, eos, bitmask, backend, rows, repeats
        )
    except Exception as exc:  # noqa: BLE001 - a backend bug fails this instance only
        return InstanceOutcome(
            test.description, test.valid, False, 0, (), error=f"{type(exc).__name__}: {exc}"
        )
    return InstanceOutcome(
        test.description, test.valid, accepted, len(times), tuple(times), mismatches, rejected_at
    )


def _limit_memory(max_bytes: int | None) -> None:
    if max_bytes is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        max_bytes = min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (max_bytes, hard))


def _plain_crashes() -> None:
    """Makes a segfault end the worker at once, with Python's traceback on stderr.

    xgrammar's tvm_ffi installs a SIGSEGV handler that symbolises a native backtrace first,
    which can take longer than the time-out (a crash would then read as a hang).
    """
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    faulthandler.enable()


def worker_main(conn: Connection, config: WorkerConfig) -> None:
    """Entry point of a worker process: builds the backends, then serves tasks until it
    receives None or the pipe closes. Sends ("fatal", traceback) and returns when a backend
    cannot be built."""
    try:
        backends = {
            name: factory(config.tokenizer, config.vocab_size)
            for name, factory in config.factories.items()
        }
        bitmask = allocate_bitmask(config.rows, config.vocab_size)
        # After the backends: their vocabularies are built once and are not what is measured.
        _limit_memory(config.max_memory_bytes)
    except Exception:  # noqa: BLE001 - reported to the parent, which stops the run
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        _plain_crashes()  # again: a backend may import tvm_ffi lazily
        backend = backends[task.backend]
        compiled, outcome = compile_case(
            backend, task.case.schema, config.whitespace, config.allow_unenforced
        )
        conn.send(("compiled", asdict(outcome)))
        if compiled is not None:
            for test in task.case.tests:
                # Every backend writes an object's declared properties in the schema's order
                # (a documented departure from JSON Schema, where objects are unordered): the
                # instance is serialised as the grammar would write the same value, integral
                # numbers without a fraction included.
                data = fed_as_written(task.case.schema, test.data)
                ordered = dataclasses.replace(test, data=data)
                result = run_instance(
                    compiled,
                    ordered,
                    config.tokenizer,
                    config.whitespace,
                    bitmask,
                    backend,
                    config.rows,
                    config.fill_repeats,
                )
                conn.send(("instance", asdict(result)))
        conn.send(("done",))
