"""Builds baton's C++ extensions (``kernels/csrc``) with torch's ``cpp_extension`` on first use.

Each extension is compiled once per version of its sources and flags into a folder of torch's
extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); it needs g++
and ninja. Processes that load the same extension at once take turns through a lock that dies
with its holder, so a build killed half way never leaves the next process waiting for ever.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
logger = logging.getLogger(__name__)


def load_extension(stem: str, source: str, cflags: Sequence[str]) -> ModuleType:
    """The extension ``stem`` built from ``csrc/<source>`` (which may include any header of
    ``csrc``) with ``cflags``; compiles it on the first call for these sources and flags.

    Side effect: may put the interpreter's scripts folder on PATH (for pip's ninja).

    Raises:
        RuntimeError: the compiler or ninja failed or is missing (torch's message).
    """
    # Imported here: cpp_extension pulls in setuptools, which nothing else at import time needs.
    from torch.utils import cpp_extension

    # torch runs `ninja` from PATH; pip's ninja (the dev extra) sits beside this interpreter,
    # which is not on PATH when a virtual environment is used without being activated.
    scripts = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    # Named by the sources' content and flags: checkouts of other versions on one machine share
    # torch's cache folder, and under one name they rebuilt over each other's module (seen: a
    # process loaded another checkout's older build, which lacked a function). Only the
    # headers the source includes count: an edit to another extension's header rebuilt this
    # one too, inside the first server start after it (30 s of a measured load time).
    # The sources' folder counts too: torch's build file names the sources by path, so two
    # checkouts of the same sources sharing a folder rebuilt it in turn (seen: 98 s of a
    # server's start).
    digest = hashlib.sha256(" ".join([str(CSRC), *cflags]).encode())
    for path in [CSRC / source, *sorted(included_headers(CSRC / source))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    name = f"{stem}_{digest.hexdigest()[:16]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    folder = Path(root) / f"baton_py{sys.version_info[0]}{sys.version_info[1]}" / name
    with build_turn(folder):
        return cpp_extension.load(
            name=name,
            sources=[str(CSRC / source)],
            extra_include_paths=[str(CSRC)],
            extra_cflags=list(cflags),
            build_directory=str(folder),
            verbose=os.environ.get("BATON_VERBOSE_BUILD") == "1",
        )


@contextlib.contextmanager
def build_turn(folder: Path) -> Iterator[None]:
    """This process's turn at ``folder`` (an extension's build folder, created if missing):
    blocks while another process has its turn there, and on entry removes a ``lock`` file
    that torch left behind.

    torch's own build lock is a file whose existence is the lock: a build killed half way
    leaves it, and every later ``cpp_extension.load`` of that folder waits for ever. Ours is an
    ``flock`` on a separate file, which the kernel releases when its holder dies; every baton
    process holds it while torch's lock exists, so a ``lock`` seen while holding ours is stale.

    Side effects: creates ``folder`` and ``folder/baton.lock``; may delete ``folder/lock``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "baton.lock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def included_headers(source: Path) -> set[Path]:
    """The headers of ``csrc`` that ``source`` includes with ``#include "..."``, directly or
    through each other (pure function of the files' text)."""
    found: set[Path] = set()
    todo = [source]
    while todo:
        for name in _INCLUDE.findall(todo.pop().read_text()):
            path = CSRC / name
            if path.exists() and path not in found:
                found.add(path)
                todo.append(path)
    return found


def runnable_isas(ext: ModuleType, names: Sequence[str]) -> tuple[str, ...]:
    """Of an extension's instruction sets ``names`` (by code: ``ext.isa_supported(code)``),
    those this CPU runs, in their order. An AVX-512 one ("avx512...") only where torch's own
    probe agrees too: where it says no (the suite's AVX2-only emulation, ``tests/avx2_only``),
    the AVX2 code is what runs, as on such a CPU."""
    avx512 = torch.cpu._is_avx512_supported()
    return tuple(
        name
        for code, name in enumerate(names)
        if ext.isa_supported(code) and (not name.startswith("avx512") or avx512)
    )
