"""What a batch-1 decode step reads, and how fast this machine can read memory.

A batch-1 CPU decode step is bound by reading the weights: every linear weight once per
token. ``weight_bytes_per_token`` counts those bytes for a GGUF model run with its blocks
(``quantization="gguf"``): every tensor of the file, the token embedding only when it is also
the LM head (tied; otherwise a step reads one row of it). ``memory_bandwidth`` measures, with
``threads`` torch threads, the rate of a large copy (STREAM's convention: bytes read plus
bytes written) and of a large streaming read, best of ``trials``. The two together give the
fraction of the machine's bandwidth a decode step uses (issue 54's goal: report it).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from baton.engine.loader.gguf import read_gguf
from baton.kernels import cpu_ops
from baton.kernels.huge_pages import huge_page_zeros

EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"


def weight_bytes_per_token(path: str | Path) -> int:
    """Bytes of weights a batch-1 decode step of the GGUF model at ``path`` reads (its blocks
    as the file holds them; the kernel's repacked layout is within a few percent of that). A
    mixture of experts reads ``expert_used_count`` of its ``expert_count`` experts a layer:
    that share of its stacked expert tensors (``*_exps``).

    Raises:
        ModelLoadError: the file is not a readable GGUF file.
    """
    gguf = read_gguf(Path(path))
    arch = gguf.metadata.get("general.architecture")
    experts = int(gguf.metadata.get(f"{arch}.expert_count") or 0)
    used = int(gguf.metadata.get(f"{arch}.expert_used_count") or 0)
    tied = not any(t.name == OUTPUT for t in gguf.tensors)
    total = 0.0
    for t in gguf.tensors:
        if t.name == EMBEDDING and not tied:
            continue
        share = used / experts if experts and "_exps." in t.name else 1.0
        total += t.n_bytes * share
    return int(total)


def memory_bandwidth(threads: int, mib: int = 512, trials: int = 5) -> dict[str, float | str]:
    """GB/s of a ``mib``-MiB copy (read + write bytes) and of a read of as many bytes, with
    ``threads`` torch threads (restored after), best of ``trials``; both on memory advised
    for huge pages, as the GGUF weights are. The read is a streaming XOR of 8-byte words
    (``cpu_ops.read_words``; ``read_method`` "xor"), or a float32 sum where the extension is
    missing ("sum": torch's reductions are bound by their arithmetic, so that undercounts:
    measured 26 against 52-63 GB/s with 2 threads on an AMD EPYC Genoa).

    Raises:
        ValueError: threads, mib or trials < 1.
    """
    if min(threads, mib, trials) < 1:
        raise ValueError(f"threads, mib and trials must be >= 1, got {threads}, {mib}, {trials}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    nbytes = mib * (1 << 20)
    method = "xor" if cpu_ops.extension() is not None else "sum"
    try:
        src = huge_page_zeros(nbytes).fill_(1)
        dst = huge_page_zeros(nbytes)
        dst.copy_(src)  # fault the pages in
        copy_s = read_s = float("inf")
        for _ in range(trials):
            t0 = time.perf_counter()
            dst.copy_(src)
            t1 = time.perf_counter()
            if method == "xor":
                cpu_ops.read_words(src)
            else:
                src.view(torch.float32).sum()
            t2 = time.perf_counter()
            copy_s, read_s = min(copy_s, t1 - t0), min(read_s, t2 - t1)
    finally:
        torch.set_num_threads(before)
    return {
        "copy_gb_s": 2 * nbytes / copy_s / 1e9,
        "read_gb_s": nbytes / read_s / 1e9,
        "read_method": method,
    }
