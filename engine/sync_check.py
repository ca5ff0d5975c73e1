"""Debug mode that reports every place the engine thread waits for device work.

baton's overlap rests on one rule: the engine thread plans step N+1 while the device runs step N,
so it may wait for device results in exactly one place, ``AsyncOutput.get_output()``. A stray
``.item()``, ``.tolist()`` or device-to-host copy anywhere else silently turns the overlap into
lock-step execution, and nothing fails; the step just gets slower. ``SyncChecker`` makes such
waits visible: ``BATON_SYNC_CHECK=warn`` logs and warns at each one, naming the first frame outside
torch, and ``BATON_SYNC_CHECK=error`` raises ``SyncCheckError`` there instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "SYNC_CHECK_ENV",
    "SYNC_CHECK_MODES",
    "SyncCheckError",
    "SyncCheckWarning",
    "SyncChecker",
    "sync_check_mode_from_env",
]

SYNC_CHECK_ENV = "BATON_SYNC_CHECK"
SYNC_CHECK_MODES: tuple[str, ...] = ("off", "warn", "error")

logger = logging.getLogger("baton.engine.sync_check")

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_NULL_CONTEXT: AbstractContextManager[None] = contextlib.nullcontext()


class SyncCheckError(RuntimeError):
    """The engine thread waited for device work outside ``AsyncOutput.get_output()``."""


class SyncCheckWarning(RuntimeWarning):
    """Warning issued in ``warn`` mode for a wait outside ``AsyncOutput.get_output()``."""


def _parse_mode(value: str, source: str) -> str:
    """``value`` stripped and lower-cased, "" meaning "off"; ValueError naming ``source`` if the
    result is not one of ``SYNC_CHECK_MODES``."""
    if not isinstance(value, str):
        raise ValueError(f"{source} must be a string, one of {SYNC_CHECK_MODES}; got {value!r}")
    mode = value.strip().lower() or "off"
    if mode not in SYNC_CHECK_MODES:
        allowed = ", ".join(repr(m) for m in SYNC_CHECK_MODES)
        raise ValueError(f"{source}={value!r} is not a sync-check mode; expected one of {allowed}")
    return mode


def sync_check_mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The sync-check mode ("off", "warn" or "error") set by ``BATON_SYNC_CHECK`` in ``environ``
    (default ``os.environ``); unset or empty means "off". Case and surrounding whitespace are
    ignored. Raises ValueError naming the variable, the bad value and the allowed ones."""
    env = os.environ if environ is None else environ
    return _parse_mode(env.get(SYNC_CHECK_ENV, ""), SYNC_CHECK_ENV)


def _overloads(*names: str) -> frozenset[Any]:
    """Every overload of the named ``aten`` ops that this torch build has."""
    found: set[Any] = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            found.add(getattr(packet, overload))
    return frozenset(found)


# ATen ops whose output (value or shape) needs the input's data on the host: on CUDA each one is a
# stream synchronisation, on the CPU worker a read of memory the worker may still be writing.
_READ_OPS: dict[Any, str] = {}
for _names, _what in (
    # Under torch.inference_mode ``item`` reaches the mode undecomposed (measured with torch 2.13).
    (("_local_scalar_dense", "item"), "Tensor.item() / bool() / int() / float() / __index__"),
    (("is_nonzero",), "bool(tensor)"),
    (("nonzero", "nonzero_numpy", "argwhere"), "torch.nonzero (data-dependent shape)"),
    (("equal",), "torch.equal (returns a Python bool)"),
    (("allclose",), "torch.allclose (returns a Python bool)"),
    (("masked_select",), "masked_select (data-dependent shape)"),
    (
        ("_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"),
        "torch.unique (data-dependent shape)",
    ),
    (("bincount",), "torch.bincount (output size depends on the data)"),
):
    for _op in _overloads(*_names):
        _READ_OPS[_op] = _what
_REPEAT_INTERLEAVE_OPS = _overloads("repeat_interleave")
_INDEX_OPS = _overloads("index", "index_put", "index_put_", "_index_put_impl_")
_TO_COPY_OPS = _overloads("_to_copy")
_COPY_OPS = _overloads("copy_")

# Python-level reads that never reach the dispatcher (checked experimentally: ``tolist`` and
# ``numpy`` read the storage directly, printing runs with dispatch modes disabled).
_FUNCTION_READS: dict[Any, str] = {
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "numpy.asarray(tensor) / Tensor.__array__",
    # str(tensor) lands here too: Tensor has no __str__ of its own.
    torch.Tensor.__repr__: "repr() / str() of a tensor",
    torch.Tensor.__format__: "format(tensor) / f-string of a tensor",
}


