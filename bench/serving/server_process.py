"""A ``baton serve`` subprocess for the benchmarks that load a real server (serve, soak): start
it on a free loopback port, wait for ``/health``, read ``/metrics``, stop it whatever happens.

Also the tiny random-weight model folder such a server can load (``--tiny`` runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from baton.bench.offline.engine import TinyModelShape, tiny_checkpoint
from baton.engine.tokenizer import Tokenizer

LOG_TAIL_CHARS = 4000


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the server binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(
    model: str | None, port: int, dtype: str | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of a ``baton serve`` on loopback ``port``; ``extra`` comes last so
    that it overrides the options before it."""
    cmd = [sys.executable, "-m", "baton.engine.cli.main", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning"]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if model is not None:
        cmd += ["--model", model]
    return cmd + list(extra)


COMPUTE_INFO = "baton_model_compute_info"


def served_dtype(samples: dict[str, float]) -> str | None:
    """The dtype the server reports computing in (its ``baton_model_compute_info`` labels),
    or None when it reports none."""
    for key in samples:
        if key.startswith(f"{COMPUTE_INFO}{{"):
            match = re.search(r'dtype="([^"]*)"', key)
            if match:
                return match.group(1)
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, keyed by name with its labels as written
    (e.g. ``baton_requests_total{status="finished"}``)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


class ServerProcess:
    """``baton serve`` in a subprocess of its own session (so that its model worker stops with
    it). A context manager: entering starts it, leaving stops it (errors and Ctrl-C too).

    ``command`` replaces baton's command line with a peer server's (e.g. llama-server), which
    must listen on ``port``; ``name`` is what its errors call it.

    Its output goes to ``log_path`` (kept) or to a temporary file; ``log_tail`` shows the end,
    and every start failure carries it.
    """

    def __init__(
        self,
        model: str | None,
        *,
        dtype: str | None = None,
        server_args: Sequence[str] = (),
        log_path: Path | None = None,
        port: int | None = None,
        command: Sequence[str] | None = None,
        name: str = "baton serve",
    ) -> None:
        self.port = port if port is not None else free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # Another OpenAI-compatible server (a peer) may replace baton's command line.
        self.command = (
            list(command)
            if command is not None
            else serve_command(model, self.port, dtype, server_args)
        )
        self.name = name
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Launches the server (does not wait for it); idempotent."""
        if self.proc is not None:
            return
        # Closed in stop(): it lives as long as the server, not one block.
        self._log = (
            open(self.log_path, "wb")  # noqa: SIM115
            if self.log_path is not None
            else tempfile.TemporaryFile()  # noqa: SIM115
        )
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of the server's output so far ("" before it started or after stop)."""
        if self._log is None:
            return ""
        self._log.flush()
        if self.log_path is not None:
            return self.log_path.read_text(errors="replace")[-chars:]
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-chars:]

    def wait_healthy(self, timeout_s: float) -> float:
        """Polls ``/health`` until it answers 200; returns the seconds it took.

        Raises:
            RuntimeError: the server exited, or was not healthy within ``timeout_s``; the
                message holds the command and the tail of its log.
        """
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {code} before it was healthy "
                    f"(command: {' '.join(self.command)}); its log ends with:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(
                    f"{self.name} was not healthy within {timeout_s:g} s "
                    f"(command: {' '.join(self.command)}); its log ends with:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def health_status(self) -> int:
        """The status of GET /health now, 0 when the server does not answer."""
        try:
            return httpx.get(f"{self.base}/health", timeout=10).status_code
        except httpx.HTTPError:
            return 0

    def metrics(self) -> dict[str, float]:
        """``/metrics`` now, parsed; empty when the server does not answer."""
        try:
            return parse_metrics(httpx.get(f"{self.base}/metrics", timeout=10).text)
        except httpx.HTTPError:
            return {}

    def terminate(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM (uvicorn then shuts the engine down) and a wait of up to ``timeout_s``;
        returns (exit status, or None when it had to be killed; seconds until it exited)."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        return code, time.monotonic() - t0

    def stop(self, grace_s: float = 15.0) -> None:
        """Stops the server if it still runs (SIGTERM, then SIGKILL to its whole process
        group after ``grace_s``) and closes its log; idempotent."""
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                self.terminate(grace_s)
            # The group is the server's own session: its model worker, whatever the server did.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace_s)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit meanwhile, so that a killed benchmark still stops its server
    (by default SIGTERM ends Python without running any ``finally``). Only the main thread
    can install signal handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_tiny_model_dir(
    directory: Path, tokenizer: Tokenizer, shape: TinyModelShape | None = None
) -> Path:
    """Writes ``tiny_checkpoint(tokenizer, shape)`` as a Hugging Face Llama folder (config.json,
    model.safetensors, tokenizer files) that ``baton serve --model`` loads; returns the folder.

    Creates ``directory`` if needed and overwrites those files in it.
    """
    from safetensors.torch import save_file

    ckpt = tiny_checkpoint(tokenizer, shape)
    cfg = ckpt.config
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(ckpt.weights, str(directory / "model.safetensors"))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **tokenizer.special_tokens_map(),
    }
    if tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    # Every end-of-sequence id, not only the one tokenizer_config.json can name.
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory
