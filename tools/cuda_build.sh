#!/usr/bin/env bash
# Builds the CUDA backend's kernel checks (test_cuda_kernels) into BUILD_DIR through the project's
# CMake — the same sources and libraries as `make cuda`, so that the list cannot fall behind (a
# hand-kept one here stopped linking once the checks used the sampler and the model's draw
# packing):
#   tools/cuda_build.sh [BUILD_DIR]      (default build-cuda-dev)
#   NVCC_EXTRA="-D..." adds nvcc flags (pack_devbin.sh's timing build)
# Runs the same here (no GPU: compile and link only) and wherever the CUDA toolkit and CMake are.
# ptxas's registers and spills per kernel go to BUILD_DIR/ptxas.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build-cuda-dev}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "cuda_build: nvcc not found (install the CUDA toolkit or set NVCC)" >&2; exit 2; }
cmake -S . -B "$OUT" -DDS_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCMAKE_CUDA_FLAGS="${NVCC_EXTRA:-} -Xptxas -v" >/dev/null
# (ptxas -v reports on stderr, one block per kernel; a failed build prints it all)
# TARGETS: what to build (default test_cuda_kernels; pack_devbin.sh's experiment builds add deltaserve)
cmake --build "$OUT" -j "$(nproc)" --target ${TARGETS:-test_cuda_kernels} >/dev/null 2> "$OUT/ptxas.txt" ||
  { cat "$OUT/ptxas.txt" >&2; exit 1; }
echo "cuda_build: $OUT/test_cuda_kernels (registers and spills per kernel: $OUT/ptxas.txt)"
