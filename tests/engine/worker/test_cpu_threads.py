"""The CPU thread governor: fewer torch threads while other processes hold the cores."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.engine.config import EngineConfig, num_cpu_cores
from baton.engine.entrypoints.args import add_engine_args, config_from_args
from baton.engine.entrypoints.llm import LLM
from baton.engine.sampling_params import SamplingParams
from baton.engine.worker.cpu_threads import CpuReading, ThreadGovernor, read_cpu


class FakeMachine:
    """A clock and ``/proc/stat``: ``run(seconds, others)`` passes time while other processes
    keep ``others`` cores busy and this one ``own`` cores."""

    def __init__(self) -> None:
        self.now = 100.0
        self.busy = 0.0
        self.own = 0.0
        self.set_calls: list[int] = []
        self.reads = 0

    def clock(self) -> float:
        return self.now

    def read(self) -> CpuReading:
        self.reads += 1
        return CpuReading(self.now, self.busy, self.own)

    def run(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def governor(self, max_threads: int = 2, cores: int = 2, **kw: object) -> ThreadGovernor:
        return ThreadGovernor(
            max_threads,
            cores=cores,
            read=self.read,
            set_threads=self.set_calls.append,
            clock=self.clock,
            period_s=0.5,
            **kw,
        )


def readings(
    gov: ThreadGovernor, machine: FakeMachine, count: int, others: float, own: float = 1.0
) -> None:
    """``count`` readings, each after half a second (the period) of others keeping ``others``
    cores busy; steps between readings read nothing."""
    gov.before_step()  # starts the governor on its first call
    for _ in range(count):
        for _ in range(4):
            machine.run(0.125, others, own)
            gov.before_step()


def test_quiet_machine_keeps_every_thread() -> None:
    m = FakeMachine()
    gov = m.governor()
    readings(gov, m, 10, others=0.05)
    assert m.set_calls == [2]  # the start only
    assert gov.state().threads == 2 and gov.state().changes == 0


def test_a_busy_core_drops_a_thread_and_a_free_one_gives_it_back_two_readings_on() -> None:
    m = FakeMachine()
    gov = m.governor()
    readings(gov, m, 2, others=0.0)
    readings(gov, m, 1, others=1.0)  # one reading may be another process's last burst
    assert gov.state().threads == 2
    readings(gov, m, 1, others=1.0)
    assert gov.state().threads == 1 and m.set_calls == [2, 1]
    assert gov.state().others_cores == pytest.approx(1.0, abs=0.01)
    readings(gov, m, 1, others=0.0)  # one quiet reading is not enough to raise
    assert gov.state().threads == 1
    readings(gov, m, 1, others=0.0)
    assert gov.state().threads == 2 and m.set_calls == [2, 1, 2]
    assert gov.state().changes == 2


@pytest.mark.parametrize(
    ("others", "threads"),
    # Measured crossover (worker/cpu_threads.py): a quarter core of others' load keeps 2
    # threads ahead, three quarters put 1 ahead.
    [(0.0, 2), (0.25, 2), (0.5, 2), (0.75, 1), (1.0, 1), (2.0, 1)],
)
def test_threads_follow_the_cores_others_leave(others: float, threads: int) -> None:
    m = FakeMachine()
    gov = m.governor()
    readings(gov, m, 4, others=others)
    assert gov.state().threads == threads


def test_many_cores_keep_to_the_starting_count_and_drop_by_the_load() -> None:
    m = FakeMachine()
    gov = m.governor(max_threads=6, cores=8)
    readings(gov, m, 4, others=1.0)  # 7 cores free: still only 6 threads
    assert gov.state().threads == 6
    readings(gov, m, 2, others=4.0)  # 4 free
    assert gov.state().threads == 4
    readings(gov, m, 2, others=9.0)  # more busy than there are cores: at least one thread
    assert gov.state().threads == 1


def test_a_noisy_load_changes_nothing_until_it_settles() -> None:
    m = FakeMachine()
    gov = m.governor(settle=3)
    for others in (1.0, 1.0, 0.0, 1.0, 1.0, 0.3):  # a different reading resets the count
        readings(gov, m, 1, others=others)
        assert gov.state().threads == 2
    readings(gov, m, 3, others=1.0)
    assert gov.state().threads == 1
    for others in (0.0, 0.0, 1.0, 0.0, 0.0):
        readings(gov, m, 1, others=others)
        assert gov.state().threads == 1
    readings(gov, m, 1, others=0.0)
    assert gov.state().threads == 2


def test_readings_while_idle_are_not_judged() -> None:
    m = FakeMachine()
    gov = m.governor()
    gov.before_step()
    for _ in range(5):  # this engine idle, another process busy: no reading counts
        m.run(2.0, others=2.0, own=0.0)
        gov.before_step()
    assert gov.state().threads == 2 and m.reads == 6
    readings(gov, m, 2, others=2.0)  # the same load while it computes drops a thread
    assert gov.state().threads == 1


def test_a_reading_never_spans_an_idle_gap() -> None:
    m = FakeMachine()
    gov = m.governor(settle=1)
    readings(gov, m, 2, others=0.0)
    m.run(2.0, others=2.0, own=0.5)  # no step for 2 s while others ran
    readings(gov, m, 3, others=0.0)
    assert gov.state().threads == 2 and gov.state().changes == 0


def test_waiting_on_others_is_not_judged() -> None:
    m = FakeMachine()
    gov = m.governor(settle=1)
    readings(gov, m, 3, others=2.0, own=0.1)  # steps, but this process mostly waits
    assert gov.state().threads == 2
    readings(gov, m, 1, others=2.0, own=1.0)
    assert gov.state().threads == 1


def test_readings_are_rate_limited() -> None:
    m = FakeMachine()
    gov = m.governor()
    for _ in range(100):  # 100 steps within 0.4 s: only the start reads
        gov.before_step()
        m.run(0.004, 0.0)
    assert m.reads == 1
    for _ in range(30):  # past 0.5 s: one more
        gov.before_step()
        m.run(0.004, 0.0)
    assert m.reads == 2


def test_one_thread_or_no_proc_stat_turns_it_off() -> None:
    m = FakeMachine()
    gov = m.governor(max_threads=1)
    readings(gov, m, 4, others=1.0)
    assert m.reads == 0 and m.set_calls == [1]
    calls: list[int] = []
    gov = ThreadGovernor(2, cores=2, read=lambda: None, set_threads=calls.append)
    for _ in range(5):
        gov.before_step()
    assert calls == [2] and gov.state().threads == 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0)
    with pytest.raises(ValueError, match="period_s"):
        ThreadGovernor(2, period_s=0)


def test_proc_stat_reading_counts_busy_time() -> None:
    first = read_cpu()
    if first is None:
        pytest.skip("no /proc/stat here")
    # Burn 0.2 s of this process's CPU time, however long a loaded machine takes to give it.
    start, deadline = time.process_time(), time.monotonic() + 30
    while time.process_time() - start < 0.2 and time.monotonic() < deadline:
        pass
    second = read_cpu()
    assert second is not None
    assert second.own - first.own >= 0.15
    # The machine-wide busy time includes this process's (ticks are coarse: 10 ms).
    assert second.busy - first.busy >= 0.1
    assert second.wall > first.wall


def test_partner_processes_count_as_own_time() -> None:
    if read_cpu() is None:
        pytest.skip("no /proc/stat here")
    (hog,) = _hogs(1)
    try:
        first = read_cpu(partners=(hog.pid, 999_999_999))  # a pid that is gone counts 0
        assert first is not None
        # This process only sleeps, so own time that grows is the busy partner's (however
        # slowly a loaded machine lets it run).
        deadline = time.monotonic() + 30
        second = first
        while second.own - first.own < 0.1 and time.monotonic() < deadline:
            time.sleep(0.1)
            reading = read_cpu(partners=(hog.pid,))
            assert reading is not None
            second = reading
    finally:
        hog.kill()
        hog.wait()
    assert second.own - first.own >= 0.1


def _hogs(n: int, niceness: int = 0) -> list[subprocess.Popen[bytes]]:
    code = f"import os; os.nice({niceness})\nwhile 1: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


@pytest.mark.skipif(num_cpu_cores() < 2, reason="needs 2 cores")
def test_real_busy_processes_drop_the_threads() -> None:
    if read_cpu() is None:
        pytest.skip("no /proc/stat here")
    calls: list[int] = []
    gov = ThreadGovernor(2, set_threads=calls.append, period_s=0.2)
    # The hogs run niced: on a machine already busy (the suite's other worker, a process
    # beside the suite) this process must still get the CPU share the governor needs to judge
    # a reading (a reading taken while it mostly waited for a core is skipped), and the hogs
    # still take every core it leaves.
    hogs = _hogs(num_cpu_cores(), niceness=10)
    try:
        deadline = time.monotonic() + 60
        gov.before_step()
        while gov.state().threads == 2 and time.monotonic() < deadline:
            # A step of this process's own CPU time, not of wall time: a reading counts only
            # while this process computes.
            spin = time.process_time()
            while time.process_time() - spin < 0.05:
                pass
            gov.before_step()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    # Niced hogs on an otherwise idle machine take the one core this process leaves: about 1.
    assert calls[-1] == 1 and gov.state().others_cores >= 0.9


def test_engine_option_and_flag() -> None:
    assert EngineConfig().adapt_cpu_threads is True
    with pytest.raises(ValueError, match="adapt_cpu_threads"):
        EngineConfig(adapt_cpu_threads="no")  # type: ignore[arg-type]
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args([])).adapt_cpu_threads is True
    assert config_from_args(p.parse_args(["--no-adapt-cpu-threads"])).adapt_cpu_threads is False


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_engine_reports_its_threads(tiny_model_dir: Path, executor: str) -> None:
    kw: dict[str, object] = {"worker_threads": 1} if executor == "mp" else {}
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        executor=executor,
        async_scheduling=executor == "mp",
        max_model_len=64,
        num_kv_blocks=16,
        **kw,
    )
    off = LLM(
        str(tiny_model_dir),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=16,
        adapt_cpu_threads=False,
    )
    try:
        llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        stats = llm.stats()
        assert stats["cpu_threads"] >= 1 and stats["cpu_max_threads"] >= stats["cpu_threads"]
        assert stats["cpu_thread_changes"] >= 0 and stats["cpu_others_busy_cores"] >= 0
        if executor == "mp":
            assert stats["cpu_max_threads"] == 1
        off.generate("hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert "cpu_threads" not in off.stats()
    finally:
        llm.shutdown()
        off.shutdown()


@pytest.mark.skipif(num_cpu_cores() < 2, reason="needs 2 cores")
def test_model_worker_drops_a_thread_beside_busy_processes(tiny_model_dir: Path) -> None:
    if read_cpu() is None:
        pytest.skip("no /proc/stat here")
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        async_scheduling=True,
        worker_threads=2,
        max_model_len=256,
        num_kv_blocks=64,
    )
    hogs = _hogs(num_cpu_cores())
    try:
        deadline = time.monotonic() + 60
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        while time.monotonic() < deadline:
            llm.generate(["a", "b"], params, use_tqdm=False)
            if llm.stats()["cpu_threads"] == 1:
                break
        stats = llm.stats()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        llm.shutdown()
    assert stats["cpu_max_threads"] == 2
    assert stats["cpu_threads"] == 1 and stats["cpu_thread_changes"] >= 1