def _is_host(device: torch.device) -> bool:
    return device.type == "cpu"


def _has_mask_index(indices: Any) -> bool:
    """Whether an ``aten.index*`` indices list holds a boolean mask (it becomes ``nonzero``)."""
    if not isinstance(indices, (list, tuple)):
        return False
    return any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in indices
    )


def _dispatch_read(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """What ``func(*args, **kwargs)`` reads from tensor data on the host, or None if nothing."""
    what = _READ_OPS.get(func)
    if what is not None:
        return what
    if func in _INDEX_OPS:
        if len(args) > 1 and _has_mask_index(args[1]):
            return "boolean-mask indexing (data-dependent shape)"
        return None
    if func in _REPEAT_INTERLEAVE_OPS:
        if kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
        return None
    if func in _TO_COPY_OPS:
        source = args[0] if args else None
        target = kwargs.get("device")
        if (
            isinstance(source, torch.Tensor)
            and not _is_host(source.device)
            and target is not None
            and _is_host(torch.device(target))
            and not kwargs.get("non_blocking", False)
        ):
            return f"blocking {source.device.type}->cpu copy (.cpu() / .to('cpu'))"
        return None
    if func in _COPY_OPS and len(args) > 1:
        dst, src = args[0], args[1]
        if (
            isinstance(dst, torch.Tensor)
            and isinstance(src, torch.Tensor)
            and _is_host(dst.device)
            and not _is_host(src.device)
        ):
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            # Only a non-blocking copy into pinned memory leaves the host free to go on.
            if not (non_blocking and dst.is_pinned()):
                return f"blocking {src.device.type}->cpu copy_ into host memory"
        return None
    return None


def _caller_frame() -> FrameType | None:
    """The innermost frame outside torch and this module (for the warning's location)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename != _THIS_FILE and not filename.startswith(_TORCH_DIR):
            return frame
        frame = frame.f_back
    return None


class _ThreadState(threading.local):
    """Per-thread nesting counters: the modes live on one thread's stacks, so must the state."""

    def __init__(self) -> None:
        self.guard_depth = 0
        self.allow_depth = 0
        # >0 while a reported op runs, so its inner ops are not reported a second time.
        self.quiet_depth = 0


class _ReadDispatchMode(TorchDispatchMode):
    """Reports ATen ops that read tensor data on the host."""

    def __init__(self, checker: SyncChecker) -> None:
        super().__init__()
        self._checker = checker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self._checker._reporting():
            what = _dispatch_read(func, args, kwargs)
            if what is not None:
                return self._checker._run_reported(f"{func} [{what}]", func, args, kwargs)
        return func(*args, **kwargs)


class _ReadFunctionMode(TorchFunctionMode):
    """Reports Python-level tensor reads that bypass the dispatcher."""

    def __init__(self, checker: SyncChecker) -> None:
        super().__init__()
        self._checker = checker

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        what = _FUNCTION_READS.get(func)
        if what is not None and self._checker._reporting():
            return self._checker._run_reported(what, func, args, kwargs)
        return func(*args, **kwargs)


class SyncChecker:
    """Reports waits for device work on the engine thread outside the one legal place.

    ``mode`` is "off", "warn" or "error" (case-insensitive; see ``sync_check_mode_from_env``).
    Wrap each engine step in ``guard()`` and the legal wait (``AsyncOutput.get_output()``) in
    ``allow()``. In "warn" mode a report logs a WARNING on ``baton.engine.sync_check`` and issues
    a ``SyncCheckWarning`` located at the offending line; in "error" mode it raises
    ``SyncCheckError`` before the op runs. ``violations`` counts reports in both modes.

    Host reads of tensor values are caught with a ``TorchDispatchMode`` (ops that reach ATen:
    ``_local_scalar_dense`` behind ``.item()``/``bool``/``int``/``float``, ``nonzero``,
    ``equal``, boolean-mask indexing, blocking device-to-host copies, ...) plus a
    ``TorchFunctionMode`` for the Python-level reads that never reach the dispatcher
    (``.tolist()``, ``.numpy()``, ``__array__``, printing a tensor). On CUDA, torch's own
    ``torch.cuda.set_sync_debug_mode`` is switched on for the duration too, so synchronising
    calls below the dispatcher are reported by torch. Waits that are not tensor reads (an
    executor blocking on its worker's pipe) are reported through ``report_wait``.

    Thread-safety: ``guard()`` and ``allow()`` push modes and counters on the *calling* thread
    only, so ``guard()`` must be entered on the engine thread; tensor reads on other threads
    (grammar compilation, the front end) are never reported. On CUDA, however,
    ``torch.cuda.set_sync_debug_mode`` is process-wide: while a guard is active, synchronising
    CUDA calls on any thread are reported by torch itself.
    """

    def __init__(self, mode: str) -> None:
        """Raises ValueError if ``mode`` is not "off", "warn" or "error"."""
        self._mode = _parse_mode(mode, "sync-check mode")
        self._state = _ThreadState()
        self._lock = threading.Lock()
        self._violations = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SyncChecker:
        """A checker in the mode that ``BATON_SYNC_CHECK`` selects (see
        ``sync_check_mode_from_env``); raises ValueError on a bad value."""
        return cls(sync_check_mode_from_env(environ))

    @property
    def mode(self) -> str:
        """The mode: "off", "warn" or "error"."""
        return self._mode

    @property
    def enabled(self) -> bool:
        """Whether anything can be reported (mode is not "off")."""
        return self._mode != "off"

    @property
    def violations(self) -> int:
        """How many waits have been reported so far (all threads, both modes)."""
        return self._violations

    def guard(self) -> AbstractContextManager[None]:
        """Context manager around one engine step, on the engine thread: host reads of tensor
        values inside it are reported (outside ``allow()``). Re-entrant; a no-op when off.

        On CUDA (available and already initialised) it also sets ``torch.cuda.set_sync_debug_mode``
        to this checker's mode for the duration and restores the previous setting on exit.

        Every tensor op inside an active guard goes through Python, so a guarded step that runs
        the forward in-process is much slower: this is a debugging aid, not a production mode."""
        if self._mode == "off":
            return _NULL_CONTEXT
        return self._guard()

    def allow(self) -> AbstractContextManager[None]:
        """Context manager around the one legal wait (``AsyncOutput.get_output()``): nothing is
        reported inside it, CUDA's sync debug mode included. Nests inside ``guard()``; checking
        resumes on exit. A no-op when off."""
        if self._mode == "off":
            return _NULL_CONTEXT
        return self._allow()

    def report_wait(self, what: str) -> None:
        """Report a wait that is not a tensor read (e.g. an executor blocking on its worker's
        pipe), described by ``what``. Ignored when off, outside any ``guard()`` on this thread
        or inside ``allow()``. Raises SyncCheckError in "error" mode."""
        if self._mode == "off" or not self._reporting():
            return
        self._report(what)

    def _reporting(self) -> bool:
        state = self._state
        return state.guard_depth > 0 and state.allow_depth == 0 and state.quiet_depth == 0

    def _report(self, what: str) -> None:
        frame = _caller_frame()
        if frame is None:
            location = "<unknown location>"
        else:
            code = frame.f_code
            location = f"{code.co_filename}:{frame.f_lineno} {code.co_name}"
        message = (
            f"{SYNC_CHECK_ENV}: the engine thread waits for device work outside "
            f"AsyncOutput.get_output(): {what} at {location}"
        )
        with self._lock:
            self._violations += 1
        if self._mode == "error":
            raise SyncCheckError(message)
        logger.warning("%s", message)
        if frame is None:
            warnings.warn(message, SyncCheckWarning, stacklevel=2)
        else:
            warnings.warn_explicit(
                message,
                SyncCheckWarning,
                frame.f_code.co_filename,
                frame.f_lineno,
                module=frame.f_globals.get("__name__"),
                registry=frame.f_globals.setdefault("__warningregistry__", {}),
            )

    def _run_reported(
        self, what: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Any:
        self._report(what)
        state = self._state
        state.quiet_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            state.quiet_depth -= 1

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        state = self._state
        if state.guard_depth > 0:
            # Already guarded on this thread: pushing the modes twice would report twice.
            state.guard_depth += 1
            try:
                yield
            finally:
                state.guard_depth -= 1
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(_ReadDispatchMode(self))
            stack.enter_context(_ReadFunctionMode(self))
            stack.enter_context(_cuda_sync_debug_mode(self._mode))
            state.guard_depth += 1
            try:
                yield
            finally:
                state.guard_depth -= 1

    @contextlib.contextmanager
    def _allow(self) -> Iterator[None]:
        state = self._state
        state.allow_depth += 1
        try:
            with _cuda_sync_debug_mode("off"):
                yield
        finally:
            state.allow_depth -= 1


@contextlib.contextmanager
def _cuda_sync_debug_mode(mode: str) -> Iterator[None]:
    """Set torch's CUDA sync debug mode for the duration, if CUDA is available and initialised
    (checking must not be what initialises CUDA); restore the previous setting on exit."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        yield
        return
    cuda_mode = {"off": "default", "warn": "warn", "error": "error"}[mode]
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(cuda_mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
