"""Shared pytest fixtures: the default model, its tokenizer, tiny random-weight model folders and
transformers' reference copies of them.

Everything expensive is session-scoped so the whole suite pays for it once. The helpers behind
them that tests import too live beside this file: tiny model folders in ``model_files.py``, GGUF
files in ``gguf_files.py``, a server in a thread in ``serving.py``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from memory_guard import register as register_memory_guard
from model_files import build_tiny_model_dir, built_once_per_run
from serving import DEFAULT_SERVED_MODEL, serve_in_thread

import baton.engine.config as engine_config_module
from baton.engine.loader import Checkpoint, load_checkpoint, load_tokenizer
from baton.engine.loader import default_model_path as _default_model_path
from baton.engine.loader.gguf import gguf_metadata, read_gguf
from baton.engine.speculative_config import SpeculativeConfig
from baton.engine.tokenizer import Tokenizer

# The repository: a test builds its paths from here, whatever folder of tests/ it lives in.
ROOT = Path(__file__).resolve().parent.parent

# tests/ mirrors the package (tests/layout.py). pytest imports a test module by its file name
# (its default "prepend" import mode puts the module's folder on sys.path; the test folders have
# no __init__.py, and tests/repo/test_layout.py keeps file names unique). With every test folder
# on sys.path, a test may import another's helpers (``from test_scheduler import fake_output``)
# wherever each lives and whichever files the run collects. Appended, so they shadow nothing.
for _folder in sorted({path.parent for path in ROOT.joinpath("tests").rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def pytest_configure(config: pytest.Config) -> None:
    """Every pytest process of the suite bounds and, on request, records its resident memory
    per test file (tests/memory_guard.py)."""
    register_memory_guard(config)


# The real resolver of dtype="auto", for the tests that check it (see float32_by_default).
REAL_AUTO_DTYPE = engine_config_module.auto_dtype


def _float32_for_tests(device: str) -> tuple[torch.dtype, str]:
    return torch.float32, "tests: dtype='auto' resolves to float32 (see tests/conftest.py)"


@pytest.fixture(scope="session", autouse=True)
def float32_by_default() -> Iterator[None]:
    """In the suite, ``dtype="auto"`` means float32. Most tests compare tokens with
    transformers or across batch shapes, which only float32 makes exact; and on a loaded 2-core
    machine bfloat16 GEMMs, which oneDNN splits over both threads even for a tiny model, stall
    ~20 ms each whenever one thread is descheduled (measured: 20 ms vs 0.3 ms for a 960x576
    GEMV), which would slow the suite many times over. Tests of the bfloat16 and int8 paths ask
    for them explicitly; tests of ``auto`` itself use ``REAL_AUTO_DTYPE``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_config_module, "auto_dtype", _float32_for_tests)
        yield


# The KV cache an engine of the suite gets unless its test sets one: the product's default is
# 1 GiB, allocated zeroed (resident from the start), so every engine a test built held 1 GiB
# for KV blocks that no test fills (issue 52: an xdist worker reached 9.5 GB).
TEST_KV_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="session", autouse=True)
def small_kv_cache_by_default() -> Iterator[None]:
    """In the suite, ``EngineConfig.kv_cache_memory_bytes`` defaults to
    ``TEST_KV_CACHE_BYTES`` (still thousands of tokens for the default model in float32);
    tests that need a given cache set ``num_kv_blocks`` or ``kv_cache_memory_bytes``."""
    yield from _with_default(
        engine_config_module.EngineConfig, "kv_cache_memory_bytes", TEST_KV_CACHE_BYTES
    )


def _with_default(cls: type, name: str, value: Any) -> Iterator[None]:
    """``cls(...)`` defaults ``name`` to ``value`` while the generator is suspended."""
    init = cls.__init__
    code = init.__code__
    names = code.co_varnames[1 : code.co_argcount]
    defaults = list(init.__defaults__ or ())
    defaults[names.index(name) - (len(names) - len(defaults))] = value
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(init, "__defaults__", tuple(defaults))
        yield


@pytest.fixture(scope="session", autouse=True)
def fixed_drafts_by_default() -> Iterator[None]:
    """In the suite, ``SpeculativeConfig.adaptive`` defaults to False: the draft policy's
    choices follow wall-clock step times, and the tests that count drafts must see them on a
    loaded machine too. The policy is tested with given timings (``test_draft_policy.py``);
    tests of it in an engine ask for ``adaptive=True``."""
    yield from _with_default(SpeculativeConfig, "adaptive", False)


