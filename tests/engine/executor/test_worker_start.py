"""Starting the model worker process: it never runs the user's script, and every start failure
says why."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from baton.engine import LLM, SamplingParams
from baton.engine.executor import worker_process
from baton.engine.executor.base import ExecutorError
from baton.engine.executor.multiproc import MultiprocExecutor
from baton.engine.loader import ModelLoadError, load_checkpoint
from baton.engine.processing import model_setup
from baton.engine.worker.build import RunnerSpec
from baton.engine.worker.fd_passing import receive_fds, send_fds
from baton.engine.worker.shared_memory import SharedBuffer

pytestmark = pytest.mark.slow


def runner_spec(ckpt, tensor_parallel_size: int = 1) -> RunnerSpec:
    """A small float32 runner spec of ``ckpt`` (also test_start_workers.py's)."""
    return RunnerSpec(
        model_config=ckpt.config,
        dtype=torch.float32,
        num_kv_blocks=16,
        block_size=16,
        max_num_seqs=4,
        max_model_len=128,
        eos_token_ids=tuple(ckpt.config.eos_token_ids),
        tokenizer_vocab_size=ckpt.tokenizer.vocab_size,
        num_threads=1,
        tensor_parallel_size=tensor_parallel_size,
    )


@pytest.mark.timeout(180)
def test_an_unguarded_script_runs_once_with_the_worker(tiny_model_dir: Path, tmp_path: Path):
    # The README's shape with async scheduling forced on, at top level without a __main__
    # guard: a worker that re-imported __main__ would build a second LLM and die starting.
    script = tmp_path / "user_script.py"
    marker = tmp_path / "runs.txt"
    script.write_text(
        textwrap.dedent(
            f"""
            from baton.engine import LLM, SamplingParams

            with open({str(marker)!r}, "a") as f:
                f.write("ran\\n")
            llm = LLM({str(tiny_model_dir)!r}, async_scheduling=True, max_model_len=128)
            outs = llm.generate(["hello there"], SamplingParams(max_tokens=5, temperature=0.0,
                                ignore_eos=True), use_tqdm=False)
            print("TOKENS", len(outs[0].outputs[0].token_ids), llm.config.executor)
            llm.shutdown()
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOKENS 5 mp" in done.stdout
    assert marker.read_text() == "ran\n"


def test_a_worker_that_cannot_build_says_why(tiny_model_dir: Path):
    ckpt = load_checkpoint(str(tiny_model_dir))
    weights = dict(ckpt.weights)
    weights.pop("model.norm.weight")
    with pytest.raises(ExecutorError, match=r"failed to start(.|\n)*model\.norm\.weight"):
        MultiprocExecutor.start(runner_spec(ckpt), weights)


def test_a_worker_that_cannot_import_says_why(tiny_model_dir: Path, monkeypatch):
    ckpt = load_checkpoint(str(tiny_model_dir))
    broken = worker_process._BOOTSTRAP.replace("worker.worker_main", "worker.no_such_module")
    monkeypatch.setattr(worker_process, "_BOOTSTRAP", broken)
    with pytest.raises(ExecutorError, match=r"cannot import the model worker(.|\n)*no_such_module"):
        MultiprocExecutor.start(runner_spec(ckpt), ckpt.weights)


def test_a_worker_that_cannot_import_the_messages_says_why(tiny_model_dir: Path, monkeypatch):
    # Not even messages.py (no Failed to send): the bare reason comes back, lines intact.
    ckpt = load_checkpoint(str(tiny_model_dir))
    broken = worker_process._BOOTSTRAP.replace("baton.engine.worker.", "baton.engine.no_room.")
    monkeypatch.setattr(worker_process, "_BOOTSTRAP", broken)
    with pytest.raises(ExecutorError, match=r"cannot import the model worker:\nTraceback"):
        MultiprocExecutor.start(runner_spec(ckpt), ckpt.weights)


def test_a_worker_killed_while_starting_says_how_it_ended(tiny_model_dir: Path, monkeypatch):
    ckpt = load_checkpoint(str(tiny_model_dir))
    monkeypatch.setattr(
        worker_process, "_BOOTSTRAP", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    )
    with pytest.raises(ExecutorError, match="killed by signal SIGKILL"):
        MultiprocExecutor.start(runner_spec(ckpt), ckpt.weights)


def test_descriptors_follow_over_the_connection():
    ours, theirs = multiprocessing.Pipe()  # a Unix socket pair on Linux
    a, b = SharedBuffer.create(64, "baton-test-a"), SharedBuffer.create(64, "baton-test-b")
    try:
        send_fds(ours, [a.fd, b.fd])
        ours.send("after")  # a Connection message behind the descriptors is read intact
        mapping = receive_fds(theirs)
        assert mapping is not None and sorted(mapping) == sorted([a.fd, b.fd])
        assert theirs.recv() == "after"
        for buf, byte in ((a, b"A"), (b, b"B")):
            os.pwrite(buf.fd, byte * 4, 8)
            local = mapping[buf.fd]
            assert local != buf.fd  # this process's own descriptor of the same file
            assert os.pread(local, 4, 8) == byte * 4
            os.close(local)
    finally:
        a.close()
        b.close()
        ours.close()
        theirs.close()


def test_a_closed_connection_hands_over_nothing():
    ours, theirs = multiprocessing.Pipe()
    ours.close()
    assert receive_fds(theirs) is None
    theirs.close()


def test_a_worker_stopped_before_its_descriptors_ends_at_once():
    worker = worker_process.WorkerProcess()
    start = time.monotonic()
    worker.stop()  # while it imports torch: not waited for
    assert time.monotonic() - start < 1.0
    assert not worker.is_alive() and worker.exit_description() is not None


@pytest.mark.timeout(180)
def test_the_worker_imports_while_the_model_is_read(tiny_model_dir: Path, monkeypatch):
    events: list[str] = []
    started: list[worker_process.WorkerProcess] = []
    real_init, real_load = worker_process.WorkerProcess.__init__, model_setup.load_checkpoint

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        events.append("worker")
        started.append(self)

    def load(*args, **kwargs):
        events.append("load")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(worker_process.WorkerProcess, "__init__", init)
    monkeypatch.setattr(model_setup, "load_checkpoint", load)
    llm = LLM(str(tiny_model_dir), executor="mp", async_scheduling=True, max_model_len=128)
    try:
        assert events == ["worker", "load"]
        assert llm.engine.core.executor.worker_pid == started[0].pid
        out = llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()

    def broken(*args, **kwargs):
        raise ModelLoadError("no such model (test)")

    monkeypatch.setattr(model_setup, "load_checkpoint", broken)
    with pytest.raises(ModelLoadError, match="no such model"):
        LLM(str(tiny_model_dir), executor="mp", async_scheduling=True, max_model_len=128)
    assert not started[-1].is_alive()  # stopped, not left behind
