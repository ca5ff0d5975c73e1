"""What a CUDA graph launch costs the host, on CUDA: by node count and by what the GPU is doing.

On the H200 (stop 40's profile, batch 32) ``cudaGraphLaunch`` took 0.4-0.7 ms of host time a
decode step, for a graph of about 390 kernels, while the whole step's kernels ran 1.2 ms: the
engine was host-bound. This measures where that cost comes from. For graphs of N small kernels
(a chain of in-place adds on a 4 KiB tensor) it times the host side of ``graph.replay()`` (the
host clock around the call, median of --repeats) in four situations:

- ``idle``: the GPU is idle (synchronised before each launch);
- ``busy``: other work is queued ahead on the stream (a long kernel), as when the engine queues
  step N+1 during step N;
- ``same``: the same graph was launched just before and is still running (async scheduling
  replays one batch size's graph step after step);
- ``other``: another graph of the same shape was launched just before and is still running
  (what double-buffered graphs would give).

A launch whose cost grows with N points at per-node work in the driver (fewer kernels per
step is the cure); ``same`` far above ``other`` points at the driver waiting for the previous
launch of that graph (two graphs per batch size, used in turn, is the cure). It also times N
eager launches of the same kernels for comparison. Without CUDA it prints one line and exits 0.

The engine's own decode graph cost ~0.5 ms a replay at batch 32 (stop 41, H200: 320 nodes) where
these chains of adds cost 10-25 µs, so it also times graphs of --kind-nodes nodes of each kind
the engine's graph holds (torch elementwise, cuBLAS GEMMs of the model's shapes, a Triton kernel)
and, with --model, the engine's decode graph itself, and writes that graph's node list
(``cudaGraphDebugDotPrint``) beside the results. Those add a situation, ``running``: the same
graph was launched on an idle GPU just before, so it is executing (not queued) at the launch.
In the engine the previous step's graph may still run when the next is launched; the
``same`` situation only covers a launch still queued behind other work.

    python -m baton.bench.gpu.graph_launch [--nodes 10,100,400,1000] [--repeats 50]
        [--kind-nodes 320] [--model DIR] [--out bench/results/graph_launch.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from baton.bench.common import write_results

SITUATIONS = ("idle", "busy", "same", "other")


def capture_chain(
    nodes: int, x: torch.Tensor, op: Callable[[], object] | None = None
) -> torch.cuda.CUDAGraph:
    """A graph of ``nodes`` calls of ``op`` (default: an in-place add on ``x``), captured after
    a warm-up."""
    op = op or (lambda: x.add_(1.0))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            op()
    torch.cuda.synchronize()
    return graph


def _busy_work() -> Callable[[], None]:
    big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def busy() -> None:
        torch.cuda.synchronize()
        for _ in range(8):  # a few ms of queued work, so the launch finds the GPU busy
            big @ big

    return busy


def kind_ops() -> dict[str, Callable[[], object]]:
    """One kernel of each kind the engine's decode graph holds, at SmolLM2-135M's shapes and
    batch 32: a torch elementwise op, a cuBLAS GEMM, a Triton kernel (RMSNorm)."""
    from baton.kernels.rms_norm import rms_norm

    x = torch.randn(32, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(576, device="cuda", dtype=torch.bfloat16)
    return {
        "elementwise": lambda: x.mul_(1.0),
        "gemm": lambda: torch.nn.functional.linear(x, w),
        "triton": lambda: rms_norm(x, g, 1e-5),
    }


def replay_situations(
    graph: torch.cuda.CUDAGraph, busy: Callable[[], None], repeats: int
) -> dict[str, float]:
    """Host µs of ``graph.replay()``: with the GPU idle, with the same graph queued behind
    ``busy`` work (``same``), and with the same graph executing (``running``: launched on an
    idle GPU just before)."""

    def same_before() -> None:
        busy()
        graph.replay()

    def running_before() -> None:
        torch.cuda.synchronize()
        graph.replay()

    return {
        "idle": host_us(graph.replay, torch.cuda.synchronize, repeats),
        "same": host_us(graph.replay, same_before, repeats),
        "running": host_us(graph.replay, running_before, repeats),
    }


def measure_kinds(nodes: int, repeats: int) -> list[dict[str, Any]]:
    """`replay_situations` of a graph of ``nodes`` kernels of each kind in `kind_ops`."""
    busy = _busy_work()
    rows = []
    for kind, op in kind_ops().items():
        graph = capture_chain(nodes, torch.zeros(1, device="cuda"), op)
        rows.append({"kind": kind, "nodes": nodes, **replay_situations(graph, busy, repeats)})
    return rows


NODE_KINDS = re.compile(
    r"\b(KERNEL|MEMCPY|MEMSET|HOST|EVENT_RECORD|WAIT_EVENT|MEM_ALLOC|MEM_FREE|EMPTY|GRAPH|"
    r"CONDITIONAL|BATCH_MEM_OP)\b"
)


def count_node_kinds(dot: str) -> dict[str, int]:
    """Nodes per kind named in a ``cudaGraphDebugDotPrint`` file's text."""
    return dict(Counter(NODE_KINDS.findall(dot)))


