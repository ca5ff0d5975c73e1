"""Writes the results tables of docs/results.md and the README's headline table from the JSON
files in bench/results/.

Every number in those tables comes from a benchmark run, never typed by hand: this script
replaces the text between the markers ``<!-- results:begin -->`` and ``<!-- results:end -->``
of docs/results.md with tables rendered from whatever result files exist, each with the
command that produced it, and the text between ``<!-- headline:begin -->`` and
``<!-- headline:end -->`` of README.md with the headline sections (``HEADLINE``).

    python -m baton.bench.readme.readme_results [--readme README.md] [--page docs/results.md]
        [--results DIR]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baton.bench.compute.gguf_decode import readme_table as gguf_decode_table
from baton.bench.compute.moe_decode import readme_table as moe_decode_table
from baton.bench.compute.quant_linear import readme_table as quant_linear_table
from baton.bench.gpu.gpu_report import gpu_check_table
from baton.bench.llama_server.serve_peers_report import readme_table as serve_peers_table
from baton.bench.offline.forward import RESULTS
from baton.bench.offline.invariance import readme_table as invariance_table
from baton.bench.offline.invariance_cost import readme_table as invariance_cost_table
from baton.bench.readme.readme_engine_tables import engine_sim_table, engine_table, spec_table
from baton.bench.readme.readme_tables import (
    compile_burst_table,
    data_parallel_table,
    forward_table,
    grammar_overhead_table,
    grammar_table,
    masks_table,
    open_objects_table,
    peers_table,
    serve_table,
    soak_table,
    structured_table,
    tensor_parallel_table,
    throughput_table,
)
from baton.bench.sim.sim_calibration_report import readme_table as sim_calibration_table

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"
_ROOT = Path(__file__).resolve().parents[2]
README = _ROOT / "README.md"
RESULTS_PAGE = _ROOT / "docs" / "results.md"
# The result files whose sections the README shows; docs/results.md shows every one.
HEADLINE = ("peers.json",)
# Where the plots are, as each page's links spell it (relative to the page's folder).
README_IMAGES, PAGE_IMAGES = "bench/results/", "../bench/results/"


SECTIONS: list[tuple[str, str, str, Callable[[dict[str, Any]], str]]] = [
    ("forward.json", "Forward pass, float32", "baton bench forward", forward_table),
    (
        "forward_bfloat16.json",
        "Forward pass, bfloat16",
        "baton bench forward --dtype bfloat16",
        forward_table,
    ),
    (
        "throughput.json",
        "Offline throughput",
        "baton bench throughput",
        throughput_table,
    ),
    ("engine.json", "Async vs sync scheduling", "baton bench engine", engine_table),
    (
        "engine_sim.json",
        "Async vs sync at accelerator speed (simulated H200)",
        "baton bench engine --device sim:h200 --shape llama-3.1-8b",
        engine_sim_table,
    ),
    (
        "gpu_check.json",
        "On an NVIDIA H200: the prepared GPU check",
        "bench/gpu/gpu_check.sh OUT, then python -m baton.bench.gpu.gpu_check collect --src OUT",
        gpu_check_table,
    ),
    (
        "sim_calibration.json",
        "The simulated H200 against the real one (calibrated runner costs)",
        "python -m baton.bench.sim.sim_calibration check",
        sim_calibration_table,
    ),
    (
        "sim_calibration_policy.json",
        "Calibrated simulator, synchronous cells with the draft policy",
        "python -m baton.bench.sim.sim_calibration check --drafts adaptive --only sync "
        "--out bench/results/sim_calibration_policy.json",
        sim_calibration_table,
    ),
    (
        "structured.json",
        "Structured vs free TPOT",
        "baton bench structured",
        structured_table,
    ),
    (
        "grammar.json",
        "Grammar backends (MaskBench)",
        "baton bench grammar",
        grammar_table,
    ),
    (
        "masks.json",
        "Mask fill time per schema feature",
        "baton bench masks",
        masks_table,
    ),
    (
        "grammar_overhead.json",
        "Grammar wrapper overhead",
        "python -m baton.bench.grammars.grammar_overhead",
        grammar_overhead_table,
    ),
    (
        "peers.json",
        "Against other engines (JSON schema)",
        "baton bench peers",
        peers_table,
    ),
    (
        "quant_linear_kquants.json",
        "GGUF K-quant kernels by row count (bandwidth at one row)",
        "baton bench quant_linear --formats Q4_K,Q6_K --threads 2 --rows 1,2,4,16,64 --trials 5",
        quant_linear_table,
    ),
    (
        "gguf_decode_1b.json",
        "GGUF decode, 1B-shape Q4_K_M: int8 against float32 activations",
        "baton bench gguf_decode --model llama-1b-random.Q4_K_M.gguf --threads 2 --configs "
        "bfloat16:gguf,bfloat16:gguf:float-activations,bfloat16:none",
        gguf_decode_table,
    ),
    (
        "moe_decode.json",
        "Mixture-of-experts decode against dense models",
        "baton bench moe_decode --trials 3 --batches 1,4,16",
        moe_decode_table,
    ),
    (
        "gguf_decode_bandwidth_1b.json",
        "GGUF decode, 1B-shape Q4_K_M: the weights' read bandwidth at batch 1",
        "baton bench gguf_decode --model llama-1b-random.Q4_K_M.gguf --threads 2 --steps 48 "
        "--configs bfloat16:gguf,bfloat16:none --out bench/results/gguf_decode_bandwidth_1b.json",
        gguf_decode_table,
    ),
    (
        "serve_peers_1b.json",
        "Against llama.cpp's llama-server: 1B-shape Q4_K_M",
        "baton bench serve_peers --shape llama-1b --type Q4_K_M",
        serve_peers_table,
    ),
    (
        "serve_peers_8b.json",
        "Against llama.cpp's llama-server: 8B-shape Q4_K_M",
        "baton bench serve_peers --shape llama-8b --engines baton-gguf,llama-server "
        "--concurrency 1 --min-requests 2 --free-tokens 32 --json-tokens 128",
        serve_peers_table,
    ),
    (
        "serve_peers_smollm2.json",
        "Against llama.cpp's llama-server: SmolLM2-135M Q4_1",
        "baton bench serve_peers",
        serve_peers_table,
    ),
    (
        "invariance.json",
        "Same request, same tokens (free requests)",
        "baton bench invariance --dtypes bfloat16,float32 --engine-args '' "
        "--engine-args quantization=gguf",
        invariance_table,
    ),
    (
        "invariance_json.json",
        "Same request, same tokens (JSON-schema requests, grammar drafts)",
        "baton bench invariance --json --dtypes bfloat16,float32 --engine-args '' "
        "--engine-args quantization=gguf",
        invariance_table,
    ),
    (
        "invariance_cost.json",
        "What batch invariance costs",
        "baton bench invariance_cost --base 811f7ef",
        invariance_cost_table,
    ),
    ("spec.json", "Speculative decoding", "baton bench spec", spec_table),
    (
        "spec_policy_1b.json",
        "Draft policy: 1B-shape Q4_K_M (random weights, drafts mostly rejected)",
        "baton bench spec --model llama-1b-random.Q4_K_M.gguf --quantization gguf "
        "--modes off,auto-fixed,auto --workloads peers --concurrency 1,8,16 --repeats 2 "
        "--sim-device none",
        spec_table,
    ),
    (
        "spec_policy_smollm2_gguf.json",
        "Draft policy: SmolLM2-135M Q4_1 with its GGUF kernels",
        "baton bench spec --quantization gguf --modes off,auto-fixed,auto --workloads peers "
        "--concurrency 1,8,16 --repeats 3 --sim-device none",
        spec_table,
    ),
    (
        "spec_policy_smollm2.json",
        "Draft policy: SmolLM2-135M dense",
        "baton bench spec --modes off,auto-fixed,auto --workloads peers --concurrency 1,8,16 "
        "--repeats 3 --sim-device none",
        spec_table,
    ),
    ("serve.json", "Serving over HTTP", "baton bench serve", serve_table),
    ("soak.json", "Soak", "baton bench soak", soak_table),
    (
        "tensor_parallel.json",
        "Tensor parallel",
        "baton bench tensor_parallel",
        tensor_parallel_table,
    ),
    (
        "open_objects.json",
        "Open objects: xgrammar vs guidance outputs",
        "baton bench open_objects",
        open_objects_table,
    ),
    (
        "data_parallel.json",
        "Data parallel on Ray",
        "baton bench data_parallel",
        data_parallel_table,
    ),
    (
        "compile_burst.json",
        "A burst of distinct schemas",
        "baton bench compile_burst --label NAME [--hog N]",
        compile_burst_table,
    ),
]


def _sections(results: Path, names: tuple[str, ...] | None, images: str) -> list[str]:
    """One ``### title`` section per result file present in ``results`` (only ``names`` when
    given), its plot linked as ``images`` + the PNG's name."""
    parts = []
    for name, title, command, renderer in SECTIONS:
        path = results / name
        if (names is not None and name not in names) or not path.exists():
            continue
        data = json.loads(path.read_text())
        try:
            body = renderer(data)
        except (KeyError, TypeError) as exc:  # an older result file: say so, don't guess
            body = f"(cannot render {name}: missing {exc})"
        # Renderers link their extra plots as the README once did; each page has its own path.
        body = body.replace("](bench/results/", f"]({images}")
        png = path.with_suffix(".png")
        image = f"\n\n![{title}]({images}{png.name})" if png.exists() else ""
        parts.append(f"### {title}\n\n`{command}` → `bench/results/{name}`\n\n{body}{image}")
    return parts


