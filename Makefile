# Thin wrapper over CMake. `make run` and `make test` do all set-up on a fresh Debian 12 machine.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)
MODEL ?= models/tiny-k3
# the bundled trained model (issue 7), shipped in the repository: what `make run` serves
RUN_MODEL ?= models/gsm-k3
PROMPT ?= The quick brown fox
DEB_PKGS := build-essential cmake pkg-config libjansson-dev libpcre2-dev libxxhash-dev \
            libcmocka-dev libmicrohttpd-dev libopenmpi-dev openmpi-bin libhiredis-dev redis-server \
            libcurl4-openssl-dev clang libclang-rt-14-dev libomp-dev libucx-dev libpython3.11 \
            ucx-utils
# ucx-utils: ucx_perftest, the transport's own rate beside the P/D transfer (bench/pd_xfer_bench.py)
# llguidance: the grammar engine of structured outputs, loaded by the server from its wheel
# (docs/structured-outputs.md); jsonschema: the tests validate outputs with it; vllm-router: the
# P/D router the disaggregation tests drive (docs/pd.md); openai-agents: an agent loop through a
# real client library (tests/e2e/test_agents.py)
PIP_PKGS := pytest openai numpy llguidance jsonschema vllm-router openai-agents tiktoken
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build run test clean format bench test-asan fuzz fuzz-build fuzz-short soak soak-short cuda cache-fuzz

all: build

# Installs only what is missing: apt-get when a Debian package is absent, pip when a module is.
deps:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@python3 -c "import pytest, openai, numpy, llguidance, jsonschema, vllm_router, agents, tiktoken" 2>/dev/null || python3 -m pip install -q $(PIP_PKGS)

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

$(MODEL)/config.json: | build
	./$(BUILD)/deltaserve init-model --preset $(notdir $(MODEL)) --out $(MODEL)

model: build $(MODEL)/config.json

run: build
	./$(BUILD)/deltaserve serve --model $(RUN_MODEL) --host 127.0.0.1 --port 8000

test: build $(MODEL)/config.json
	cd $(BUILD) && ctest --output-on-failure -j 2
	DS_BIN=$(CURDIR)/$(BUILD)/deltaserve DS_MODEL=$(CURDIR)/$(MODEL) python3 -m pytest -q tests/e2e
	DS_SERVE_ARGS="--speculative-method dspark --num-speculative-tokens 4 --test-async-masks 1" \
	  DS_BIN=$(CURDIR)/$(BUILD)/deltaserve DS_MODEL=$(CURDIR)/$(MODEL) python3 -m pytest -q tests/e2e
	DS_SERVE_ARGS="-tp 2 -pp 2" \
	  DS_BIN=$(CURDIR)/$(BUILD)/deltaserve DS_MODEL=$(CURDIR)/$(MODEL) python3 -m pytest -q tests/e2e
	$(MAKE) --no-print-directory test-asan
	$(MAKE) --no-print-directory fuzz-short
	$(MAKE) --no-print-directory soak-short

# ---- hardening (issue 8): sanitizers, fuzzing, soak ----
# Every C test again in build-asan with ASan + UBSan (no recovery) and LeakSanitizer: any report
# aborts the test, so it fails.
ASAN_BUILD ?= build-asan
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
           UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 OMP_NUM_THREADS=2
test-asan: deps
	@cmake -S . -B $(ASAN_BUILD) -DDS_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && $(SAN_ENV) ctest --output-on-failure -j 2

# libFuzzer targets (tests/fuzz/fuzz_*.c, clang), each run FUZZ_SECONDS from its seed corpus
# tests/fuzz/corpus/<target>/; a crashing input is copied there and fails the run.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 300
fuzz-build: deps
	@cmake -S . -B $(FUZZ_BUILD) -DDS_FUZZ=ON -DCMAKE_C_COMPILER=clang \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_all
fuzz: fuzz-build
	tests/fuzz/run_fuzzers.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)