@pytest.fixture(scope="session")
def default_gguf_metadata(default_model_path: Path) -> dict[str, Any]:
    """Every metadata key of the default GGUF as plain Python values."""
    return gguf_metadata(read_gguf(default_model_path), default_model_path)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default SmolLM2-135M-Instruct GGUF file."""
    return _default_model_path()


TOKENIZER_ENV = "BATON_TEST_TOKENIZER"


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """baton's tokenizer of the default model: from its GGUF file, or from the Hugging Face
    folder in $BATON_TEST_TOKENIZER where the 98 MB file cannot go (the prepared GPU check)."""
    folder = os.environ.get(TOKENIZER_ENV)
    if folder:
        return load_tokenizer(folder)
    return Tokenizer.from_gguf_metadata(request.getfixturevalue("default_gguf_metadata"))


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path: Path) -> Checkpoint:
    """baton's float32 ``Checkpoint`` of the default model, loaded once per session; tests must
    not modify its weights."""
    return load_checkpoint(default_model_path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """A tiny random-weight Llama (2 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, tied
    embeddings, SmolLM2's tokenizer and chat template) saved as a Hugging Face folder, built
    once per test run (read-only: copy it to change it)."""
    folder, _ = built_once_per_run(
        tmp_path_factory,
        "tiny_llama",
        lambda folder: build_tiny_model_dir(folder, tokenizer, "llama"),
    )
    return folder


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """Like ``tiny_model_dir`` but Qwen2: q/k/v biases and an untied lm_head."""
    folder, _ = built_once_per_run(
        tmp_path_factory,
        "tiny_qwen2",
        lambda folder: build_tiny_model_dir(folder, tokenizer, "qwen2"),
    )
    return folder


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF import, unchanged but for two repeats it makes: it parses the file's
    metadata twice (for the config, then for the tensors; 3-7 s each for the default model's 49k
    tokens and merges) and rebuilds gguf's tensor-name table once per module of the model (~400
    times, 4-7 s). Inside this context ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map``
    (which transformers looks up at each call) return the first result for the same arguments:
    gguf's reader is read-only and the name table is only read."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.cache
    def cached_reader(path: Any, mode: str = "r") -> Any:
        return reader(path, mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", cached_reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(name_map))
        yield


@pytest.fixture(scope="session")
def hf_default_model_dir(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The default GGUF as transformers imports it (its reader, names and dequantisation;
    never baton's), saved as a float32 safetensors folder once per test run.

    That import takes 7-25 s (see ``gguf_parsed_once``); loading the folder takes under a
    second (float32 round-trips exactly)."""
    from safetensors.torch import save_model
    from transformers import LlamaForCausalLM

    def convert(folder: Path) -> None:
        with gguf_parsed_once():
            model = LlamaForCausalLM.from_pretrained(
                default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
            )
        # save_pretrained refuses a model loaded from GGUF; its weights are plain float32
        # tensors by now, so the config without the GGUF entry describes them.
        config = copy.deepcopy(model.config)
        del config.quantization_config
        config.save_pretrained(folder)
        save_model(model, str(folder / "model.safetensors"))  # the tied head stored once

    folder, _ = built_once_per_run(tmp_path_factory, "hf_default_model", convert)
    return folder


@pytest.fixture
def hf_default_model(hf_default_model_dir: Path) -> Any:
    """transformers' ``LlamaForCausalLM`` of the default GGUF (float32, eval mode): the reference
    for weights and logits. Loaded for each test that asks (from ``hf_default_model_dir``, about
    a second): a session-wide copy kept 0.5 GB resident in a worker for the rest of the run,
    and a module-wide one sat beside the engines that tests/engine/entrypoints/test_engine.py
    starts (issue 52)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf_default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path) -> Any:
    """transformers' tokenizer built from the default GGUF: the reference for encode/decode and
    chat templates."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name
    )


def shared_data_dir() -> Path | None:
    """The shared schema data (maskbench format): $BATON_DATA_DIR or ../shared/data."""
    env = os.environ.get("BATON_DATA_DIR")
    path = Path(env) if env else ROOT.parent / "shared" / "data"
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Directory of the shared schema files; skips the test when it is absent."""
    path = shared_data_dir()
    if path is None:
        pytest.skip("shared schema data not found (set BATON_DATA_DIR)")
    return path


InterpreterRun = Callable[[str, Any, Path], Any]


@pytest.fixture(scope="session")
def run_interpreted() -> InterpreterRun:
    """``run(code, payload, folder)``: saves ``payload`` to ``folder``, runs ``code`` in a fresh
    Python with TRITON_INTERPRET=1 (the interpreter is chosen when a kernel module is imported,
    which this process may already have done) as ``code cases.pt out.pt``, and returns what it
    saved to out.pt. Fails the test with the child's output when it exits non-zero."""
    pytest.importorskip("triton")

    def run(code: str, payload: Any, folder: Path) -> Any:
        torch.save(payload, folder / "cases.pt")
        result = subprocess.run(
            [sys.executable, "-c", code, str(folder / "cases.pt"), str(folder / "out.pt")],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, f"interpreter run failed:\n{result.stdout}\n{result.stderr}"
        return torch.load(folder / "out.pt")

    return run


@pytest.fixture(scope="module")
def default_model_engine(default_checkpoint: Checkpoint) -> Iterator[Any]:
    """An ``AsyncLLM`` of the default model (8 sequences, 2048 tokens) for the test module,
    shut down after it; the engine behind ``default_model_server``, for modules that serve it
    under other settings too. Module-scoped: a session-wide engine (0.8 GB) stayed resident in
    a worker for the rest of the run (issue 52), and starting one from the loaded
    ``default_checkpoint`` takes seconds."""
    from baton.engine.entrypoints.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        None, checkpoint=default_checkpoint, max_num_seqs=8, max_model_len=2048
    )
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def default_model_server(default_model_engine: Any) -> Iterator[str]:
    """``baton serve``'s app on the default model (no API key, served as "smol"), in a uvicorn
    thread for the test module; yields its base URL."""
    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig

    config = ServerConfig(served_model_name=DEFAULT_SERVED_MODEL)
    with serve_in_thread(build_app(default_model_engine, config)) as base:
        yield base


@pytest.fixture(scope="module")
def parser_servers(default_model_engine: Any) -> Iterator[dict[str, str]]:
    """The base URL of an app per ``--tool-call-parser`` name (``TOOL_CALL_FORMATS``), all
    on the module's ``default_model_engine`` (served as "smol")."""
    from baton.engine.server.app import build_app
    from baton.engine.server.config import ServerConfig
    from baton.grammar.tool_formats import TOOL_CALL_FORMATS

    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(
                serve_in_thread(
                    build_app(
                        default_model_engine,
                        ServerConfig(served_model_name=DEFAULT_SERVED_MODEL, tool_call_parser=name),
                    )
                )
            )
            for name in TOOL_CALL_FORMATS
        }