def render(results: Path = RESULTS) -> str:
    """docs/results.md's results section body from the result files present in ``results``."""
    parts = [
        "Measured on the development machine: x86_64, 2 CPU cores with AVX-512, 24 GiB, no "
        "GPU (the commit, date, CPU model and its bfloat16 units (AMX, AVX512-BF16; recorded "
        "from 2026-12-03 on), dtype and threads of each run are in its JSON file), except "
        "the H200 section, which says where it ran. "
        "`python -m baton.bench.readme.readme_results` rewrites this section from "
        "`bench/results/*.json`.",
    ]
    return "\n\n".join(parts + _sections(results, None, PAGE_IMAGES))


def render_headline(results: Path = RESULTS) -> str:
    """The README's headline section body: the ``HEADLINE`` result files' sections."""
    lead = (
        "Rendered from `bench/results/` by `python -m baton.bench.readme.readme_results`, like "
        "every table in [docs/results.md](docs/results.md), which has the rest."
    )
    return "\n\n".join([lead, *_sections(results, HEADLINE, README_IMAGES)])


def update_section(path: Path, body: str, begin: str = BEGIN, end: str = END) -> bool:
    """Replaces the text between ``begin`` and ``end`` in ``path`` with ``body``; returns
    whether the file changed (it is written only then).

    Raises:
        ValueError: the file lacks the markers.
    """
    text = path.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no {begin} ... {end} section")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{begin}\n{body}\n{end}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


def update_readme(readme: Path, results: Path = RESULTS) -> bool:
    """Rewrites the README's headline section; returns whether the text changed.

    Raises:
        ValueError: the README lacks the headline markers.
    """
    return update_section(readme, render_headline(results), HEADLINE_BEGIN, HEADLINE_END)


def update_results_page(page: Path, results: Path = RESULTS) -> bool:
    """Rewrites docs/results.md's results section; returns whether the text changed.

    Raises:
        ValueError: the page lacks the results markers.
    """
    return update_section(page, render(results))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--page", type=Path, default=RESULTS_PAGE, help="the full results page")
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    for path, changed in (
        (a.page, update_results_page(a.page, a.results)),
        (a.readme, update_readme(a.readme, a.results)),
    ):
        print(f"{path}: {'updated' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