def measure_engine_graph(model: str, batch: int, repeats: int, dot: Path) -> dict[str, Any]:
    """`replay_situations` of the engine's own decode graph of ``batch`` rows, and its node
    kinds from a debug capture written to ``dot``."""
    from baton.engine.config import EngineConfig
    from baton.engine.processing.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, device="cuda", max_num_seqs=batch))
    try:
        graphs = engine.core.executor.runner.graphs
        row: dict[str, Any] = {"batch": batch, "node_kinds": {}}
        # First: the debug capture also leaves pad rows in the buffers the replays read.
        try:
            graphs.debug_dump(batch, dot)
            row["node_kinds"] = count_node_kinds(dot.read_text(errors="replace"))
        except Exception as exc:  # the timing is worth having without the node list
            row["dump_error"] = f"{type(exc).__name__}: {exc}"
        row.update(replay_situations(graphs.graph(batch), _busy_work(), repeats))
        row["nodes"] = sum(row["node_kinds"].values())
        return row
    finally:
        engine.shutdown()


def host_us(launch: Callable[[], object], before: Callable[[], object], repeats: int) -> float:
    """Median host microseconds of ``launch()``, with ``before()`` run (untimed) ahead of each."""
    samples = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        launch()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def measure(nodes: int, repeats: int) -> dict[str, Any]:
    """One row: host µs per launch in each situation, and per eager launch of the same kernels."""
    x = torch.zeros(1024, device="cuda")
    y = torch.zeros(1024, device="cuda")
    a, b = capture_chain(nodes, x), capture_chain(nodes, y)
    busy = _busy_work()

    row: dict[str, Any] = {"nodes": nodes}
    row["idle"] = host_us(a.replay, torch.cuda.synchronize, repeats)
    row["busy"] = host_us(a.replay, busy, repeats)

    def same_before() -> None:
        busy()
        a.replay()

    def other_before() -> None:
        busy()
        b.replay()

    row["same"] = host_us(a.replay, same_before, repeats)
    row["other"] = host_us(a.replay, other_before, repeats)

    def eager() -> None:
        for _ in range(nodes):
            x.add_(1.0)

    row["eager_per_kernel"] = host_us(eager, torch.cuda.synchronize, max(5, repeats // 5)) / nodes
    return row


def per_node_us(rows: list[dict[str, Any]], situation: str) -> float | None:
    """The least-squares slope of host µs over node count in ``situation``: what each node adds
    to a launch; None with fewer than two node counts."""
    if len({r["nodes"] for r in rows}) < 2:
        return None
    xs = [float(r["nodes"]) for r in rows]
    ys = [float(r[situation]) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as text, then each situation's µs per node."""
    lines = ["nodes  " + "  ".join(f"{s:>9}" for s in SITUATIONS) + "  eager/kernel  (host us)"]
    for r in rows:
        cells = "  ".join(f"{r[s]:>9.1f}" for s in SITUATIONS)
        lines.append(f"{r['nodes']:>5}  {cells}  {r['eager_per_kernel']:>12.2f}")
    slopes = {s: per_node_us(rows, s) for s in SITUATIONS}
    lines.append(
        "us per node: " + ", ".join(f"{s} {v:.3f}" for s, v in slopes.items() if v is not None)
    )
    return "\n".join(lines)


def kinds_table(rows: list[dict[str, Any]], engine: dict[str, Any] | None) -> str:
    """The per-kind rows and the engine's graph as text."""
    lines = ["kind          nodes      idle      same   running  (host us)"]
    for r in [
        *rows,
        *([] if engine is None else [{**engine, "kind": f"engine b{engine['batch']}"}]),
    ]:
        lines.append(
            f"{r['kind']:<12} {r['nodes']:>6} {r['idle']:>9.1f} {r['same']:>9.1f} "
            f"{r.get('running', float('nan')):>9.1f}"
        )
    if engine is not None:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(engine["node_kinds"].items()))
        lines.append(f"engine graph nodes: {kinds}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="10,100,400,1000")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--kind-nodes", type=int, default=320)
    p.add_argument("--model", default=None, help="also time this model's engine decode graph")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("bench/results/graph_launch.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph launch benchmark: needs a CUDA device; nothing measured")
        return 0
    rows = [measure(int(n), a.repeats) for n in a.nodes.split(",")]
    print(table(rows))
    kinds = measure_kinds(a.kind_nodes, a.repeats)
    engine = None
    if a.model is not None:
        dot = a.out.with_suffix(".engine_graph.dot")
        engine = measure_engine_graph(a.model, a.batch, a.repeats, dot)
    print(kinds_table(kinds, engine))
    result = {
        "device": torch.cuda.get_device_name(),
        "rows": rows,
        "per_node_us": {s: per_node_us(rows, s) for s in SITUATIONS},
        "kinds": kinds,
        "engine_graph": engine,
    }
    write_results(result, a.out, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