fuzz-short: fuzz-build
	tests/fuzz/run_fuzzers.sh $(FUZZ_BUILD) 6

# Soak: a real server under a mix of valid, malformed and abandoned requests (tests/soak/soak.py).
SOAK_SECONDS ?= 600
soak: build $(MODEL)/config.json
	DS_BIN=$(CURDIR)/$(BUILD)/deltaserve DS_MODEL=$(CURDIR)/$(MODEL) \
	  python3 tests/soak/soak.py --seconds $(SOAK_SECONDS)
soak-short: build $(MODEL)/config.json
	DS_BIN=$(CURDIR)/$(BUILD)/deltaserve DS_MODEL=$(CURDIR)/$(MODEL) \
	  python3 tests/soak/soak.py --seconds 40

bench: build
	@[ -f models/bench-large/config.json ] || ./$(BUILD)/deltaserve init-model --preset bench-large --out models/bench-large
	./$(BUILD)/deltaserve bench --model models/bench-large

format:
	clang-format -i $$(git ls-files 'src/*.c' 'src/*.h' 'tests/*.c' 'tests/*.h')

# CUDA backend (issue 9): the whole engine with --device cuda, plus test_cuda_kernels (each CUDA
# kernel against the CPU's), in build-cuda with the CUDA toolkit (no GPU needed to build; not part
# of `make test`, which stays CPU-only). For the GPU machine: tools/device/pack_devbin.sh packs
# the binaries here, tools/device/cuda_model_check.sh runs the CPU's tests there on the GPU.
NVCC ?= $(shell command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda: deps
	@cmake -S . -B build-cuda -DDS_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=$(NVCC) >/dev/null
	@cmake --build build-cuda -j $(JOBS)

clean:
	rm -rf $(BUILD)

# The prefix cache's randomized differential tester (issue 30): CACHE_FUZZ_SEEDS seeds on one
# process (a quarter of them P/D, a quarter short of pages and preempting, a fifth restarted
# halfway on the same tiers) and a quarter as many
# at -tp 2 -pp 2 (four MPI ranks; a quarter of those preempting) and an eighth at -pp 2 (half P/D,
# half preempting), with a Redis tier; failing seeds
# are saved to tests/cachefuzz/cases (replayed by `make test`).
CACHE_FUZZ_SEEDS ?= 2000
CACHE_FUZZ_SEED0 ?= 1
cache-fuzz: build
	@port=$$((20000 + RANDOM % 20000)); \
	redis-server --port $$port --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
	  --loglevel warning --pidfile /tmp/ds-cache-fuzz-redis.pid >/dev/null; sleep 0.5; \
	OMP_NUM_THREADS=2 ./$(BUILD)/cache_fuzz --seeds $(CACHE_FUZZ_SEEDS) --seed0 $(CACHE_FUZZ_SEED0) \
	  --redis redis://127.0.0.1:$$port --pd 25 --grammar 20 --preempt 25 --restart 20 \
	  --save-dir tests/cachefuzz/cases; st=$$?; \
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive ./$(BUILD)/cache_fuzz --seeds $$(( $(CACHE_FUZZ_SEEDS) / 4 )) \
	  --seed0 $$(( $(CACHE_FUZZ_SEED0) + 1000000 )) -tp 2 -pp 2 --grammar 20 --preempt 25 --restart 20 \
	  --redis redis://127.0.0.1:$$port \
	  --save-dir tests/cachefuzz/cases \
	  || st=1; \
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive ./$(BUILD)/cache_fuzz --seeds $$(( $(CACHE_FUZZ_SEEDS) / 8 )) \
	  --seed0 $$(( $(CACHE_FUZZ_SEED0) + 2000000 )) -pp 2 --pd 50 --preempt 50 --grammar 20 \
	  --save-dir tests/cachefuzz/cases \
	  || st=1; \
	kill $$(cat /tmp/ds-cache-fuzz-redis.pid) 2>/dev/null; exit $$st
